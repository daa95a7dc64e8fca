#!/bin/bash
# Session 19's third GPU run (one H200, no MPS): 3 stages as the default for
# BF16 / FP16 input with a columnwise copy, against 2 stages (variant stages2,
# the default before) and against FP32 amaxes at 3 stages (float_amax); the
# block kernels' tests first; 1-D and 2-D, row+col, col and row, both L2
# methods, three rounds; Nsight Compute counters and stall reasons of one
# launch of each at 8192^2; then every test of kernels_cuda_test, and the
# quantize paths through qtxd (cuda_e2e_test, cuda_channel_test without its
# kill test, optimizer_cuda_e2e_test).
# Bundle: B/bin/{quantize_cuda_bench,kernels_cuda_test,qtxd,cuda_e2e_test,cuda_channel_test,
#   optimizer_cuda_e2e_test}.   B/gpu_session19_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step tests_block 300 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda*'
V=default,stages2,float_amax,kcopy_t512_c2_u8_plain
qtx_quantize_rounds both row+col,col,row "$V"
qtx_quantize_ncu ncu default,stages2,float_amax "$QTX_NCU_COUNTERS"
qtx_quantize_ncu ncu_stalls default,stages2,float_amax "$QTX_NCU_STALLS"
step tests_all 400 "$B/bin/kernels_cuda_test"
step cuda_e2e 120 "$B/bin/cuda_e2e_test" --qtxd="$B/bin/qtxd"
step optimizer_cuda_e2e 120 "$B/bin/optimizer_cuda_e2e_test" --qtxd="$B/bin/qtxd"
step channel 90 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*ClientKilled*
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
