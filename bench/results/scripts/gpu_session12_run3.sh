#!/bin/bash
# The lead's third GPU run of session 12: the one-pass current-scaling launch
# keeping each CTA's first tiles in shared memory and casting the most recently
# read ones first (this build, bin/quantize_cuda_bench) against run 2's, which
# kept the last tiles and cast them first (bin/quantize_cuda_bench_keeplast),
# alternated over two rounds; each bench times two_pass and the copy of the
# same bytes in its own process. Before: the per-tensor and block tests and the
# channel tests (they quantize TENSOR through qtxd); after round 1, Nsight
# Compute DRAM bytes of each launch (ncu's cache control off).
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench,quantize_cuda_bench_keeplast,
# cuda_channel_test,qtxd}.   B/gpu_session12_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
SH=4096x4096,8192x8192,16384x7168,32768x4096
round() {  # round N BINARY LABEL
  step "bench_round$1_$3" 120 bash -c "\"$2\" --iters 100 --l2 both --modes tensor \
    --usages row+col,row --variants default,two_pass --shapes $SH | \
    sed 's/^{/{\"round\":$1,\"build\":\"$3\",/' >> \"$O/quantize_cuda_bench.jsonl\""
}
step tests 400 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeTensorCuda.*:QuantizeBlockCuda.Tuned*'
step channel 300 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd"
round 1 "$B/bin/quantize_cuda_bench" keepfirst
round 1 "$B/bin/quantize_cuda_bench_keeplast" keeplast
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step ncu_tensor 120 bash -c 'o=$1; shift; "$@" > "$o"' _ "$O/ncu_tensor.csv" "$NCU" --csv \
  --clock-control none --cache-control none -k regex:'OnePass' \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes tensor \
  --usages row+col,row --variants default --shapes 4096x4096,8192x8192,16384x7168
round 2 "$B/bin/quantize_cuda_bench_keeplast" keeplast
round 2 "$B/bin/quantize_cuda_bench" keepfirst
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
