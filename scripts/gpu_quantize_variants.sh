#!/bin/bash
# Quantize kernel launch variants on one GPU (issue 16's experiments), from a
# bundle with bin/quantize_cuda_bench and bin/kernels_cuda_test:
#   [VARIANTS=default,fixed] [SHAPES=...] [TESTS=gtest filter] [SECTIONS=default,fixed]
#   [STALLS=1] B/gpu_quantize_variants.sh OUT
# Steps: the bit-exactness tests TESTS (default: the tuned-launch and tile
# counter tests), quantize_cuda_bench round 1 over VARIANTS (each timed right
# after `default`, with the copy of the same bytes), Nsight Compute counters of
# one launch per variant at 8192^2 (ncu.csv), with SECTIONS set the warp-state,
# scheduler, memory and occupancy sections of those variants (ncu_sections.csv),
# with STALLS=1 the stall reasons and instruction counts (ncu_stalls.csv), then
# round 2. Session 11's runs 2, 3, 4 and 6 (bench/results/
# quantize_cuda_h200_session11_2026-12-02.md) are this script with their settings.
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
V=${VARIANTS:-default,fixed}
SH=${SHAPES:-4096x4096,8192x8192,16384x7168,32768x4096}
step tuned_exact 200 "$B/bin/kernels_cuda_test" \
  --gtest_filter="${TESTS:-QuantizeBlockCuda.Tuned*:QuantizeBlockCuda.TileCounter*}"
qtx_quantize_round 1 "$V" "$SH"
qtx_quantize_ncu ncu "$V" "$QTX_NCU_COUNTERS"
if [ -n "${SECTIONS:-}" ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  step ncu_sections 120 bash -c 'o=$1; shift; "$@" > "$o"' _ "$O/ncu_sections.csv" "$NCU" --csv \
    --clock-control none -k regex:QuantizeBlockKernel --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy \
    "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes 1d,2d \
    --usages row+col --variants "$SECTIONS" --shapes 8192x8192
fi
[ "${STALLS:-0}" = 1 ] && qtx_quantize_ncu ncu_stalls "$V" "$QTX_NCU_STALLS"
qtx_quantize_round 2 "$V" "$SH"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
