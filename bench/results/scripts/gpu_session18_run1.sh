#!/bin/bash
# Session 18's first and second GPU runs (one H200, no MPS; run 2 with the
# evict-first policy of the cp.async loads passed in as a kernel argument,
# commit bcb2dce; both stopped at an illegal instruction in those loads):
#  1. kernels_cuda_test whole: dd07d47 (TensorAmax's kAmaxPerThread) and the
#     block kernel's new L2 tunings (evict-last FP8 stores, evict-first input
#     loads), each compared with the CPU reference byte for byte;
#  2. quantize_cuda_bench, 1-D and 2-D row+col, L2 flushed, three rounds, then
#     one round with rotating buffers: does cudaMemcpyAsync's lead come from
#     what it leaves dirty in the L2? Each line now carries the time of the
#     flush that follows the launch (next_flush_us); copy kernels and the
#     quantize kernel with L2 eviction hints run next to the plain ones.
# Bundle: B/bin/{kernels_cuda_test, quantize_cuda_bench}.
#   B/gpu_session18_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
V=default,evict_last,in_evict_first,in_first_out_last,kcopy_t512_c4_u4_plain,kcopy_t512_c4_u4_lf,kcopy_t512_c4_u4_lf_sl
for r in 1 2 3; do
  step "bench_round$r" 150 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush \
    --modes 1d,2d --usages row+col --variants $V \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
step bench_rotate 150 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 rotate \
  --modes 1d,2d --usages row+col --variants $V --shapes 8192x8192,16384x7168 | \
  sed 's/^{/{\"round\":4,/' >> \"$O/quantize_cuda_bench.jsonl\""
step kernels_cuda_test 300 "$B/bin/kernels_cuda_test"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-220 | head -40
