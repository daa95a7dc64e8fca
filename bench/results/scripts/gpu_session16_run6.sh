#!/bin/bash
# Session 16's sixth GPU run: run 5's cuda_allgather_channel_test (TENSOR on
# both AllGather paths, the held-stream tests) again under MPS.
# Bundle: run 5's (B/bin/{cuda_allgather_channel_test, kernels_cuda_test, qtxd}).
#   B/gpu_session16_run6.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
qtx_mps_start >> "$L" 2>&1
step cuda_allgather_channel_test_mps 120 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
qtx_mps_stop >> "$L" 2>&1
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|\{\"test\"" "$L" | cut -c1-220 | head -40
