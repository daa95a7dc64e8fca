#!/bin/bash
# Session 17's second GPU run: the host AdamW + FP8 step with the AVX-512
# columnwise transpose (64 rows x 16 columns straight into the copy, commit
# 7ff0afa) against the kernel before it, and torch's fused CPU AdamW, on the
# GPU machine's 16-core host.
#  1. kernels_cpu_adamw_test on this host, as is (AVX-512) and with
#     QTX_ADAMW_ISA=baseline (AVX2);
#  2. optimizer_vs_torch.py: before / after, 1-16 threads, 8192^2, FP32
#     gradients, 6 rounds (order reversed in odd rounds), torch fused.
# Bundle: B/bin/{kernels_cpu_adamw_test, optimizer_cpu_bench (after),
#   optimizer_cpu_bench_before (65f0365), optimizer_vs_torch.py}.
#   B/gpu_session17_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step adamw_test 120 "$B/bin/kernels_cpu_adamw_test"
step adamw_test_avx2 120 env QTX_ADAMW_ISA=baseline "$B/bin/kernels_cpu_adamw_test"
step adamw 480 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" \
  --bench=before=\"$B/bin/optimizer_cpu_bench_before\" --bench=after=\"$B/bin/optimizer_cpu_bench\" \
  --bench_flag=before=--triad_mib=512 --bench_flag=after=--triad_mib=512 \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=6 --grad=fp32 --torch_impls=fused \
  > \"$O/adamw_vs_torch.jsonl\""
grep adamw_vs_torch "$O/adamw_vs_torch.jsonl" | cut -c1-300 >> "$L"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|adamw_vs_torch" "$L" | cut -c1-300 | head -40
