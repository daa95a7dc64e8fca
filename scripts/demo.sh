#!/usr/bin/env bash
# Set up, build, start qtxd on the CPU on a private unix socket, and run the
# demo client against it: health, a quantization of a random tensor (inline
# and through a shared-memory region), the region list. Stops qtxd at the end.
#   scripts/demo.sh            (env: QTX_BUILD_DIR=build, QTX_JOBS=$(nproc))
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_deps.sh

BUILD="${QTX_BUILD_DIR:-build}"
JOBS="${QTX_JOBS:-$(nproc)}"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD" -j"$JOBS" --target qtxd qtx

RUN_DIR="$(mktemp -d)"
SOCK="$RUN_DIR/qtxd.sock"
"$BUILD/server/qtxd" --device=cpu --socket="$SOCK" --allow_client_shm &
QTXD_PID=$!
trap 'kill -TERM $QTXD_PID 2>/dev/null; wait $QTXD_PID 2>/dev/null; rm -rf "$RUN_DIR"' EXIT

QTX="$BUILD/client/cli/qtx"
for _ in $(seq 1 100); do
  "$QTX" --target="unix:$SOCK" health >/dev/null 2>&1 && break
  sleep 0.1
done
set -x
"$QTX" --target="unix:$SOCK" health
"$QTX" --target="unix:$SOCK" quantize --shape=1000x4096 --seed=1 --mode=1d --usages=rowwise,columnwise
"$QTX" --target="unix:$SOCK" quantize --shape=256x300 --seed=2 --mode=2d --format=e5m2 --shm
"$QTX" --target="unix:$SOCK" regions
