#!/usr/bin/env bash
# Runs the tests that feed the loader's C code damaged and crafted files (hostile input, the fuzz corpus and bounded
# mutation runs of shards and of token counts, the reader's, images' and packer's tests) with the C extensions built under AddressSanitizer and UBSan.
# Any report fails the run. Extra arguments go to pytest, e.g. `bash scripts/sanitize.sh -m slow -k long` for the
# 20,000-case mutation run.
#
# The extensions are built into a copy of the working tree (the project's own .so files stay as they are), and the
# tests run there with the sanitizer runtimes preloaded into Python (which is not built with them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
root=$(pwd)
py="$root/.venv/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work" 2>/dev/null || true

include=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$("$py" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
flags=(-fsanitize=address,undefined -fno-sanitize-recover=all -g -O1 -fno-omit-frame-pointer -std=gnu11 -shared -fPIC
       -I"$include")
echo "==> building loader/format/_riegeli.c, loader/decoding/_jpeg.c and loader/planning/_pack.c with -fsanitize=address,undefined"
gcc "${flags[@]}" loader/format/_riegeli.c -o "$work/loader/format/_riegeli$suffix" -ldl -lpthread
gcc "${flags[@]}" loader/decoding/_jpeg.c -o "$work/loader/decoding/_jpeg$suffix" -ljpeg
gcc "${flags[@]}" loader/planning/_pack.c -o "$work/loader/planning/_pack$suffix"

cd "$work"
export PYTHONPATH="$work"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
# Python's own allocations are not instrumented (no leak checks); a report aborts the process, so a child's report is
# a crash its test sees, and the parent's fails the run.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
"$py" -c "import loader.format._riegeli as r, loader.planning._pack as p; assert r.__file__.startswith('$work') and p.__file__.startswith('$work'); print('==> sanitized', r.__file__, p.__file__)"
exec "$py" -m pytest -q -p no:cacheprovider -m "not slow" tests/loader/test_hostile.py tests/loader/test_fuzz.py \
  tests/loader/fetch/test_reader.py tests/loader/decoding/test_images.py tests/loader/test_packing.py "$@"
