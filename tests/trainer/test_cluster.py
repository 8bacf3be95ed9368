"""TF_CONFIG: every role parsed and mapped (trainer/cluster.py), and every error says what is wrong."""

import json

import pytest

from trainer import cluster

_CLUSTER = {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222", "p1:2222"],
            "evaluator": ["e0:2222"]}


def _spec(task_type, index=0, cluster_=None):
    return cluster.parse(json.dumps({"cluster": cluster_ or _CLUSTER, "task": {"type": task_type, "index": index}}))


def test_every_role_is_parsed():
    assert [(s.task_type, s.task_index, s.is_coordinator, s.is_evaluator) for s in
            (_spec("chief"), _spec("worker", 1), _spec("ps", 1), _spec("evaluator"))] == [
        ("chief", 0, True, False), ("worker", 1, False, False), ("ps", 1, False, False), ("evaluator", 0, False, True)]
    # parameter_server: the chief is the Ray head; the worker and ps counts size the job
    assert _spec("ps", 1).parameter_server() == ("c0:2222", 2, 2)
    # the evaluator need not be listed in the cluster (tf's sidecar evaluator usually is not)
    assert cluster.parse(json.dumps({"cluster": {"worker": ["w0:1"]}, "task": {"type": "evaluator"}})).is_evaluator
    # tf's sparse form {index: address}
    sparse = cluster.parse(json.dumps({"cluster": {"worker": {"1": "w1:1", "0": "w0:1"}},
                                       "task": {"type": "worker", "index": 1}}))
    assert sparse.cluster["worker"] == ["w0:1", "w1:1"]
    assert cluster.from_env({"TF_CONFIG": " "}) is None
    assert cluster.from_env({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}})})


def test_multi_worker_mapping_puts_the_chief_first():
    no_ps = {k: v for k, v in _CLUSTER.items() if k != "ps"}
    assert _spec("chief", 0, no_ps).multi_worker() == ("c0:2222", 3, 0)
    assert _spec("worker", 1, no_ps).multi_worker() == ("c0:2222", 3, 2)
    workers_only = {"worker": ["w0:1", "w1:1"]}
    assert _spec("worker", 1, workers_only).multi_worker() == ("w0:1", 2, 1)
    assert _spec("worker", 0, workers_only).is_coordinator and not _spec("worker", 1, workers_only).is_coordinator


@pytest.mark.parametrize("text, message", [
    ("{not json", "TF_CONFIG is not JSON"),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), 'needs a "cluster" object and a "task" object'),
    (json.dumps({"cluster": {"master": ["a:1"]}, "task": {"type": "master"}}), "cluster has role 'master'"),
    (json.dumps({"cluster": {"worker": []}, "task": {"type": "worker"}}), "must be a non-empty list"),
    (json.dumps({"cluster": {"worker": ["nohost"]}, "task": {"type": "worker"}}), "address 'nohost' is not host:port"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "driver"}}), "task type 'driver' is not one of"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 2}}),
     "task worker:2 is not in the cluster, which has 1 worker task(s); set task.index to 0..0"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "x"}}), "index 'x' is not an integer"),
    (json.dumps({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief"}}), "2 chief tasks; there is at most one"),
    (json.dumps({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}}), 'neither "chief" nor "worker" tasks'),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1.7}}),
     "index 1.7 is not an integer"),  # (taken as 1)
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}),
     "task type 'chief' has no tasks in the cluster (worker): add \"chief\": [\"host:port\"] to \"cluster\""),
])
def test_bad_specs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match="TF_CONFIG") as e:
        cluster.parse(text)
    assert message in str(e.value)


def test_roles_in_the_wrong_strategy_are_refused():
    with pytest.raises(ValueError, match="2 ps task.*use strategy=parameter_server"):
        _spec("worker").multi_worker()
    with pytest.raises(ValueError, match="task type 'evaluator' has no part in a multi_worker job"):
        _spec("evaluator", 0, {"worker": ["w:1"]}).multi_worker()
    with pytest.raises(ValueError, match="needs a chief task in TF_CONFIG"):
        _spec("worker", 0, {"worker": ["w:1"], "ps": ["p:1"]}).parameter_server()


def test_a_job_of_several_processes_under_a_one_process_strategy_is_refused(monkeypatch, tmp_path):
    """TF_CONFIG of two workers without strategy=multi_worker: each worker trained alone on all the data, exit 0."""
    from trainer import TrainConfig
    from trainer.launch import run

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                                                "task": {"type": "worker", "index": 1}}))
    for strategy in ("default", "mirrored"):
        with pytest.raises(ValueError, match=rf"^TF_CONFIG describes a job of 2 processes \(chief and workers\), and "
                                             rf"strategy='{strategy}' trains in one: pass strategy=multi_worker, or "
                                             r"unset TF_CONFIG$"):
            run(TrainConfig(data=str(tmp_path / "none"), workdir=str(tmp_path / "w"), strategy=strategy))
    assert not (tmp_path / "w").exists()
