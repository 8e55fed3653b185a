#!/usr/bin/env bash
# Set up everything (idempotent) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --browser --proxy
# TEST_WORKERS test processes (pytest-xdist), a test file each at a time, so a module's stack
# fixture is built once; TEST_WORKERS=0 runs in this process; the 25 slowest tests are listed
# (where the suite's time goes on a CI box)
exec .venv/bin/python -m pytest -ra --durations=25 -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
