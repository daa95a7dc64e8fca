#!/bin/bash
# Session 18's fourth GPU run (one H200, no MPS): the plain (not evict-first)
# copy kernel in launch shapes other than 512 threads x 4 CTAs x 4 words, next
# to cudaMemcpyAsync and qtx's kernels; 1-D and 2-D row+col, L2 flushed,
# three rounds. Is any kernel shape closer to the driver's copy?
# Bundle: B/bin/quantize_cuda_bench.   B/gpu_session18_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
V=default
for k in t512_c4_u4 t512_c4_u1 t512_c4_u2 t512_c4_u8 t1024_c2_u4 t256_c8_u4 t128_c16_u4 \
         t256_flat_u4 t512_c2_u8 t1024_c1_u8 t256_c2_u8; do
  V="$V,kcopy_${k}_plain"
done
for r in 1 2 3; do
  step "bench_round$r" 200 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush \
    --modes 1d,2d --usages row+col --variants $V \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
grep -hE " rc=" "$L"
