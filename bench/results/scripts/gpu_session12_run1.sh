#!/bin/bash
# The lead's first GPU run of session 12: the quantize block and per-tensor
# tests (935c159's TileCountersHeld assertion first ran here); Nsight Compute
# DRAM bytes and time of each pass of per-tensor current scaling at 4096^2 and
# 8192^2 with ncu's cache control off (so the cast pass finds what the amax pass
# left in L2; three single-pass metrics, so no replay); the tensor-mode bench;
# then host AdamW with BF16 gradients against torch fused (FP32 gradients).
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench,optimizer_cpu_bench},
# B/optimizer_vs_torch.py.   B/gpu_session12_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >> "$L" 2>&1
step tests 300 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda.*:QuantizeTensorCuda.*'
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step ncu_tensor 120 bash -c 'o=$1; shift; "$@" > "$o"' _ "$O/ncu_tensor.csv" "$NCU" --csv \
  --clock-control none --cache-control none -k regex:'TensorAmax|TileCast|RowCast' \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes tensor \
  --usages row+col,row --shapes 4096x4096,8192x8192
step tensor_bench 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both --modes tensor \
  --usages row+col,row --shapes 4096x4096,8192x8192,16384x7168 > \"$O/tensor_bench.jsonl\""
step vs_torch_bf16 420 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/optimizer_vs_torch.py\" \
  --bench=rowcol=\"$B/bin/optimizer_cpu_bench\" --bench=row=\"$B/bin/optimizer_cpu_bench\" \
  --bench_flag=row=--output=row --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=2 \
  --grad=bf16 --torch_impls=fused > \"$O/optimizer_vs_torch_bf16.jsonl\""
grep -h '"adamw_vs_torch"' "$O/optimizer_vs_torch_bf16.jsonl" | cut -c1-400
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L"
