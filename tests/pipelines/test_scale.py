"""A million shards: the job description does not grow with the shard count, and the tasks are shuffled once."""

import apache_beam as beam
import pytest

from dataset_format.manifest import ShardEntry
from pipelines import ConvertConfig, tasks as shard_tasks
from pipelines.convert import ConvertToArrayRecord
from pipelines.paths import InputFile
from pipelines.plan import Plan
from pipelines.shard import ShardResult, ShardTask


def _description_bytes(n: int, tmp_path, kept: int = 0) -> tuple[int, beam.Pipeline]:
    out = str(tmp_path / f"out-{n}-{kept}")
    tasks = tuple(ShardTask(InputFile(f"gs://b/in/part-{i:07d}.tfrecord", 1 << 20, 1.7e9), f"{out}/part-{i:07d}.ar",
                            f"part-{i:07d}.ar") for i in range(n))
    pipeline = beam.Pipeline()
    _ = pipeline | ConvertToArrayRecord(ConvertConfig(input="gs://b/in/*", output=out),
                                        Plan("tfrecord", tasks, _entries(kept), (), ()))
    return len(pipeline.to_runner_api().SerializeToString()), pipeline


def _entries(n: int, prefix: str = "kept") -> tuple[ShardEntry, ...]:
    return tuple(ShardEntry(f"{prefix}-{i:07d}.ar", f"gs://b/in/{prefix}-{i:07d}.tfrecord", 100, 1 << 17, 1 << 20,
                            "1048576:1700000000", "group_size:1,snappy") for i in range(n))


def test_the_description_does_not_grow_with_the_shards_and_shuffles_once(tmp_path):
    small, _ = _description_bytes(10, tmp_path)
    large, pipeline = _description_bytes(100_000, tmp_path)  # was 5.65 MB: 57 bytes a task
    assert large - small < 2_000, (small, large)  # the staged files' names only: 10 of them
    assert large < 1 << 20
    transforms = {t.unique_name: t for t in pipeline.to_runner_api().components.transforms.values()}
    assert transforms["ConvertToArrayRecord/Convert/Distribute"].subtransforms  # the one shuffle of the tasks
    # beam.Create's own reshuffle is off: its MaybeReshuffle step is an empty composite.
    assert not transforms["ConvertToArrayRecord/Convert/ListShards/MaybeReshuffle"].subtransforms
    assert not [n for n in transforms if "Reshuffle" in n and "Distribute" not in n and "MaybeReshuffle" not in n]
    assert len([f for f in (tmp_path / "out-100000-0" / ".tasks").iterdir() if f.suffix == ".jsonl"]) == 10


def test_a_rerun_keeping_100k_shards_stages_them_beside_the_tasks(tmp_path):
    """The kept entries (a rerun of mostly up-to-date shards) travel as a staged file, not in the job description,
    and come back whole on the worker that writes the manifest."""
    small, _ = _description_bytes(1, tmp_path, kept=10)
    large, _ = _description_bytes(1, tmp_path, kept=100_000)  # pickled into the last step: 0.30 MB (zlib-compressed)
    assert large - small < 2_000, (small, large)
    staged = [f for f in (tmp_path / "out-1-100000" / ".tasks").iterdir() if f.name.endswith("-finalize.json")]
    assert len(staged) == 1
    plan = shard_tasks.read_plan(str(staged[0]))
    assert plan.kept == _entries(100_000) and plan.tasks == () and plan.split_order == (None,)


def test_the_staged_plan_round_trips_every_group(tmp_path):
    recovered = (ShardResult(_entries(1, "rec")[0], ({"source": "s", "offset": 8, "length": 3, "reason": "crc"},)),)
    plan = Plan("tfds", (), _entries(2), _entries(1, "orphan"), _entries(1, "pruned"), recovered).without_tasks()
    path = shard_tasks.stage_plan(plan, str(tmp_path / "staged"), "run1")
    assert shard_tasks.read_plan(path) == plan
    assert shard_tasks.delete_run(str(tmp_path / "staged"), "run1") == 1
    assert not (tmp_path / "staged").exists()  # the emptied staging directory goes too


@pytest.mark.slow
def test_a_million_shards_describe_in_under_a_megabyte(tmp_path):
    size, _ = _description_bytes(1_000_000, tmp_path)
    assert size < 1 << 20, size
