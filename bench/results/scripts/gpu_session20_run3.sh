#!/bin/bash
# Session 20's third GPU run (one H200, no MPS): the tests of the code this
# session changed after run 2, on the final build: the block kernel as at
# 598898f again (the sub4 / ctas3 variants removed), the server ops' shared
# output description (Quantize, AllGather), the client channel's one
# submission path. kernels_cuda_test in full, then through qtxd: cuda_e2e_test,
# optimizer_cuda_e2e_test, cuda_channel_test (without its kill test),
# cuda_allgather_channel_test, cuda_plan_test.
# Bundle: B/bin/{kernels_cuda_test,qtxd,cuda_e2e_test,optimizer_cuda_e2e_test,cuda_channel_test,
#   cuda_allgather_channel_test,cuda_plan_test}.   B/gpu_session20_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...; QTXD=B/bin/qtxd
step tests_all 400 "$B/bin/kernels_cuda_test"
step cuda_e2e 120 "$B/bin/cuda_e2e_test"
step optimizer_cuda_e2e 120 "$B/bin/optimizer_cuda_e2e_test"
step channel 120 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*ClientKilled*
step allgather_channel 120 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
step plan 120 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd"
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
