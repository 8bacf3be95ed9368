"""A gs:// workdir shared by two processes (the GCS emulator): everything the trainer writes lands in the bucket, and
a run resumes from it."""

import json
import socket

import pytest

from tests.trainer.conftest import REPO, run_trainer

pytestmark = pytest.mark.gcs


def _two_processes(args, env) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [run_trainer(*args, "strategy=multi_worker", f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
                         f"process_id={i}", popen=True, extra_env=env) for i in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-2000:] + outputs[1][-2000:]
    return outputs


@pytest.mark.timeout(600)
def test_two_processes_share_a_gs_workdir_and_resume_from_it(digits, gcs_bucket, gcs_emulator):
    bucket, client = gcs_bucket
    args = (f"data={digits['train']}", f"workdir=gs://{bucket}/run", "model=mlp", "num_classes=10", "batch_size=32",
            "log_every=1", "eval_every=1000", "checkpoint_every=3")
    _two_processes((*args, "steps=4"), gcs_emulator)
    names = [b.name for b in client.list_blobs(bucket)]
    assert {n.split("/")[2] for n in names if n.startswith("run/checkpoints/")} == {"3", "4"}
    assert any(n.startswith("run/tensorboard/events.out.tfevents") for n in names), names
    # the run cut back to its checkpoint at step 3: the next run logs step 4 again, and the first run's record of
    # step 4 must not stay beside it
    for blob in client.list_blobs(bucket, prefix="run/checkpoints/4/"):
        blob.delete()
    outputs = _two_processes((*args, "steps=6"), gcs_emulator)
    assert all("resumed from step 3 (loader at batch 3)" in out for out in outputs), outputs[0][-3000:]
    records = [json.loads(line) for line in client.bucket(bucket).blob("run/metrics.jsonl").download_as_text()
               .splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # written by the chief alone, each step once
    assert not (REPO / "gs:").exists()  # nothing local named after the URL
