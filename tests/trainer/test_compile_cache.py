"""trainer/compile_cache.py: which directory a run's compilation cache is in, and that JAX uses it only while the run
does."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import REPO
from trainer import compile_cache

VECTOR = jax.ShapeDtypeStruct((7,), jnp.float32)  # (lowered for it: no program compiled to make an input)


@pytest.fixture
def no_cache():
    """This process's cache setting as a test found it (None unless JAX_COMPILATION_CACHE_DIR is set), restored."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_the_directory_each_setting_names(no_cache, tmp_path):
    assert compile_cache.directory("auto", str(tmp_path)) == str(tmp_path / "compilation_cache")
    assert compile_cache.directory("auto", "gs://bucket/run") is None  # JAX would need gcsfs or TF for a bucket
    assert compile_cache.directory("none", str(tmp_path)) is None
    assert compile_cache.directory("gs://bucket/cache", str(tmp_path)) == "gs://bucket/cache"
    assert compile_cache.directory(str(tmp_path / "mine"), "gs://bucket/run") == str(tmp_path / "mine")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "env"))  # as JAX_COMPILATION_CACHE_DIR sets it
    assert compile_cache.directory("auto", str(tmp_path)) == str(tmp_path / "env")
    assert compile_cache.directory("none", str(tmp_path)) is None


def test_programs_go_to_the_runs_cache_only_while_it_runs(no_cache, tmp_path):
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache these small programs too
    try:
        for run in ("a", "b"):  # two runs in one process: each writes its own
            with compile_cache.enabled("auto", str(tmp_path / run)) as path:
                assert path == str(tmp_path / run / "compilation_cache")
                with compile_cache.Lookups() as lookups:
                    jax.jit(lambda x: jnp.sin(x) * 3).lower(VECTOR).compile()
                assert (lookups.hits, lookups.misses) == (0, 1)
            assert len(list((tmp_path / run / "compilation_cache").glob("jit_*"))) == 1
            assert jax.config.jax_compilation_cache_dir is None  # restored after the run
        with compile_cache.enabled("auto", str(tmp_path / "a")), compile_cache.Lookups() as lookups:
            jax.jit(lambda x: jnp.sin(x) * 3).lower(VECTOR).compile()
        assert (lookups.hits, lookups.misses) == (1, 0)  # read back, not compiled
        entry, = (tmp_path / "a" / "compilation_cache").glob("jit_*")  # as a process killed while writing it left it
        entry.write_bytes(entry.read_bytes()[:len(entry.read_bytes()) // 2])
        with compile_cache.enabled("auto", str(tmp_path / "a")), compile_cache.Lookups() as lookups, \
                pytest.warns(UserWarning, match="Error reading persistent compilation cache entry"):
            jax.jit(lambda x: jnp.sin(x) * 3).lower(VECTOR).compile()  # compiled again, not an error
        assert (lookups.hits, lookups.misses) == (0, 1)
        with compile_cache.enabled("none", str(tmp_path / "c")), compile_cache.Lookups() as lookups:
            jax.jit(lambda x: jnp.cos(x) * 3).lower(VECTOR).compile()
        assert (lookups.hits, lookups.misses) == (0, 0) and not (tmp_path / "c").exists()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)



_GS_CHILD = """
import sys, jax, jax.numpy as jnp
from trainer import compile_cache
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
with compile_cache.enabled(sys.argv[1], "gs://elsewhere/run"), compile_cache.Lookups() as lookups:
    jax.jit(lambda x: jnp.tanh(x) - 2).lower(jax.ShapeDtypeStruct((7,), jnp.float32)).compile()
print(lookups.hits, lookups.misses)
"""


@pytest.mark.gcs
def test_a_gs_directory_holds_the_cache_as_orbax_holds_checkpoints(gcs_bucket, gcs_emulator):
    """compilation_cache=gs://...: JAX reaches the bucket through etils.epath and gcsfs (installed with .[train], as
    for a gs:// workdir's checkpoints); a program compiled in one process is read back in the next."""
    bucket, client = gcs_bucket
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **gcs_emulator}
    runs = [subprocess.run([sys.executable, "-c", _GS_CHILD, f"gs://{bucket}/cache"], env=env, cwd=REPO, text=True,
                           capture_output=True, timeout=120, check=False) for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["0", "1"], ["1", "0"]], runs[-1].stderr[-2000:]
    assert [b.name.startswith("cache/jit_") for b in client.list_blobs(bucket)] == [True]
