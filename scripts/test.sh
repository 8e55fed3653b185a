#!/usr/bin/env bash
# Set up everything (idempotent) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --browser --proxy
exec .venv/bin/python -m pytest -ra "$@"
