#!/bin/bash
# Session 23's fourth GPU run, issue 16. Run 3 showed that the first variant
# measured in each block of quantize_cuda_bench runs 0.5-5 % slower than the
# same kernel measured after it (2-D rowwise: `default` and `stages2` are one
# kernel), so runs 1-2 compared positions as much as variants. Here each block
# starts with a discarded `default`, and stages2 / stages3 / half_stages3 take
# each place in turn (6 rounds: every order of the three once). Also the tile
# counter tests with the 2-D shape.
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench}.   B/gpu_session23_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step counter_tests 120 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda.MoreStreams*:QuantizeBlockCuda.TileCounter*'
r=0
for order in stages2,stages3,half_stages3 stages3,half_stages3,stages2 half_stages3,stages2,stages3 \
             stages2,half_stages3,stages3 stages3,stages2,half_stages3 half_stages3,stages3,stages2; do
  r=$((r + 1))
  step "round$r" 90 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush --modes 1d,2d \
    --usages row,row+col --variants default,$order \
    --shapes 2048x4096,4096x4096,4096x12288,8192x8192 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
