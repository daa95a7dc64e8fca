#!/bin/bash
# Session 24's fifth GPU run (one H200): the Python GPU tests on the final
# code (the gpu-labelled python_* tests): scripts/gpu_python.sh, tests only,
# with and without MPS (qtx.cuda: gpu_test_cuda, gpu_test_optimizer,
# gpu_test_allgather_ranks, the RegionCache channel test), then
# tests/python/test_torch_fp8_gpu.py (qtx operands through PyTorch's
# block-scaled FP8 GEMM) against this bundle's qtxd and qtx CLI.
# Bundle: scripts/make_gpu_python_bundle.sh BUILD B, plus
#   B/tests/test_torch_fp8_gpu.py and this script.   B/gpu_session24_run5.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
O=${1:?out}; mkdir -p "$O"
QTX_PY_BENCH=0 bash "$B/gpu_python.sh" "$O/py"
. "$B/gpu_env.sh" || exit 2
qtx_gpu_env "$B/lib"
s=$SECONDS
timeout 300 python3 "$B/tests/test_torch_fp8_gpu.py" --qtxd="$B/bin/qtxd" --qtx_cli="$B/bin/qtx" \
  --python_dir="$B/py" --json="$O/torch_fp8.jsonl" > "$O/torch_fp8.txt" 2>&1
echo "torch_fp8_gpu rc=$? $((SECONDS - s))s" | tee -a "$O/torch_fp8.txt"
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
grep -h " rc=" "$O/py/log.txt" | head -30
tail -3 "$O/torch_fp8.txt"
