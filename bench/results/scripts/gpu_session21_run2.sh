#!/bin/bash
# Session 21's second GPU run (one H200, no MPS): after the driver's memory
# functions moved to common/cuda_driver.h (MemoryOps, one lookup for the
# client's IPC / VMM exports and qtxd's imports) and the CPU reference's typed
# loads and encoders to kernels/fp8.h: cuda_driver_test, cuda_device_test, the
# qtxd tests of IPC and VMM memory (kill tests included: no MPS), the channel,
# plan and all-gather tests, and the CPU kernel tests on this host's AVX-512
# (the band kernel's ISA tests skip on CI's CPU).
# Bundle: B/bin/{cuda_driver_test,cuda_device_test,qtxd,cuda_e2e_test,cuda_vmm_test,
#   cuda_channel_test,cuda_plan_test,cuda_allgather_channel_test,cuda_param_allgather_test,
#   optimizer_cuda_e2e_test,optimizer_shard_cuda_e2e_test,kernels_cpu_test,
#   kernels_cpu_adamw_test}.   B/gpu_session21_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...; QTXD=B/bin/qtxd
step driver 60 "$B/bin/cuda_driver_test"
step device 200 "$B/bin/cuda_device_test"
step cuda_e2e 60 "$B/bin/cuda_e2e_test"
step vmm 200 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd"
step channel 200 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd"
step plan 60 "$B/bin/cuda_plan_test" --qtxd="$B/bin/qtxd"
step allgather_channel 60 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
step param_allgather 60 "$B/bin/cuda_param_allgather_test" --qtxd="$B/bin/qtxd"
step optimizer_cuda_e2e 60 "$B/bin/optimizer_cuda_e2e_test"
step optimizer_shard_cuda_e2e 60 "$B/bin/optimizer_shard_cuda_e2e_test"
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
step kernels_cpu 200 "$B/bin/kernels_cpu_test"
step kernels_cpu_adamw 200 "$B/bin/kernels_cpu_adamw_test"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED|NOT exercised" "$L" | cut -c1-200 | head -60
