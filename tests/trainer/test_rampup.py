"""The batch-size ramp-up's plan (trainer/rampup.py) and its settings' checks; the run itself: test_train.py and
test_lm.py."""

import pytest

from trainer.config import TrainConfig
from trainer.rampup import Ramp


def _config(**overrides) -> TrainConfig:
    return TrainConfig(data="x", workdir="/tmp/w", **{"batch_size": 512, "batch_size_start": 128,
                                                     "batch_size_increment": 128, "rampup_samples": 300_000,
                                                     **overrides})


def _maxtexts_sizes(start: int, increment: int, end: int, samples: float, steps: int) -> list[int]:
    """The global batch of each step as MaxText's RampupBatchManager counts it: after each step its batch is added
    to the examples of the current size, and once they reach samples / increments the size grows (capped at end)."""
    share, size, accumulated, out = samples / ((end - start) // increment), start, 0, []
    for _ in range(steps):
        out.append(size)
        accumulated += size
        if accumulated >= share:
            size, accumulated = min(size + increment, end), 0
    return out


def test_the_plan_is_maxtexts_step_by_step():
    ramp = Ramp.of(_config())
    assert ramp.stages == ((1, 128), (783, 256), (1174, 384), (1435, 512))
    assert ramp.describe() == "128 for steps 1-782, 256 for steps 783-1173, 384 for steps 1174-1434, 512 from step 1435"
    for start, increment, end, samples in [(128, 128, 512, 300_000), (32, 16, 64, 192), (8, 8, 64, 1000), (3, 1, 7, 11)]:
        ramp = Ramp.of(_config(batch_size=end, batch_size_start=start, batch_size_increment=increment,
                               rampup_samples=samples))
        steps = ramp.stages[-1][0] + 5
        assert [ramp.batch_size(s) for s in range(1, steps + 1)] == _maxtexts_sizes(start, increment, end, samples,
                                                                                     steps)
    assert Ramp.of(_config(batch_size_start=0, batch_size_increment=0, rampup_samples=0)) is None
    small = Ramp.of(_config(batch_size=64, batch_size_start=32, batch_size_increment=16, rampup_samples=192))
    assert [small.examples(s) for s in (0, 2, 3, 4, 5, 8)] == [0, 64, 96, 144, 192, 384]
    assert all(small.examples(s) == sum(small.batch_size(t) for t in range(1, s + 1)) for s in range(12))


@pytest.mark.parametrize("overrides, message", [
    ({"batch_size_start": 0}, "batch_size_increment=128 is for a batch-size ramp-up, which batch_size_start= turns "
                              "on: set it (the first global batch size), or drop batch_size_increment="),
    ({"batch_size_start": 512}, "batch_size_start=512 must be between 0 and batch_size=512 (the ramp ends at "
                                "batch_size)"),
    ({"batch_size_increment": 100}, "batch_size_increment=100 must be >= 1 and divide batch_size - batch_size_start "
                                    "= 384"),
    ({"rampup_samples": 0}, "rampup_samples=0: a ramp-up needs the examples it spans (>= 1), e.g. "
                            "rampup_samples=51200"),
    ({"grad_accum_steps": 256}, "the ramp-up's batch size 128 does not split into grad_accum_steps=256 micro-batches; "
                                "choose batch_size_start and batch_size_increment as multiples of 256"),
    ({"in_memory_batches": 4}, "batch_size_start= ramps the batch size up, and in_memory_batches=4 cycles batches of "
                               "one size: drop one of them"),
    ({"strategy": "parameter_server"}, "batch_size_start= ramps the batch size up, and strategy=parameter_server "
                                       "workers take batches of one size: drop one of them"),
])
def test_bad_ramp_settings_are_one_line_naming_the_fix(overrides, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        _config(**overrides)


def test_maxtexts_ramp_names_are_named_with_ours():
    with pytest.raises(ValueError) as e:
        TrainConfig.from_args(["data=x", "workdir=w", "enable_rampup_batch_size=true", "per_device_batch_size_start=4",
                               "global_rampup_samples=500"])
    assert "enable_rampup_batch_size: a batch-size ramp-up is on when batch_size_start= is set" in str(e.value)
    assert "per_device_batch_size_start is batch_size_start (the global batch) here" in str(e.value)
    assert "global_rampup_samples is rampup_samples here" in str(e.value)
