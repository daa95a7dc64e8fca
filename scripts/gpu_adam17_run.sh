#!/bin/bash
# Host AdamW A/B on the GPU machine's host (issue 16), from bundle-adam17:
# optimizer_cpu_bench_before (main before the kept tile scales, 2ed3236),
# optimizer_cpu_bench_after (with them, and the columnwise strips),
# after_nokeep.sh (the after binary with --no_tile_scales), and
# kernels_cpu_adamw_test. Bit-exact tests first (both ISAs), then
# bench/optimizer_vs_torch.py at 8192^2, FP32 gradients, torch fused, 3
# alternated rounds, phases in round 0:  bash B/gpu_adam17_run.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
O=${1:?out}; mkdir -p "$O"
export LD_LIBRARY_PATH=$B/lib OMP_WAIT_POLICY=passive PYTHONUNBUFFERED=1
S=$(date +%s)
{ date -u; nproc; grep -m1 'model name' /proc/cpuinfo
  python3 -c 'import torch;print(torch.__version__, torch.backends.cpu.get_cpu_capability())'
  timeout 60 "$B/bin/kernels_cpu_adamw_test" 2>&1 | tail -2; echo "test(as is) rc=${PIPESTATUS[0]}"
  QTX_ADAMW_ISA=baseline timeout 60 "$B/bin/kernels_cpu_adamw_test" 2>&1 | tail -2
  echo "test(baseline) rc=${PIPESTATUS[0]}"
  echo "tests done after $(( $(date +%s) - S )) s"; } > "$O/log.txt" 2>&1
timeout "${BENCH_TIMEOUT:-330}" python3 "$B/optimizer_vs_torch.py" \
  --bench=before="$B/bin/optimizer_cpu_bench_before" \
  --bench=after="$B/bin/optimizer_cpu_bench_after" --bench=after_nokeep="$B/after_nokeep.sh" \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=3 --grad=fp32 --torch_impls=fused \
  --phases > "$O/ab_8192.jsonl" 2>> "$O/log.txt"
echo "bench rc=$? after $(( $(date +%s) - S )) s" >> "$O/log.txt"
cat "$O/log.txt"
grep adamw_vs_torch "$O/ab_8192.jsonl" | cut -c1-260
