#!/bin/bash
# Session 24's sixth GPU run (one H200): nccl_communicator_test (a one-rank
# NCCL group on cuda:0, the host's NCCL), the last gpu-labelled test binary
# that runs on one GPU (nccl_e2e_test needs two).
# Bundle: B/bin/nccl_communicator_test.   B/gpu_session24_run6.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step nccl_communicator 240 "$B/bin/nccl_communicator_test"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | head
