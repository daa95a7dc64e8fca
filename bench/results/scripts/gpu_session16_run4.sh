#!/bin/bash
# Session 16's fourth GPU run (one H200, no MPS): qtx.cuda's GPU tests with
# the prebuilt cp312 module, for per-tensor scaling through Python on the GPU:
# gpu_test_cuda.py (AllGatherTest now gathers mode='tensor' through the
# channel's two-round path) and gpu_test_optimizer.py (mode='tensor' outputs).
# Bundle: scripts/make_gpu_python_bundle.sh build B, plus this file.
#   B/gpu_session16_run4.sh OUT
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:?out}"
mkdir -p "$OUT"
L="$OUT/log.txt"
. "$B/gpu_env.sh" || exit 2
qtx_host_cxx_runtime "$B/lib"
qtx_gpu_env "$B/lib"
cp -f "$B"/bin/_native*.so "$B/py/qtx/"
for t in gpu_test_cuda gpu_test_optimizer; do
  timeout -k 20 180 python3 "$B/tests/$t.py" --qtxd="$B/bin/qtxd" --python_dir="$B/py" >> "$L" 2>&1
  echo "$t rc=$?" | tee -a "$L"
done
grep -E "^(FAIL|ERROR)|^Ran |^OK|^FAILED|tensor" "$L" | head -40
