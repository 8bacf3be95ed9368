"""A user's own flax model (model=package.module:attr): the `train` flag and Dropout as flax's examples use them, and a
last layer that does not fit the task named before anything compiles."""

import json
import os
import sys
import textwrap

import numpy as np
import pytest

from tests.conftest import REPO
from tests.trainer.conftest import run_trainer, trainer_here

NETS = textwrap.dedent('''
    import flax.linen as nn
    import jax.numpy as jnp

    class Drop(nn.Module):  # Dropout on while training: needs train=True and a "dropout" stream
        num_classes: int = 10

        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Dense(64)(x.reshape(x.shape[0], -1))
            x = nn.Dropout(0.5, deterministic=not train)(x)
            return nn.Dense(self.num_classes)(x)

    class BatchNormDrop(nn.Module):  # ended in "InvalidRngError: Dropout_0 needs PRNG for 'dropout'"
        num_classes: int = 10

        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(64)(x.reshape(x.shape[0], -1)))
            return nn.Dense(self.num_classes)(nn.Dropout(0.5, deterministic=not train)(x))

    class Training(nn.Module):  # BatchNorm behind a flag of another name: a TypeError from inside flax
        num_classes: int = 10

        @nn.compact
        def __call__(self, x, training: bool = False):
            return nn.Dense(self.num_classes)(nn.BatchNorm(use_running_average=not training)(x.reshape(x.shape[0], -1)))

    class FiveLogits(nn.Module):  # the loss went NaN at step 1 ("lower learning_rate")
        num_classes: int = 10

        @nn.compact
        def __call__(self, x):
            return nn.Dense(5)(x.reshape(x.shape[0], -1))

    class Broadcast(nn.Module):  # a ValueError from jax.numpy: exit 2 with its message alone, no file or line
        num_classes: int = 10

        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1)) + jnp.ones(3)

    class LateNoise(nn.Module):  # fails; a thread it started then logs, and raises, after the cause (as orbax's do)
        num_classes: int = 10

        @nn.compact
        def __call__(self, x):
            import logging, threading, time

            def late():
                time.sleep(1.0)
                try:
                    raise RuntimeError("Event loop is closed")
                except RuntimeError:
                    logging.getLogger("concurrent.futures").exception("exception calling callback")
                raise RuntimeError("Event loop is closed")

            threading.Thread(target=late).start()
            raise RuntimeError("the model's own failure")

    class Pair(nn.Module):  # an AttributeError from inside optax
        num_classes: int = 10

        @nn.compact
        def __call__(self, x):
            y = nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))
            return y, y
''')


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    (root / "nets.py").write_text(NETS)
    return root


def _run(digits, nets, tmp_path, model, *extra):
    return trainer_here(f"data={digits['train']}", f"workdir={tmp_path}", f"model=nets:{model}", "num_classes=10",
                        "batch_size=32", *extra, path=nets)


@pytest.mark.parametrize("model, message", [
    ("FiveLogits", "error: model=nets:FiveLogits gives outputs of shape (1, 5) for a batch of 1, not (1, 10): the "
                   "task takes [batch, num_classes=10] logits: its last layer has num_classes units (it is built with "
                   "num_classes=), after pooling"),
    ("Pair", "error: model=nets:Pair returns a tuple of 2, not one array: the task takes [batch, num_classes=10] "
             "logits: its last layer has num_classes units (it is built with num_classes=), after pooling; return "
             "the logits alone"),
    ("Training", "error: model=nets:Training keeps state (batch_stats: BatchNorm statistics) but its __call__ takes no "
                 "`train` argument: name its flag train (train=True while training, as flax's examples do)"),
])
def test_a_model_that_does_not_fit_the_task_is_one_line(digits, nets, tmp_path, model, message):
    proc = _run(digits, nets, tmp_path, model, "steps=2")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == message, proc.stderr[-2000:]


def test_dropout_is_on_while_training_and_off_in_evaluation(digits, nets, tmp_path):
    """The train flag was passed only to models with BatchNorm: Dropout stayed off, silently."""
    from trainer import TrainConfig
    from trainer.program import Program

    sys.path.insert(0, str(nets))
    try:
        program = Program.build(TrainConfig(data=str(digits["train"]), workdir=str(tmp_path), model="nets:Drop",
                                            num_classes=10, seed=3))
        assert program.takes_train
        params = program.init_variables()["params"]
        train = [program._apply(params, None, program.sample, True, program.step_rng(s))[0] for s in (0, 0, 1)]
        evaluated = [program.outputs(params, program.sample) for _ in range(2)]
    finally:
        sys.path.remove(str(nets))
    np.testing.assert_array_equal(train[0], train[1])  # a step's dropout comes from seed= and the step: resumable
    assert not np.allclose(train[0], train[2])  # another step, another mask
    assert not np.allclose(train[0], evaluated[0])  # on while training
    np.testing.assert_array_equal(evaluated[0], evaluated[1])  # off in evaluation


def test_batchnorm_and_dropout_train_and_resume(digits, nets, tmp_path):
    proc = _run(digits, nets, tmp_path, "BatchNormDrop", "steps=4", "checkpoint_every=2", "log_every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = _run(digits, nets, tmp_path, "BatchNormDrop", "steps=6", "log_every=2")
    assert again.returncode == 0 and json.loads(again.stdout)["summary"]["final_step"] == 6, again.stdout[-3000:]


def test_an_error_raised_in_the_users_own_code_names_its_file_and_line(digits, nets, tmp_path):
    proc = _run(digits, nets, tmp_path, "Broadcast", "steps=2")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("error: Incompatible shapes for broadcasting"), proc.stderr[-2000:]
    line = next(n for n, text in enumerate(NETS.splitlines(), 1) if "jnp.ones(3)" in text)
    assert last.endswith(f"(in {nets / 'nets.py'}:{line}, __call__)")


def test_what_a_failed_run_still_says_as_it_ends_comes_before_its_cause(digits, nets, tmp_path):
    """A background thread (orbax's, of a failed checkpoint write) that logs and raises after the cause was said
    left "RuntimeError: Event loop is closed" as the run's last line. In a process of its own: the quiet end is the
    process's, not a caller's of main()."""
    proc = run_trainer(f"data={digits['train']}", f"workdir={tmp_path}", "model=nets:LateNoise", "num_classes=10",
                       "batch_size=32", "steps=2", extra_env={"PYTHONPATH": f"{REPO}{os.pathsep}{nets}"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: RuntimeError: the model's own failure", proc.stderr[-2000:]
    assert "Event loop is closed" not in proc.stderr
