#!/bin/bash
# The lead's regression run of session 9 on a GPU host, from a bundle made by
# scripts/make_gpu_python_bundle.sh with cuda_vmm_test, cuda_plan_test,
# cuda_allgather_channel_test, cuda_param_allgather_test and channel_bench in
# bin/: the VMM test whole (the killed busy client included: the channel's
# enqueue window), the channel, plan and one-rank AllGather tests, the
# qtx.cuda tests, then the channel chain benchmark under MPS.
# Usage: B/gpu_session9_run.sh OUT. One log, written as it goes.
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
cp -f "$B"/bin/_native*.so "$B/py/qtx/" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L" 2>&1
step cuda_vmm_test 90 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd"
step cuda_channel_test 60 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd"
step cuda_plan_test 40 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd"
step cuda_allgather_channel_test 40 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
step cuda_param_allgather_test 40 "$B/bin/cuda_param_allgather_test" --qtxd="$B/bin/qtxd"
step gpu_test_cuda 60 python3 "$B/tests/gpu_test_cuda.py" --qtxd="$B/bin/qtxd" --python_dir="$B/py"
if qtx_mps_start; then
  step channel_bench_mps1 40 "$B/bin/channel_bench" --qtxd="$B/bin/qtxd" --mps=1
  qtx_mps_stop
fi
grep -hE "^(OK|FAILED)|Ran | rc=|^\[  (PASSED|FAILED) |FAILED  \]|\"channel_chain\"|kill_busy|Error:" "$L" | head -60
