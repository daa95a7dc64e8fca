#!/bin/bash
# Session 24's eighth GPU run (one H200): can the half-tile test fail? A
# kernels_cuda_test built with one mutation in kernels/cuda/quantize_block.cu
# (a unit's first row taken as tm * 128 instead of tm * kRows, which moves
# every half tile but the first of each column and leaves 128-row tiles
# alone) must fail QuantizeBlockCuda.HalfTilesMatchCpuReferenceOnEveryPath;
# the unmutated build must pass it.
# Bundle: B/bin/kernels_cuda_test{,_mut}.   B/gpu_session24_run8.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
T='QuantizeBlockCuda.HalfTilesMatchCpuReferenceOnEveryPath'
step half_tiles_mutated 200 "$B/bin/kernels_cuda_test_mut" --gtest_filter="$T"
step half_tiles 200 "$B/bin/kernels_cuda_test" --gtest_filter="$T"
grep -c "Failure" "$L"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | head
