"""Two real JAX processes (jax.distributed, gloo on localhost): each takes its rows by default."""

import json
import socket
import subprocess
import sys

import pytest

import loader
from tests.conftest import REPO

_WORKER = """
import json, sys
import jax
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]))
import loader
it = iter(loader.load(sys.argv[3], batch_size=8, seed=11, decode=None))  # shard_index/count from JAX
print(json.dumps({"index": jax.process_index(), "count": jax.process_count(),
                  "batches": [[r.decode() for r in next(it)] for _ in range(6)]}))
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_two_jax_processes_split_each_global_batch(converted):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(port), str(i), str(converted)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
             for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    outs.sort(key=lambda o: o["index"])
    assert [(o["index"], o["count"]) for o in outs] == [(0, 2), (1, 2)]
    single = iter(loader.load(str(converted), batch_size=8, seed=11, decode=None, shard_index=0, shard_count=1))
    for k in range(6):
        expected = [r.decode() for r in next(single)]
        assert outs[0]["batches"][k] + outs[1]["batches"][k] == expected
        assert len(outs[0]["batches"][k]) == 4
