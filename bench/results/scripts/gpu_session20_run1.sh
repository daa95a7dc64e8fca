#!/bin/bash
# Ran from a bundle of commit 0ce102e; the variants sub4, sub4_stages2 and ctas3 were removed after run 2.
# Session 20's first GPU run (one H200, no MPS): the block kernel with 4x8
# sub-tiles in 512-thread CTAs (variant sub4: 1024 threads per SM, at most 64
# registers a thread) against the default 8x8 sub-tiles (256-thread CTAs),
# next to the copy kernels with 1024 and 512 threads per SM; the block kernels'
# and the all-FP32 cast tests first; 1-D and 2-D, row+col, col and row, both
# L2 methods, three rounds; Nsight Compute counters and stall reasons of one
# launch of each at 8192^2; then every test of kernels_cuda_test.
# Bundle: B/bin/{quantize_cuda_bench,kernels_cuda_test}.   B/gpu_session20_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step tests_block 400 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda*:Fp8HardwareCast*'
V=default,sub4,sub4_stages2,kcopy_t1024_c2_u4_plain,kcopy_t512_c2_u8_plain
qtx_quantize_rounds both row+col,col,row "$V"
qtx_quantize_ncu ncu default,sub4,sub4_stages2 "$QTX_NCU_COUNTERS"
qtx_quantize_ncu ncu_stalls default,sub4 "$QTX_NCU_STALLS"
step tests_all 400 "$B/bin/kernels_cuda_test" --gtest_filter='-QuantizeBlockCuda*:Fp8HardwareCast*'
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
