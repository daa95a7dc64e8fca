#!/bin/bash
# GPU host: the optimizer's device paths (data-parallel sharded Step, device Step, qtx.cuda step incl. per-tensor scaled parameters), from a bundle of scripts/make_gpu_python_bundle.sh with optimizer_shard_cuda_e2e_test and optimizer_cuda_e2e_test added to bin/, this script as B/runB.sh and gpu_env.sh next to it. Usage: B/runB.sh OUT.
B=$(cd "$(dirname "$0")" && pwd)
O=${1:?out}; mkdir -p "$O"; L=$O/runB.txt
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_host_cxx_runtime "$B/lib"
qtx_gpu_env "$B/lib"
export PYTHONUNBUFFERED=1 QTXD=$B/bin/qtxd
step() { qtx_step "$L" "$@"; }  # step NAME SECONDS CMD... (gpu_env.sh)
step optimizer_shard_cuda_e2e 150 "$B/bin/optimizer_shard_cuda_e2e_test"
step optimizer_cuda_e2e 150 "$B/bin/optimizer_cuda_e2e_test"
cp -f "$B"/bin/_native*.so "$B/py/qtx/"
step gpu_test_optimizer 120 python3 "$B/tests/gpu_test_optimizer.py" --qtxd="$B/bin/qtxd" --python_dir="$B/py"
grep -hE "^\[  (PASSED|FAILED) |^\[  FAILED|^(OK|FAILED)|Ran |rc=" "$L" | head -30
