#!/usr/bin/env bash
# On a GPU host: per-tensor current scaling (issue 16) - the CUDA kernel's
# bit-exact tests against the CPU reference, then quantize_cuda_bench on the
# issue's shapes with both L2 methods (rotating buffers, and a 256 MiB memset
# flush before every launch) and the copy of the same bytes in the same run,
# then the whole kernels_cuda_test (the block kernels share the cast code).
#
# Bundle (made here; the script travels inside it):
#   QTX_BUNDLE_SKIP='libcublas|libcublasLt' deploy/bundle/make_bundle.sh build BUNDLE \
#     build/tests/kernels/cuda/kernels_cuda_test build/bench/quantize_cuda_bench
#   cp scripts/gpu_current_scaling.sh scripts/gpu_env.sh BUNDLE/
# Run:
#   BUNDLE/gpu_current_scaling.sh OUT_DIR [BUNDLE]
# BUNDLE defaults to the script's own folder when it holds bin/kernels_cuda_test,
# else ./bundle-cur-scale. Environment: QTX_BENCH_ITERS (default 100),
# QTX_BENCH_SHAPES (default the issue's four shapes), QTX_FULL_TEST=0 skips the
# whole-suite step, QTX_TIME_BUDGET_S (default 570: a 600 s device call) bounds
# the whole script: each step runs under `timeout`, and the last step gets
# what is left (it is skipped, and says so, when under a minute is left).
# Writes under OUT_DIR: gpu.txt, tensor_test.txt, bench.txt (the table and
# any error), bench.jsonl (one JSON object per measurement), full_test.txt;
# prints one summary line per step. Exit status: 0 when every step passed.
set -uo pipefail
OUT="${1:?usage: gpu_current_scaling.sh OUT_DIR [BUNDLE]}"
script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
if [ -n "${2:-}" ]; then
  B="$(cd "$2" && pwd)" || { echo "bundle '$2' not found" >&2; exit 2; }
elif [ -x "$script_dir/bin/kernels_cuda_test" ]; then
  B="$script_dir"
else
  B="$(cd bundle-cur-scale && pwd)" || { echo "no bundle: pass it as the second argument" >&2; exit 2; }
fi
for exe in kernels_cuda_test quantize_cuda_bench; do
  if [ ! -x "$B/bin/$exe" ]; then
    echo "$B/bin/$exe: missing (see the bundle command in this script)" >&2
    exit 2
  fi
done
mkdir -p "$OUT" || exit 2
qtx_gpu_env "$B/lib"
iters="${QTX_BENCH_ITERS:-100}"
shapes="${QTX_BENCH_SHAPES:-4096x4096,8192x8192,16384x7168,32768x4096}"

nvidia-smi -L > "$OUT/gpu.txt" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.limit --format=csv \
  >> "$OUT/gpu.txt" 2>&1

rc_all=0
budget="${QTX_TIME_BUDGET_S:-570}"
step() {  # step NAME SECONDS CMD...: run under timeout, log to OUT/NAME.txt, summarize
  local name="$1" limit="$2"
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  [ "$rc" -ne 0 ] && rc_all=1
  echo "$name rc=$rc $((SECONDS - t0))s $(grep -E '^\[  PASSED  \] |^\[  FAILED  \] [0-9]+ tests?,' "$OUT/$name.txt" | tr '\n' ' ')"
  return "$rc"
}

step tensor_test 300 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeTensorCuda.*'

# JSON lines on stdout, the table on stderr.
t0=$SECONDS
timeout 240 "$B/bin/quantize_cuda_bench" --l2 both --iters "$iters" --shapes "$shapes" \
  --modes 1d,2d,tensor > "$OUT/bench.jsonl" 2> "$OUT/bench.txt"
rc=$?
[ "$rc" -ne 0 ] && rc_all=1
echo "bench rc=$rc $((SECONDS - t0))s $(grep -c '^{' "$OUT/bench.jsonl") measurements"
# Per-tensor rows of the summary: mode l2 usage shape variant time_us ... ratio.
grep -E '^(mode|tensor) ' "$OUT/bench.txt" || true

left=$((budget - SECONDS))
if [ "${QTX_FULL_TEST:-1}" = 0 ]; then
  echo "full_test skipped (QTX_FULL_TEST=0)"
elif [ "$left" -lt 60 ]; then
  echo "full_test skipped: ${left}s of the ${budget}s budget left"
else
  step full_test "$((left - 10))" "$B/bin/kernels_cuda_test" --gtest_filter='-QuantizeTensorCuda.*'
fi
exit "$rc_all"
