"""Which program this process runs, from the config and TF_CONFIG's task (trainer/cluster.py):

- mode=evaluate, or TF_CONFIG type "evaluator": the sidecar evaluator (trainer/evaluator.py);
- strategy=parameter_server: the coordinator (the chief, or this machine alone), or, for TF_CONFIG worker and ps
  tasks, a Ray node that joins the chief's cluster and serves until it ends (trainer/parameter_server.py);
- otherwise the synchronous loop (trainer/train.py) on the strategy's device mesh.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer import cluster
from trainer.config import TrainConfig

log = logging.getLogger(__name__)


def run(config: TrainConfig) -> dict[str, Any]:
    spec = cluster.from_env()
    if config.mode == "evaluate" or (spec is not None and spec.is_evaluator):
        from trainer.evaluator import evaluate_checkpoints

        return evaluate_checkpoints(config)
    if config.strategy == "parameter_server":
        from trainer import parameter_server

        if spec is not None and not spec.is_coordinator:
            return parameter_server.serve_node(config, spec)
        from trainer import job

        with job.alone_in(config.workdir):
            return parameter_server.train(config, spec)
    if spec is not None and spec.cluster.get("ps"):
        raise ValueError(f"TF_CONFIG lists ps tasks, but strategy={config.strategy!r}; use strategy=parameter_server "
                         "(or drop the ps tasks)")
    members = len(spec.cluster.get("chief", [])) + len(spec.cluster.get("worker", [])) if spec is not None else 0
    if members > 1 and config.strategy != "multi_worker":  # (each host trained alone, on all the data)
        raise ValueError(f"TF_CONFIG describes a job of {members} processes (chief and workers), and strategy="
                         f"{config.strategy!r} trains in one: pass strategy=multi_worker, or unset TF_CONFIG")
    from trainer.train import train_and_evaluate

    return train_and_evaluate(config)
