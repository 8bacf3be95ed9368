"""Running the conversion on Google Cloud Dataflow: our code on the workers, and launches that do not wait.

Workers need the `pipelines` package. Two ways, fastest first:
- the image built from dataflow/Dockerfile (`--sdk_container_image IMAGE --sdk_location container`):
  workers start with everything installed, and the same image is the Flex Template launcher;
- `--setup_file`: Beam builds an sdist and every worker pip-installs it (and its dependencies) at start-up,
  which costs minutes per worker but needs no image. When neither is given (or --setup_file names this
  checkout's pyproject.toml), the workers get a project of the conversion alone, made from this checkout
  (`worker_project`): `dataset_format` and `pipelines`, depending on the base install and the `convert`
  extra, so no worker installs jax, flax, optax, orbax or grain.

A run that writes a job description (`--template_location`, what a Flex Template launch and the
offline tests do) or is told not to wait (`--no_wait`) ends at submission; the job itself writes
OUT/manifest.json as its last step.

    python -m pipelines convert --input 'gs://bkt/raw/*.tfrecord' --output gs://bkt/ar --runner DataflowRunner \
        --project P --region us-central1 --temp_location gs://bkt/tmp --sdk_container_image IMAGE --sdk_location container
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# The Dockerfile bakes the image's own name in here, so that a Flex Template launch runs its
# workers in the image that launched them.
SDK_IMAGE_ENV = "CONVERT_SDK_IMAGE"


def is_dataflow(options) -> bool:
    from apache_beam.options.pipeline_options import StandardOptions

    return (options.view_as(StandardOptions).runner or "").lower() in ("dataflowrunner", "dataflow")


def temp_location(options) -> str:
    """Where the job stages its files (--temp_location, else --staging_location); raises naming the flag."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    cloud = options.view_as(GoogleCloudOptions)
    location = cloud.temp_location or cloud.staging_location
    if not location:
        raise ValueError("a Dataflow run needs --temp_location gs://BUCKET/tmp (the job stages its files there)")
    return location


def template_location(options) -> str | None:
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    return options.view_as(GoogleCloudOptions).template_location


def check_remote_paths(input: str, output: str, tokenizer: str | None = None) -> None:
    """Dataflow workers see gs:// only: a local --input, --output or --tokenizer (given, or kept from the output's
    manifest) fails before any work, not in every worker after the job started."""
    from dataset_format import storage

    for flag, value in (("--input", input), ("--output", output), ("--tokenizer", tokenizer)):
        if value is not None and not storage.is_remote(value):
            what = "the tokenizer file" if flag == "--tokenizer" else "the data"
            raise ValueError(f"{flag} {value!r} is a local path, which Dataflow workers cannot see; copy {what} "
                             "to Cloud Storage (gcloud storage cp -r) and pass a gs:// path")


def checkout_pyproject() -> Path | None:
    """This source checkout's pyproject.toml (None for an installed, non-editable package)."""
    candidate = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return candidate if candidate.is_file() else None


def our_checkout(setup_file: str) -> Path | None:
    """The checkout of this project whose pyproject.toml or setup.py `--setup_file` names (this one, or another where
    the package is installed from a wheel), or None: a project of the user's own."""
    import tomllib

    path = Path(setup_file).resolve()
    root = path.parent
    if path.name not in ("pyproject.toml", "setup.py") or not (root / "pyproject.toml").is_file():
        return None
    if not all((root / package).is_dir() for package in WORKER_PACKAGES):
        return None
    try:
        name = tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, ValueError, KeyError):
        return None
    return root if name == PROJECT else None


# What the workers install from this checkout: the contract and the converter, not the loader or the trainer.
WORKER_PACKAGES = ("dataset_format", "pipelines")
PROJECT = "arrayrecord-platform"  # its name in pyproject.toml; the workers' package is PROJECT-convert


