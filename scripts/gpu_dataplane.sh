#!/usr/bin/env bash
# On a GPU host: runs the CUDA data-plane tests (CudaDevice, qtxd on cuda:0 with
# CUDA IPC regions and events, end to end) and the service-overhead benchmark,
# without and with CUDA MPS, from a bundle made by deploy/bundle/make_bundle.sh
# with the test and bench executables added:
#   deploy/bundle/make_bundle.sh build-gpu bundle-gpu build-gpu/tests/server/backend/{server_backend_test,cuda_device_test,cuda_e2e_test} build-gpu/bench/service_overhead_bench
#   scripts/gpu_dataplane.sh bundle-gpu OUT_DIR
# Writes logs and JSON lines under OUT_DIR; prints one summary line per step.
set -uo pipefail
B="$(cd "${1:?bundle dir}" && pwd)"
OUT="${2:?output dir}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
export QTXD="$B/bin/qtxd"
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
rc_all=0

step() {  # step NAME CMD...: run, log to OUT/NAME.txt, summarize
  local name="$1"; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && rc_all=1
  echo "$name rc=$rc $((SECONDS - t0))s $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.txt" | tr '\n' ' ')"
}

step server_backend_test "$B/bin/server_backend_test"
step cuda_device_test "$B/bin/cuda_device_test"
step cuda_e2e_test "$B/bin/cuda_e2e_test"
"$B/bin/service_overhead_bench" --qtxd="$QTXD" --mps=0 \
  > "$OUT/overhead_mps0.jsonl" 2> "$OUT/overhead_mps0.txt"
echo "overhead mps=0 rc=$?"; cat "$OUT/overhead_mps0.txt"

# CUDA MPS: qtxd and the clients started below all connect through it.
if qtx_mps_start; then
  step cuda_e2e_test_mps "$B/bin/cuda_e2e_test"
  "$B/bin/service_overhead_bench" --qtxd="$QTXD" --mps=1 \
    > "$OUT/overhead_mps1.jsonl" 2> "$OUT/overhead_mps1.txt"
  echo "overhead mps=1 rc=$?"; cat "$OUT/overhead_mps1.txt"
  qtx_mps_stop
  cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mps-log" 2>/dev/null
else
  echo "MPS daemon did not start"
fi
exit $rc_all
