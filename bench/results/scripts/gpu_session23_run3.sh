#!/bin/bash
# Session 23's third GPU run, issue 16: the new launch defaults of the block
# kernel (1-D rowwise alone: half tiles with 3 stages up to 24 tiles per SM;
# 3 stages for 1-D with a columnwise copy and for 2-D row+col only when the
# launch draws its tiles). Every kernel GPU test (bit-exact with the CPU
# reference), then 6 rounds of default against stages2 / stages3 at the
# issue's four shapes and the shapes of run 2, L2 flushed.
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench}.   B/gpu_session23_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$L" 2>&1
step kernels_cuda_test 330 "$B/bin/kernels_cuda_test"
for r in $(seq 1 6); do
  step "round$r" 90 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush --modes 1d,2d \
    --usages row,row+col --variants default,stages2,stages3 \
    --shapes 2048x4096,4096x4096,4096x6144,6144x6144,4096x12288,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
