#!/usr/bin/env bash
# Makes .venv (Python 3.11) on first use and installs the project into it, editable.
# Re-runs are cheap: the install is skipped while pyproject.toml, setup.py and the C extension are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${EXTRAS:-convert,train,demo,test}
why="updating: pyproject.toml, setup.py, a C source or EXTRAS changed"
if [ ! -x .venv/bin/python ]; then
  PY=${PYTHON:-python3.11}
  command -v "$PY" >/dev/null || { echo "error: $PY not found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2; exit 1; }
  echo "==> creating .venv with $PY"
  "$PY" -m venv .venv
  why="first run: ~2 min"
fi
stamp=.venv/.installed-$(cat pyproject.toml setup.py loader/format/_riegeli.c loader/decoding/_jpeg.c loader/planning/_pack.c | sha1sum | cut -c1-12)-$extras
if [ ! -f "$stamp" ]; then
  echo "==> installing the project and its dependencies into .venv ($why; pip's output: .venv/install.log)"
  # pip's own output (and setuptools' notes on editable installs) goes to the log, shown when the install fails
  if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e ".[$extras]"; } \
      > .venv/install.log 2>&1; then
    tail -n 40 .venv/install.log >&2
    echo "error: installing the project into .venv failed (the whole output: .venv/install.log)" >&2
    exit 1
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
