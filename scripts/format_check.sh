#!/usr/bin/env bash
# Checks that every C++ and CUDA file tracked by git is formatted as
# .clang-format says (Google style, 100 columns). Prints the files that are
# not, and how to fix them; exits 1 if there is any.
#   scripts/format_check.sh          check (CI runs this from scripts/test.sh)
#   scripts/format_check.sh --fix    reformat those files in place
# clang-format 14 (Debian 12's clang-format package) is the reference
# version: another version may format some constructs differently.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v clang-format > /dev/null ||
  { echo "format_check: clang-format not found (scripts/install_deps.sh installs it)"; exit 1; }

mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run --Werror "$f" > /dev/null 2>&1 || bad+=("$f")
done
if [ "${#bad[@]}" -ne 0 ]; then
  echo "format_check: ${#bad[@]} file(s) differ from .clang-format ($(clang-format --version)):"
  printf '  %s\n' "${bad[@]}"
  echo "fix with: scripts/format_check.sh --fix"
  exit 1
fi
echo "format_check: ${#files[@]} files formatted as .clang-format says"
