#!/bin/bash
# Session 22's fourth GPU run: issue 16's 1-D rowwise figure at 4096^2 (1.09x
# TransformerEngine's in session 21's two rounds, 1.12-1.14x in sessions
# 14-19; the goal is 1.1x) measured over 10 rounds, with 1-D and 2-D row+col
# and 8192^2 beside it, L2 flushed before each launch, as the TE figures were.
# Bundle: B/bin/quantize_cuda_bench (libraries from the run-1 bundle).
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$L" 2>&1
for r in $(seq 1 10); do
  step "round$r" 60 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush --modes 1d,2d \
    --usages row,row+col --variants default --shapes 4096x4096,8192x8192 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
grep -hE " rc=" "$L" | tail -3
