#!/bin/bash
# The lead's fifth GPU run of session 12: the one cooperative launch of
# per-tensor current scaling under MPS (qtx's deployment on one GPU), first
# with no limit (every QuantizeTensorCuda test, then the channel tests through
# qtxd), then with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50, where the one launch
# is expected to be refused as too large and QuantizeTensor to fall back to the
# two launches with the same bytes (the tests that check bytes on the default
# path; the launch-path test is expected to report the forced one launch as
# not taken there).
# First, without MPS, one round of quantize_cuda_bench (tensor mode, 4096^2 and
# 8192^2) for the build whose launch plan is found once per device.
# Bundle: B/bin/{kernels_cuda_test,cuda_channel_test,qtxd,quantize_cuda_bench}.
#   B/gpu_session12_run5.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step bench 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both --modes tensor \
  --usages row+col,row --variants default,two_pass --shapes 4096x4096,8192x8192 \
  > \"$O/quantize_cuda_bench.jsonl\""
qtx_mps_start >> "$L" 2>&1 && echo "mps started" | tee -a "$L"
step mps_tests 300 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeTensorCuda.*'
step mps_channel 300 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd"
step mps50_tests 300 env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 "$B/bin/kernels_cuda_test" \
  --gtest_filter='QuantizeTensorCuda.*'
qtx_mps_stop
grep -hE "mps started| rc=|^\[  (PASSED|FAILED) |FAILED  \]|launch path" "$L" | cut -c1-200 | head -40
