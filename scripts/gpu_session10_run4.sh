#!/bin/bash
# The lead's fourth GPU run of session 10: the optimizer's GPU tests on the
# kept tile scales (host AdamW, 2b69205), from a bundle with qtxd,
# optimizer_cuda_e2e_test, optimizer_shard_cuda_e2e_test, the cp312 qtx._native,
# the qtx package in B/py and tests/python/gpu_test_optimizer.py in B/tests:
#   B/gpu_session10_run4.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
export QTXD="$B/bin/qtxd"
step optimizer_cuda_e2e_test 100 "$B/bin/optimizer_cuda_e2e_test"
step optimizer_shard_cuda_e2e_test 100 "$B/bin/optimizer_shard_cuda_e2e_test"
qtx_host_cxx_runtime "$B/lib"
cp -f "$B"/bin/_native*.so "$B/py/qtx/"
step gpu_test_optimizer 100 python3 "$B/tests/gpu_test_optimizer.py" --qtxd="$B/bin/qtxd" \
  --python_dir="$B/py"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|^(OK|FAILED)|Ran " "$L" | head -20
