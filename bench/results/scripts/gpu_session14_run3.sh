#!/bin/bash
# Session 14's third GPU run (one H200): what runs 1 and 2 could not run as
# bundled, then one A/B.
#  1. the server backend's GPU end-to-end tests, given the bundle's qtxd ($QTXD);
#  2. qtx.cuda's GPU Python tests with and without MPS (scripts/gpu_python.sh,
#     tests only), in an environment of their own (the host's libstdc++);
#  3. quantize_cuda_bench, both L2 methods, 1-D and 2-D: default (evict-first
#     FP8 stores) against l2_outputs (plain stores), two rounds;
#  4. host AdamW next to torch's fused CPU AdamW, 8192^2, FP32 gradients, row+col:
#     the new default (claimed runs of 4 units) against contiguous runs
#     (--claim_units=0) and against builds that prefetch 1 and 4 rows ahead
#     instead of 2 (QTX_ADAMW_PREFETCH_ROWS), ROUNDS rounds (default 4),
#     --phases in the first.
# Bundle: B/bin/{cuda_e2e_test, optimizer_cuda_e2e_test,
# optimizer_shard_cuda_e2e_test, qtxd, quantize_cuda_bench, optimizer_cpu_bench,
# optimizer_cpu_bench_pf{1,4}, optimizer_vs_torch.py}, the Python bundle in B/py_bundle.
#   B/gpu_session14_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
for t in cuda_e2e_test optimizer_cuda_e2e_test optimizer_shard_cuda_e2e_test; do
  step "$t" 180 env QTXD="$B/bin/qtxd" "$B/bin/$t"
done
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
step python 300 env -u LD_LIBRARY_PATH QTX_PY_BENCH=0 QTX_GPU_BUDGET_S=280 \
  bash "$B/py_bundle/gpu_python.sh" "$O/py"
grep -E " rc=|MPS" "$O/py/log.txt" >> "$L" 2>/dev/null
for r in 1 2; do
  step "bench_round$r" 150 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d --usages row+col,row --variants default,l2_outputs \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
export OMP_WAIT_POLICY=passive
step adamw 420 bash -c "python3 \"$B/bin/optimizer_vs_torch.py\" --bench=claim4=\"$B/bin/optimizer_cpu_bench\" \
  --bench=static=\"$B/bin/optimizer_cpu_bench\" --bench_flag=static=--claim_units=0 \
  --bench=pf1=\"$B/bin/optimizer_cpu_bench_pf1\" --bench=pf4=\"$B/bin/optimizer_cpu_bench_pf4\" \
  --bench_flag=static=--triad_mib=512 --bench_flag=claim4=--triad_mib=512 \
  --bench_flag=pf1=--triad_mib=512 --bench_flag=pf4=--triad_mib=512 \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=${ROUNDS:-4} --grad=fp32 --torch_impls=fused \
  --phases > \"$O/adamw_vs_torch.jsonl\""
grep adamw_vs_torch "$O/adamw_vs_torch.jsonl" | cut -c1-300 >> "$L"
grep -hE " rc=|MPS|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -60
