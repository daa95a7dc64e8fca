#!/bin/bash
# A lead's regression run on a GPU host after merging a session's branches,
# from a Python GPU bundle (scripts/make_gpu_python_bundle.sh) with
# cuda_vmm_test added to bin/: qtx.cuda's optimizer tests (incl. the
# data-parallel sharded step from a Python thread per owner), the qtx.cuda
# tests (fast-path quantize, background writer), and the C++ channel and VMM
# tests that now start their child processes through tests/testing/subprocess.
# Usage: B/gpu_session8_run.sh OUT. The log is written as it goes.
B=$(cd "$(dirname "$0")" && pwd)
O=${1:?out}; mkdir -p "$O"; L=$O/log.txt
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
export PYTHONUNBUFFERED=1
step() { qtx_step "$L" "$@"; }  # step NAME SECONDS CMD... (gpu_env.sh)
cp -f "$B"/bin/_native*.so "$B/py/qtx/" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L" 2>&1
step gpu_test_optimizer 90 python3 "$B/tests/gpu_test_optimizer.py" --qtxd="$B/bin/qtxd" --python_dir="$B/py"
step cuda_channel_test 60 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd"
step cuda_vmm_test 40 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd"
step gpu_test_cuda 70 python3 "$B/tests/gpu_test_cuda.py" --qtxd="$B/bin/qtxd" --python_dir="$B/py"
grep -hE "^(OK|FAILED)|Ran | rc=|^\[  (PASSED|FAILED) |Error:" "$L" | head -40
