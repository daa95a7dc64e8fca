#!/bin/bash
# Session 24's seventh GPU run (one H200): every kernels_cuda_test test after
# the block and per-tensor columnwise dequantize kernels came to share one
# transposing routine (kernels/cuda/device_fp8.cuh DequantizeColumnwiseTiles);
# the quantize tests dequantize each copy and compare with the CPU's.
# Bundle: B/bin/kernels_cuda_test.   B/gpu_session24_run7.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step kernels_cuda_test 330 "$B/bin/kernels_cuda_test" --gtest_brief=1
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | head
