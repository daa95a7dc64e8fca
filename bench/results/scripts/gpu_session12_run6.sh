#!/bin/bash
# The lead's sixth GPU run of session 12: the review commit of per-tensor
# current scaling (shared scale helper, no no_prefetch variant): the
# QuantizeTensorCuda tests, the channel tests through qtxd, and one round of
# quantize_cuda_bench (tensor mode, default against two_pass).
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench,cuda_channel_test,qtxd}.
#   B/gpu_session12_run6.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step tests 300 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeTensorCuda.*'
step channel 300 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd"
step bench 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both --modes tensor \
  --usages row+col,row --variants default,two_pass --shapes 4096x4096,8192x8192,16384x7168 \
  > \"$O/quantize_cuda_bench.jsonl\""
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
