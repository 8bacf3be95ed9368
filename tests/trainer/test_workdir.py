"""A gs:// workdir shared by two processes (the GCS emulator): everything the trainer writes lands in the bucket, a
preempted run exits 143 with its checkpoint there, a run resumes from it, and the sidecar evaluator reads it."""

import json
import re
import signal
import socket
import time

import pytest

from tests.trainer.conftest import REPO, finish, run_trainer

pytestmark = pytest.mark.gcs


def _launch(args, env) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [run_trainer(*args, "strategy=multi_worker", f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
                        f"process_id={i}", popen=True, extra_env=env) for i in range(2)]


def _finish(procs) -> tuple[list[int], list[str]]:
    """The processes' exit statuses and outputs."""
    outputs = finish(procs, timeout=240)  # (none outlives the test: one left waiting in a collective is killed)
    return [p.returncode for p in procs], outputs


def _metric_steps(client, bucket) -> list[int]:
    blob = client.bucket(bucket).blob("run/metrics.jsonl")
    return [json.loads(line)["step"] for line in blob.download_as_text().splitlines()] if blob.exists() else []


@pytest.mark.slow  # ~50-70 s on 2 cores: two JAX processes, the emulator, three runs
@pytest.mark.timeout(600)
def test_two_processes_share_a_gs_workdir_are_preempted_and_resume_from_it(digits, gcs_bucket, gcs_emulator):
    bucket, client = gcs_bucket
    args = (f"data={digits['train']}", f"workdir=gs://{bucket}/run", "model=mlp", "num_classes=10", "batch_size=32",
            "log_every=1", "eval_every=100000", "checkpoint_every=3")
    # Preempted: SIGTERM to process 1 only; both save one checkpoint at one step, in the bucket, and exit 143.
    procs = _launch((*args, "steps=100000"), gcs_emulator)  # it ends only through the notice, however fast
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and len(_metric_steps(client, bucket)) < 5 and procs[0].poll() is None:
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    codes, outputs = _finish(procs)
    assert codes == [143, 143], outputs[0][-2000:] + outputs[1][-2000:]
    stops = [re.findall(r"SIGTERM: saved a checkpoint at step (\d+)", out) for out in outputs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    stopped = int(stops[0][0])
    names = [b.name for b in client.list_blobs(bucket)]
    saved = sorted({int(n.split("/")[2]) for n in names if n.startswith("run/checkpoints/")})
    assert saved[-1] == stopped and len(saved) >= 2, saved
    assert any(n.startswith("run/tensorboard/events.out.tfevents") for n in names), names
    assert _metric_steps(client, bucket)[-1] == stopped

    # Cut back to the checkpoint before: the resumed run logs the steps after it again, and the first run's
    # records of them must not stay beside them.
    for blob in client.list_blobs(bucket, prefix=f"run/checkpoints/{stopped}/"):
        blob.delete()
    end = stopped + 2
    codes, outputs = _finish(_launch((*args, f"steps={end}"), gcs_emulator))
    assert codes == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert all(f"resumed from step {saved[-2]} (loader at batch {saved[-2]})" in out for out in outputs), \
        outputs[0][-3000:]
    assert _metric_steps(client, bucket) == list(range(1, end + 1))  # written by the chief alone, each step once
    assert not (REPO / "gs:").exists()  # nothing local named after the URL

    # The sidecar evaluator reads the bucket's checkpoints and writes its records there too.
    evaluator = run_trainer(f"eval_data={digits['test']}", f"workdir=gs://{bucket}/run", "mode=evaluate",
                            "model=mlp", "num_classes=10", f"steps={end}", "batch_size=32", "eval_timeout=30",
                            extra_env=gcs_emulator)
    assert evaluator.returncode == 0, evaluator.stderr[-3000:]
    records = [json.loads(line) for line in
               client.bucket(bucket).blob("run/eval/metrics.jsonl").download_as_text().splitlines()]
    assert [r["step"] for r in records] == [end] and records[0]["eval_examples"] == 359
    assert any(b.name.startswith("run/eval/events.out.tfevents") for b in client.list_blobs(bucket, prefix="run/eval/"))
