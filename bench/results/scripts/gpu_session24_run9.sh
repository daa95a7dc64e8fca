#!/bin/bash
# Session 24's ninth GPU run (one H200): after the review fix to
# quantize_cuda_bench's copy buffers (a kwrite_* of 1-D or 2-D row+col wrote
# its scales' bytes past the end of a buffer sized for the copy), the bench's
# copy, read and write kernels in every mode under compute-sanitizer memcheck
# (small shape, few launches), then one plain round at 8192^2.
# Bundle: B/bin/quantize_cuda_bench.   B/gpu_session24_run9.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
V=default,kcopy_t512_c4_u4,kread_t512_c4_u4,kread_t256_flat_u4_plain,kwrite_t512_c4_u4
V=$V,kwrite_t256_flat_u4_plain,amax_phase,amax_pass
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step memcheck 240 "$cs" --tool memcheck --error-exitcode 3 "$B/bin/quantize_cuda_bench" \
  --iters 2 --warmup 1 --l2 both --modes 1d,2d,tensor --usages row+col,row,col \
  --variants "$V" --shapes 1024x1024
step round 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 50 --l2 flush --modes 1d,2d,tensor \
  --usages row+col --variants $V --shapes 8192x8192 > \"$O/quantize_cuda_bench.jsonl\""
grep -hE " rc=|ERROR SUMMARY" "$L" | head
