"""The loader's state saves with the model in one orbax checkpoint and resumes in a fresh process."""

import json
import subprocess
import sys

from tests.conftest import REPO

_SAVE = """
import json, sys
import numpy as np
import orbax.checkpoint as ocp
import loader
it = iter(loader.load(sys.argv[1], batch_size=4, seed=5, decode=None))
for _ in range(6):
    next(it)
with ocp.CheckpointManager(sys.argv[2]) as mngr:
    mngr.save(6, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.arange(3.0)}),
                                         data_iter=ocp.args.JsonSave(it.get_state())))
    mngr.wait_until_finished()
print(json.dumps([[r.decode() for r in next(it)] for _ in range(5)]))
"""

_RESTORE = """
import json, sys
import orbax.checkpoint as ocp
import loader
with ocp.CheckpointManager(sys.argv[2]) as mngr:
    step = mngr.latest_step()
    restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(),
                                                          data_iter=ocp.args.JsonRestore()))
assert step == 6 and restored["params"]["w"].tolist() == [0.0, 1.0, 2.0]
it = iter(loader.load(sys.argv[1], batch_size=4, seed=5, decode=None))
it.set_state(restored["data_iter"])
print(json.dumps([[r.decode() for r in next(it)] for _ in range(5)]))
"""


def _run(code, *args):
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_state_in_an_orbax_checkpoint_resumes_exactly(converted, tmp_path):
    expected = _run(_SAVE, str(converted), str(tmp_path / "ckpt"))
    assert _run(_RESTORE, str(converted), str(tmp_path / "ckpt")) == expected
