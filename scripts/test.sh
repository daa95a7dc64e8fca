#!/usr/bin/env bash
# Set up, build and run every CPU test (the GPU-labelled tests are built but
# not run; run them on a GPU host with `ctest -L gpu`). This is what CI runs.
#   scripts/test.sh            (env: QTX_BUILD_DIR=build, QTX_JOBS=$(nproc))
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_deps.sh
# Formatting first: it takes half a minute and needs no build.
scripts/format_check.sh

BUILD="${QTX_BUILD_DIR:-build}"
JOBS="${QTX_JOBS:-$(nproc)}"
# Warnings are errors in CI (-Wall -Wextra on every target: CMakeLists.txt).
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQTX_WERROR=ON
cmake --build "$BUILD" -j"$JOBS"
ctest --test-dir "$BUILD" -LE gpu --output-on-failure -j"$JOBS" --timeout 900
# The lock annotations, checked by clang's -Wthread-safety (build-tsa; about
# 2 minutes of 2 cores).
QTX_JOBS="$JOBS" scripts/thread_safety_check.sh
# ASan+UBSan, fuzzing and TSan builds in their own directories (issue 6);
# QTX_HARDENING=0 skips them.
if [ "${QTX_HARDENING:-1}" != "0" ]; then
  QTX_JOBS="$JOBS" scripts/hardening.sh
fi
