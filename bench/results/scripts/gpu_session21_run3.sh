#!/bin/bash
# Session 21's third GPU run (one H200, no MPS): the all-gather shard kernels
# after their typed load became kernels/fp8.h LoadAs (QuantizeShardCuda.*
# against the CPU reference, byte for byte), then the all-gather paths through
# qtxd.
# Bundle: B/bin/{kernels_cuda_test,qtxd,cuda_allgather_channel_test,
#   cuda_param_allgather_test}.   B/gpu_session21_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...; QTXD=B/bin/qtxd
step shard 200 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeShardCuda.*:QuantizeTensorCuda.*'
step allgather_channel 60 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
step param_allgather 60 "$B/bin/cuda_param_allgather_test" --qtxd="$B/bin/qtxd"
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
