#!/usr/bin/env bash
# Install size of each extra: a fresh venv each, non-editable, from this checkout (docs/installs.md).
#   bash scripts/install_sizes.sh [WORKDIR]      # ~3 min with a warm pip cache; needs ~4 GB in WORKDIR (one venv at a time)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
PY=${PYTHON:-python3.11}
measure() {  # name, pip spec (relative to the checkout)
  local v="$work/v-$1"
  rm -rf "$v" && "$PY" -m venv "$v"
  "$v/bin/pip" install -q --upgrade pip >/dev/null 2>&1
  (cd "$src" && "$v/bin/pip" install -q --no-compile "$2") >"$work/log-$1" 2>&1
  local has=""
  for m in apache_beam tensorflow jax grain flax optax orbax; do
    "$v/bin/python" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$m') else 1)" \
      2>/dev/null && has+=" $m"
  done
  printf '%-8s %5s MB  %3s distributions  has:%s\n' "$1" "$(du -sm "$v/lib/python3.11/site-packages" | cut -f1)" \
    "$("$v/bin/pip" list 2>/dev/null | tail -n +3 | wc -l)" "${has:- none of them}"
  rm -rf "$v" "$src/build"
}
measure base "."
measure convert ".[convert]"
measure train ".[train]"
measure all ".[convert,train,demo,test]"
