#!/usr/bin/env bash
# On a GPU host: qtx.cuda's GPU tests and benchmark with the host's PyTorch and
# CuPy, from a bundle made like this (on the build host, CUDA build):
#   QTX_BUNDLE_SKIP='libcublas|libcublasLt' deploy/bundle/make_bundle.sh build B \
#     build/bench/channel_bench build/client/python/native/extra/qtx/_native.cpython-312-*.so
#   strip --strip-debug B/bin/* B/lib/*
#   mkdir -p B/py/qtx B/tests B/bench B/fallback/include/qtx
#   cp client/python/qtx/*.py B/py/qtx/; cp tests/python/gpu_test_*.py B/tests/
#   cp bench/python_channel_bench.py B/bench/; cp scripts/gpu_python.sh B/
#   cp client/python/native/qtx_native.cc build/client/libqtx_client*.a \
#      build/proto/libqtx_proto.a B/fallback/ && strip --strip-debug B/fallback/*.a
#   cp -r /usr/include/pybind11 /usr/include/absl B/fallback/include/
#   cp client/qtx/*.h client/cuda/qtx/*.h B/fallback/include/qtx/
#   B/gpu_python.sh OUT_DIR
# The binding is compiled here against this host's Python headers (g++,
# /usr/local/cuda); the prebuilt module (qtx_native_extra, see client/README.md)
# is only import-checked. MPS is started for the tests and the first bench and
# stopped for the last. Writes OUT_DIR/log.txt (everything) and
# OUT_DIR/bench.jsonl.
set -uo pipefail
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:?output dir}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
# The bundle's libstdc++/libgcc_s (Debian 12) must not shadow the host's newer
# ones that PyTorch needs; qtxd and qtx._native run with the host's.
rm -f "$B/lib/libstdc++.so.6" "$B/lib/libgcc_s.so.1"
NCCL_LIB="$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)"
CU13="$(python3 -c "import sysconfig,os;print(os.path.join(sysconfig.get_paths()['purelib'],'nvidia','cu13','lib'))")"
export LD_LIBRARY_PATH="$B/lib:$NCCL_LIB:$CU13${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
PY="$B/py"
rc_all=0
step() {  # step NAME TIMEOUT CMD...
  local name="$1" t="$2"; shift 2
  local t0=$SECONDS
  echo "=== $name" >> "$LOG"
  timeout -k 5 "$t" "$@" >> "$LOG" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && rc_all=1
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$LOG"
  return $rc
}
{ python3 -V; nvidia-smi -L; python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"; } >> "$LOG" 2>&1
# The module built on the build host (qtx_native_extra, against this Python's
# headers) is checked in a copy of the package; the tests use one compiled
# here against this host's own Python headers (FALLBACK=DIR: qtx_native.cc,
# the stripped static client libraries, the qtx client, pybind11 and Abseil
# headers), or the
# prebuilt one when that compile fails.
rm -rf "$B/py_pre" && cp -r "$PY" "$B/py_pre" && cp -f "$B"/bin/_native*.so "$B/py_pre/qtx/"
step import_prebuilt 30 python3 -c "import sys; sys.path.insert(0, '$B/py_pre'); import qtx, qtx.cuda as c, qtx._native as n; print(n.__file__, c.layout((300, 520), '2d'))
try:
    n.Session('unix:///nonexistent/q.sock', 'host', 'p', 2.0).health()
except qtx.errors.UnavailableError as e:
    print('mapped:', repr(e))"
F="${QTX_PY_FALLBACK:-$B/fallback}"
PYINC="$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])")"
SUFFIX="$(python3 -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")"
step compile_native 100 g++ -O2 -fPIC -shared -std=c++20 -fvisibility=hidden \
  -I"$F/include" -isystem "$F/include" -isystem "$PYINC" \
  -isystem /usr/local/cuda/include "$F/qtx_native.cc" -o "$PY/qtx/_native$SUFFIX" \
  "$F/libqtx_client_cuda.a" "$F/libqtx_client.a" "$F/libqtx_proto.a" "$B"/lib/*.so* \
  /usr/local/cuda/lib64/libcudart_static.a -ldl -lrt -lpthread || cp -f "$B"/bin/_native*.so "$PY/qtx/"
step import 30 python3 -c "import sys; sys.path.insert(0, '$PY'); import qtx, qtx.cuda, qtx._native as n; print('qtx._native', n.__file__, 'grpc part:', qtx._GRPC_MISSING)"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/qtx-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/qtx-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS on" >> "$LOG"
# python -m qtx health against a running qtxd.
"$B/bin/qtxd" --device=cuda:0 --allow_client_shm --socket=/tmp/qtx-py-health.sock --log_level=warn &
QPID=$!
for _ in $(seq 40); do [ -S /tmp/qtx-py-health.sock ] && break; sleep 0.25; done
sleep 0.5
step health 20 env PYTHONPATH="$PY" python3 -m qtx health --target unix:///tmp/qtx-py-health.sock
kill $QPID; wait $QPID 2>/dev/null
step gpu_test_mps1 "${QTX_TEST_TIMEOUT:-60}" python3 "$B/tests/gpu_test_cuda.py" --qtxd="$B/bin/qtxd" --python_dir="$PY"
if [ -x "$B/bin/channel_bench" ]; then
  step channel_bench_mps1 20 "$B/bin/channel_bench" --qtxd="$B/bin/qtxd" --mps=1 --flags=host
  grep '^{' "$LOG" | grep channel_ > "$OUT/channel_bench_mps1.jsonl"
fi
step py_bench_mps1 25 python3 "$B/bench/python_channel_bench.py" --qtxd="$B/bin/qtxd" --python_dir="$PY" --mps=1 --in_process_jsonl="$OUT/channel_bench_mps1.jsonl"
step gpu_test_optimizer_mps1 30 python3 "$B/tests/gpu_test_optimizer.py" --qtxd="$B/bin/qtxd" --python_dir="$PY"
echo quit | nvidia-cuda-mps-control
sleep 1
step py_bench_mps0 20 python3 "$B/bench/python_channel_bench.py" --qtxd="$B/bin/qtxd" --python_dir="$PY" --mps=0 --layers=100
grep '^{' "$LOG" > "$OUT/bench.jsonl"
exit $rc_all
