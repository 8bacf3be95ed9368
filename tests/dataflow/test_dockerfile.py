"""dataflow/Dockerfile: linted (hadolint), and consistent with the repository it is built from."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import apache_beam

from tests.conftest import REPO

DOCKERFILE = REPO / "dataflow" / "Dockerfile"
HADOLINT = Path(sys.executable).with_name("hadolint")


def _instructions():
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def test_hadolint_passes_and_would_catch_a_bad_dockerfile(tmp_path):
    ok = subprocess.run([str(HADOLINT), str(DOCKERFILE)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install curl\nCMD python app.py\n")
    caught = subprocess.run([str(HADOLINT), str(bad)], capture_output=True, text=True)
    assert caught.returncode != 0 and "DL3007" in caught.stdout  # `latest` tag


def test_beam_in_the_image_is_the_beam_that_builds_the_job():
    (arg,) = [a for i, a in _instructions() if i == "ARG" and a.startswith("BEAM_VERSION=")]
    pin = re.search(r'"apache-beam\[gcp\]==([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert arg == f"BEAM_VERSION={pin}" and pin == apache_beam.__version__
    assert ("FROM", "apache/beam_python3.11_sdk:${BEAM_VERSION}") in _instructions()


def test_the_image_is_both_launcher_and_worker():
    instructions = _instructions()
    copies = [shlex.split(a) for i, a in instructions if i == "COPY"]
    launcher = "/opt/google/dataflow/python_template_launcher"
    assert ["--from=launcher", launcher, launcher] in copies
    assert ("ENTRYPOINT", '["/opt/apache/beam/boot"]') in instructions
    env = " ".join(a for i, a in instructions if i == "ENV")
    py_file = re.search(r"FLEX_TEMPLATE_PYTHON_PY_FILE=(\S+)", env).group(1)
    assert "CONVERT_SDK_IMAGE=${SDK_IMAGE}" in env
    workdir = [a for i, a in instructions if i == "WORKDIR"][-1]
    # The entry point is copied in, and every COPY source exists and is not excluded from the context.
    destinations = {}
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for args in copies:
        if args[0].startswith("--from"):
            continue
        *sources, dest = args
        for source in sources:
            assert (REPO / source).exists(), source
            assert not any(Path(source).match(pattern) for pattern in ignored), source
            destinations[source] = dest
    assert f"{workdir}/{destinations['dataflow/main.py']}" == py_file
    assert {"dataset_format/", "pipelines/", "pyproject.toml"} <= set(destinations)
    # Conversion only: the training packages stay out of the image, and pip installs the convert extra.
    assert not {"loader/", "trainer/"} & set(destinations)
    (install,) = [a for i, a in instructions if i == "RUN" and "pip install" in a]
    assert "\"./[convert]\"" in install
