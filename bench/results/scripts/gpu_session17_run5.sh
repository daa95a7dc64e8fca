#!/bin/bash
# Session 17's fifth GPU run (one H200, no MPS): kernels_cuda_test whole after
# the test refactors (kernel_test_util.h shared by the block, tensor and
# FP8-cast tests; quantize_shard_test's ExpectAssembledEquals) and the
# kernels' shared StoreFromFloat.
# Bundle: B/bin/kernels_cuda_test.   B/gpu_session17_run5.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step kernels_cuda_test 300 "$B/bin/kernels_cuda_test"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-220 | head -40
