#!/bin/bash
# The lead's second GPU run of session 12: per-tensor current scaling in one
# cooperative launch (kernels/cuda/quantize_tensor.cu OnePassTensorKernel).
# Its bit-exactness tests (and the other quantize tests, and the channel tests,
# which quantize TENSOR through it), quantize_cuda_bench round 1 (tensor mode,
# the one-pass default against `two_pass`, with the copy of the same bytes),
# Nsight Compute DRAM bytes and time of each launch with ncu's cache control
# off, then round 2. (no_prefetch, timed here, was removed after run 5;
# today's bench skips the name.)
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench,cuda_channel_test}.
#   B/gpu_session12_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
SH=4096x4096,8192x8192,16384x7168,32768x4096
round() {
  step "bench_round$1" 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes tensor --usages row+col,row,col --variants default,no_prefetch,two_pass --shapes $SH | \
    sed 's/^{/{\"round\":$1,/' >> \"$O/quantize_cuda_bench.jsonl\""
}
step tests 400 "$B/bin/kernels_cuda_test" \
  --gtest_filter='QuantizeTensorCuda.*:Columnwise*:QuantizeBlockCuda.Tuned*'
step channel 300 "$B/bin/cuda_channel_test"
round 1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step ncu_tensor 120 bash -c 'o=$1; shift; "$@" > "$o"' _ "$O/ncu_tensor.csv" "$NCU" --csv \
  --clock-control none --cache-control none -k regex:'TensorAmax|TileCast|RowCast|OnePass' \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes tensor \
  --usages row+col,row --variants default,no_prefetch,two_pass --shapes 4096x4096,8192x8192
round 2
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
