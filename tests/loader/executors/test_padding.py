"""pad_remainder=True (loader/executors/padding.py): every batch full, the short last one padded with zeros, `_mask`
marking the real rows, on every host; for plain and packed loaders."""

import numpy as np
import pytest

import loader
from tests.loader.conftest import LENGTHS
from tests.loader.ids import flat_ids


def _plain(data, **options):
    return loader.load(data, **{"batch_size": 8, "shuffle": False, "num_epochs": 1, "drop_remainder": False,
                                "pad_remainder": True, **options})


def test_the_last_batch_is_padded_and_masked_on_every_host(token_data):
    """12 records in batches of 8: the second has 4 real rows; on 2 hosts, host 0 holds them and host 1 a batch of
    padding alone (shaped as its first)."""
    one = list(_plain(token_data))
    assert [b["_mask"].tolist() for b in one] == [[True] * 8, [True] * 4 + [False] * 4]
    assert [len(b["ids"]) for b in one] == [8, 8] and one[1]["ids"][4:] == [None] * 4  # (a ragged feature: a list)
    hosts = [list(_plain(token_data, shard_index=h, shard_count=2)) for h in range(2)]
    assert [[b["_mask"].tolist() for b in host] for host in hosts] == [[[True] * 4, [True] * 4],
                                                                      [[True] * 4, [False] * 4]]
    real = [ids for host in hosts for b in host for ids, m in zip(b["ids"], b["_mask"]) if m]
    assert sorted(int(ids[0]) for ids in real) == [100 * i for i in range(len(LENGTHS))]
    assert all(set(b) == {"ids", "_mask"} for host in hosts for b in host)


def test_a_host_resumed_at_a_last_batch_it_has_no_rows_of_pads_it_alike(token_data):
    """4 hosts, 12 records in batches of 8: hosts 2 and 3 have no rows of the second batch. Restored at that batch
    (no batch handed out since), host 3 still gives a batch of padding shaped as the uninterrupted run's."""
    options = dict(shard_index=3, shard_count=4, shuffle=True, seed=1, features=["ids"])
    whole = list(_plain(token_data, **options))
    it = iter(_plain(token_data, **options))
    next(it)
    state = it.get_state()
    it.close()
    resumed = iter(_plain(token_data, **options))
    resumed.set_state(state)
    (last,) = list(resumed)
    assert last["_mask"].tolist() == whole[1]["_mask"].tolist() == [False, False]
    assert last["ids"] == whole[1]["ids"] == [None, None] and set(last) == {"ids", "_mask"}
    dense = iter(_plain(token_data, map_fn=lambda r: {"first": np.int64(r["ids"][0])}, **options))
    dense.set_state(state)
    (last,) = list(dense)
    assert last["first"].tolist() == [0, 0] and last["first"].dtype == np.int64


def test_packed_rows_are_padded_too(token_data):
    packing = loader.Packing("ids", seq_len=6, tokenize=flat_ids)
    batches = list(loader.load(token_data, batch_size=4, packing=packing, shuffle=False, num_epochs=1,
                               drop_remainder=False, pad_remainder=True))
    assert [b["_mask"].tolist() for b in batches] == [[True] * 4, [True] * 4, [True, True, False, False]]
    assert batches[2]["tokens"].shape == (4, 6) and not batches[2]["segment_ids"][2:].any()


def test_what_padding_cannot_do_is_one_line(token_data, converted):
    with pytest.raises(ValueError, match=r"^pad_remainder=True pads the last, short batch that drop_remainder=False "
                                         r"keeps: pass drop_remainder=False too$"):
        loader.load(token_data, batch_size=8, pad_remainder=True)
    with pytest.raises(ValueError, match=r"^pad_remainder=True pads batches of decoded features, and decode=None "
                                         r"gives raw records"):
        _plain(str(converted), decode=None)
    with pytest.raises(ValueError, match=r"the records have a feature named '_mask', the key pad_remainder=True adds"):
        next(iter(_plain(token_data, map_fn=lambda r: {**r, "_mask": np.int64(1)})))
