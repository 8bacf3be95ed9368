#!/usr/bin/env bash
# What every scripts/gpu/*.sh does alike (sourced): `wheels` here (the GPU host has no network: what it lacks, as
# cp312 wheels, in .gpu/whl), `on_the_host OUT` there (install them, build our C extensions in place, PYTHONPATH,
# and the GPU, cores and revision in $LOGS/gpu.txt), then `run` (one trainer run, logged and archived) and `pack`.
# The logs stay in $LOGS (/tmp/ARCHIVE_logs), outside OUT: the device tool returns at most 8 files of OUT, so OUT
# holds archives only.

wheels() {
  ${PY:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl grain==0.2.18 array-record==0.8.6 simplejpeg==1.9.0 tensorboardX==2.6.5 portpicker importlib_resources \
    google-crc32c
}

on_the_host() {
  LOGS=/tmp/${ARCHIVE}_logs
  mkdir -p "$1" "$LOGS"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
  python3 setup.py -q build_ext --inplace
  export PYTHONPATH=$PWD:/tmp/site
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpu.txt"
  nproc >> "$LOGS/gpu.txt"
  # the revision prepared here (`git rev-parse --short HEAD > .gpu/revision`): the host's git may be older
  { cat .gpu/revision 2>/dev/null || git rev-parse --short HEAD 2>/dev/null; } >> "$LOGS/gpu.txt" || true
}

pack() {  # pack NAME: the logs as $OUT/NAME.tgz (written aside first, then moved: never half an archive there)
  tar czf "/tmp/$1.tgz" -C "$LOGS" . && mv "/tmp/$1.tgz" "$OUT/"
}

run() {  # run NAME [DIR] ARGS...: python -m trainer $common ARGS from DIR (default: here; -m puts the working directory
  # first, so DIR's trainer and loader run) into $LOGS/NAME.log, within $LIMIT seconds; its key lines echoed, then
  # `pack $ARCHIVE`, so a stage cut short by the host's time still returns what came before
  local name=$1 dir=.
  shift
  if [ -d "${1:-}" ]; then dir=$1; shift; fi
  # shellcheck disable=SC2086
  (cd "$dir" && echo "$name: $(python3 -c 'import trainer, loader; print(trainer.__file__, loader.__file__)')" \
     >> "$LOGS/gpu.txt" && timeout "${LIMIT:-180}" python3 -m trainer $common workdir="/tmp/${ARCHIVE}_$name" "$@") \
    > "$LOGS/$name.log" 2>&1 || echo "$name: exit $?" >> "$LOGS/gpu.txt"
  grep -E "loader workers|initialised|attention:|remat=auto|step compiled|step read from|MFU|step [0-9]+/|rror|Out of memory" "$LOGS/$name.log" \
    | sed "s/^/$name: /" || true
  pack "$ARCHIVE"
}
