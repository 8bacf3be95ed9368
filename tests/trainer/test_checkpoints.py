"""Checkpoints (trainer/checkpoints.py): written in the background or before the next step, the same either way;
a checkpoint that cannot be written ends the run with the storage's cause, exit 1."""

import logging
import re
import resource
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.conftest import REPO


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _checkpoint(workdir, step):
    """Checkpoint `step`'s state (NumPy arrays) and loader state."""
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(str(workdir / "checkpoints"), item_handlers=handlers) as mngr:
        meta = mngr.item_metadata(step)["state"]
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta)
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                              data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]


def test_background_checkpoints_hold_what_written_ones_hold(digits, tmp_path, caplog):
    """async_checkpointing (the default): each checkpoint is written in orbax's thread while the next steps run, and
    those steps reuse the state's buffers (donated): every checkpoint still holds bitwise what a synchronous run's
    holds at that step, each is logged as taken and then as written, all are written when the run returns, and the
    summary says how long the loop was held by them."""
    from trainer import TrainConfig, train

    lines, summaries = {}, {}
    for name, background in (("written", False), ("background", True)):
        config = TrainConfig(data=str(digits["train"]), workdir=str(tmp_path / name), model="mlp", steps=6,
                             batch_size=32, num_classes=10, log_every=2, checkpoint_every=2,
                             async_checkpointing=background)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trainer.train"):
            summaries[name] = train.train_and_evaluate(config)
        lines[name] = [re.sub(r"\d+\.\d s", "T s", r.getMessage()) for r in caplog.records
                       if "checkpoint" in r.getMessage()]
    assert lines["written"] == [f"step {s}: checkpoint saved in T s" for s in (2, 4, 6)]
    assert lines["background"] == [line for s in (2, 4, 6) for line in (
        f"step {s}: checkpoint taken in T s (being written in the background)",
        f"step {s}: checkpoint written (T s in the background)")]
    assert all(0 <= summaries[name]["checkpoint_wait_s"] < 60 for name in summaries)
    for step in (2, 4, 6):
        (want, want_data), (got, got_data) = (_checkpoint(tmp_path / name, step) for name in ("written", "background"))
        assert got_data == want_data and int(got["step"]) == step
        assert all(np.array_equal(x, y) for x, y in zip(_leaves(want), _leaves(got), strict=True))


@pytest.mark.parametrize("background", [True, False])
def test_a_checkpoint_that_cannot_be_written_ends_the_run_with_its_cause(digits, tmp_path, background):
    """Files the trainer may write are limited to 16 KiB (RLIMIT_FSIZE): the first checkpoint's writing fails (in
    orbax's thread with async_checkpointing). The run ends with exit 1 (the storage failed; 2 is for bad settings
    and data), its last line naming the directory, the storage's error and the fix; no checkpoint is left as
    written."""
    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))

    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", f"data={digits['train']}", f"workdir={workdir}", "model=mlp", "num_classes=10",
         "batch_size=32", "steps=6", "log_every=2", "checkpoint_every=2", "compilation_cache=none",
         f"async_checkpointing={str(background).lower()}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=limited,
        # (no bytecode: a .pyc written under the limit would be cut short, and later imports would fail on it)
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert re.fullmatch(rf"error: CheckpointWriteError: writing a checkpoint to {re.escape(str(workdir))}/checkpoints "
                        r"failed: .*File too large.*; make room there or let the job write it, then run again: it "
                        r"resumes from the last checkpoint written", last), last
    with ocp.CheckpointManager(str(workdir / "checkpoints")) as mngr:
        assert mngr.all_steps() == []


def test_a_checkpoint_that_cannot_be_read_is_one_line_naming_it_and_the_way_on(digits, tmp_path):
    """A damaged checkpoint was `error: Expecting value: line 1 column 1 (char 0)` (exit 2, as for a bad setting),
    or pages of tensorstore's spec after the error line, or orbax's KeyError: none named the checkpoint or what to do.
    Moved aside as the line says, the run resumes from the one before."""
    import shutil

    from tests.trainer.conftest import train_here

    common = (f"data={digits['train']}", f"workdir={tmp_path}", "model=mlp", "num_classes=10", "batch_size=8",
              "log_every=2", "checkpoint_every=2")
    assert train_here(*common, "steps=4").returncode == 0
    kept = tmp_path / "kept"
    shutil.copytree(tmp_path / "checkpoints" / "4", kept)
    store = tmp_path / "checkpoints" / "4"
    damage = {
        "a loader state that is not JSON": lambda: (store / "data" / "metadata").write_text("garbage"),
        "the array store cut short": lambda: [f.write_bytes(f.read_bytes()[:7]) for f in
                                             (store / "state").rglob("*") if f.is_file() and "ocdbt" in str(f)
                                             and f.stat().st_size > 64],
        "the state gone": lambda: shutil.rmtree(store / "state"),
    }
    for what, do in damage.items():
        shutil.rmtree(store)
        shutil.copytree(kept, store)
        do()
        proc = train_here(*common, "steps=6")
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 1 and re.fullmatch(
            rf"error: checkpoint 4 in {re.escape(str(tmp_path / 'checkpoints'))} cannot be read \(\w+: .*\); if it is "
            rf"damaged or partly written, move it aside \(e\.g\. to {re.escape(str(store))}\.unreadable\) and the run "
            r"resumes from step 2; if its storage failed, run again", last), (what, proc.stderr[-3000:])
    store.rename(tmp_path / "checkpoints" / "4.unreadable")
    resumed = train_here(*common, "steps=6")
    assert resumed.returncode == 0 and "resumed from step 2" in resumed.stderr, resumed.stderr[-3000:]


def test_an_unreadable_checkpoint_says_the_way_on_for_each_listing():
    """What follows moving the checkpoint aside: the step a resume takes, afresh only where nothing is before it, and
    no claim of either when the listing failed too (it said "starts afresh" with checkpoints before it)."""
    from trainer.checkpoints import unreadable
    error = OSError("the storage said no\nmore")
    said = {steps: str(unreadable("/w/checkpoints", 8, error, *([] if steps == "default" else [steps])))
            for steps in ("default", None)}
    said["[2, 4, 8]"] = str(unreadable("/w/checkpoints", 8, error, [2, 4, 8]))
    said["[8]"] = str(unreadable("/w/checkpoints", 8, error, [8]))
    assert said == {
        "default": "checkpoint 8 in /w/checkpoints cannot be read (OSError: the storage said no); if it is damaged "
                   "or partly written, move it aside (e.g. to /w/checkpoints/8.unreadable) and run the evaluator "
                   "again: it goes on with the next one; if its storage failed, run again",
        None: "checkpoint 8 in /w/checkpoints cannot be read (OSError: the storage said no); if it is damaged or "
              "partly written, move it aside (e.g. to /w/checkpoints/8.unreadable) and the run resumes from the "
              "latest checkpoint before it (or starts afresh where there is none); if its storage failed, run again",
        "[2, 4, 8]": "checkpoint 8 in /w/checkpoints cannot be read (OSError: the storage said no); if it is "
                     "damaged or partly written, move it aside (e.g. to /w/checkpoints/8.unreadable) and the run "
                     "resumes from step 4; if its storage failed, run again",
        "[8]": "checkpoint 8 in /w/checkpoints cannot be read (OSError: the storage said no); if it is damaged or "
               "partly written, move it aside (e.g. to /w/checkpoints/8.unreadable) and the run starts afresh; if its "
               "storage failed, run again",
    }
