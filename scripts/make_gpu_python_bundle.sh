#!/usr/bin/env bash
# Makes the bundle that scripts/gpu_python.sh runs on a GPU host (see its
# header), from a CUDA build configured with
#   -DQTX_EXTRA_PYTHON_INCLUDE=<CPython 3.12 include dir>
#   -DQTX_EXTRA_PYTHON_SUFFIX=.cpython-312-x86_64-linux-gnu.so
# and these targets built: qtxd channel_bench qtx_native_extra
# qtx_bench_inproc_extra (their static libraries come along); cuda_channel_test
# too if built.
#
#   scripts/make_gpu_python_bundle.sh BUILD OUT [BEFORE_REF]
# BEFORE_REF (a git ref, optional): its client/python/qtx goes to OUT/py_before
# and is benchmarked as the "legacy" variant next to the working tree's.
# QTX_BEFORE_NATIVE=FILE (optional, with BEFORE_REF): that ref's own prebuilt
# cp312 module, put into OUT/py_before/qtx, for an A/B of package + module
# (e.g. main's build's client/python/native/extra/qtx/_native*.so; run with
# QTX_PY_PREBUILT=1 QTX_PY_BEFORE_ARGS=--label=main). QTX_NATIVE=FILE: use
# this module instead of BUILD's (e.g. one linked by hand).
set -euo pipefail
BUILD="$(cd "${1:?build dir}" && pwd)"
OUT="${2:?output dir}"
REF="${3:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rm -rf "$OUT"
native=("$BUILD"/client/python/native/extra/qtx/_native.cpython-312-*.so)
[ -n "${QTX_NATIVE:-}" ] && native=("$QTX_NATIVE")
inproc=("$BUILD"/bench/python/extra/qtx_bench_inproc.cpython-312-*.so)
extra=()
[ -x "$BUILD/tests/client/cuda_channel_test" ] && extra+=("$BUILD/tests/client/cuda_channel_test")
QTX_BUNDLE_SKIP='libcublas|libcublasLt' "$ROOT/deploy/bundle/make_bundle.sh" "$BUILD" "$OUT" \
  "$BUILD/bench/channel_bench" "${native[@]}" "${inproc[@]}" ${extra[@]+"${extra[@]}"}
mkdir -p "$OUT/py/qtx" "$OUT/tests" "$OUT/bench" "$OUT/fallback/include/qtx" \
  "$OUT/fallback/include/kernels/cuda"
cp "$ROOT"/client/python/qtx/*.py "$OUT/py/qtx/"
cp "$ROOT"/tests/python/gpu_test_*.py "$ROOT"/tests/python/qtxd_child.py \
  "$ROOT"/tests/python/qtx_cli_io.py "$OUT/tests/"
cp "$ROOT/bench/python_channel_bench.py" "$OUT/bench/"
cp "$ROOT/scripts/gpu_python.sh" "$ROOT/scripts/gpu_env.sh" "$OUT/"
if [ -n "$REF" ]; then
  mkdir -p "$OUT/py_before"
  git -C "$ROOT" archive "$REF" client/python/qtx | tar -x -C "$OUT/py_before" --strip-components=2
  rm -rf "$OUT/py_before/qtx/v1"
  if [ -n "${QTX_BEFORE_NATIVE:-}" ]; then
    cp "$QTX_BEFORE_NATIVE" "$OUT/py_before/qtx/"
    strip --strip-debug "$OUT"/py_before/qtx/_native*.so
  fi
fi
F="$OUT/fallback"
cp "$ROOT/client/python/native/qtx_native.cc" "$ROOT/bench/python/inproc_quantize.cc" "$F/"
cp "$BUILD/client/libqtx_client.a" "$BUILD/client/libqtx_client_cuda.a" \
  "$BUILD/proto/libqtx_proto.a" "$BUILD/kernels/cuda/libqtx_kernels_cuda.a" "$F/"
cp -r /usr/include/pybind11 /usr/include/absl "$F/include/"
cp "$ROOT"/client/qtx/*.h "$ROOT"/client/cuda/qtx/*.h "$F/include/qtx/"
cp "$ROOT/kernels/quantize_params.h" "$F/include/kernels/"
cp "$ROOT/kernels/cuda/quantize_block.h" "$F/include/kernels/cuda/"
strip --strip-debug "$OUT"/bin/* "$OUT"/lib/* "$F"/*.a
du -sh "$OUT"
