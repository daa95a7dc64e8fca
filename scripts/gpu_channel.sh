#!/usr/bin/env bash
# On a GPU host: the stream-ordered channel's GPU test and benchmark, without
# and with CUDA MPS, from a bundle made by deploy/bundle/make_bundle.sh with
# the test and bench added (cuBLAS left out: the host's PyTorch has it):
#   QTX_BUNDLE_SKIP='libcublas|libcublasLt' deploy/bundle/make_bundle.sh build bundle-ch \
#     build/tests/client/cuda_channel_test build/bench/channel_bench
#   scripts/gpu_channel.sh bundle-ch OUT_DIR
# QTX_CUBLAS_LIB: folder with libcublas.so.13 (default: PyTorch's nvidia wheel).
# Writes logs and JSON lines under OUT_DIR; prints one summary line per step.
set -uo pipefail
B="$(cd "${1:?bundle dir}" && pwd)"
OUT="${2:?output dir}"
mkdir -p "$OUT"
if [ -z "${QTX_CUBLAS_LIB:-}" ]; then
  QTX_CUBLAS_LIB="$(dirname "$(find /opt /usr/local /usr/lib -name 'libcublas.so.13' 2>/dev/null | head -1)" 2>/dev/null)"
fi
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib${QTX_CUBLAS_LIB:+:$QTX_CUBLAS_LIB}"
QTXD="$B/bin/qtxd"
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
echo "cublas: ${QTX_CUBLAS_LIB:-none}" >> "$OUT/gpu.txt"
rc_all=0
step() {  # step NAME CMD...: run, log to OUT/NAME.txt, summarize
  local name="$1"; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && rc_all=1
  echo "$name rc=$rc $((SECONDS - t0))s $(grep -E '^\[  (PASSED|FAILED) |^\{' "$OUT/$name.txt" | tr '\n' ' ')"
}
run_all() {  # run_all MPS
  # Under MPS a client killed while qtxd's work uses its device memory brings
  # down every process on the GPU (client/README.md, "MPS"): that test runs
  # last and on its own there, and its failure is reported as that limit.
  local filter=""
  [ "$1" = 1 ] && filter="--gtest_filter=-*ClientKilled*"
  step "cuda_channel_test_mps$1" "$B/bin/cuda_channel_test" --qtxd="$QTXD" $filter
  for f in host device; do
    step "channel_bench_${f}_mps$1" "$B/bin/channel_bench" --qtxd="$QTXD" --mps="$1" \
      --flags="$f" ${QTX_BENCH_ARGS:-}
    grep '^{' "$OUT/channel_bench_${f}_mps$1.txt" > "$OUT/channel_bench_${f}_mps$1.jsonl"
  done
}
QTX_CHANNEL_TEST_ITERS="${QTX_CHANNEL_TEST_ITERS:-300}" run_all 0
if qtx_mps_start; then
  QTX_CHANNEL_TEST_ITERS="${QTX_CHANNEL_TEST_ITERS_MPS:-2000}" run_all 1
  "$B/bin/cuda_channel_test" --qtxd="$QTXD" --gtest_filter='*ClientKilled*' \
    > "$OUT/cuda_channel_client_killed_mps1.txt" 2>&1
  echo "client_killed_mps1 rc=$? (known limit under MPS when non-zero: see client/README.md)"
  qtx_mps_stop
else
  echo "MPS daemon did not start"; rc_all=1
fi
exit $rc_all
