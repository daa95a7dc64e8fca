#!/bin/bash
# Session 20's fourth GPU run (one H200, no MPS): after Step's FP8 outputs
# moved onto DescribeQuantizedOutputs (server/ops/optimizer.cc), the device
# tests of Step and Quantize through qtxd: optimizer_cuda_e2e_test,
# optimizer_shard_cuda_e2e_test (two qtxd over Gloo), cuda_e2e_test.
# Bundle: B/bin/{qtxd,optimizer_cuda_e2e_test,optimizer_shard_cuda_e2e_test,cuda_e2e_test}.
#   B/gpu_session20_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...; QTXD=B/bin/qtxd
step optimizer_cuda_e2e 120 "$B/bin/optimizer_cuda_e2e_test"
step optimizer_shard_cuda_e2e 180 "$B/bin/optimizer_shard_cuda_e2e_test"
step cuda_e2e 120 "$B/bin/cuda_e2e_test"
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
