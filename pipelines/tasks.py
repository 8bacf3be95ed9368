"""The shard list reaches the workers as files, not inside the job description.

`beam.Create(tasks)` inlines every task into the pipeline (~57 bytes each: Dataflow's 10 MB job-graph limit near 175k
shards). Instead the launcher writes the tasks as JSON lines, `TASKS_PER_FILE` a file, to `DIR/<run>-NNNNN.jsonl`
(DIR: `--temp_location/arrayrecord-tasks` on Dataflow, beside the job's other staged files; `OUT/.tasks` locally); the
pipeline carries only those file names and reads them on the workers, then reshuffles the tasks once. What the last
step needs besides the results (the kept, orphaned, pruned and recovered entries: a rerun of a million up-to-date
shards keeps a million) is staged the same way, as `DIR/<run>-finalize.json`. The files of a run are deleted with its
manifest; a dead local run's are removed by the next run (under the output's lease).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

from dataset_format import storage
from dataset_format.manifest import ShardEntry
from pipelines.paths import InputFile
from pipelines.plan import FinalizePlan
from pipelines.shard import ShardResult, ShardTask

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


def stage_plan(plan: FinalizePlan, directory: str, run_id: str) -> str:
    """Writes what the last step needs (the plan without its tasks) to `directory`; returns the file's path."""
    path = storage.join(directory, f"{run_id}-finalize.json")
    entries = lambda group: [dataclasses.asdict(e) for e in group]  # noqa: E731
    storage.write_text(path, json.dumps({
        "kind": plan.kind, "kept": entries(plan.kept), "orphaned": entries(plan.orphaned),
        "pruned": entries(plan.pruned), "splits": list(plan.split_order),
        "recovered": [{"entry": dataclasses.asdict(r.entry), "corruptions": list(r.corruptions)}
                      for r in plan.recovered]}))
    return path


def read_plan(path: str) -> FinalizePlan:
    """`stage_plan`'s file, read back on the worker that writes the manifest."""
    text = storage.read_text(path)
    if text is None:
        raise FileNotFoundError(f"{path}: the staged plan is gone (deleted while the job ran?); run the conversion "
                                "again")
    d = json.loads(text)
    entries = lambda group: tuple(ShardEntry.from_json(e) for e in d[group])  # noqa: E731
    recovered = tuple(ShardResult(ShardEntry.from_json(r["entry"]), tuple(r["corruptions"])) for r in d["recovered"])
    return FinalizePlan(d["kind"], (), entries("kept"), entries("orphaned"), entries("pruned"), recovered,
                        input_splits=tuple(d["splits"]))


def delete_run(directory: str, run_id: str | None = None) -> int:
    """Deletes the staged files of `run_id` in `directory`, or of every run when None; returns how many."""
    names = [n for n in storage.list_sizes(directory)
             if n.endswith((".jsonl", "-finalize.json")) and (run_id is None or n.startswith(run_id))]
    for name in names:
        storage.delete_quietly(storage.join(directory, name))
    if not storage.is_remote(directory) and not storage.list_sizes(directory):
        try:
            os.rmdir(directory)
        except OSError:
            pass  # absent, or holds something else: leave it
    return len(names)
