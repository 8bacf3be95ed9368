"""Scheduled refreshes, run here as far as they go without Google Cloud: the refresh build's own plan
step (in-process `python -m pipelines plan`), its launch script against a stand-in gcloud, and the Flex
Template entry point (dataflow/main.py) run with the parameters that script passed, on the DirectRunner,
against the GCS emulator. Plus the scheduler set-up script in dry-run mode."""

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dataset_format.manifest import Manifest
from tests.conftest import REPO, synthetic_records, write_tfrecord_shards
from tests.dataflow import cloudbuild_steps as cb

REFRESH = cb.load(REPO / "dataflow" / "refresh.cloudbuild.yaml")
BUILD = {"PROJECT_ID": "my-project", "BUILD_ID": "0b1c", "LOCATION": "us-central1"}


def _run_plan_step(values, workspace):
    plan = cb.step(REFRESH, "plan")
    assert plan["entrypoint"] == "python"
    args = [cb.substitute(a, values) for a in plan["args"]]
    proc = subprocess.run([sys.executable, *args], cwd=workspace, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads((workspace / "plan.json").read_text())


def _launch_as_dataflow_would(call):
    """What the Flex Template launcher does with a `flex-template run`: main.py with --param=value flags."""
    parameters = cb.flag(call, "parameters")
    assert parameters.startswith("^~^")
    argv = [f"--{p}" for p in parameters[3:].split("~")]
    proc = subprocess.run([sys.executable, str(REPO / "dataflow" / "main.py"), *argv, "--direct_num_workers=1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.gcs
@pytest.mark.slow  # ~34 s on 2 cores; converting only new or changed shards is tested in tests/pipelines (default run)
def test_refresh_converts_only_new_shards_and_launches_nothing_when_up_to_date(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    paths = write_tfrecord_shards(tmp_path / "raw", [synthetic_records(i, 10 + i) for i in range(3)])
    upload = lambda path: client.bucket(bucket).blob(f"raw/{path.name}").upload_from_filename(str(path))  # noqa: E731
    upload(paths[0]), upload(paths[1])
    values = cb.resolve(REFRESH, {"_BUCKET": bucket, "_INPUT": f"gs://{bucket}/raw/*.tfrecord",
                                  "_OUTPUT": f"gs://{bucket}/ar"}, BUILD)
    workspace = tmp_path / "workspace"
    workspace.mkdir()

    # First refresh: two new shards -> one launch, which converts both.
    out, plan = _run_plan_step(values, workspace)
    assert [p.rsplit("/", 1)[1] for p in plan["to_convert"]] == [paths[0].name, paths[1].name]
    proc, calls = cb.run_bash_step(REFRESH, "launch-if-changed", values, workspace)
    assert proc.returncode == 0, proc.stderr
    listed, call = calls  # first: is a refresh of this output still running? (none)
    prefix = "refresh-" + hashlib.sha1(f"gs://{bucket}/ar".encode()).hexdigest()[:8]
    assert listed[:3] == ["dataflow", "jobs", "list"] and cb.flag(listed, "status") == "active"
    assert cb.flag(listed, "filter") == f"name~^(refresh|convert)-{prefix[8:]}-"
    assert call[:3] == ["dataflow", "flex-template", "run"] and call[3].startswith(f"{prefix}-2")
    assert cb.flag(call, "template-file-gcs-location") == f"gs://{bucket}/templates/tfrecord-to-arrayrecord-latest.json"
    assert "converted 2 shard(s) (21 records" in _launch_as_dataflow_would(call)

    # Nothing new: the plan says so and no job is launched.
    out, plan = _run_plan_step(values, workspace)
    assert "plan: 0 shard(s) to convert, 2 up to date, 0 to prune: nothing to do" in out
    proc, calls = cb.run_bash_step(REFRESH, "launch-if-changed", values, workspace)
    assert proc.returncode == 0 and calls == []
    assert f"gs://{bucket}/ar is up to date with gs://{bucket}/raw/*.tfrecord: no job launched" in proc.stdout

    # A new shard arrives: only it is converted, and the manifest lists all three.
    upload(paths[2])
    out, plan = _run_plan_step(values, workspace)
    assert plan["to_convert"] == [f"gs://{bucket}/raw/{paths[2].name}"] and plan["up_to_date"] == 2
    assert plan["why"] == {f"gs://{bucket}/raw/{paths[2].name}": "new: not in the manifest"}
    # ... while the previous refresh's job, or a job launched by cloudbuild.yaml, still writes this output: nothing
    # is launched over it (a job writing another output does not count)
    other = "convert-" + hashlib.sha1(f"gs://{bucket}/other".encode()).hexdigest()[:8] + "-20261122-010203"
    for job in (f"{prefix}-20261122-010203", f"convert-{prefix[8:]}-20261122-010203"):
        proc, calls = cb.run_bash_step(REFRESH, "launch-if-changed", values, workspace,
                                       active_jobs=f"2026-11-22_01_02-66 {other}\n2026-11-22_01_02-77 {job}")
        assert proc.returncode == 0 and [c[:3] for c in calls] == [["dataflow", "jobs", "list"]]
        assert "still running (Dataflow job 2026-11-22_01_02-77): none launched" in proc.stdout
    proc, calls = cb.run_bash_step(REFRESH, "launch-if-changed", values, workspace,
                                   active_jobs=f"2026-11-22_01_02-66 {other}")
    _, call = calls
    summary = _launch_as_dataflow_would(call)
    assert "converted 1 shard(s) (12 records" in summary and "skipped 2 up-to-date shard(s)" in summary
    manifest = Manifest.from_json(client.bucket(bucket).blob("ar/manifest.json").download_as_text())
    assert [s.records for s in manifest.shards] == [10, 11, 12]

    # A job cancelled after its shards committed but before its manifest (here: the manifest lost): every later
    # refresh said "up to date" and launched nothing. It launches one that converts nothing and lists them again.
    client.bucket(bucket).blob("ar/manifest.json").delete()
    out, plan = _run_plan_step(values, workspace)
    assert plan["to_convert"] == [] and len(plan["recovered"]) == 3
    assert "plan: 0 shard(s) to convert, 0 up to date, 3 recovered from an interrupted run, 0 to prune: " \
           "manifest.json lacks 3 converted shard(s), which `convert` with these flags adds (converting nothing)" in out
    proc, calls = cb.run_bash_step(REFRESH, "launch-if-changed", values, workspace)
    assert proc.returncode == 0 and "3 shard(s) to convert, prune or list in the manifest" in proc.stdout
    summary = _launch_as_dataflow_would(calls[1])
    assert "converted 0 shard(s)" in summary, summary
    manifest = Manifest.from_json(client.bucket(bucket).blob("ar/manifest.json").download_as_text())
    assert [s.records for s in manifest.shards] == [10, 11, 12]


SCHEDULE_ENV = {"PROJECT": "my-project", "BUCKET": "my-bucket", "INPUT": "gs://my-bucket/raw/train-*,v2.tfrecord",
                "OUTPUT": "gs://my-bucket/ar", "REPO": "https://github.com/my-org/data",
                "SERVICE_ACCOUNT": "refresh@my-project.iam.gserviceaccount.com", "DRY_RUN": "1"}


def _schedule(env):
    return subprocess.run(["bash", str(REPO / "dataflow" / "schedule_refresh.sh")], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **env}, timeout=30)


def test_schedule_script_creates_a_trigger_for_the_refresh_config_and_a_scheduler_job():
    proc = _schedule(SCHEDULE_ENV)
    assert proc.returncode == 0, proc.stderr
    trigger, job = [shlex.split(line) for line in proc.stdout.splitlines()[:2]]
    assert trigger[:5] == ["gcloud", "builds", "triggers", "create", "manual"]
    config = cb.flag(trigger, "build-config")
    assert config == "dataflow/refresh.cloudbuild.yaml" and (REPO / config).exists()
    substitutions = cb.flag(trigger, "substitutions")
    assert substitutions.startswith("^~^")
    given = dict(pair.split("=", 1) for pair in substitutions[3:].split("~"))
    assert set(given) <= set(REFRESH["substitutions"])  # Cloud Build rejects unknown ones
    assert given["_INPUT"] == SCHEDULE_ENV["INPUT"] and given["_BUCKET"] == "my-bucket"
    assert given["_PROJECT"] == "my-project" and given["_REPOSITORY"] == "dataflow"  # the image's repository
    assert job[:5] == ["gcloud", "scheduler", "jobs", "create", "http"]
    assert cb.flag(job, "schedule") == "0 3 * * *"
    assert cb.flag(job, "uri") == ("https://cloudbuild.googleapis.com/v1/projects/my-project/locations/us-central1/"
                                   "triggers/TRIGGER_ID:run")
    assert json.loads(cb.flag(job, "message-body")) == {"source": {"branchName": "main"}}
    assert cb.flag(job, "oauth-service-account-email") == SCHEDULE_ENV["SERVICE_ACCOUNT"]
    # a dry run says that it created nothing ("scheduled: ..." read as if it had)
    assert proc.stdout.splitlines()[-1] == ("DRY_RUN: nothing was created; without DRY_RUN, '0 3 * * *' (Etc/UTC) "
                                            "would run trigger arrayrecord-refresh")


def test_schedule_script_refuses_missing_settings_and_local_paths():
    proc = _schedule({k: v for k, v in SCHEDULE_ENV.items() if k not in ("REPO", "SERVICE_ACCOUNT")})
    assert proc.returncode == 2 and "error: set REPO SERVICE_ACCOUNT" in proc.stderr and proc.stdout == ""
    proc = _schedule({**SCHEDULE_ENV, "INPUT": "/data/raw/*.tfrecord"})
    assert proc.returncode == 2 and "must be gs:// paths" in proc.stderr
    # the template's prune parameter takes true or false alone: a refresh failed at launch on a night with new shards
    proc = _schedule({**SCHEDULE_ENV, "PRUNE": "maybe"})
    assert proc.returncode == 2 and "error: PRUNE=maybe is not true or false" in proc.stderr and proc.stdout == ""
    proc = _schedule({**SCHEDULE_ENV, "PRUNE": "yes"})
    given = dict(pair.split("=", 1) for pair in cb.flag(shlex.split(proc.stdout.splitlines()[0]),
                                                         "substitutions")[3:].split("~"))
    assert proc.returncode == 0 and given["_PRUNE"] == "true"


def test_schedule_script_passes_shellcheck():
    result = subprocess.run([str(Path(sys.executable).with_name("shellcheck")),
                             str(REPO / "dataflow" / "schedule_refresh.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_a_pinned_refresh_runs_that_commits_image_and_template():
    proc = _schedule({**SCHEDULE_ENV, "PIN": "0123abcd" * 5, "REPOSITORY": "ml-images"})
    assert proc.returncode == 0, proc.stderr
    trigger = shlex.split(proc.stdout.splitlines()[0])
    given = dict(pair.split("=", 1) for pair in cb.flag(trigger, "substitutions")[3:].split("~"))
    assert set(given) <= set(REFRESH["substitutions"])
    assert given["_IMAGE"] == ("${_REGION}-docker.pkg.dev/${_PROJECT}/${_REPOSITORY}/${_IMAGE_NAME}:"
                               + "0123abcd" * 5)
    assert given["_REPOSITORY"] == "ml-images"  # the repository cloudbuild.yaml pushed to (dataflow/README.md)
    resolved = cb.resolve(REFRESH, given, BUILD)
    assert resolved["_IMAGE"] == "us-central1-docker.pkg.dev/my-project/ml-images/tfrecord-to-arrayrecord:" + \
        "0123abcd" * 5
    plan = cb.step(REFRESH, "plan")  # the pinned image's own code, not the trigger's checkout in /workspace
    assert plan["entrypoint"] == "python" and plan["args"][:3] == ["-P", "-m", "pipelines"]
    assert given["_TEMPLATE"] == "gs://${_BUCKET}/templates/tfrecord-to-arrayrecord-" + "0123abcd" * 5 + ".json"
    bad = _schedule({**SCHEDULE_ENV, "PIN": "latest"})
    assert bad.returncode == 2 and "PIN=latest is not a commit SHA" in bad.stderr
    short = _schedule({**SCHEDULE_ENV, "PIN": "0123abc"})  # a short SHA names no tag cloudbuild.yaml wrote
    assert short.returncode == 2 and "PIN=0123abc has 7 hex digits; pass the full commit SHA" in short.stderr
