#!/bin/bash
# Session 24's GPU run (one H200), issue 16's per-tensor goal (>= 0.85x the
# copy at 8192^2): what bounds it. Part "tensor":
#   QuantizeTensorCuda (bit-exact with the CPU reference; the new amax-phase
#   timing mode included), then 4 rounds, L2 flushed, per-tensor row+col and
#   row at 4096^2, 8192^2 and 16384x7168: the default one cooperative launch;
#   its phase 1 alone (amax_phase); the two launches (two_pass) and their
#   amax pass alone (amax_pass); the copy kernels; and the device's read-only
#   and write-only rates (kread_*, kwrite_*) over the bytes the quantize reads
#   and writes. The variants' order rotates each round (one discarded first
#   measurement each). Then Nsight Compute counters of one launch of each at
#   8192^2 (cache control off: the cast sees what the amax phase left in L2).
# Part "suite": every kernels_cuda_test test, the driver and device tests;
#   then the service GPU tests (plan, allgather channel, channel, vmm, param
#   allgather) without and with MPS (scripts/gpu_final.sh's filters), and the
#   end-to-end quantize / optimizer / sharded optimizer tests without MPS.
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench,qtxd,cuda_*_test,
#   optimizer_cuda_e2e_test,optimizer_shard_cuda_e2e_test}.
#   B/gpu_session24_run1.sh OUT tensor|suite
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
case "${2:?tensor|suite}" in
  tensor)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$L" 2>&1
    step tensor_tests 200 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeTensorCuda*'
    K=kcopy_t512_c4_u4,kcopy_t1024_c2_u4_plain,kread_t512_c4_u4,kread_t1024_c2_u4_plain
    K=$K,kread_t256_c8_u8,kread_t256_flat_u4_plain,kwrite_t512_c4_u4,kwrite_t1024_c2_u4_plain
    K=$K,kwrite_t256_flat_u4_plain
    VS=(default,amax_phase,amax_pass,two_pass two_pass,default,amax_phase,amax_pass
        amax_pass,two_pass,default,amax_phase amax_phase,amax_pass,two_pass,default)
    for r in 1 2 3 4; do
      v=${VS[$((r - 1))]}
      step "round$r" 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush \
        --modes tensor --usages row+col,row --variants ${v%%,*},$v,$K \
        --shapes 4096x4096,8192x8192,16384x7168 | \
        sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
    done
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    step ncu 200 bash -c "\"$ncu\" --csv --clock-control none --cache-control none \
      -k regex:'OnePassTensorKernel|TensorAmaxKernel|TileCastKernel|RowCastKernel|Stream' \
      --metrics $QTX_NCU_COUNTERS \"$B/bin/quantize_cuda_bench\" --iters 1 --warmup 0 \
      --l2 flush --modes tensor --usages row+col,row \
      --variants default,amax_phase,two_pass,kcopy_t512_c4_u4,kread_t512_c4_u4,kwrite_t512_c4_u4 \
      --shapes 8192x8192 > \"$O/ncu.csv\""
    ;;
  suite)
    step kernels_cuda_test 330 "$B/bin/kernels_cuda_test" --gtest_brief=1
    suite() {  # suite MPS(0|1) PLAN_FILTER
      step "plan_mps$1" 60 "$B/bin/cuda_plan_test" --qtxd="$QTXD" --gtest_filter="$2"
      step "allgather_mps$1" 90 "$B/bin/cuda_allgather_channel_test" --qtxd="$QTXD"
      QTX_CHANNEL_TEST_ITERS=200 step "channel_mps$1" 60 "$B/bin/cuda_channel_test" \
        --qtxd="$QTXD" --gtest_filter=-*ClientKilled*
      step "vmm_mps$1" 60 "$B/bin/cuda_vmm_test" --qtxd="$QTXD" --gtest_filter=-*Kill*
      step "param_allgather_mps$1" 60 "$B/bin/cuda_param_allgather_test" --qtxd="$QTXD"
    }
    step driver 60 "$B/bin/cuda_driver_test"
    step device 120 "$B/bin/cuda_device_test"
    suite 0 '*'
    step cuda_e2e 60 "$B/bin/cuda_e2e_test"
    step optimizer_cuda_e2e 60 "$B/bin/optimizer_cuda_e2e_test"
    step optimizer_shard_cuda_e2e 60 "$B/bin/optimizer_shard_cuda_e2e_test"
    qtx_mps_start
    suite 1 '-*QtxdDying*'
    step plan_qtxd_dying_mps1 40 "$B/bin/cuda_plan_test" --qtxd="$QTXD" --gtest_filter='*QtxdDying*'
    qtx_mps_stop
    pkill -9 -f "$QTXD" 2>/dev/null
    ;;
esac
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -60
