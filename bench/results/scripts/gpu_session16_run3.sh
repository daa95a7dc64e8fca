#!/bin/bash
# Session 16's third GPU run (one H200, no MPS): per-tensor scaling (TENSOR)
# in the exact all-gather.
#  1. kernels_cuda_test, whole: the CUDA shard protocol against the CPU
#     reference with TENSOR added, TensorAmax / QuantizeTensorWithAmax against
#     the CPU's, and every other kernel test;
#  2. cuda_device_test (the CUDA device's shard operations);
#  3. cuda_allgather_channel_test: a one-rank NCCL group through qtxd on the
#     GPU, channel and synchronous calls, now with TENSOR cases (EXACT_FP8 in
#     two rounds, refused with shard_rows; GATHER_HIGH_PRECISION).
# Bundle: B/bin/{kernels_cuda_test, cuda_device_test, cuda_allgather_channel_test, qtxd}.
#   B/gpu_session16_run3.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi -L >> "$L" 2>&1
step kernels_cuda_test 240 "$B/bin/kernels_cuda_test"
step cuda_device_test 120 "$B/bin/cuda_device_test"
step cuda_allgather_channel_test 150 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|cuda_allgather_1rank_exact" "$L" | cut -c1-200 | head -60
