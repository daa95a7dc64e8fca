#!/usr/bin/env bash
# Checks the lock annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED,
# ABSL_LOCKS_EXCLUDED, ...) of the server and the client library with clang's
# -Wthread-safety analysis, with every warning an error (-Werror: the
# thread-safety findings and clang's view of the build's -Wall -Wextra). GCC
# ignores the annotations, so the normal build does not check them.
#
# The analysis is a front-end pass: every C++ file under server/ and client/
# is compiled with clang exactly as the build would (its compile command from
# compile_commands.json, CUDA build included when /usr/local/cuda exists), up
# to semantic analysis (-fsyntax-only): no code generation, no link. The
# configure step only generates the protobuf headers those files include.
# Everything goes to its own directory; nothing touches the default build.
#   scripts/thread_safety_check.sh   env: QTX_TSA_BUILD_DIR=build-tsa  QTX_JOBS=$(nproc)
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD="${QTX_TSA_BUILD_DIR:-build-tsa}"
JOBS="${QTX_JOBS:-$(nproc)}"
command -v clang++ > /dev/null ||
  { echo "thread_safety_check: clang++ not found (scripts/install_deps.sh installs clang)"; exit 1; }

start=$(date +%s)
mkdir -p "$BUILD"
CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "-DCMAKE_CXX_FLAGS=-Wthread-safety -Werror" \
  -DQTX_BUILD_TESTS=OFF -DQTX_BUILD_BENCH=OFF \
  > "$BUILD/thread-safety-configure.log" 2>&1 \
  || { cat "$BUILD/thread-safety-configure.log"; exit 1; }
# The generated protobuf headers (protoc only; their .cc files are not compiled).
mapfile -t headers < <(cd "$BUILD" && ninja -t targets all | sed -n 's/^\(proto\/qtx\/v1\/[a-z_]*\.\(grpc\.\)\{0,1\}pb\.h\): .*/\1/p')
ninja -C "$BUILD" "${headers[@]}" > /dev/null

# One line per C++ file of server/ and client/: its compile command, for
# -fsyntax-only. Python only reads the JSON (no third-party module).
/usr/bin/python3 - "$BUILD" "$PWD" > "$BUILD/thread-safety-commands.txt" <<'EOF'
import json, os, shlex, sys
build, root = sys.argv[1], sys.argv[2]
for e in json.load(open(os.path.join(build, "compile_commands.json"))):
    f = os.path.relpath(os.path.join(e["directory"], e["file"]), root)
    if not f.startswith(("server/", "client/")) or not f.endswith(".cc"):
        continue
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    if os.path.basename(args[0]) == "ccache":
        args = args[1:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT"):
            skip = True
            continue
        if a in ("-c", "-MD"):
            continue
        out.append(a)
    print(shlex.quote(e["directory"]) + " " + shlex.join(out + ["-fsyntax-only"]))
EOF
count=$(wc -l < "$BUILD/thread-safety-commands.txt")
echo "thread_safety_check: clang -Wthread-safety on $count files of server/ and client/"
# Each line: directory, then the command. xargs runs them JOBS at a time and
# fails if any of them fails (its output, the findings, is printed).
xargs -a "$BUILD/thread-safety-commands.txt" -d '\n' -P "$JOBS" -I{} \
  bash -c 'set -- {}; cd "$1" && shift && "$@"' ||
  { echo "thread_safety_check: FAILED (clang's findings above)"; exit 1; }
echo "thread-safety: {\"files\":$count,\"findings\":0,\"seconds\":$(( $(date +%s) - start ))}"