def worker_project(checkout: Path, dest: Path) -> Path:
    """Writes a project of the conversion alone into `dest` and returns its pyproject.toml: WORKER_PACKAGES copied
    from `checkout`, depending on the base install plus the `convert` extra of `checkout`'s pyproject.toml."""
    import tomllib

    meta = tomllib.loads((checkout / "pyproject.toml").read_text())
    project = meta["project"]
    dependencies = project["dependencies"] + project["optional-dependencies"]["convert"]
    package_data = {k: v for k, v in meta.get("tool", {}).get("setuptools", {}).get("package-data", {}).items()
                    if k.split(".")[0] in WORKER_PACKAGES}
    toml = [
        "[build-system]",
        f"requires = {json.dumps(meta['build-system']['requires'])}",
        f"build-backend = {json.dumps(meta['build-system']['build-backend'])}",
        "",
        "[project]",
        f"name = {json.dumps(project['name'] + '-convert')}",
        f"version = {json.dumps(project['version'])}",
        f"requires-python = {json.dumps(project['requires-python'])}",
        f"dependencies = {json.dumps(dependencies)}",
        'readme = "README.md"',
    ]
    # (packages in setup.py: older setuptools call [tool.setuptools] in pyproject.toml "beta" at every build)
    setup_py = ["from setuptools import find_packages, setup", "",
                f"setup(packages=find_packages(include={[p + '*' for p in WORKER_PACKAGES]!r}),",
                f"      package_data={package_data!r})"]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "pyproject.toml").write_text("\n".join(toml) + "\n")
    (dest / "setup.py").write_text("\n".join(setup_py) + "\n")
    (dest / "README.md").write_text(f"# {project['name']}-convert\n\nThe conversion's packages "
                                    f"({', '.join(WORKER_PACKAGES)}) for Dataflow workers, written by "
                                    "pipelines/dataflow.py at launch.\n")
    for package in WORKER_PACKAGES:
        shutil.copytree(checkout / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest / "pyproject.toml"


def ship_package(options) -> None:
    """Makes sure Dataflow workers get the `pipelines` package; raises naming the fix if they cannot."""
    from apache_beam.options.pipeline_options import SetupOptions, WorkerOptions

    setup = options.view_as(SetupOptions)
    if options.view_as(WorkerOptions).sdk_container_image:
        if setup.sdk_location == "default":
            setup.sdk_location = "container"  # the image has Beam; do not stage another copy
        return
    if setup.extra_packages:
        return
    if setup.setup_file:  # this project's (its pyproject.toml or setup.py: the whole checkout, without the
        checkout = our_checkout(setup.setup_file)  # convert extra), or a project of the user's own, shipped as is
        if checkout is None:
            return
    else:
        pyproject = checkout_pyproject()
        checkout = pyproject.parent if pyproject is not None else None
    if checkout is None:
        raise ValueError("Dataflow workers need the pipelines package: pass --sdk_container_image IMAGE (built "
                         "from dataflow/Dockerfile) or --setup_file /path/to/checkout/pyproject.toml")
    dest = Path(tempfile.mkdtemp(prefix="arconv-workers-"))
    atexit.register(shutil.rmtree, dest, ignore_errors=True)
    setup.setup_file = str(worker_project(checkout, dest))
    log.info("shipping the conversion (%s, with the convert extra's dependencies) to the workers with --setup_file "
             "%s (each worker installs it at start-up; --sdk_container_image starts faster: see dataflow/README.md)",
             " and ".join(WORKER_PACKAGES), setup.setup_file)


def flex_template_argv(argv: list[str], environ: dict[str, str]) -> list[str]:
    """The `convert` command line for a Flex Template launch: `--param=value` flags from the launcher
    plus Dataflow's own options; the workers run in this image; the launch does not wait for the job."""
    args = ["convert", "--no_wait", *argv]
    image = environ.get(SDK_IMAGE_ENV)
    if image and not any(a.startswith("--sdk_container_image") for a in argv):
        args += [f"--sdk_container_image={image}", "--sdk_location=container"]
    return args
