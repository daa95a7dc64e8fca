#!/usr/bin/env bash
# The build steps of the container images (docker/Dockerfile.cpu and
# docker/Dockerfile.cuda run exactly this), also run by CI (CTest
# docker_build_steps) so that the image build stays honest without a Docker
# engine:
#   1. scripts/install_deps.sh          (the README's install script)
#   2. configure BUILD_DIR (Release, no tests or benchmarks) unless it is
#      already configured (CI passes its own, built build folder)
#   3. build qtxd and the qtx CLI
#   4. deploy/bundle/make_bundle.sh BUILD_DIR OUT_DIR: bin/ + lib/ + run
#   5. smoke test of the bundle: its qtxd starts with a health-only port and
#      `run qtx health` against that port (the images' HEALTHCHECK) says SERVING
#
#   docker/build.sh BUILD_DIR OUT_DIR      (env: QTX_JOBS, QTX_CMAKE_ARGS)
#
# With --image=cpu or --image=cuda first, it then also builds that container
# image here, with no registry and no Docker engine (debootstrap base +
# buildah), starts qtxd in it and checks health and a Quantize from the host
# through the mounted socket and the health port: docker/build_image.sh.
#   docker/build.sh --image=cpu build-image-cpu /var/tmp/qtx-bundle-cpu
# --image=cpu needs a build folder without CUDA (configured here with
# -DQTX_WITH_CUDA=OFF when it is new); --image=cuda one with CUDA.
set -euo pipefail
IMAGE=""
case "${1:-}" in
  --image=cpu|--image=cuda) IMAGE="${1#--image=}"; shift ;;
  --image=*) echo "$0: $1: the image is cpu or cuda" >&2; exit 2 ;;
esac
if [ $# -ne 2 ]; then
  echo "usage: $0 [--image=cpu|cuda] BUILD_DIR OUT_DIR" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
BUILD="$1"
OUT="$2"
if [ -n "$IMAGE" ]; then QTX_DEPS=images scripts/install_deps.sh; fi
if [ "$IMAGE" = cpu ]; then
  QTX_CMAKE_ARGS="${QTX_CMAKE_ARGS:--DQTX_WITH_CUDA=OFF}"
  if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q '^QTX_WITH_CUDA:STRING=OFF$' "$BUILD/CMakeCache.txt"; then
    echo "$0: --image=cpu needs a build folder configured with -DQTX_WITH_CUDA=OFF ($BUILD is not)" >&2
    exit 2
  fi
fi
JOBS="${QTX_JOBS:-$(nproc)}"

scripts/install_deps.sh

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  # shellcheck disable=SC2086  # QTX_CMAKE_ARGS is a list of arguments
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DQTX_BUILD_TESTS=OFF -DQTX_BUILD_BENCH=OFF ${QTX_CMAKE_ARGS:-}
fi
cmake --build "$BUILD" -j"$JOBS" --target qtxd qtx

rm -rf "$OUT"
deploy/bundle/make_bundle.sh "$BUILD" "$OUT"

# Smoke test: the bundle runs on its own libraries.
tmp="$(mktemp -d)"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$OUT/run" qtxd --device=cpu --socket="$tmp/qtxd.sock" --health_port="$port" --log_level=warn &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$tmp"' EXIT
status=""
for _ in $(seq 1 100); do
  if status="$("$OUT/run" qtx --target="127.0.0.1:$port" --timeout=2s health 2>/dev/null)"; then
    break
  fi
  sleep 0.1
done
echo "docker/build.sh: bundled qtxd health on port $port: ${status:-no answer}"
case "$status" in
  *" SERVING"*) ;;
  *) echo "docker/build.sh: the bundled qtxd did not report SERVING" >&2; exit 1 ;;
esac
kill -TERM "$pid"
wait "$pid"
echo "docker/build.sh: bundle in $OUT ok"

if [ -n "$IMAGE" ]; then
  trap - EXIT
  rm -rf "$tmp"
  docker/build_image.sh "$IMAGE" "$OUT"
fi
