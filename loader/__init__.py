"""Deterministic, globally shuffled, prefetched batches from converted ArrayRecord data, on grain.

    import loader
    it = iter(loader.load("out/", batch_size=256, seed=0))

`loader.images` holds the image ops for `random_map_fn=` / `map_fn=` (loader/decoding/images.py).
"""

try:  # the C parts (setup.py builds them): without them, one line naming the fix rather than a bare ImportError
    from loader.format import _riegeli as _riegeli
    from loader.planning import _pack as _pack
except ImportError as e:
    raise ImportError(f"the loader's C extensions are not built here ({e}): run `pip install -e .` in the repository "
                      "(or `python setup.py build_ext --inplace`), which compiles them with gcc and Python's headers"
                      ) from e

from loader.decoding import images as images  # (re-exported: `from loader import images`)
from loader.fetch.staging import StageResult, stage
from loader.format.source import ShardedSource, resolve, token_info
from loader.grain_source import DataSource
from loader.pipeline import Loader, LoaderConfig, LoaderIterator, load
from loader.planning.packing import Packing

__all__ = ["DataSource", "Loader", "LoaderConfig", "LoaderIterator", "Packing", "ShardedSource", "StageResult", "load",
           "resolve", "stage", "token_info"]
