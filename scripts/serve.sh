#!/usr/bin/env bash
# Set up (idempotent: venv, deps, redis-server, the SmolLM2 model) and run the service on CPU:
# a local Redis + gateway + worker, in the foreground. Ctrl-C stops everything gracefully.
# Extra args go to scripts/stack.py, e.g. `scripts/serve.sh --gateways 2 --workers 2 --proxy`
# (--proxy needs nginx: `scripts/setup.sh --proxy` installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
setup_args=()
for a in "$@"; do [[ $a == --proxy ]] && setup_args+=(--proxy); done
scripts/setup.sh "${setup_args[@]}"
exec .venv/bin/python scripts/stack.py "$@"
