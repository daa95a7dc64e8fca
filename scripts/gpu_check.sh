#!/usr/bin/env bash
# Build the CUDA kernel tests and benchmark here and package them for the GPU
# machine; or, on the GPU machine, run them and write results under $OUT.
#
#   scripts/gpu_check.sh package   # here: build-cuda/ + build-cuda/dist (carry it)
#   scripts/gpu_check.sh run       # there (repo root): tests + benchmark -> $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  package)
    cmake -S . -B build-cuda -G Ninja -DQTX_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES=90a
    cmake --build build-cuda -j2 --target kernels_cuda_test quantize_cuda_bench
    rm -rf build-cuda/dist && mkdir -p build-cuda/dist
    cp build-cuda/tests/kernels/cuda/kernels_cuda_test build-cuda/bench/quantize_cuda_bench \
      build-cuda/dist/
    strip build-cuda/dist/*
    # Non-system shared libraries (cudart is static): libgomp for the CPU reference.
    ldd build-cuda/dist/kernels_cuda_test | awk '$3 ~ /libgomp/ {print $3}' |
      xargs -r -I{} cp {} build-cuda/dist/
    du -sh build-cuda/dist
    ;;
  run)
    : "${OUT:?set OUT to the results folder}"
    # shellcheck source=scripts/gpu_env.sh
    . scripts/gpu_env.sh
    qtx_gpu_env "$PWD/build-cuda/dist"
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >"$OUT/smi.txt" 2>&1 || true
    timeout 200 build-cuda/dist/quantize_cuda_bench --iters 100 >"$OUT/bench.jsonl" 2>"$OUT/bench.txt"
    echo "bench rc=$?"; cat "$OUT/bench.txt"
    set +e
    timeout 400 build-cuda/dist/kernels_cuda_test --gtest_brief=1 >"$OUT/test.txt" 2>&1
    rc=$?
    echo "test rc=$rc"; tail -c 3000 "$OUT/test.txt"
    exit $rc
    ;;
  *)
    echo "usage: $0 package|run" >&2
    exit 2
    ;;
esac
