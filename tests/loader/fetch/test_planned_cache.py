"""The planned memory cache (loader/fetch/planned_cache.py): Belady's policy on the next reads the plan gives."""

from __future__ import annotations

import numpy as np
import pytest

import loader
from loader.fetch.planned_cache import PlannedCache, NEVER
from tests.emulator import upload_files


def test_keeps_the_soonest_read_and_evicts_the_furthest():
    cache = PlannedCache(capacity=30)
    cache.keep(["a", "b", "c"], np.array([50, 20, NEVER]), [b"a" * 10, b"b" * 10, b"c" * 10], now=0)
    assert cache.get("c") is None and len(cache) == 2  # never read again here: not kept
    cache.keep(["d", "e"], np.array([30, 60]), [b"d" * 10, b"e" * 10], now=1)
    assert [k for k in "abcde" if cache.get(k)] == ["a", "b", "d"]  # e is read after all of them
    cache.keep(["f"], np.array([25]), [b"f" * 10], now=2)
    assert [k for k in "abcdef" if cache.get(k)] == ["b", "d", "f"] and cache.size == 30  # a (50) made room
    cache.keep(["b"], np.array([NEVER]), [b"b" * 10], now=20)  # b read at 20: not again
    assert cache.get("b") is None and cache.get("f") == b"f" * 10
    cache.keep(["g"], np.array([99]), [b"g" * 10], now=26)  # f's read at 25 passed without a hit: it goes
    assert [k for k in "abcdefg" if cache.get(k)] == ["d", "g"] and cache.size == 20


def test_a_chunk_larger_than_the_cache_is_not_kept():
    cache = PlannedCache(capacity=8)
    cache.keep(["big", "small"], np.array([1, 2]), [b"x" * 9, b"y" * 8], now=0)
    assert cache.get("big") is None and cache.get("small") == b"y" * 8


@pytest.mark.gcs
def test_one_host_of_four_downloads_less_with_the_planned_cache_and_the_same_batches(gcs_bucket, converted):
    """Host 0 of 4, a memory cache of a quarter of the dataset, 6 epochs: the batches are the local loader's, and
    the planned cache (what this host reads again soonest) downloads less than the fixed set (the first read). Read
    groups of 16 records: an epoch is many groups, as on a real dataset."""
    bucket, client = gcs_bucket
    remote = upload_files(client, bucket, converted, "planned")
    options = dict(batch_size=8, seed=5, num_epochs=6, decode=None, shard_index=0, shard_count=4, records_per_read=16)
    local = list(loader.load(str(converted), **options))
    whole = loader.load(remote, **options)
    assert list(whole) == local
    cache = whole._reader._remote_reader.served // 6 // 4  # a quarter of the dataset's chunks
    downloaded = {}
    for planned in (True, False):
        ours = loader.load(remote, cache_bytes=cache, **options)
        assert ours._reader.wants_next_reads
        if not planned:  # the fixed set, as one host uses
            ours._reader._planned = False
            ours._reader._setup()
        assert list(ours) == local
        downloaded[planned] = ours._reader._remote_reader.downloaded
    assert downloaded[True] < 0.9 * downloaded[False], downloaded
