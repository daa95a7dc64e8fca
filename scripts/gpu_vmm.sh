#!/usr/bin/env bash
# On a GPU host: the VMM registration GPU test (cuda_vmm_test) without and
# with CUDA MPS, the client-killed case repeated under MPS, and for contrast
# the same case with CUDA IPC (cudaMalloc) memory; plus what PyTorch's
# allocator settings produce (scripts/torch_vmm_probe.py, if torch imports).
# From a bundle made by deploy/bundle/make_bundle.sh with the tests added:
#   deploy/bundle/make_bundle.sh build bundle-vmm build/tests/client/cuda_vmm_test \
#     build/tests/client/cuda_channel_test
#   scripts/gpu_vmm.sh bundle-vmm OUT_DIR
# Writes OUT_DIR/vmm.txt (all logs) and prints one summary line per step.
set -uo pipefail
B="$(cd "${1:?bundle dir}" && pwd)"
OUT="${2:?output dir}"
mkdir -p "$OUT"
LOG="$OUT/vmm.txt"
HERE="$(cd "$(dirname "$0")" && pwd)"
# PyTorch first, with the environment it was started with.
if [ -z "${QTX_SKIP_TORCH:-}" ] && [ -f "$HERE/torch_vmm_probe.py" ] &&
   python3 -c 'import torch' 2>/dev/null; then
  for conf in "" "expandable_segments:True" "backend:cudaMallocAsync"; do
    echo "===== torch_probe[$conf]" >> "$LOG"
    PYTORCH_CUDA_ALLOC_CONF="$conf" timeout 60 python3 "$HERE/torch_vmm_probe.py" >> "$LOG" 2>&1
    echo "torch_probe[$conf] rc=$?"
  done
fi
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
QTXD="$B/bin/qtxd"
nvidia-smi -L >> "$LOG" 2>&1
rc_all=0
step() {  # step NAME CMD...: run with a time limit, append to the log, summarize
  local name="$1"; shift
  local t0=$SECONDS
  echo "===== $name" >> "$LOG"
  timeout "${QTX_STEP_TIMEOUT:-60}" "$@" >> "$LOG" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && rc_all=1
  echo "$name rc=$rc $((SECONDS - t0))s"
}
step cuda_vmm_test_mps0 "$B/bin/cuda_vmm_test" --qtxd="$QTXD"
if [ -x "$B/bin/cuda_channel_test" ]; then  # the CUDA IPC path of RegionCache
  step cuda_channel_region_cache_mps0 "$B/bin/cuda_channel_test" --qtxd="$QTXD" \
    --gtest_filter='*RegionCache*'
fi
if qtx_mps_start; then
  step cuda_vmm_test_mps1 "$B/bin/cuda_vmm_test" --qtxd="$QTXD" --gtest_filter='-*Kill*'
  # One killed client per step (a GPU fault under MPS tears down every
  # client, and the MPS server needs a moment to come back); the CUDA IPC
  # cases last.
  for t in KillSpinningClient KillBusyClientVmm KillBusyClientVmm \
           AClientKilledWithParkedWorkOnVmmMemoryLeavesQtxdServing KillBusyClientIpc; do
    sleep 3
    step "kill_${t}_mps1" "$B/bin/cuda_vmm_test" --qtxd="$QTXD" --gtest_filter="*.$t"
  done
  if [ -x "$B/bin/cuda_channel_test" ]; then
    sleep 3
    step ipc_parked_client_killed_mps1 "$B/bin/cuda_channel_test" --qtxd="$QTXD" \
      --gtest_filter='*ClientKilled*'
  fi
  qtx_mps_stop
  grep -iE "sticky|fault|teardown|exception|Xid" "$CUDA_MPS_LOG_DIRECTORY/server.log" 2>/dev/null \
    | tail -n 40 >> "$LOG"
else
  echo "MPS daemon did not start"; rc_all=1
fi
grep -E '^\{|^\[  (PASSED|FAILED) |FAILED  \]|Failure|error' "$LOG" | head -80
exit $rc_all
