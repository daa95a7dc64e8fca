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
qtx_quantize_round 1 "$V" "$SH"
qtx_quantize_ncu ncu "$V" "$QTX_NCU_COUNTERS"
qtx_quantize_round 2 "$V" "$SH"
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
