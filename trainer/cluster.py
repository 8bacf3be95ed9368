"""TF_CONFIG, tf.distribute's cluster description, read for every role it has.

    TF_CONFIG='{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]},
                "task": {"type": "worker", "index": 0}}'

How each role maps here:
- multi_worker: the chief (if any) and the workers are one `jax.distributed` job, chief first; the chief's (else
  worker 0's) address is the coordinator. ps tasks are refused (they belong to parameter_server).
- parameter_server: one Ray cluster. The chief is its head and the coordinator (the `python -m trainer` process that
  schedules steps); workers and ps tasks join it as Ray nodes that offer a "worker" or "ps" resource, and the
  coordinator's actors land on them. A chief is required (tf's ParameterServerStrategy needs one too).
- evaluator: `mode=evaluate`, the sidecar evaluator. It reads checkpoints and never joins the cluster, so it may be
  listed in the cluster or not.
"""

from __future__ import annotations

import dataclasses
import json
import os

ROLES = ("chief", "worker", "ps", "evaluator")
_EXAMPLE = ('{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"]}, "task": {"type": "worker", '
            '"index": 0}}')


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    cluster: dict[str, list[str]]  # role -> its tasks' host:port, in index order
    task_type: str
    task_index: int

    @property
    def is_evaluator(self) -> bool:
        return self.task_type == "evaluator"

    @property
    def is_coordinator(self) -> bool:
        """The task that runs the training loop (the chief, or worker 0 of a cluster without one)."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    def multi_worker(self) -> tuple[str, int, int]:
        """(coordinator address, number of processes, this process's id) of the jax.distributed job: the chief,
        then the workers."""
        if self.cluster.get("ps"):
            raise ValueError(f"TF_CONFIG lists {len(self.cluster['ps'])} ps task(s), which strategy=multi_worker "
                             "has no use for; use strategy=parameter_server, or drop the ps tasks")
        if self.task_type not in ("chief", "worker"):
            raise ValueError(f"TF_CONFIG task type {self.task_type!r} has no part in a multi_worker job (chief and "
                             "workers)")
        members = self.cluster.get("chief", []) + self.cluster.get("worker", [])
        offset = 0 if self.task_type == "chief" else len(self.cluster.get("chief", []))
        return members[0], len(members), offset + self.task_index

    def parameter_server(self) -> tuple[str, int, int]:
        """(the Ray head's host:port = the chief's, number of workers, number of ps tasks)."""
        if not self.cluster.get("chief"):
            raise ValueError("strategy=parameter_server needs a chief task in TF_CONFIG (the coordinator, which is "
                             'also the Ray head): add "chief": ["host:port"] to "cluster"')
        if not self.cluster.get("worker"):
            raise ValueError('strategy=parameter_server needs worker tasks in TF_CONFIG: add "worker": [...]')
        return self.cluster["chief"][0], len(self.cluster["worker"]), len(self.cluster.get("ps", []))


def from_env(environ=None) -> ClusterSpec | None:
    """The TF_CONFIG of the environment, parsed and checked; None when it is unset or empty."""
    text = (environ if environ is not None else os.environ).get("TF_CONFIG", "").strip()
    return parse(text) if text else None


def parse(text: str) -> ClusterSpec:
    """A TF_CONFIG string -> ClusterSpec; every error names what is wrong and shows the expected shape."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ValueError(f"TF_CONFIG is not JSON ({e}); expected e.g. {_EXAMPLE}") from e
    if not isinstance(spec, dict) or not isinstance(spec.get("cluster"), dict) or not isinstance(spec.get("task"),
                                                                                                 dict):
        raise ValueError(f'TF_CONFIG needs a "cluster" object and a "task" object; expected e.g. {_EXAMPLE}')
    cluster: dict[str, list[str]] = {}
    for role, addresses in spec["cluster"].items():
        if role not in ROLES:
            raise ValueError(f"TF_CONFIG cluster has role {role!r}; the roles are {', '.join(ROLES)}")
        if isinstance(addresses, dict):  # tf allows {index: address} for sparse clusters
            try:
                addresses = [addresses[k] for k in sorted(addresses, key=int)]
            except ValueError as e:
                raise ValueError(f"TF_CONFIG cluster[{role!r}] has a non-integer index ({e})") from e
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(f"TF_CONFIG cluster[{role!r}] must be a non-empty list of \"host:port\" (got "
                             f"{addresses!r})")
        for address in addresses:
            host, sep, port = str(address).rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"TF_CONFIG cluster[{role!r}] address {address!r} is not host:port")
        cluster[role] = [str(a) for a in addresses]
    if len(cluster.get("chief", [])) > 1:
        raise ValueError(f"TF_CONFIG has {len(cluster['chief'])} chief tasks; there is at most one")
    task_type = spec["task"].get("type")
    if task_type not in ROLES:
        raise ValueError(f"TF_CONFIG task type {task_type!r} is not one of {', '.join(ROLES)}")
    index = spec["task"].get("index", 0)
    try:
        task_index = int(index)
        if isinstance(index, bool) or task_index != float(index):  # (1.7 was taken as 1)
            raise ValueError(index)
    except (TypeError, ValueError) as e:
        raise ValueError(f"TF_CONFIG task index {index!r} is not an integer") from e
    known = cluster.get(task_type, [])
    if task_type != "evaluator" and not known:  # (it said "set task.index to 0..0", which was given)
        raise ValueError(f'TF_CONFIG task type {task_type!r} has no tasks in the cluster ({", ".join(cluster)}): '
                         f'add "{task_type}": ["host:port"] to "cluster", or give this process another task type')
    if task_type != "evaluator" and not 0 <= task_index < len(known):
        raise ValueError(f"TF_CONFIG task {task_type}:{task_index} is not in the cluster, which has {len(known)} "
                         f"{task_type} task(s); set task.index to 0..{max(len(known) - 1, 0)} or add the address")
    if task_type != "evaluator" and not ({"chief", "worker"} & set(cluster)):
        raise ValueError('TF_CONFIG cluster has neither "chief" nor "worker" tasks; nothing would train')
    return ClusterSpec(cluster, task_type, task_index)
