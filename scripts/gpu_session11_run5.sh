#!/bin/bash
# The lead's fifth GPU run of session 11: drawn tiles (each stream's tile
# counter) as the quantize kernel's default, the fixed share as the
# `fixed` variant, 128-byte aligned stages. From one bundle (B/bin: qtxd,
# kernels_cuda_test, quantize_cuda_bench and the C++ GPU tests below; B/py,
# B/tests as in gpu_session10_run2.sh):
#   B/gpu_session11_run5.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
export QTXD="$B/bin/qtxd"
V=${VARIANTS:-default,fixed}
SH=${SHAPES:-4096x4096,8192x8192,16384x7168,32768x4096}
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
lts__t_sectors_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__registers_per_thread,launch__grid_size \
  "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes 1d,2d \
  --usages row+col,row --variants "$V" --shapes 8192x8192
bench 2
step kernels_cuda_test 300 "$B/bin/kernels_cuda_test"
for t in cuda_device_test cuda_e2e_test optimizer_cuda_e2e_test; do
  step "$t" 200 "$B/bin/$t"
done
for t in cuda_channel_test cuda_allgather_channel_test cuda_param_allgather_test; do
  step "$t" 200 "$B/bin/$t" --qtxd="$B/bin/qtxd"
done
qtx_host_cxx_runtime "$B/lib"
cp -f "$B"/bin/_native*.so "$B/py/qtx/"
step gpu_test_cuda 200 python3 "$B/tests/gpu_test_cuda.py" --qtxd="$B/bin/qtxd" \
  --python_dir="$B/py"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|^(OK|FAILED)|Ran " "$L" | cut -c1-200 | head -40
