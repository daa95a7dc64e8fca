#!/bin/bash
# Session 22's third GPU-host run: the host AdamW step's division sqrt(v) /
# bc2_sqrt by a multiplication and two FMAs (checked exact per bc2_sqrt), its
# bit-exactness with both instruction sets, and an A/B, 6 rounds, phases in
# round 0:
#   final   the committed kernel (6f2399f);
#   recip   the division by a verified reciprocal (this change);
#   nodiv1  sqrt(v) * (1 / bc2_sqrt) without the correction: NOT a valid step
#           (it changes the result; measurement only), the most recip can gain.
# Bundle: B/bin/{kernels_cpu_adamw_test,optimizer_cpu_bench_{final,recip,nodiv1},
#   optimizer_vs_torch.py}.
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"
step adamw_test 120 "$B/bin/kernels_cpu_adamw_test"
step adamw_test_baseline 120 env QTX_ADAMW_ISA=baseline "$B/bin/kernels_cpu_adamw_test"
args=()
for v in final recip nodiv1; do
  args+=(--bench=$v="$B/bin/optimizer_cpu_bench_$v" --bench_flag=$v=--triad_mib=512)
done
step adamw_ab 480 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" ${args[*]} \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=6 --grad=fp32 --torch_impls=fused --phases \
  > \"$O/adamw_ab.jsonl\""
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
