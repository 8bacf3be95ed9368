"""Running the conversion on Google Cloud Dataflow: our code on the workers, and launches that do not wait.

Workers need the `pipelines` package. Two ways, fastest first:
- the image built from dataflow/Dockerfile (`--sdk_container_image IMAGE --sdk_location container`):
  workers start with everything installed, and the same image is the Flex Template launcher;
- `--setup_file PATH/pyproject.toml`: Beam builds an sdist and every worker pip-installs it (and its
  dependencies) at start-up, which costs minutes per worker but needs no image. When neither is given,
  this checkout's pyproject.toml is used.

A run that writes a job description (`--template_location`, what a Flex Template launch and the
offline tests do) or is told not to wait (`--no_wait`) ends at submission; the job itself writes
OUT/manifest.json as its last step.

    python -m pipelines convert --input 'gs://b/raw/*.tfrecord' --output gs://b/ar --runner DataflowRunner \
        --project P --region us-central1 --temp_location gs://b/tmp --sdk_container_image IMAGE --sdk_location container
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# The Dockerfile bakes the image's own name in here, so that a Flex Template launch runs its
# workers in the image that launched them.
SDK_IMAGE_ENV = "CONVERT_SDK_IMAGE"


def is_dataflow(options) -> bool:
    from apache_beam.options.pipeline_options import StandardOptions

    return (options.view_as(StandardOptions).runner or "").lower() in ("dataflowrunner", "dataflow")


def template_location(options) -> str | None:
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    return options.view_as(GoogleCloudOptions).template_location


def check_remote_paths(input: str, output: str) -> None:
    """Dataflow workers see gs:// only: a local --input or --output fails before any work."""
    from pipelines import storage

    for flag, value in (("--input", input), ("--output", output)):
        if not storage.is_remote(value):
            raise ValueError(f"{flag} {value!r} is a local path, which Dataflow workers cannot see; copy the data "
                             "to Cloud Storage (gcloud storage cp -r) and pass a gs:// path")


def checkout_pyproject() -> Path | None:
    """This source checkout's pyproject.toml (None for an installed, non-editable package)."""
    candidate = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return candidate if candidate.is_file() else None


def ship_package(options) -> None:
    """Makes sure Dataflow workers get the `pipelines` package; raises naming the fix if they cannot."""
    from apache_beam.options.pipeline_options import SetupOptions, WorkerOptions

    setup = options.view_as(SetupOptions)
    if options.view_as(WorkerOptions).sdk_container_image:
        if setup.sdk_location == "default":
            setup.sdk_location = "container"  # the image has Beam; do not stage another copy
        return
    if setup.setup_file or setup.extra_packages:
        return
    pyproject = checkout_pyproject()
    if pyproject is None:
        raise ValueError("Dataflow workers need the pipelines package: pass --sdk_container_image IMAGE (built "
                         "from dataflow/Dockerfile) or --setup_file /path/to/checkout/pyproject.toml")
    log.info("shipping this checkout to the workers with --setup_file %s (each worker installs it at start-up; "
             "--sdk_container_image starts faster: see dataflow/README.md)", pyproject)
    setup.setup_file = str(pyproject)


def flex_template_argv(argv: list[str], environ: dict[str, str]) -> list[str]:
    """The `convert` command line for a Flex Template launch: `--param=value` flags from the launcher
    plus Dataflow's own options; the workers run in this image; the launch does not wait for the job."""
    args = ["convert", "--no_wait", *argv]
    image = environ.get(SDK_IMAGE_ENV)
    if image and not any(a.startswith("--sdk_container_image") for a in argv):
        args += [f"--sdk_container_image={image}", "--sdk_location=container"]
    return args


def flex_template_main() -> int:
    """Entry point of dataflow/main.py, the file FLEX_TEMPLATE_PYTHON_PY_FILE names."""
    from pipelines.cli import main

    return main(flex_template_argv(sys.argv[1:], dict(os.environ)))
