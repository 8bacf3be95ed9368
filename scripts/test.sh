#!/usr/bin/env bash
# Sets up .venv if needed and runs the default test suite (slow tests excluded: pytest -m slow), on TEST_WORKERS
# pytest-xdist workers (default 2: most tests wait on subprocesses, Ray or the GCS emulator, so two keep 2 cores busy;
# about 19 minutes on 2 cores, and 3 workers measured no faster: the cores are the limit). TEST_WORKERS=0 runs them in
# this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
exec .venv/bin/python -m pytest -m "not slow" -n "${TEST_WORKERS:-2}" --dist worksteal --durations=25 "$@"
