#!/bin/bash
# Session 24's fourth GPU run (one H200): the bench's copy, read and write
# kernels after they were made to share their step, load and store code
# (bench/stream_copy.cu): the bench's byte-for-byte check of every shape at
# start, then 3 rounds of the shapes run 1 timed at 8192^2 (per-tensor usage
# row+col and row, L2 flushed), to compare with run 1's figures.
# Bundle: B/bin/quantize_cuda_bench.   B/gpu_session24_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
K=kcopy_t512_c4_u4,kcopy_t1024_c2_u4_plain,kread_t512_c4_u4,kread_t1024_c2_u4_plain
K=$K,kread_t256_c8_u8,kread_t256_flat_u4_plain,kwrite_t512_c4_u4,kwrite_t1024_c2_u4_plain
K=$K,kwrite_t256_flat_u4_plain
for r in 1 2 3; do
  step "round$r" 60 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush \
    --modes tensor --usages row+col,row --variants default,default,$K --shapes 8192x8192 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
grep -hE " rc=" "$L" | head
