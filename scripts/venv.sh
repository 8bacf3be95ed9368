#!/usr/bin/env bash
# Makes .venv (Python 3.11) on first use and installs the project into it, editable.
# Re-runs are cheap: the install is skipped while pyproject.toml, setup.py and the C extension are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || { echo "error: $PY not found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $PY"
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml setup.py loader/format/_riegeli.c loader/decoding/_jpeg.c loader/planning/_pack.c | sha1sum | cut -c1-12)-${EXTRAS:-convert,train,demo,test}
if [ ! -f "$stamp" ]; then
  echo "==> installing the project and its dependencies into .venv (first run: ~2 min)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[${EXTRAS:-convert,train,demo,test}]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
