"""A million shards: the job description does not grow with the shard count, and the tasks are shuffled once."""

import apache_beam as beam
import pytest

from pipelines import ConvertConfig
from pipelines.convert import ConvertToArrayRecord
from pipelines.paths import InputFile
from pipelines.plan import Plan
from pipelines.shard import ShardTask


def _description_bytes(n: int, tmp_path) -> tuple[int, beam.Pipeline]:
    out = str(tmp_path / f"out-{n}")
    tasks = tuple(ShardTask(InputFile(f"gs://b/in/part-{i:07d}.tfrecord", 1 << 20, 1.7e9), f"{out}/part-{i:07d}.ar",
                            f"part-{i:07d}.ar") for i in range(n))
    pipeline = beam.Pipeline()
    _ = pipeline | ConvertToArrayRecord(ConvertConfig(input="gs://b/in/*", output=out), Plan("tfrecord", tasks, (), (), ()))
    return len(pipeline.to_runner_api().SerializeToString()), pipeline


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
    assert len(list((tmp_path / "out-100000" / ".tasks").iterdir())) == 10  # 10,000 tasks a file


@pytest.mark.slow
def test_a_million_shards_describe_in_under_a_megabyte(tmp_path):
    size, _ = _description_bytes(1_000_000, tmp_path)
    assert size < 1 << 20, size
