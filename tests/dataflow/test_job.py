"""Building the Dataflow job offline: DataflowRunner with a local --template_location, staging into
the GCS emulator. The job description must name our image and options, the staged pipeline must hold
our steps, and without an image the staged package must carry our code to the workers."""

import io
import json
import re
import tarfile
from pathlib import Path

import pytest
from apache_beam.portability.api import beam_runner_api_pb2

from tests.conftest import run_cli, synthetic_records, write_tfrecord_shards

pytestmark = pytest.mark.gcs

IMAGE = "us-central1-docker.pkg.dev/test/dataflow/tfrecord-to-arrayrecord:abc123"


def _upload_shards(tmp_path, bucket, client, count=3, prefix="raw"):
    paths = write_tfrecord_shards(tmp_path / "raw", [synthetic_records(i, 20) for i in range(count)])
    for path in paths:
        client.bucket(bucket).blob(f"{prefix}/{path.name}").upload_from_filename(str(path))
    return f"gs://{bucket}/{prefix}/*.tfrecord"


def _dataflow_args(bucket, template):
    return ["--runner", "DataflowRunner", "--project", "test", "--region", "us-central1",
            "--temp_location", f"gs://{bucket}/tmp", "--template_location", str(template)]


def _staged(client, bucket, name):
    blobs = [b for b in client.list_blobs(bucket, prefix="tmp/") if b.name.endswith("/" + name)]
    assert len(blobs) == 1, [b.name for b in client.list_blobs(bucket)]
    return blobs[0].download_as_bytes()


