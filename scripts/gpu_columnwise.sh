#!/bin/bash
# GPU run of the columnwise-copy kernel (docs/numerics.md §4.5) and the
# NcclCommunicator unit test. Usage (GPU host): a bundle
# (deploy/bundle/make_bundle.sh) holding qtxd, kernels_cuda_test,
# cuda_channel_test, nccl_communicator_test and quantize_cuda_bench, with this
# script and gpu_env.sh copied into it; OUT= names the log folder.
B=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=$O/columnwise.txt
step() { qtx_step "$L" "$@"; }  # step NAME SECONDS CMD... (gpu_env.sh)
step kernels_columnwise 120 "$B/bin/kernels_cuda_test" --gtest_filter='ColumnwiseFromRowwise*'
step channel_columnwise 120 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter='*Columnwise*'
step nccl_communicator 120 "$B/bin/nccl_communicator_test"
step bench_col_from_row 240 "$B/bin/quantize_cuda_bench" --modes 2d,tensor --l2 both --iters 50 \
  --shapes 4096x4096,8192x8192,16384x7168,32768x4096
grep -hE "^\[  (PASSED|FAILED) |^\[  FAILED|^[a-z0-9_]+ rc=|col_from_row|row\+col " "$L" | grep -v '"variant":"s' | head -80
