#!/bin/bash
# Device run 1 (adam16, issue 16): 8192^2 FP32 grads, A/B/C/D of kernels next to
# torch fused and the triad, phases in round 0; then the bit-exact test.
#   before: main's kernel (6df7995); enc: + the AVX-512 LUT encoder (this branch);
#   encpf: enc + prefetch of the deferred unit's master rows 2 rows ahead;
#   encpf_u8: encpf with 8-tile units. (encpf / encpf_u8 were not kept.)
B=bundle-adam16
export LD_LIBRARY_PATH=$PWD/$B/lib OMP_WAIT_POLICY=passive PYTHONUNBUFFERED=1
S=$(date +%s)
{ date -u; nproc; grep -m1 'model name' /proc/cpuinfo; python3 -c 'import torch;print(torch.__version__, torch.backends.cpu.get_cpu_capability())'; } > $OUT/log.txt 2>&1
ab="--bench=before=$B/bin/optimizer_cpu_bench_before --bench=enc=$B/bin/optimizer_cpu_bench_enc --bench=encpf=$B/bin/optimizer_cpu_bench_encpf --bench=encpf_u8=$B/bin/optimizer_cpu_bench_encpf_u8"
timeout 190 python3 $B/optimizer_vs_torch.py $ab --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=2 \
  --grad=fp32 --torch_impls=fused --phases > $OUT/ab_8192.jsonl 2>> $OUT/log.txt
echo "bench rc=$? after $(( $(date +%s) - S )) s" >> $OUT/log.txt
left=$(( 232 - ($(date +%s) - S) ))
[ $left -gt 5 ] && timeout $left $B/bin/kernels_cpu_adamw_test > $OUT/tests.txt 2>&1
echo "test rc=$? after $(( $(date +%s) - S )) s" >> $OUT/log.txt
tail -3 $OUT/tests.txt >> $OUT/log.txt
grep adamw_vs_torch $OUT/ab_8192.jsonl | cut -c1-260
cat $OUT/log.txt
