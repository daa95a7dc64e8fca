#!/bin/bash
# Session 19's second GPU run (one H200, no MPS): pow2 scales by exponent
# arithmetic (ComputeScalePow2 / ScaleInvPow2, the default now) against the
# division (variant division_scales), and packed 1-D amaxes (the default now)
# against FP32 ones (variant float_amax); the exhaustive device test of the
# pow2 functions and the block kernels' tests first; 1-D and 2-D, row+col and row,
# L2 flushed, three rounds, next to copies of qtx's occupancy; Nsight Compute
# counters and stall reasons of one launch of each at 8192^2; then every test
# of kernels_cuda_test.
# Bundle: B/bin/{quantize_cuda_bench,kernels_cuda_test}.   B/gpu_session19_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step tests_block 300 "$B/bin/kernels_cuda_test" \
  --gtest_filter='Fp8HardwareCast.Pow2*:QuantizeBlockCuda.*'
V=default,division_scales,float_amax,stages3,kcopy_t256_c2_u8_plain,kcopy_t512_c2_u8_plain
qtx_quantize_rounds flush row+col,row "$V"
qtx_quantize_ncu ncu default,division_scales,float_amax "$QTX_NCU_COUNTERS"
qtx_quantize_ncu ncu_stalls default,division_scales,float_amax "$QTX_NCU_STALLS"
step tests_all 400 "$B/bin/kernels_cuda_test"
grep -hE " rc=" "$L"
