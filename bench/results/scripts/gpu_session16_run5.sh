#!/bin/bash
# Session 16's fifth GPU run (one H200, no MPS): TENSOR's one-round path
# (shard_rows: the shard amaxes all-gathered on the device before the slots).
#  cuda_allgather_channel_test: a one-rank NCCL group through qtxd, every
#  case through the channel and synchronously, with and without shard_rows,
#  TENSOR included; the held-stream tests with a TENSOR kind (no host wait on
#  either path).
# Also kernels_cuda_test's QuantizeTensorCuda.* and shard tests (their output
# check became one helper).
# Bundle: B/bin/{cuda_allgather_channel_test, kernels_cuda_test, qtxd}.
#   B/gpu_session16_run5.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step kernels_cuda_tensor 150 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeTensorCuda.*:*Shard*'
step cuda_allgather_channel_test 200 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|\{\"test\"" "$L" | cut -c1-220 | head -40
