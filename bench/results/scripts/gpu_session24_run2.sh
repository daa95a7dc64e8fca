#!/bin/bash
# Session 24's second GPU run (one H200): issue 16's three benchmarks on the
# final code, in one run, with the commands of the closing report.
#   1. quantize_cuda_bench: 1-D, 2-D and per-tensor, row+col and row, the four
#      shapes of the issue, both L2 methods, 2 rounds (default launches; the
#      bench first checks its copy, read and write kernels byte for byte).
#   2. The host AdamW + FP8 step (128x128 blocks, and per-tensor) against
#      torch 2.11's fused CPU AdamW, with the host's triad bandwidth, 1-16
#      threads, 3 rounds.
# Bundle: B/bin/{quantize_cuda_bench,optimizer_cpu_bench,optimizer_vs_torch.py}.
#   B/gpu_session24_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$L" 2>&1
{ lscpu | grep -E 'Model name|^CPU\(s\)' | cut -c1-200; } >> "$L" 2>&1
for r in 1 2; do
  step "quantize_round$r" 150 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d,tensor --usages row+col,row --variants default,default \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
step adamw_vs_torch 420 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" \
  --bench=block2d=\"$B/bin/optimizer_cpu_bench\" --bench=tensor=\"$B/bin/optimizer_cpu_bench\" \
  --bench_flag=block2d=--triad_mib=512 --bench_flag=tensor=--triad_mib=512 \
  --bench_flag=tensor=--scaling=tensor \
  --m=8192 --n=8192 --max_threads=16 --reps=3 --rounds=3 --grad=fp32 --torch_impls=fused \
  > \"$O/adamw_vs_torch.jsonl\""
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
