#!/bin/bash
# Final GPU regression run of the C++ GPU tests (lead), without and with MPS.
# Usage (GPU host): a bundle (deploy/bundle/make_bundle.sh) holding qtxd,
# cuda_plan_test, cuda_allgather_channel_test, cuda_channel_test and
# cuda_vmm_test, with this script and gpu_env.sh copied into it; OUT= names
# the log folder.
# The tests that kill a process while GPU work is parked run last and only once
# under MPS: there such a kill may take the GPU's other MPS clients down (see
# client/README "MPS"), so nothing runs after them.
B=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=$O/final.txt
step() { qtx_step "$L" "$@"; }  # step NAME SECONDS CMD... (gpu_env.sh)
suite() {  # suite MPS(0|1) PLAN_FILTER
  step "plan_mps$1" 60 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd" --gtest_filter="$2"
  step "allgather_mps$1" 90 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
  QTX_CHANNEL_TEST_ITERS=200 step "channel_mps$1" 60 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*ClientKilled*
  step "vmm_mps$1" 60 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*Kill*
}
suite 0 '*'
qtx_mps_start
suite 1 '-*QtxdDying*'
step plan_qtxd_dying_mps1 40 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd" --gtest_filter='*QtxdDying*'
qtx_mps_stop
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
grep -hE "^\[  (PASSED|FAILED) |^\{|^[a-z0-9_]+ rc=" "$L" | head -80
