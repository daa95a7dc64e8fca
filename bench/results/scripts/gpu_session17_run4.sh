#!/bin/bash
# Session 17's fourth GPU run (one H200, no MPS): after TensorAmax's one-CTA
# path (a114d70), the TENSOR AllGather end to end through qtxd on a one-rank
# NCCL group (cuda_allgather_channel_test: synchronous, channel, one round,
# held stream), and kernels_cuda_test whole.
# Bundle: B/bin/{cuda_allgather_channel_test, kernels_cuda_test, qtxd}.
#   B/gpu_session17_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step kernels_cuda_test 240 "$B/bin/kernels_cuda_test"
step cuda_allgather_channel_test 240 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|\{\"test\"" "$L" | cut -c1-220 | head -40
