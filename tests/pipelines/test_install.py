"""The conversion needs only the `convert` extra: it runs with the training stack made unimportable.

A `sitecustomize` on PYTHONPATH refuses jax, flax, optax, orbax, grain and our loader and trainer in the
launcher and in every DirectRunner worker process it starts, as if they were not installed.
"""

import os
import subprocess
import sys

from tests.conftest import REPO, run_cli, synthetic_records, write_tfrecord_shards

BLOCKED = ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "loader", "trainer")

SITECUSTOMIZE = f'''
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not in the convert extra)")
        return None

sys.meta_path.insert(0, _NotInstalled())
'''


def test_conversion_runs_without_the_training_stack(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    write_tfrecord_shards(tmp_path / "raw", [synthetic_records(i, 50) for i in range(3)])
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    convert = run_cli("convert", "--input", str(tmp_path / "raw" / "*.tfrecord"), "--output", str(tmp_path / "out"),
                      env=env, check=True)  # the default local run: one worker process per core
    verify = run_cli("verify", "--output", str(tmp_path / "out"), "--deep", env=env, check=True)

    assert "converted 3 shard(s) (150 records" in convert.stdout
    assert "3 shards, 150 records, 0 problem(s)" in verify.stdout
    # The blocker works: the same environment cannot import jax.
    blocked = subprocess.run([sys.executable, "-c", "import jax"], env={**os.environ, **env}, capture_output=True,
                             text=True)
    assert blocked.returncode == 1 and "blocked: not in the convert extra" in blocked.stderr
