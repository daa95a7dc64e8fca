#!/usr/bin/env bash
# On a GPU host: the GPU path of Optimizer.Step — the end-to-end test (qtxd on
# cuda:0, gradients and FP8 parameters in device memory via CUDA IPC, bytes vs
# kernels::cpu) and the ~1B-parameter Step benchmark — from a bundle made by
# deploy/bundle/make_bundle.sh with the test and bench executables added:
#   deploy/bundle/make_bundle.sh build-gpu bundle-opt build-gpu/tests/server/backend/optimizer_cuda_e2e_test build-gpu/bench/optimizer_gpu_bench
#   scripts/gpu_optimizer.sh bundle-opt OUT_DIR
# Each step has a timeout; logs and JSON lines go under OUT_DIR.
set -uo pipefail
B="$(cd "${1:?bundle dir}" && pwd)"
OUT="${2:?output dir}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
export QTXD="$B/bin/qtxd"
{ nvidia-smi -L; nproc; free -g; df -h /dev/shm; } > "$OUT/machine.txt" 2>&1
rc_all=0

timeout 90 "$B/bin/optimizer_cuda_e2e_test" > "$OUT/optimizer_cuda_e2e_test.txt" 2>&1
rc=$?; [ $rc -ne 0 ] && rc_all=1
echo "optimizer_cuda_e2e_test rc=$rc $(grep -E '^\[  (PASSED|FAILED) |^\[       OK|FAILED  \]' "$OUT/optimizer_cuda_e2e_test.txt" | tr '\n' ' ')"

timeout "${QTX_BENCH_TIMEOUT:-150}" "$B/bin/optimizer_gpu_bench" --qtxd="$QTXD" \
  --params="${QTX_BENCH_PARAMS:-8}" --m=8192 --n=16384 --steps="${QTX_BENCH_STEPS:-4}" \
  > "$OUT/optimizer_gpu_bench.jsonl" 2> "$OUT/optimizer_gpu_bench.txt"
rc=$?; [ $rc -ne 0 ] && rc_all=1
echo "optimizer_gpu_bench rc=$rc"
cat "$OUT/optimizer_gpu_bench.txt" "$OUT/optimizer_gpu_bench.jsonl"
exit $rc_all
