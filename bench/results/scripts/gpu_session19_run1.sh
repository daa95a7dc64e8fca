#!/bin/bash
# Session 19's first GPU run (one H200, no MPS): 3 stages with drawn tiles (two
# tiles loading ahead of the one processed, 128 KiB in flight per SM instead
# of 64) and per-thread 1-D column scales (one barrier less per tile), against
# the default, the fixed share, and copy kernels of qtx's occupancy with 64 and
# 128 KiB in flight per SM; 1-D and 2-D row+col, L2 flushed, three rounds; the
# bit-exactness tests of the block kernels first; Nsight Compute counters of
# one launch of each at 8192^2.
# Bundle: B/bin/{quantize_cuda_bench,kernels_cuda_test}.   B/gpu_session19_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi -L >> "$L" 2>&1
step tests_block 300 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda.*'
V=default,stages3,stages3_fixed,fixed,col_scales_t,stages3_col_scales_t
for k in t256_c2_u8 t256_c2_u16 t512_c2_u8 t1024_c2_u4; do V="$V,kcopy_${k}_plain"; done
qtx_quantize_rounds flush row+col "$V"
qtx_quantize_ncu ncu default,stages3,col_scales_t,stages3_col_scales_t "$QTX_NCU_COUNTERS"
step tests_all 400 "$B/bin/kernels_cuda_test"
grep -hE " rc=" "$L"
