#!/usr/bin/env bash
# Makes a relocatable qtx bundle for a GPU host without containers:
#   <out>/bin/      qtxd, qtx and any extra executables given
#   <out>/lib/      every non-system shared library they need (gRPC, protobuf,
#                   Abseil, spdlog, Gloo, OpenMP, ...), found with ldd
#   <out>/run       launcher: sets LD_LIBRARY_PATH and execs bin/<name>
# glibc's own libraries, the CUDA driver (libcuda) and NCCL are left out: the
# host provides them (NCCL: set QTX_NCCL_LIB to its folder, or have it on the
# default library path; the CUDA runtime is linked statically).
#
#   deploy/bundle/make_bundle.sh BUILD_DIR OUT_DIR [EXTRA_EXECUTABLE ...]
#   OUT_DIR/run qtxd --device=cuda:0 --socket=/run/qtx/qtxd.sock
# QTX_BUNDLE_SKIP=libfoo|libbar leaves more libraries out (e.g. libcublas.*, which
# a GPU host with PyTorch already has).
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD_DIR OUT_DIR [EXTRA_EXECUTABLE ...]" >&2
  exit 2
fi
BUILD="$1"
OUT="$2"
shift 2

bins=()
for b in "$BUILD/server/qtxd" "$BUILD/client/cli/qtx"; do
  [ -x "$b" ] && bins+=("$b")
done
bins+=("$@")
if [ "${#bins[@]}" -eq 0 ]; then
  echo "make_bundle: no executables found under $BUILD (build qtxd and qtx first)" >&2
  exit 1
fi

mkdir -p "$OUT/bin" "$OUT/lib"
skip="^(libc|libm|libdl|librt|libpthread|ld-linux.*|libcuda|libnccl|linux-vdso${QTX_BUNDLE_SKIP:+|$QTX_BUNDLE_SKIP})\\.so"
for b in "${bins[@]}"; do
  if [ ! -x "$b" ]; then
    echo "make_bundle: $b is not an executable" >&2
    exit 1
  fi
  cp -f "$b" "$OUT/bin/"
  # "libfoo.so.1 => /path/libfoo.so.1 (0x...)": copy the resolved path.
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if [[ "$name" =~ $skip ]]; then continue; fi
    [ -e "$OUT/lib/$name" ] || cp -fL "$path" "$OUT/lib/$name"
  done
done

cat > "$OUT/run" <<'LAUNCHER'
#!/usr/bin/env bash
# Runs a bundled qtx executable with the bundle's libraries:  run NAME [ARGS...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
name="$1"; shift
export LD_LIBRARY_PATH="$here/lib${QTX_NCCL_LIB:+:$QTX_NCCL_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/bin/$name" "$@"
LAUNCHER
chmod +x "$OUT/run"
echo "make_bundle: $(ls "$OUT/bin" | wc -l) executables, $(ls "$OUT/lib" | wc -l) libraries," \
     "$(du -sh "$OUT" | cut -f1) in $OUT"
