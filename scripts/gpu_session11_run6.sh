#!/bin/bash
# The lead's sixth GPU run of session 11 (bundle as in gpu_session11_run3.sh):
# issue 16's banded tile order (LaunchTuning::band_rows) on the drawn tiles
# against the default row-major order: bit-exactness,
# quantize_cuda_bench twice and ncu counters of each at 8192^2.
#   B/gpu_session11_run6.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
V=${VARIANTS:-default,band4,band8,band16}
SH=${SHAPES:-4096x4096,8192x8192,16384x7168,32768x4096}
step tuned_exact 200 "$B/bin/kernels_cuda_test" \
  --gtest_filter='QuantizeBlockCuda.Tuned*'
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
bench 2
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
