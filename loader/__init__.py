"""Deterministic, globally shuffled, prefetched batches from converted ArrayRecord data, on grain.

    import loader
    it = iter(loader.load("out/", batch_size=256, seed=0))
"""

from loader.grain_source import DataSource
from loader.packing import Packing
from loader.pipeline import Loader, LoaderConfig, LoaderIterator, load
from loader.source import ShardedSource, resolve, token_info
from loader.staging import StageResult, stage

__all__ = ["DataSource", "Loader", "LoaderConfig", "LoaderIterator", "Packing", "ShardedSource", "StageResult", "load",
           "resolve", "stage", "token_info"]
