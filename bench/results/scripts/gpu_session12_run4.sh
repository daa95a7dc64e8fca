#!/bin/bash
# The lead's fourth GPU run of session 12: the kept build of per-tensor
# current scaling (one cooperative launch, two launches for a columnwise copy
# of more than 6 tiles per kept tile): the per-tensor tests, the channel tests
# through qtxd, then two rounds of quantize_cuda_bench (tensor mode, the default
# against two_pass, with the copy of the same bytes).
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench,cuda_channel_test,qtxd}.
#   B/gpu_session12_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
SH=4096x4096,8192x8192,16384x7168,32768x4096
step tests 400 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeTensorCuda.*'
step channel 300 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd"
for r in 1 2; do
  step "bench_round$r" 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes tensor --usages row+col,row,col --variants default,two_pass --shapes $SH | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
