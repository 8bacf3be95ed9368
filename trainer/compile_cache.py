"""JAX's persistent compilation cache for a run: a restarted run (after a preemption, a crash, or with more steps)
reads its compiled programs back instead of compiling them again, as MaxText does with `jax_cache_dir`.

`compilation_cache=` (trainer/config.py) picks the directory: `auto` is WORKDIR/compilation_cache for a local
workdir, so it lives beside the checkpoints and survives what they survive; for a gs:// workdir `auto` is no cache,
as JAX looks every program up before compiling it (one request each, and a run starts many small programs): name
one there, e.g. compilation_cache=gs://bucket/run/compilation_cache (JAX writes it through etils.epath: gcsfs, or
TensorFlow's file system where TensorFlow is installed). `none` turns it off; any other value is the directory.
Where JAX_COMPILATION_CACHE_DIR is set, `auto` keeps that.

JAX caches a program only when compiling it took at least jax_persistent_cache_min_compile_time_secs (1 s by
default): a language model's step and its attention probe, not the small programs around them. The cache holds
executables that a JAX process will load and run: like the checkpoints, it must be a directory only you can write.

    with compile_cache.enabled(config.compilation_cache, config.workdir):
        ...  # every compile in here reads and writes the cache; the process's previous setting comes back after
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import ClassVar, Self

import jax
from jax._src import compilation_cache as jax_cache

from dataset_format import storage

_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def directory(setting: str, workdir: str) -> str | None:
    """The cache directory `compilation_cache=setting` names for a run in `workdir` (None: no cache)."""
    if setting == "none":
        return None
    if setting == "auto":
        current = jax.config.jax_compilation_cache_dir  # JAX_COMPILATION_CACHE_DIR, or a caller's own setting
        if current or storage.is_remote(workdir):
            return current
        return storage.absolute(storage.join(workdir, "compilation_cache"))
    return storage.absolute(setting)


@contextlib.contextmanager
def enabled(setting: str, workdir: str) -> Iterator[str | None]:
    """JAX's compilation cache in `directory(setting, workdir)` for the body; yields the directory. JAX opens its
    cache once a process, at the first compile: a directory other than the one it opened is switched to here, and
    the previous one restored after (a notebook or test that trains twice, in two workdirs)."""
    path = directory(setting, workdir)
    previous = jax.config.jax_compilation_cache_dir
    if path == previous:
        yield path
        return
    _switch(path)
    try:
        yield path
    finally:
        _switch(previous)


def _switch(path: str | None) -> None:
    jax.config.update("jax_compilation_cache_dir", path)
    if hasattr(jax_cache, "reset_cache"):  # JAX opens `path` at the next compile, not the directory it opened before
        jax_cache.reset_cache()


class Lookups:
    """Counts the compilation cache's hits and misses while it is open (JAX's monitoring events), so a log line can
    say that a program came from the cache:

        with Lookups() as lookups:
            compiled = step.lower(...).compile()
        lookups.hits  # programs read back from the cache
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _open: ClassVar[list[Lookups]] = []
    _listening: ClassVar[bool] = False

    def __init__(self):
        self.hits = self.misses = 0

    def __enter__(self) -> Self:
        with Lookups._lock:
            if not Lookups._listening:  # JAX has no way to remove a listener: one for the process, shared
                jax.monitoring.register_event_listener(Lookups._event)
                Lookups._listening = True
            Lookups._open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with Lookups._lock:
            Lookups._open.remove(self)

    @staticmethod
    def _event(event: str, **kwargs) -> None:
        if event in (_HIT, _MISS):
            with Lookups._lock:
                for lookups in Lookups._open:
                    if event == _HIT:
                        lookups.hits += 1
                    else:
                        lookups.misses += 1
