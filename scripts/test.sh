#!/usr/bin/env bash
# Sets up .venv if needed and runs the default test suite (slow tests excluded: pytest -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
exec .venv/bin/python -m pytest -m "not slow" --durations=25 "$@"
