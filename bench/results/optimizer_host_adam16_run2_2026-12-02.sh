#!/bin/bash
# Device run 2 (adam16, issue 16): bit-exact tests of the final kernel (both
# ISAs), then the A/B at 8192^2 (FP32 gradients): before = main's kernel,
# after = this branch (AVX-512 LUT encoder), after_thp = after with --thp,
# after_u4 = after with 4-tile units (kUnitTiles = 4);
# 3 rounds (order reversed in odd rounds), torch fused + triad in the same run,
# phases in round 0.
B=bundle-adam16
export LD_LIBRARY_PATH=$PWD/$B/lib OMP_WAIT_POLICY=passive PYTHONUNBUFFERED=1
S=$(date +%s)
{ date -u; nproc; grep -m1 'model name' /proc/cpuinfo; python3 -c 'import torch;print(torch.__version__, torch.backends.cpu.get_cpu_capability())'
  timeout 40 $B/bin/kernels_cpu_adamw_test 2>&1 | tail -2; echo "test(as is) rc=${PIPESTATUS[0]}"
  QTX_ADAMW_ISA=baseline timeout 40 $B/bin/kernels_cpu_adamw_test 2>&1 | tail -2; echo "test(baseline) rc=${PIPESTATUS[0]}"
  timeout 40 $B/bin/kernels_cpu_adamw_test_u4 2>&1 | tail -2; echo "test(u4) rc=${PIPESTATUS[0]}"
  echo "tests done after $(( $(date +%s) - S )) s"; } > $OUT/log.txt 2>&1
left=$(( 234 - ($(date +%s) - S) ))
ab="--bench=before=$B/bin/optimizer_cpu_bench_before --bench=after=$B/bin/optimizer_cpu_bench_after --bench=after_u4=$B/bin/optimizer_cpu_bench_after_u4 --bench=after_thp=$B/bin/optimizer_cpu_bench_after_thp"
timeout $left python3 $B/optimizer_vs_torch.py $ab --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=3 \
  --grad=fp32 --torch_impls=fused --phases > $OUT/ab_8192.jsonl 2>> $OUT/log.txt
echo "bench rc=$? after $(( $(date +%s) - S )) s" >> $OUT/log.txt
grep adamw_vs_torch $OUT/ab_8192.jsonl | cut -c1-200
cat $OUT/log.txt
