"""Deterministic, globally shuffled, prefetched batches from converted ArrayRecord data, on grain.

    import loader
    it = iter(loader.load("out/", batch_size=256, seed=0))

`loader.images` holds the image ops for `random_map_fn=` / `map_fn=` (loader/decoding/images.py).
"""

from loader.decoding import images as images  # (re-exported: `from loader import images`)
from loader.fetch.staging import StageResult, stage
from loader.format.source import ShardedSource, resolve, token_info
from loader.grain_source import DataSource
from loader.pipeline import Loader, LoaderConfig, LoaderIterator, load
from loader.planning.packing import Packing

__all__ = ["DataSource", "Loader", "LoaderConfig", "LoaderIterator", "Packing", "ShardedSource", "StageResult", "load",
           "resolve", "stage", "token_info"]
