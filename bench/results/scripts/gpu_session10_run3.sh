#!/bin/bash
# The lead's third GPU run of session 10, from run 2's bundle (with
# tests/python/qtx_cli_io.py added): the PyTorch FP8 GEMM test that run 2's
# bundle could not import, and the killed-busy-client tests three times over.
#   B/gpu_session10_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step killbusy_x3 200 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd" \
  --gtest_filter='*KillBusy*' --gtest_repeat=3
qtx_host_cxx_runtime "$B/lib"
step test_torch_fp8_gpu 200 python3 "$B/tests/test_torch_fp8_gpu.py" --qtxd="$B/bin/qtxd" \
  --qtx_cli="$B/bin/qtx" --python_dir="$B/py"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|kill_busy|^(OK|FAILED)|Ran |passed|failed" "$L" |
  cut -c1-200 | head -40
