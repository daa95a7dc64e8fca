#!/bin/bash
# The lead's seventh GPU run of session 11: host AdamW with the FP8 output
# written as rowwise + columnwise (as before) and as rowwise only (the
# columnwise copy then made on the GPU), against torch's fused CPU AdamW in
# the same run, 8192^2, 1-16 threads, two rounds; then the GPU's columnwise
# copy from the rowwise one at 8192^2 (quantize_cuda_bench --usages col_from_row).
# Bundle: B/bin/optimizer_cpu_bench, B/bin/quantize_cuda_bench,
# B/optimizer_vs_torch.py.
#   B/gpu_session11_run7.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step vs_torch 400 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/optimizer_vs_torch.py\" \
  --bench=rowcol=\"$B/bin/optimizer_cpu_bench\" --bench=row=\"$B/bin/optimizer_cpu_bench\" \
  --bench_flag=row=--output=row --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=2 \
  --grad=fp32 --torch_impls=fused > \"$O/optimizer_vs_torch.jsonl\""
step col_from_row 60 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both --modes 2d \
  --usages col_from_row,row+col,row --shapes 8192x8192,16384x7168 > \"$O/col_from_row.jsonl\""
grep -h '"adamw_vs_torch"' "$O/optimizer_vs_torch.jsonl" | cut -c1-400
grep -hE " rc=" "$L"
