"""cloudbuild.yaml and dataflow/refresh.cloudbuild.yaml: valid against Cloud Build's schema, plus what
the schema misses (substitution names, `waitFor` ids, the step scripts themselves)."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.dataflow import cloudbuild_steps as cb

CONFIGS = [REPO / "cloudbuild.yaml", REPO / "dataflow" / "refresh.cloudbuild.yaml"]
BIN = Path(sys.executable).parent
BUILD = {"PROJECT_ID": "my-project", "BUILD_ID": "0b1c", "COMMIT_SHA": "abc123", "LOCATION": "us-central1"}


def _check_jsonschema(path):
    return subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.cloudbuild", str(path)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_schema(path):
    result = _check_jsonschema(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_catches_a_bad_config(tmp_path):
    bad = tmp_path / "cloudbuild.yaml"
    bad.write_text("steps:\n  - name: bash\n    wait_for: ['-']\n")  # misspelled waitFor
    assert _check_jsonschema(bad).returncode != 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_substitutions_are_declared_used_and_well_formed(path):
    config = cb.load(path)
    declared = set(config["substitutions"])
    assert all(name.startswith("_") for name in declared)  # user substitutions must start with _
    used, bad = set(), []
    for text in cb.strings(config):
        names, malformed = cb.references(text)
        used |= names
        bad += malformed
    assert bad == [], "escape bash's $ as $$"
    assert used - declared - cb.BUILTINS == set(), "undeclared substitution"
    assert declared - used == set(), "declared but unused: Cloud Build rejects it when passed"
    assert config["options"]["dynamicSubstitutions"] is True  # derived substitutions need it


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_steps_have_names_and_wait_for_earlier_steps(path):
    seen = []
    for s in cb.load(path)["steps"]:
        assert s.get("name") and s.get("id"), s  # the schema does not require either
        for dependency in s.get("waitFor", []):
            assert dependency == "-" or dependency in seen, (s["id"], dependency)
        assert s["id"] not in seen
        seen.append(s["id"])


def test_build_tests_then_pushes_the_commit_image_and_builds_its_template():
    config = cb.load(CONFIGS[0])
    assert [s["id"] for s in config["steps"]] == ["check-substitutions", "test", "build-image", "push-image",
                                                  "build-template", "publish-template", "push-latest", "launch"]
    values = cb.resolve(config, {"_BUCKET": "my-bucket"}, BUILD)
    image = "us-central1-docker.pkg.dev/my-project/dataflow/tfrecord-to-arrayrecord:abc123"
    assert cb.step(config, "test")["args"] == ["scripts/test.sh", "-q"] and (REPO / "scripts/test.sh").exists()
    build = [cb.substitute(a, values) for a in cb.step(config, "build-image")["args"]]
    assert f"--tag={image}" in build and f"--build-arg=SDK_IMAGE={image}" in build
    assert (REPO / cb.flag(build, "file")).exists()
    assert set(cb.step(config, "push-image")["waitFor"]) == {"test", "build-image"}  # only tested code
    assert [cb.substitute(a, values) for a in cb.step(config, "push-image")["args"]] == ["push", image]
    # "latest" (what the refresh's plan step runs) moves only after "latest"'s template spec does
    assert cb.step(config, "push-latest")["waitFor"] == ["publish-template"]
    assert [cb.substitute(a, values) for a in cb.step(config, "push-latest")["args"]] == \
        ["push", image.replace(":abc123", ":latest")]
    template = [cb.substitute(a, values) for a in cb.step(config, "build-template")["args"]]
    assert template[:4] == ["dataflow", "flex-template", "build",
                            "gs://my-bucket/templates/tfrecord-to-arrayrecord-abc123.json"]
    assert cb.flag(template, "image") == image and cb.flag(template, "sdk-language") == "PYTHON"
    assert (REPO / cb.flag(template, "metadata-file")).exists()


def test_launch_runs_only_when_asked(tmp_path):
    config = cb.load(CONFIGS[0])
    values = cb.resolve(config, {"_BUCKET": "my-bucket"}, BUILD)
    proc, calls = cb.run_bash_step(config, "launch", values, tmp_path)
    assert proc.returncode == 0 and calls == [] and "no job launched" in proc.stdout

    values = cb.resolve(config, {"_BUCKET": "my-bucket", "_LAUNCH": "true"}, BUILD)
    proc, calls = cb.run_bash_step(config, "launch", values, tmp_path)
    assert proc.returncode == 1 and calls == [] and "needs _INPUT and _OUTPUT" in proc.stderr

    values = cb.resolve(config, {"_BUCKET": "my-bucket", "_LAUNCH": "true", "_INPUT": "gs://my-bucket/raw/*,x",
                                 "_OUTPUT": "gs://my-bucket/ar", "_SERVICE_ACCOUNT": "sa@x"}, BUILD)
    proc, calls = cb.run_bash_step(config, "launch", values, tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed, call = calls  # first: is a conversion of this output running? (none)
    output_id = hashlib.sha1(b"gs://my-bucket/ar").hexdigest()[:8]
    assert listed[:3] == ["dataflow", "jobs", "list"] and cb.flag(listed, "status") == "active"
    assert cb.flag(listed, "filter") == f"name~^(refresh|convert)-{output_id}-"
    assert call[:3] == ["dataflow", "flex-template", "run"] and call[3].startswith(f"convert-{output_id}-2")
    assert cb.flag(call, "template-file-gcs-location") == "gs://my-bucket/templates/tfrecord-to-arrayrecord-abc123.json"
    assert cb.flag(call, "parameters") == "^~^input=gs://my-bucket/raw/*,x~output=gs://my-bucket/ar"
    assert (cb.flag(call, "region"), cb.flag(call, "service-account-email")) == ("us-central1", "sa@x")
    assert cb.flag(call, "project") == "my-project"  # _PROJECT defaults to the build's project
    assert cb.flag(call, "temp-location") == "gs://my-bucket/tmp"


def test_launch_refuses_while_a_conversion_of_the_output_runs(tmp_path):
    """A scheduled refresh (or an earlier launch) still writing the output: the launch fails, naming the job."""
    config = cb.load(CONFIGS[0])
    values = cb.resolve(config, {"_BUCKET": "my-bucket", "_LAUNCH": "true", "_INPUT": "gs://my-bucket/raw/*",
                                 "_OUTPUT": "gs://my-bucket/ar"}, BUILD)
    output_id = hashlib.sha1(b"gs://my-bucket/ar").hexdigest()[:8]
    proc, calls = cb.run_bash_step(config, "launch", values, tmp_path,
                                   active_jobs=f"2026-11-22_03_04-5 refresh-{output_id}-20261122-030400")
    assert proc.returncode == 1 and [c[:3] for c in calls] == [["dataflow", "jobs", "list"]]
    assert "a conversion of gs://my-bucket/ar is still running (Dataflow job 2026-11-22_03_04-5)" in proc.stderr
    assert "gcloud dataflow jobs cancel 2026-11-22_03_04-5" in proc.stderr


def test_missing_bucket_or_commit_fails_the_build_first(tmp_path):
    config = cb.load(CONFIGS[0])
    for overrides, message in [({}, "_BUCKET is empty"), ({"_BUCKET": "b", "COMMIT_SHA": ""}, "COMMIT_SHA is empty")]:
        values = cb.resolve(config, overrides, BUILD)
        proc, _ = cb.run_bash_step(config, "check-substitutions", values, tmp_path)
        assert proc.returncode == 1 and message in proc.stderr
    proc, _ = cb.run_bash_step(config, "check-substitutions", cb.resolve(config, {"_BUCKET": "b"}, BUILD), tmp_path)
    assert proc.returncode == 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_step_scripts_pass_shellcheck(path):
    config = cb.load(path)
    # Substitutions stay variables here: as literals, `[ -z "value" ]` would be "always false".
    values = {name: "${%s}" % name for name in set(config["substitutions"]) | cb.BUILTINS}
    scripts = [cb.substitute(s["args"][1], values) for s in config["steps"]
               if s.get("entrypoint") == "bash" and s["args"][0] == "-c"]
    assert scripts
    for script in scripts:
        result = subprocess.run([str(BIN / "shellcheck"), "--shell=bash", "-"], input=script, capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stdout
