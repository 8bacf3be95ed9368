"""The shard list reaches the workers as files, not inside the job description.

`beam.Create(tasks)` inlines every task into the pipeline (~57 bytes each: Dataflow's 10 MB job-graph limit near 175k
shards). Instead the launcher writes the tasks as JSON lines, `TASKS_PER_FILE` a file, to `DIR/<run>-NNNNN.jsonl`
(DIR: `--temp_location/arrayrecord-tasks` on Dataflow, beside the job's other staged files; `OUT/.tasks` locally); the
pipeline carries only those file names and reads them on the workers, then reshuffles the tasks once. The files of a
run are deleted with its manifest; a dead local run's are removed by the next run (under the output's lease).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

from dataset_format import storage
from pipelines.paths import InputFile
from pipelines.shard import ShardTask

TASKS_DIR = ".tasks"
TASKS_PER_FILE = 10_000


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def local_dir(output: str) -> str:
    return storage.join(output, TASKS_DIR)


def dataflow_dir(temp_location: str) -> str:
    return storage.join(temp_location, "arrayrecord-tasks")


def stage(tasks: tuple[ShardTask, ...], directory: str, run_id: str) -> list[str]:
    """Writes the tasks as JSON lines into `directory`; returns the files' paths, in task order."""
    paths = []
    for part, first in enumerate(range(0, len(tasks), TASKS_PER_FILE)):
        path = storage.join(directory, f"{run_id}-{part:05d}.jsonl")
        storage.write_text(path, "\n".join(json.dumps(dataclasses.asdict(t)) for t in tasks[first:first + TASKS_PER_FILE]))
        paths.append(path)
    return paths


def read(path: str) -> list[ShardTask]:
    """The tasks of one staged file."""
    text = storage.read_text(path)
    if text is None:
        raise FileNotFoundError(f"{path}: the staged shard list is gone (deleted while the job ran?); run the "
                                "conversion again")
    return [ShardTask(**{**d, "source": InputFile(**d["source"])}) for d in map(json.loads, text.splitlines())]


def delete_run(directory: str, run_id: str | None = None) -> int:
    """Deletes the staged files of `run_id` in `directory`, or of every run when None; returns how many."""
    names = [n for n in storage.list_sizes(directory) if n.endswith(".jsonl") and (run_id is None or n.startswith(run_id))]
    for name in names:
        storage.delete_quietly(storage.join(directory, name))
    if not storage.is_remote(directory) and not storage.list_sizes(directory):
        try:
            os.rmdir(directory)
        except OSError:
            pass  # absent, or holds something else: leave it
    return len(names)
