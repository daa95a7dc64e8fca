#!/bin/bash
# Session 14's fourth GPU run (one H200): the block quantize kernel with plain
# FP8 stores by default (evict-first stores became the `evict_first` variant):
# its bit-exactness tests (every tuned launch, both store kinds), then
# quantize_cuda_bench, both L2 methods, 1-D and 2-D, row+col and row, default
# against evict_first and the bench's best copy kernel shape, one round.
# Then the GPU Python tests (tests only; with MPS, and without it too when
# QTX_PY_MPS0=1), which now start
# qtxd through tests/python/qtxd_child.py.
# Bundle: B/bin/{kernels_cuda_test, quantize_cuda_bench}, the Python bundle in
# B/py_bundle.   B/gpu_session14_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step tests 240 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda.*:Shapes/QuantizeBlockCudaSmall.*:*/4096x4096:*/8208x4096:*/4100x1040:*/1000x4000:ColumnwiseFromRowwiseCuda.*'
for r in 1; do
  step "bench_round$r" 150 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d --usages row+col,row --variants default,evict_first,kcopy_t512_c4_u4_plain \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
step python 300 env -u LD_LIBRARY_PATH QTX_PY_BENCH=0 QTX_PY_MPS0=${QTX_PY_MPS0:-0} QTX_GPU_BUDGET_S=280 \
  bash "$B/py_bundle/gpu_python.sh" "$O/py"
grep -E " rc=|MPS" "$O/py/log.txt" >> "$L" 2>/dev/null
grep -hE " rc=|MPS|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
