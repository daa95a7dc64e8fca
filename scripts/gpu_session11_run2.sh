#!/bin/bash
# The lead's second GPU run of session 11 (bundle as in gpu_session11_run1.sh,
# with tests/python/gpu_test_cuda.py added): issue 16's tensor-engine tile
# loads (LaunchTuning::bulk_loads, now one 128 x 128 box per tile) against the
# default kernel: bit-exactness, quantize_cuda_bench twice, ncu counters and
# the warp-state / scheduler / memory sections of both at 8192^2; then the
# optimizer's Python GPU test that run 1's bundle could not import.
#   B/gpu_session11_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
V=${VARIANTS:-default,bulk,bulk_balanced}
SH=${SHAPES:-4096x4096,8192x8192,16384x7168,32768x4096}
step tuned_exact 200 "$B/bin/kernels_cuda_test" \
  --gtest_filter='QuantizeBlockCuda.Tuned*:QuantizeBlockCuda.Dynamic*'
bench() {
  step "bench_round$1" 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d --usages row+col,row --variants $V --shapes $SH | \
    sed 's/^{/{\"round\":$1,/' >> \"$O/quantize_cuda_bench.jsonl\""
}
bench 1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step ncu 90 bash -c 'o=$1; shift; "$@" > "$o"' _ "$O/ncu.csv" "$NCU" --csv --clock-control none \
  -k regex:QuantizeBlockKernel --metrics \
gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,\
sm__cycles_elapsed.avg,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,\
lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__registers_per_thread,launch__grid_size \
  "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes 1d,2d \
  --usages row+col,row --variants "$V" --shapes 8192x8192
step ncu_sections 120 bash -c 'o=$1; shift; "$@" > "$o"' _ "$O/ncu_sections.csv" "$NCU" --csv \
  --clock-control none -k regex:QuantizeBlockKernel --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy \
  "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes 1d,2d \
  --usages row+col --variants default,bulk --shapes 8192x8192
bench 2
export QTXD="$B/bin/qtxd"
qtx_host_cxx_runtime "$B/lib"
cp -f "$B"/bin/_native*.so "$B/py/qtx/"
step gpu_test_optimizer 100 python3 "$B/tests/gpu_test_optimizer.py" --qtxd="$B/bin/qtxd" \
  --python_dir="$B/py"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|^(OK|FAILED)|Ran " "$L" | cut -c1-200 | head -40
