#!/bin/bash
# Session 14's fourth GPU run (one H200): the block quantize kernel with plain
# FP8 stores by default (evict-first stores became the `evict_first` variant):
# its bit-exactness tests (every tuned launch, both store kinds), then
# quantize_cuda_bench, both L2 methods, 1-D and 2-D, row+col and row, default
# against evict_first and the bench's best copy kernel shape, two rounds.
# Bundle: B/bin/{kernels_cuda_test, quantize_cuda_bench}.   B/gpu_session14_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step tests 240 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda.*:QuantizeTensorCuda.*'
for r in 1 2; do
  step "bench_round$r" 150 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d --usages row+col,row --variants default,evict_first,kcopy_t512_c4_u4_plain \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
