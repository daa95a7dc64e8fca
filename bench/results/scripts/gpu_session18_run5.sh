#!/bin/bash
# Session 18's fifth GPU run (one H200): the C++ GPU tests after the code-health
# commits c77b171..cb8a02f (the client's one unary-call helper, GradNorm on the
# shared stub, AllGather's SetRequestFields, the optimizer store's FusedStep,
# cuda_device's LoadDriverSymbols for stream memory operations and VMM):
# the server backend's GPU tests, then gpu_final.sh's client suite without and
# with MPS (the kill tests last, under MPS only).
# Bundle: B/bin/{qtxd, cuda_*_test, nccl_communicator_test, optimizer_*cuda_e2e_test}.
#   B/gpu_session18_run5.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
for t in cuda_device_test cuda_e2e_test nccl_communicator_test optimizer_cuda_e2e_test \
         optimizer_shard_cuda_e2e_test; do
  step "$t" 120 "$B/bin/$t" --qtxd="$B/bin/qtxd"  # (run 5 lacked --qtxd; run 6 reran these 3)
done
suite() {  # suite MPS(0|1) PLAN_FILTER
  step "plan_mps$1" 60 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd" --gtest_filter="$2"
  step "allgather_mps$1" 90 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
  step "param_allgather_mps$1" 90 "$B/bin/cuda_param_allgather_test" --qtxd="$B/bin/qtxd"
  step "channel_mps$1" 60 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*ClientKilled*
  step "vmm_mps$1" 60 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd" --gtest_filter=-*Kill*
}
suite 0 '*'
qtx_mps_start
suite 1 '-*QtxdDying*'
step plan_qtxd_dying_mps1 40 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd" --gtest_filter='*QtxdDying*'
qtx_mps_stop
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -60
