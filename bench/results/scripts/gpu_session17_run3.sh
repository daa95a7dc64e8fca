#!/bin/bash
# Session 17's third GPU run (the host only): what the FP8 output's stores cost
# the host AdamW + FP8 step on the GPU machine's 16-core host. Three builds of
# optimizer_cpu_bench at 50618d2, differing only in kernels/cpu/adamw_band.cc:
#   nt     as committed: the FP8 rowwise and columnwise bytes leave with
#          non-temporal 32-byte stores (where aligned);
#   plain  the same bytes with ordinary stores (`aligned = false` in
#          StoreTileRows and DeferredRow): write-allocate reads, but no
#          write-combining path;
#   nostore  no FP8 stores at all (the rowwise copy in DeferredRow and both
#          StoreTileRows calls skipped; the encode and the transposes still
#          run): the stores' whole share, by subtraction. Not a valid step.
# optimizer_vs_torch.py, 1-16 threads, 8192^2, FP32 gradients, 5 rounds, torch fused.
# Bundle: B/bin/{optimizer_cpu_bench_{nt,plain,nostore}, optimizer_vs_torch.py}.
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step adamw 540 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" \
  --bench=nt=\"$B/bin/optimizer_cpu_bench_nt\" --bench=plain=\"$B/bin/optimizer_cpu_bench_plain\" \
  --bench=nostore=\"$B/bin/optimizer_cpu_bench_nostore\" \
  --bench_flag=nt=--triad_mib=512 --bench_flag=plain=--triad_mib=512 --bench_flag=nostore=--triad_mib=512 \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=5 --grad=fp32 --torch_impls=fused \
  > \"$O/adamw_vs_torch.jsonl\""
grep -hE " rc=" "$L" | cut -c1-300 | head -40