def test_job_with_the_image_names_image_options_and_steps(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    source = _upload_shards(tmp_path, bucket, client)
    template = tmp_path / "job.json"

    proc = run_cli("convert", "--input", source, "--output", f"gs://{bucket}/ar", "--compression", "zstd:1",
                   *_dataflow_args(bucket, template), "--sdk_container_image", IMAGE, "--max_num_workers", "7",
                   check=True)

    assert f"job description written to {template} (not submitted): 3 shard(s) to convert" in proc.stdout
    job = json.loads(template.read_text())
    assert job["type"] == "JOB_TYPE_BATCH"
    pool = job["environment"]["workerPools"][0]
    assert pool["workerHarnessContainerImage"] == IMAGE
    assert [c["containerImage"] for c in pool["sdkHarnessContainerImages"]] == [IMAGE]
    options = job["environment"]["sdkPipelineOptions"]["options"]
    assert (options["project"], options["region"], options["sdk_location"], options["max_num_workers"]) == (
        "test", "us-central1", "container", 7)
    assert options["sdk_container_image"] == IMAGE
    # The image has our code: nothing of ours is staged.
    assert {p["name"] for p in pool["packages"]} == {"pickled_main_session", "submission_environment_dependencies.txt"}

    pipeline = beam_runner_api_pb2.Pipeline.FromString(_staged(client, bucket, "pipeline.pb"))
    names = {t.unique_name for t in pipeline.components.transforms.values()}
    assert {"ConvertToArrayRecord/Convert/ListShards", "ConvertToArrayRecord/Convert/Distribute",
            "ConvertToArrayRecord/Convert/ConvertShard", "ConvertToArrayRecord/WriteManifest"} <= names
    (environment,) = pipeline.components.environments.values()
    payload = beam_runner_api_pb2.DockerPayload.FromString(environment.payload)
    assert (environment.urn, payload.container_image) == ("beam:env:docker:v1", IMAGE)
    # Nothing ran: the output is untouched until the job runs.
    assert list(client.list_blobs(bucket, prefix="ar/")) == []


def test_a_job_description_for_an_output_in_use_leaves_its_files_alone(tmp_path, gcs_bucket):
    """Writing a Dataflow job description holds no lease: it must not clean up an output a local run is writing (it
    deleted that run's shard lists and temporary files, and the run died: "the staged plan is gone")."""
    bucket, client = gcs_bucket
    source = _upload_shards(tmp_path, bucket, client, count=1)
    live = ["ar/.tmp-123-shard", "ar/.tasks/live-00000.jsonl", "ar/.tasks/live-finalize.json"]
    for name in live:
        client.bucket(bucket).blob(name).upload_from_string(b"{}")
    run_cli("convert", "--input", source, "--output", f"gs://{bucket}/ar", *_dataflow_args(bucket, tmp_path / "j.json"),
            check=True)
    assert sorted(b.name for b in client.list_blobs(bucket, prefix="ar/")) == sorted(live)


TRAINING_STACK = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorboardx")


def test_job_without_an_image_ships_the_conversion_alone(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    source = _upload_shards(tmp_path, bucket, client, count=1)
    template = tmp_path / "job.json"

    proc = run_cli("convert", "--input", source, "--output", f"gs://{bucket}/ar", *_dataflow_args(bucket, template),
                   check=True)

    assert "shipping the conversion (dataset_format and pipelines, with the convert extra's dependencies) to the " \
           "workers with --setup_file" in proc.stderr
    # the sdist builds without a warning that reads as trouble (no README; [tool.setuptools] called beta)
    assert "standard file not found" not in proc.stderr and "is still *beta*" not in proc.stderr, proc.stderr[-3000:]
    job = json.loads(template.read_text())
    assert "workflow.tar.gz" in {p["name"] for p in job["environment"]["workerPools"][0]["packages"]}
    with tarfile.open(fileobj=io.BytesIO(_staged(client, bucket, "workflow.tar.gz"))) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
        # What pip installs with the sdist: setuptools writes it to egg-info/requires.txt whatever its version
        # (PKG-INFO lists it only from Metadata-Version 2.2 on); sections like [extra] would be conditional.
        (requires_txt,) = [m for m in sdist.getmembers() if m.name.endswith(".egg-info/requires.txt")]
        requires = sdist.extractfile(requires_txt).read().decode().split()
    assert {"pyproject.toml", "pipelines/convert.py", "pipelines/shard.py", "pipelines/tfrecord.py",
            "dataset_format/storage.py", "dataset_format/manifest.py"} <= names
    assert not [n for n in names if n.startswith(("loader/", "trainer/"))]
    assert not [r for r in requires if r.startswith("[")], requires  # no extras: the workers install all of it
    distributions = {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requires}
    assert {"apache-beam", "array-record", "google-cloud-storage", "tensorflow-datasets"} <= distributions
    assert not distributions & set(TRAINING_STACK), requires


def test_local_paths_are_refused_for_dataflow_before_any_work(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "raw", [synthetic_records(0, 5)])
    proc = run_cli("convert", "--input", str(tmp_path / "raw" / "*"), "--output", f"gs://{bucket}/ar",
                   *_dataflow_args(bucket, tmp_path / "job.json"))
    assert proc.returncode == 2
    assert f"error: --input '{tmp_path / 'raw' / '*'}' is a local path, which Dataflow workers cannot see" \
        in proc.stderr
    assert not (tmp_path / "job.json").exists()
    assert list(client.list_blobs(bucket)) == []
    # a local tokenizer too: read here at launch, then missing on every worker once the job had started
    (tmp_path / "tok.json").write_text("{}")
    proc = run_cli("convert", "--input", f"gs://{bucket}/raw/*", "--output", f"gs://{bucket}/ar", "--tokenizer",
                   str(tmp_path / "tok.json"), "--text-key", "text", *_dataflow_args(bucket, tmp_path / "job.json"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --tokenizer '{tmp_path / 'tok.json'}' is a local path, which Dataflow workers cannot see; copy the "
        "tokenizer file to Cloud Storage (gcloud storage cp -r) and pass a gs:// path")


def test_this_projects_setup_file_given_by_hand_ships_the_conversion_alone():
    """--setup_file naming this project (its setup.py, or its pyproject.toml where the package is installed from a
    wheel, as the error for that case says to pass) shipped the whole checkout without the convert extra: the
    workers had no array_record. It is swapped for the conversion's own project, as without --setup_file; a
    project of the user's own is shipped as it is."""
    from apache_beam.options.pipeline_options import PipelineOptions, SetupOptions

    from pipelines import dataflow
    from tests.conftest import REPO

    for given in (REPO / "setup.py", REPO / "pyproject.toml"):
        options = PipelineOptions(["--setup_file", str(given)])
        dataflow.ship_package(options)
        shipped = Path(options.view_as(SetupOptions).setup_file)
        assert shipped.name == "pyproject.toml" and shipped.parent.name.startswith("arconv-workers-"), shipped
        assert 'name = "arrayrecord-platform-convert"' in shipped.read_text()
    theirs = PipelineOptions(["--setup_file", str(REPO / "tests" / "setup.py")])
    dataflow.ship_package(theirs)
    assert theirs.view_as(SetupOptions).setup_file == str(REPO / "tests" / "setup.py")


def test_a_job_is_built_even_when_everything_is_up_to_date(tmp_path, gcs_bucket):
    """A Flex Template launcher waits for a job description, so one is written with nothing to do."""
    bucket, client = gcs_bucket
    source = _upload_shards(tmp_path, bucket, client, count=2)
    output = f"gs://{bucket}/ar"
    run_cli("convert", "--input", source, "--output", output, "--direct_num_workers=1", check=True)
    template = tmp_path / "job.json"

    proc = run_cli("convert", "--input", source, "--output", output, *_dataflow_args(bucket, template),
                   "--sdk_container_image", IMAGE, check=True)

    assert "(not submitted): 0 shard(s) to convert, 2 up to date" in proc.stdout
    assert json.loads(template.read_text())["environment"]["workerPools"][0]["workerHarnessContainerImage"] == IMAGE
