#!/usr/bin/env bash
# On a GPU host: qtx.cuda's GPU tests and benchmark with the host's PyTorch and
# CuPy, with and without MPS, from a bundle made on the build host (CUDA
# build) by scripts/make_gpu_python_bundle.sh BUILD B:
#   B/bin      qtxd, channel_bench, the prebuilt cp312 _native and
#              qtx_bench_inproc modules, cuda_channel_test (optional: its
#              RegionCache test runs); B/lib their shared libraries
#   B/py       the qtx package (client/python/qtx/*.py)
#   B/py_before  (optional) an older qtx package, benchmarked as "legacy"
#              (with this bundle's module), or, when it holds its own
#              qtx/_native*.so (e.g. main's package and module), as an A/B
#              baseline labelled by QTX_PY_BEFORE_ARGS (e.g. --label=main)
#   B/tests    tests/python/gpu_test_*.py; B/bench python_channel_bench.py
#   B/fallback the sources, static libraries and headers to compile both
#              modules here against this host's Python headers
#   B/gpu_python.sh (this file) and B/gpu_env.sh
# Then: B/gpu_python.sh OUT_DIR. Writes OUT_DIR/log.txt (everything, with a
# "NAME rc=N Ts" line per step) and OUT_DIR/bench.jsonl (every JSON line of
# the benchmarks). MPS is started for the first half and stopped for the
# second (qtxd processes are stopped first); nothing is left running.
# Order: with MPS health, tests, benches; without MPS benches, then tests.
# QTX_GPU_BUDGET_S (default 370): steps that would start after it are skipped
# (said in the log). QTX_PY_PREBUILT=1: use the modules built on the build
# host (no compile here; an A/B against another prebuilt module compares like
# with like). QTX_PY_MPS0=0: skip the half without MPS; QTX_PY_MPS0_BENCH=0:
# only its tests.
set -uo pipefail
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:?output dir}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
BUDGET="${QTX_GPU_BUDGET_S:-370}"
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
# qtxd and qtx._native run with the host's libstdc++ (PyTorch needs it).
qtx_host_cxx_runtime "$B/lib"
qtx_gpu_env "$B/lib"
export PYTHONUNBUFFERED=1
PY="$B/py"
INPROC="$B/inproc"
mkdir -p "$INPROC"
rc_all=0
step() {  # step NAME TIMEOUT CMD...  (SIGTERM at the timeout: the tests and the bench stop their qtxd; SIGKILL 20 s later)
  local name="$1" t="$2"; shift 2
  if [ "$SECONDS" -ge "$BUDGET" ]; then
    echo "$name skipped: ${SECONDS}s of the ${BUDGET}s budget used" | tee -a "$LOG"
    rc_all=1
    return 1
  fi
  local t0=$SECONDS
  echo "=== $name" >> "$LOG"
  timeout -k 20 "$t" "$@" >> "$LOG" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && rc_all=1
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$LOG"
  return $rc
}
stop_qtxd() {  # every qtxd of this bundle still running (a test killed at its timeout)
  local pids
  pids="$(pgrep -f -- "^$B/bin/qtxd" || true)"
  [ -z "$pids" ] && return 0
  echo "stopping leftover qtxd: $pids" >> "$LOG"
  for p in $pids; do kill "$p" 2>/dev/null; done
  for _ in $(seq 20); do
    pids="$(pgrep -f -- "^$B/bin/qtxd" || true)"
    [ -z "$pids" ] && return 0
    sleep 0.5
  done
  for p in $pids; do kill -9 "$p" 2>/dev/null; done
}
{ date -u; python3 -V; nvidia-smi -L; python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"; } >> "$LOG" 2>&1
# The modules built on the build host (against CPython 3.12 headers) are
# import-checked in a copy of the package; the tests use ones compiled here
# against this host's own Python headers (FALLBACK=DIR), or the prebuilt
# ones when that compile fails.
rm -rf "$B/py_pre" && cp -r "$PY" "$B/py_pre" && cp -f "$B"/bin/_native*.so "$B/py_pre/qtx/"
step import_prebuilt 30 python3 -c "import sys; sys.path.insert(0, '$B/py_pre'); import qtx, qtx.cuda as c, qtx._native as n; print(n.__file__, c.layout((300, 520), '2d'))
try:
    n.Session('unix:///nonexistent/q.sock', 'host', 'p', 2.0).health()
except qtx.errors.UnavailableError as e:
    print('mapped:', repr(e))"
F="${QTX_PY_FALLBACK:-$B/fallback}"
if [ "${QTX_PY_PREBUILT:-0}" = 1 ]; then
  cp -f "$B"/bin/_native*.so "$PY/qtx/" && cp -f "$B"/bin/qtx_bench_inproc*.so "$INPROC/"
  echo "prebuilt modules: $(ls "$PY"/qtx/_native*.so "$INPROC"/*.so)" >> "$LOG"
else
PYINC="$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])")"
SUFFIX="$(python3 -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")"
step compile_native 120 g++ -O2 -fPIC -shared -std=c++20 -fvisibility=hidden \
  -I"$F/include" -isystem "$F/include" -isystem "$PYINC" \
  -isystem /usr/local/cuda/include "$F/qtx_native.cc" -o "$PY/qtx/_native$SUFFIX" \
  "$F/libqtx_client_cuda.a" "$F/libqtx_client.a" "$F/libqtx_proto.a" "$B"/lib/*.so* \
  /usr/local/cuda/lib64/libcudart_static.a -ldl -lrt -lpthread || cp -f "$B"/bin/_native*.so "$PY/qtx/"
step compile_inproc 90 g++ -O2 -fPIC -shared -std=c++20 -fvisibility=hidden \
  -I"$F/include" -isystem "$F/include" -isystem "$PYINC" -isystem /usr/local/cuda/include \
  "$F/inproc_quantize.cc" -o "$INPROC/qtx_bench_inproc$SUFFIX" "$F/libqtx_kernels_cuda.a" \
  /usr/local/cuda/lib64/libcudart_static.a -ldl -lrt -lpthread || cp -f "$B"/bin/qtx_bench_inproc*.so "$INPROC/"
fi
step import 30 python3 -c "import sys; sys.path[:0] = ['$PY', '$INPROC']; import qtx, qtx.cuda, qtx._native as n, qtx_bench_inproc as b; print('qtx._native', n.__file__, 'inproc', b.__file__, 'grpc part:', qtx._GRPC_MISSING)"
if [ -d "$B/py_before/qtx" ] && ! ls "$B"/py_before/qtx/_native*.so > /dev/null 2>&1; then
  cp -f "$PY"/qtx/_native*.so "$B/py_before/qtx/"
fi

collect() { grep -h '^{' "$LOG" > "$OUT/bench.jsonl"; }
health() {  # python -m qtx health against a running qtxd
  "$B/bin/qtxd" --device=cuda:0 --allow_client_shm --socket=/tmp/qtx-py-health.sock --log_level=warn &
  local qpid=$!
  for _ in $(seq 40); do [ -S /tmp/qtx-py-health.sock ] && break; sleep 0.25; done
  sleep 0.5
  step "health_mps$1" 20 env PYTHONPATH="$PY" python3 -m qtx health --target unix:///tmp/qtx-py-health.sock
  kill $qpid; wait $qpid 2>/dev/null
  rm -f /tmp/qtx-py-health.sock
}
tests() {
  step "gpu_test_mps$1" "${QTX_TEST_TIMEOUT:-120}" python3 "$B/tests/gpu_test_cuda.py" --qtxd="$B/bin/qtxd" --python_dir="$PY"
  step "gpu_test_optimizer_mps$1" 60 python3 "$B/tests/gpu_test_optimizer.py" --qtxd="$B/bin/qtxd" --python_dir="$PY"
  if [ -f "$B/tests/gpu_test_allgather_ranks.py" ]; then  # two ranks, two qtxd, one GPU
    step "gpu_test_allgather_ranks_mps$1" 150 python3 "$B/tests/gpu_test_allgather_ranks.py" --qtxd="$B/bin/qtxd" --python_dir="$PY"
  fi
  if [ -x "$B/bin/cuda_channel_test" ]; then  # the C++ RegionCache test (fast path, replacement)
    step "region_cache_test_mps$1" 60 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd" --gtest_filter='*RegionCache*'
  fi
  stop_qtxd
}
benches() {  # channel_bench (C++ context), then the Python bench: current, then legacy
  # QTX_PY_BENCH=0: tests only (a regression run).
  [ "${QTX_PY_BENCH:-1}" = 0 ] && return 0
  local mps="$1" cb="$OUT/channel_bench_mps$1.jsonl"
  if [ -x "$B/bin/channel_bench" ]; then
    step "channel_bench_mps$mps" 40 "$B/bin/channel_bench" --qtxd="$B/bin/qtxd" --mps="$mps" --flags=host
    sed -n '/^=== channel_bench_mps'"$mps"'$/,/^channel_bench_mps'"$mps"' rc=/p' "$LOG" | grep '^{' > "$cb"
  fi
  # QTX_PY_BENCH_ROUNDS (default 1): rounds of (current, before), interleaved.
  local round
  for round in $(seq "${QTX_PY_BENCH_ROUNDS:-1}"); do
    step "py_bench_mps${mps}_r$round" 60 python3 "$B/bench/python_channel_bench.py" --qtxd="$B/bin/qtxd" \
      --python_dir="$PY" --inproc_dir="$INPROC" --mps="$mps" --in_process_jsonl="$cb" --breakdown
    collect
    if [ -d "$B/py_before/qtx" ]; then
      # shellcheck disable=SC2086  # QTX_PY_BEFORE_ARGS: several words
      step "py_bench_before_mps${mps}_r$round" 60 python3 "$B/bench/python_channel_bench.py" --qtxd="$B/bin/qtxd" \
        --python_dir="$B/py_before" --inproc_dir="$INPROC" --mps="$mps" --in_process_jsonl="$cb" \
        --breakdown ${QTX_PY_BEFORE_ARGS:---legacy}
      collect
    fi
  done
  stop_qtxd
}

if qtx_mps_start; then
  echo "MPS on" >> "$LOG"
  health 1
  tests 1
  benches 1
  stop_qtxd
  qtx_mps_stop
  echo "MPS off" >> "$LOG"
else
  echo "MPS did not start: the MPS half is skipped" | tee -a "$LOG"
  rc_all=1
fi
if [ "${QTX_PY_MPS0:-1}" != 0 ]; then
  [ "${QTX_PY_MPS0_BENCH:-1}" != 0 ] && benches 0
  tests 0
fi
stop_qtxd
collect
echo "total ${SECONDS}s rc=$rc_all" | tee -a "$LOG"
exit $rc_all
