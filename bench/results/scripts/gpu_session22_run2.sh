#!/bin/bash
# Session 22's second GPU-host run: an A/B of five builds of the host AdamW +
# FP8 step (issue 16) against torch's fused CPU AdamW, 6 rounds:
#   z      FP8 rows stored as whole 64-byte non-temporal lines (run 1's z);
#   zy     z + rowwise bytes of a unit encoded during its update stored then;
#   pfl2   z with the software prefetches to L2 (prefetcht1) instead of L1;
#   pf4l2  pfl2, 4 rows ahead instead of 2;
#   v256   z with the AVX-512 build's loops vectorized 256 bits wide.
# Bundle: B/bin/{optimizer_cpu_bench_{z,zy,pfl2,pf4l2,v256},optimizer_vs_torch.py}.
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"
args=()
for v in z zy pfl2 pf4l2 v256; do
  args+=(--bench=$v="$B/bin/optimizer_cpu_bench_$v" --bench_flag=$v=--triad_mib=512)
done
step adamw_ab 560 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" ${args[*]} \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=6 --grad=fp32 --torch_impls=fused \
  > \"$O/adamw_ab.jsonl\""
grep -hE " rc=" "$L"
