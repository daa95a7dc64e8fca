#!/usr/bin/env bash
# On a GPU host: the stream-ordered AllGather's GPU tests (one-rank NCCL
# group) with CUDA MPS, the exact all-gather kernels' test, and the channel
# AllGather bench line, from a bundle made by deploy/bundle/make_bundle.sh:
#   QTX_BUNDLE_SKIP='libcublas|libcublasLt' deploy/bundle/make_bundle.sh build bundle-ag \
#     build/tests/client/cuda_allgather_channel_test build/tests/kernels/cuda/kernels_cuda_test \
#     build/tests/client/cuda_channel_test build/bench/channel_bench
# (each of the last three is optional: its step runs when it is in the bundle)
#   scripts/gpu_allgather_channel.sh bundle-ag OUT_DIR
# NCCL and cuBLAS come from the host (gpu_env.sh: PyTorch's wheels).
# Writes OUT_DIR/log.txt (everything) and OUT_DIR/bench.jsonl.
set -uo pipefail
B="$(cd "${1:?bundle dir}" && pwd)"
OUT="${2:?output dir}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
LOG="$OUT/log.txt"
rc_all=0
step() {  # step NAME TIMEOUT CMD...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  echo "=== $name" >> "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && rc_all=1
  echo "=== $name rc=$rc $((SECONDS - t0))s" >> "$LOG"
  echo "$name rc=$rc $((SECONDS - t0))s"
  return $rc
}
nvidia-smi -L >> "$LOG" 2>&1
mps=0
qtx_mps_start && mps=1
echo "mps=$mps" >> "$LOG"
if ! step cuda_allgather_channel_test 75 "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd"; then
  # Diagnosis: the same held tests with 4x larger CUDA launch queues (the
  # driver's command buffers), in case a full buffer is what made a host wait.
  CUDA_SCALE_LAUNCH_QUEUES=4x step cuda_allgather_channel_test_queues4x 45 \
    "$B/bin/cuda_allgather_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter='*Held*'
fi
if [ -x "$B/bin/kernels_cuda_test" ]; then
  step kernels_cuda_quantize_shard 60 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeShardCuda.*'
fi
if [ -x "$B/bin/cuda_channel_test" ]; then  # the channel test's AllGather (late producer)
  step cuda_channel_test_allgather 30 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" \
    --gtest_filter='*AllGather*'
fi
if [ -x "$B/bin/channel_bench" ]; then
  step channel_bench_allgather 30 "$B/bin/channel_bench" --qtxd="$B/bin/qtxd" --mps="$mps" \
    --allgather=1 ${QTX_BENCH_ARGS:---layers=50}
  grep -h '^{"bench"' "$LOG" > "$OUT/bench.jsonl"
fi
[ "$mps" = 1 ] && qtx_mps_stop
exit $rc_all
