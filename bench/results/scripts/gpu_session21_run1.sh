#!/bin/bash
# Session 21's GPU run (one H200): the tests of the shared driver lookup
# (common/cuda_driver.h, used by qtxd's channel queue, VMM and IPC paths and by
# the client's channel and IPC exports), without and with MPS; then issue 16's
# three benchmarks on the final code, in one run: quantize_cuda_bench (1-D,
# 2-D and per-tensor, both L2 methods, two rounds) and the host AdamW + FP8
# step against torch's fused CPU AdamW with the host's triad bandwidth.
# Bundle: B/bin/{cuda_driver_test,kernels_cuda_test,qtxd,cuda_e2e_test,
#   optimizer_cuda_e2e_test,cuda_channel_test,cuda_allgather_channel_test,
#   cuda_plan_test,cuda_param_allgather_test,cuda_vmm_test,quantize_cuda_bench,
#   optimizer_cpu_bench,optimizer_vs_torch.py}.   B/gpu_session21_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...; QTXD=B/bin/qtxd
step driver 60 "$B/bin/cuda_driver_test"
step channel 120 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*ClientKilled*
step vmm 150 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*Kill*
step plan 60 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd"
step allgather_channel 60 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
step param_allgather 60 "$B/bin/cuda_param_allgather_test" --qtxd="$B/bin/qtxd"
step cuda_e2e 60 "$B/bin/cuda_e2e_test"
step optimizer_cuda_e2e 60 "$B/bin/optimizer_cuda_e2e_test"
if qtx_mps_start; then
  step mps_driver 60 "$B/bin/cuda_driver_test"
  step mps_channel 120 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*ClientKilled*
  step mps_plan 60 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd"
  pkill -9 -f "$B/bin/qtxd" 2>/dev/null
  qtx_mps_stop
else
  echo "mps rc=unavailable" | tee -a "$L"
fi
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
for r in 1 2; do
  step "bench_round$r" 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d,tensor --usages row+col,row --variants default \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
step adamw 200 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" \
  --bench=qtx=\"$B/bin/optimizer_cpu_bench\" --bench_flag=qtx=--triad_mib=512 \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=3 --grad=fp32 --torch_impls=fused \
  > \"$O/adamw_vs_torch.jsonl\""
step tests_all 330 "$B/bin/kernels_cuda_test"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -60
