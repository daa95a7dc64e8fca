#!/bin/bash
# GPU host: the torch_quantized_linear example through qtx.cuda (zero-copy, stream-ordered), from the repository root with a bundle B of scripts/make_gpu_python_bundle.sh whose bin/_native*.so is copied into B/py/qtx/, with this script as B/example.sh and gpu_env.sh next to it: B/example.sh OUT;
# against a CUDA qtxd under MPS, one H200.
B=$(cd "$(dirname "$0")" && pwd); O=${1:?out}; mkdir -p "$O"
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_host_cxx_runtime "$B/lib"
qtx_gpu_env "$B/lib"
export PYTHONUNBUFFERED=1
qtx_mps_start
"$B/bin/qtxd" --device=cuda:0 --allow_client_shm --socket=/tmp/qtxd-ex.sock --log_level=warn > "$O/qtxd.log" 2>&1 &
for i in $(seq 80); do [ -S /tmp/qtxd-ex.sock ] && break; sleep 0.25; done; sleep 0.5
timeout 240 python3 examples/torch_quantized_linear/train.py --target unix:///tmp/qtxd-ex.sock \
  --python_dir "$B/py" --quantizer cuda --device cuda --steps 100 --log_every 10 --check \
  --json "$O/example.jsonl" > "$O/example.txt" 2>&1; echo "example rc=$?" | tee -a "$O/example.txt"
kill %1; wait; qtx_mps_stop
tail -25 "$O/example.txt"
