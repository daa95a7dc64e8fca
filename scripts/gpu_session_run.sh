#!/bin/bash
# A lead's regression run on a GPU host, from a Python GPU bundle (scripts/make_gpu_python_bundle.sh) with kernels_cuda_test and cuda_allgather_channel_test added to bin/: C++ tests of the merged tree (one-round AllGather on a
# one-rank NCCL group, the one-round CUDA shard pieces, columnwise copy), then
# the Python GPU tests (qtx.cuda incl. make_columnwise) with and without MPS.
B=$(cd "$(dirname "$0")" && pwd)
O=${1:?out}; mkdir -p "$O"; L=$O/cpp.txt
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
step() { qtx_step "$L" "$@"; }  # step NAME SECONDS CMD... (gpu_env.sh)
step kernels_shard_columnwise 120 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeShardCuda.*:ColumnwiseFromRowwise*'
step allgather_channel 150 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
grep -hE "^\[  (PASSED|FAILED) |^\{" "$L" | head -20
QTX_PY_BENCH=0 "$B/gpu_python.sh" "$O/py" > "$O/py_stdout.txt" 2>&1; echo "gpu_python rc=$?"
grep -E " rc=|^(OK|FAILED)|Ran " "$O/py/log.txt" | head -30
