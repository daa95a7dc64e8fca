#!/usr/bin/env bash
# Lints and schema-validates deploy/k8s: yamllint, then the manifests against
# the Kubernetes API schemas (kubernetes-models, installed with npm ci from the
# lock file), then a self-test that broken manifests are rejected. node.yaml
# is generated: it must equal what deploy/k8s/node/gen_node.py prints.
#   deploy/k8s/validate/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
k8s="$(dirname "$here")"
manifests=("$k8s"/*.yaml)
/usr/bin/python3 "$k8s/node/gen_node.py" --check "$k8s/node.yaml"
yamllint -s -c "$k8s/.yamllint" "${manifests[@]}"
echo "yamllint: ${#manifests[@]} files clean"
cd "$here"
npm ci --no-audit --no-fund --loglevel=error
node validate.js "${manifests[@]}"
node validate.js --self-test "$k8s"
