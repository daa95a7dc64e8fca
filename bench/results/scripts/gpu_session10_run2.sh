#!/bin/bash
# The lead's second GPU run of session 10: every single-GPU test of the
# "gpu" label on the final code, from one bundle (see bench/results/scripts/gpu_session10_run.sh
# for the C++ part; here also qtx, the cp312 qtx._native, the qtx package in
# B/py and tests/python/gpu_test_*.py + test_torch_fp8_gpu.py in B/tests):
#   B/gpu_session10_run2.sh OUT
# The C++ tests run with the bundle's libraries; the Python tests after them
# with the host's libstdc++ (PyTorch's), as scripts/gpu_python.sh does.
# nccl_e2e_test needs two GPUs: it runs to show what it does on one.
# Then the SASS of the quantize kernels, where the host has cuobjdump.
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
export QTXD="$B/bin/qtxd"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L" 2>&1
for t in cuda_vmm_test cuda_channel_test cuda_plan_test cuda_allgather_channel_test \
         cuda_param_allgather_test; do
  step "$t" 200 "$B/bin/$t" --qtxd="$B/bin/qtxd"
done
for t in cuda_device_test nccl_communicator_test cuda_e2e_test optimizer_cuda_e2e_test \
         optimizer_shard_cuda_e2e_test nccl_e2e_test; do
  step "$t" 200 "$B/bin/$t"
done
qtx_host_cxx_runtime "$B/lib"
cp -f "$B"/bin/_native*.so "$B/py/qtx/"
for t in gpu_test_cuda gpu_test_optimizer gpu_test_allgather_ranks; do
  step "$t" 200 python3 "$B/tests/$t.py" --qtxd="$B/bin/qtxd" --python_dir="$B/py"
done
step test_torch_fp8_gpu 200 python3 "$B/tests/test_torch_fp8_gpu.py" --qtxd="$B/bin/qtxd" \
  --qtx_cli="$B/bin/qtx" --python_dir="$B/py"
if command -v cuobjdump > /dev/null; then
  cuobjdump -sass "$B/bin/kernels_cuda_test" 2> /dev/null |
    awk '/Function : .*QuantizeBlockKernel/ {p=1} /Function : / && !/QuantizeBlockKernel/ {p=0} p' \
    > "$O/quantize_block_sass.txt"
  echo "sass lines $(wc -l < "$O/quantize_block_sass.txt")" >> "$L"
else
  echo "no cuobjdump on this host" >> "$L"
fi
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED|^(OK|FAILED)|Ran |sass|cuobjdump" "$L" |
  cut -c1-200 | head -80
