#!/usr/bin/env bash
# NCCL half of the collective AllGather on a 2-GPU host, from a bundle:
#   here:  cmake --build build-nccl -j2 --target qtxd nccl_e2e_test kernels_cuda_test allgather_nccl_bench
#          deploy/bundle/make_bundle.sh build-nccl bundle-nccl \
#            build-nccl/tests/server/collective/nccl_e2e_test \
#            build-nccl/tests/kernels/cuda/kernels_cuda_test build-nccl/bench/allgather_nccl_bench
#   there: scripts/gpu_nccl.sh bundle-nccl "$OUT"
# Runs the kernel test (quantize_shard filter), the two-qtxd NCCL e2e test
# and the all-gather benchmark; logs and JSON lines under OUT_DIR.
set -uo pipefail
B="$(cd "${1:?bundle dir}" && pwd)"
OUT="${2:?output dir}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
export QTXD="$B/bin/qtxd"
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
echo "LD_LIBRARY_PATH: $LD_LIBRARY_PATH"
rc_all=0
step() {  # step NAME TIMEOUT CMD...
  local name="$1" to="$2"; shift 2
  local t0=$SECONDS
  timeout "$to" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && rc_all=1
  echo "$name rc=$rc $((SECONDS - t0))s $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.txt" | tr '\n' ' ')"
  [ $rc -ne 0 ] && tail -c 2500 "$OUT/$name.txt"
}
# Timeouts sum to < 150 s (one device call of at most 150 s keeps $OUT).
step kernels_shard_test 20 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeShardCuda.*'
step nccl_e2e_test 80 "$B/bin/nccl_e2e_test"
t0=$SECONDS
timeout 45 "$B/bin/allgather_nccl_bench" --iters=10 > "$OUT/allgather_nccl.jsonl" 2> "$OUT/allgather_nccl.txt"
echo "bench rc=$? $((SECONDS - t0))s"; cat "$OUT/allgather_nccl.txt" | tail -70
exit $rc_all
