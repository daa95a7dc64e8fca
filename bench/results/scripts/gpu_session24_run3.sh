#!/bin/bash
# Session 24's third GPU run (the H200 machine's host): run 2 measured the
# host AdamW + FP8 step (128x128 blocks) at 0.68x torch at 1 thread, where
# session 23's run 1 had 0.90x. Is that the code or the host? An A/B of three
# builds of optimizer_cpu_bench in one run, 5 rounds (order reversed in odd
# rounds), against torch's fused CPU AdamW and the triad:
#   s22   6f2399f, session 22's kept kernel (0.87x at 1 thread in its run 1);
#   s23   a825732, before the TileAt refactor (ad13280);
#   head  this session's code.
# Bundle: B/bin/{optimizer_cpu_bench_{s22,s23,head},optimizer_vs_torch.py}.
#   B/gpu_session24_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
{ lscpu | grep -E 'Model name|^CPU\(s\)|MHz' | cut -c1-200; uptime; } >> "$L" 2>&1
step adamw_ab 500 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" \
  --bench=s22=\"$B/bin/optimizer_cpu_bench_s22\" --bench=s23=\"$B/bin/optimizer_cpu_bench_s23\" \
  --bench=head=\"$B/bin/optimizer_cpu_bench_head\" --bench_flag=s22=--triad_mib=512 \
  --bench_flag=s23=--triad_mib=512 --bench_flag=head=--triad_mib=512 \
  --m=8192 --n=8192 --max_threads=16 --reps=3 --rounds=5 --grad=fp32 --torch_impls=fused \
  > \"$O/adamw_ab.jsonl\""
grep -hE " rc=" "$L" | head
