#!/usr/bin/env bash
# Installs everything qtx needs to build and test on a Debian 12 machine (CPU build).
# Idempotent: apt-get skips packages that are already present. Run as root (or with sudo).
# CUDA and NCCL are not Debian packages: the CUDA build is enabled when /usr/local/cuda exists.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev
  python3 python3-dev pybind11-dev python3-grpcio python3-grpc-tools python3-numpy python3-torch
  python3-pip python3-setuptools python3-wheel
  zlib1g-dev
  openssl yamllint
  clang libclang-rt-14-dev libomp-14-dev clang-format
)

# Needed only when the command is missing (a machine may have Node.js from
# elsewhere, whose nodejs package already provides npm): "command:package".
COMMANDS=(node:nodejs npm:npm)

# QTX_DEPS=build (the container images' build stage): only what building
# qtxd and the qtx CLI needs; the test-only tools below are skipped.
TEST_ONLY=(python3-torch python3-pip python3-setuptools python3-wheel yamllint
           clang libclang-rt-14-dev libomp-14-dev clang-format)
if [ "${QTX_DEPS:-all}" = "build" ]; then
  kept=()
  for p in "${PACKAGES[@]}"; do
    [[ " ${TEST_ONLY[*]} " == *" $p "* ]] || kept+=("$p")
  done
  PACKAGES=("${kept[@]}")
  COMMANDS=()
fi

# QTX_DEPS=images (docker/build.sh --image=..., docker/build_image.sh): the
# tools that make container images here without Docker or a registry.
if [ "${QTX_DEPS:-all}" = "images" ]; then
  PACKAGES=(debootstrap buildah)
  COMMANDS=()
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

for cp in "${COMMANDS[@]}"; do
  if ! command -v "${cp%%:*}" >/dev/null 2>&1; then
    missing+=("${cp#*:}")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
