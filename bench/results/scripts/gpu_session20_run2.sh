#!/bin/bash
# Ran from a bundle of commit 83b4774 (kernel of e1ca9c8); the variants sub4, sub4_stages2 and ctas3 were removed after run 2.
# Session 20's second GPU run (one H200, no MPS): the block kernel with 4x8
# sub-tiles (variant sub4) now keeping its sub-tile as the loaded 16-bit words
# (no spill), and 3 CTAs of 256 threads per SM (variant ctas3: 80 registers a
# thread, 2 stages) against the default, next to the copy kernels; the block kernels'
# and the all-FP32 cast tests first; 1-D and 2-D, row+col, col and row, both
# L2 methods, three rounds; Nsight Compute counters and stall reasons of one
# launch of each at 8192^2 (the default kernel is unchanged since run 1, which ran every test).
# Bundle: B/bin/{quantize_cuda_bench,kernels_cuda_test}.   B/gpu_session20_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step tests_block 400 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda*:Fp8HardwareCast*'
V=default,sub4,ctas3,kcopy_t1024_c2_u4_plain,kcopy_t512_c2_u8_plain
qtx_quantize_rounds both row+col,col,row "$V"
qtx_quantize_ncu ncu default,sub4,ctas3 "$QTX_NCU_COUNTERS"
qtx_quantize_ncu ncu_stalls default,sub4,ctas3 "$QTX_NCU_STALLS"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
