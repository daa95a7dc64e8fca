#!/usr/bin/env bash
# Installs the Node.js client's locked dependencies (npm ci) and runs its
# tests against QTXD:  tests/node/run_node_test.sh QTXD
set -euo pipefail
qtxd="$(realpath "$1")"
cd "$(dirname "$0")/../../client/node"
npm ci --no-audit --no-fund --loglevel=error
QTXD="$qtxd" node --test test/
