#!/bin/bash
# Issue 16 kernel experiments on one H200 (session kern16b). Run from the repo root of the device
# copy with the bundle beside it:  bash bundle-kern16b/gpu_kern16b_run.sh   ($OUT: results)
# 1) quantize_cuda_bench, round 1: baseline ("default" = main's kernel) and the variants, measured
#    one after the other for every shape / mode / usage / L2 method (A/B alternated within the run)
# 2) ncu counters of one launch per variant, 8192^2 row+col and row, 1-D and 2-D
# 3) quantize_cuda_bench, round 2 (same command)
# 4) kernels_cuda_test: the cast tests (all 2^32 FP32 patterns) and every quantize_block test but
#    the large shapes other than 8192^2
B=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
LOG=$OUT/run.log
SH=${SHAPES:-4096x4096,8192x8192,16384x7168,32768x4096}
V=${VARIANTS:-default,dynamic}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv; } >"$LOG" 2>&1
bench() {
  local t0=$SECONDS
  timeout "${BENCH_TIMEOUT:-75}" "$B/bin/quantize_cuda_bench" --iters 100 --l2 both --modes 1d,2d \
    --usages row+col,row --variants "$V" --shapes "$SH" 2>>"$LOG" |
    sed "s/^{/{\"round\":$1,/" >>"$OUT/quantize_cuda_bench.jsonl"
  echo "bench round $1 rc ${PIPESTATUS[0]} $((SECONDS - t0)) s" >>"$LOG"
}
bench 1
if [ -z "$NO_NCU" ]; then
  t0=$SECONDS
  timeout 60 "$NCU" --csv --clock-control none -k regex:QuantizeBlockKernel --metrics \
gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,\
sm__cycles_elapsed.avg,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,\
lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \
    "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes 1d,2d --usages row+col,row \
    --variants "$V" --shapes 8192x8192 >"$OUT/ncu.csv" 2>>"$LOG"
  echo "ncu rc $? $((SECONDS - t0)) s" >>"$LOG"
  # Where the L2 read sectors come from (cp.async instructions, SM vs L2-fabric requests).
  t0=$SECONDS
  timeout 45 "$NCU" --csv --clock-control none -k regex:QuantizeBlockKernel --metrics \
smsp__inst_executed_op_ldgsts.sum,lts__t_sectors_srcunit_tex_op_read.sum,\
lts__t_sectors_srcunit_ltcfabric.sum,lts__t_requests_srcunit_tex_op_read.sum,\
lts__t_sectors_op_read.sum,lts__t_sectors_op_atom.sum,lts__t_sectors_op_red.sum \
    "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes 1d --usages row+col \
    --variants "$V" --shapes 8192x8192 >>"$OUT/ncu.csv" 2>>"$LOG"
  echo "ncu (read sources) rc $? $((SECONDS - t0)) s" >>"$LOG"
fi
bench 2
t0=$SECONDS
timeout "${TEST_TIMEOUT:-100}" "$B/bin/kernels_cuda_test" --gtest_brief=1 \
  --gtest_filter="${TESTS:-Fp8*:QuantizeBlockCuda.*:*QuantizeBlockCudaSmall*:*QuantizeBlockCudaLarge*8192x8192}" \
  >>"$LOG" 2>&1
echo "kernels_cuda_test rc $? $((SECONDS - t0)) s" >>"$LOG"
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
"$CUOBJ" --dump-resource-usage "$B/bin/quantize_cuda_bench" 2>&1 | grep -A1 "QuantizeBlockKernel" |
  grep -o "InputDTypeE1ELNS0_9Fp8FormatE0ELNS0_12BlockScalingE[01]ELb[01]ELb[01]ELi1ELi2ELi[0-9]EEEv\|REG:[0-9]* STACK:[0-9]* SHARED:[0-9]* LOCAL:[0-9]*" |
  paste - - | sort | uniq -c >>"$LOG" 2>&1
date -u >>"$LOG"
