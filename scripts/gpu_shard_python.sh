#!/bin/bash
# GPU host: qtx.cuda's optimizer tests incl. the data-parallel sharded step
# (two qtxd --device=cuda:0 as the owners, a CPU qtxd as the reference), then
# optimizer_shard_bench on the host's cores (CPU qtxd over Gloo). The bundle:
# deploy/bundle/make_bundle.sh with bin/qtxd, bin/optimizer_shard_bench and the
# CPython 3.12 _native module (qtx_native_extra), plus py/qtx/*.py and
# tests/gpu_test_{cuda,optimizer}.py, this script and gpu_env.sh. Usage: B/gpu_shard_python.sh OUT.
B=$(cd "$(dirname "$0")" && pwd)
O=${1:?out}; mkdir -p "$O"; L=$O/gpu_shard.txt
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
export PYTHONUNBUFFERED=1
step() { qtx_step "$L" "$@"; }  # step NAME SECONDS CMD... (gpu_env.sh)
cp -f "$B"/bin/_native*.so "$B/py/qtx/" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L" 2>&1
step gpu_test_optimizer 180 python3 "$B/tests/gpu_test_optimizer.py" --qtxd="$B/bin/qtxd" --python_dir="$B/py"
step optimizer_shard_bench 150 sh -c "'$B/bin/optimizer_shard_bench' --qtxd='$B/bin/qtxd' --owners=2,3 --sets=8192x8192,megatron --steps=5 --optimizer_threads=4 --label=h200-host-16c > '$O/optimizer_shard_bench.jsonl'"
grep -hE "^(OK|FAILED)|Ran |rc=|Error|Traceback" "$L" | head -30
