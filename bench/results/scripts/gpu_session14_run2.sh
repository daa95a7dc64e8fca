#!/bin/bash
# Session 14's second GPU run (one H200): the C++ channel tests under MPS (as
# scripts/gpu_final.sh's MPS suite), then qtx.cuda's GPU Python tests with and
# without MPS (scripts/gpu_python.sh, tests only), the first run of the Python
# tests since they start qtxd through tests/python/qtxd_child.py.
# Bundle: B/bin/{qtxd, cuda_plan_test, cuda_allgather_channel_test,
# cuda_channel_test, cuda_vmm_test}, and the Python bundle in B/py_bundle
# (scripts/make_gpu_python_bundle.sh).   B/gpu_session14_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
if qtx_mps_start >> "$L" 2>&1; then
  echo "mps started" >> "$L"
  step plan_mps1 60 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd" --gtest_filter='-*QtxdDying*'
  step allgather_mps1 90 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
  step channel_mps1 90 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*ClientKilled*
  step vmm_mps1 60 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*Kill*
  pkill -9 -f "$B/bin/qtxd" 2>/dev/null
  qtx_mps_stop
else
  echo "MPS did not start" | tee -a "$L"
fi
step python 420 env QTX_PY_BENCH=0 QTX_GPU_BUDGET_S=400 bash "$B/py_bundle/gpu_python.sh" "$O/py"
grep -E " rc=|MPS" "$O/py/log.txt" >> "$L" 2>/dev/null
grep -hE "mps started|MPS| rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -60
