#!/bin/bash
# Session 22's GPU run, host part (one H200 machine; its 16-core AVX-512 Xeon):
# the band kernel's bit-exactness with both instruction sets, then an A/B of
# three builds of the host AdamW + FP8 step against torch's fused CPU AdamW
# (issue 16), 6 rounds, phases in round 0:
#   before  the kernel of the session's start (a897b83);
#   z       FP8 rows stored as whole 64-byte non-temporal lines (AVX-512);
#   zy      z, and a unit encoded during its update (kept tile scales) stores
#           its rowwise bytes then, from L1, instead of in the next unit.
# Bundle: B/bin/{kernels_cpu_adamw_test,optimizer_cpu_bench_{before,z,zy},
#   optimizer_vs_torch.py}.   B/gpu_session22_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
{ lscpu | grep -E 'Model name|^CPU\(s\)|L2|L3|Flags' | cut -c1-200; cat /sys/kernel/mm/transparent_hugepage/enabled; } >> "$L" 2>&1
step adamw_test 120 "$B/bin/kernels_cpu_adamw_test"
step adamw_test_baseline 120 env QTX_ADAMW_ISA=baseline "$B/bin/kernels_cpu_adamw_test"
step adamw_ab 480 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" \
  --bench=before=\"$B/bin/optimizer_cpu_bench_before\" --bench=z=\"$B/bin/optimizer_cpu_bench_z\" \
  --bench=zy=\"$B/bin/optimizer_cpu_bench_zy\" --bench_flag=before=--triad_mib=512 \
  --bench_flag=z=--triad_mib=512 --bench_flag=zy=--triad_mib=512 \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=6 --grad=fp32 --torch_impls=fused --phases \
  > \"$O/adamw_ab.jsonl\""
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
