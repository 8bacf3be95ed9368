"""Sources other than our own conversion: TFDS's own ArrayRecord output, and gs:// directly."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

import loader
from pipelines import ConvertConfig, run_conversion
from tests.conftest import synthetic_records, write_tfrecord_shards


def test_tfds_build_array_record_directory(tfds_digits_array_record):
    batches = list(loader.load(str(tfds_digits_array_record), split="test", batch_size=50, shuffle=False,
                               num_epochs=1, drop_remainder=False))
    assert sum(len(b["label"]) for b in batches) == 359
    assert batches[0]["image"].shape == (50, 8, 8, 1) and batches[0]["image"].dtype == np.uint8
    # Same examples, same order as TFDS's own data source.
    source = tfds.builder_from_directory(str(tfds_digits_array_record)).as_data_source("test")
    labels = np.concatenate([b["label"] for b in batches])
    np.testing.assert_array_equal(labels, [source[i]["label"] for i in range(len(source))])
    np.testing.assert_array_equal(batches[1]["image"][3], source[53]["image"])


def test_our_tfds_conversion_loads_by_split(tfds_digits, tmp_path):
    out = tmp_path / "digits" / "1.0.0"
    run_conversion(ConvertConfig(input=str(tfds_digits), output=str(out)), ["--direct_num_workers=1"])
    train = loader.load(str(out), split="train", batch_size=2, num_epochs=1)
    assert len(train) == 1438 // 2
    with pytest.raises(ValueError, match=r"no shards for split 'validation'; the splits are \['test', 'train'\]"):
        loader.load(str(out), split="validation", batch_size=2)


def test_tfrecord_tfds_directory_is_refused_with_the_fix(tfds_digits):
    with pytest.raises(ValueError, match="fileFormat='tfrecord'; convert it first: python -m pipelines convert"):
        loader.load(str(tfds_digits), batch_size=2)


@pytest.mark.gcs
def test_tfrecord_shards_given_as_arrayrecord_are_named_with_the_convert_command(tmp_path):
    write_tfrecord_shards(tmp_path, [synthetic_records(0, 3)])
    (shard,) = tmp_path.glob("*.tfrecord")
    renamed = shard.rename(tmp_path / "train-00000.array_record")  # a TFRecord under an ArrayRecord name
    with pytest.raises(ValueError, match=rf"{renamed} is a TFRecord file, not ArrayRecord: convert it first \(python -m "
                                         rf"pipelines convert --input {renamed} --output DIR\)"):
        loader.load(str(tmp_path / "*.array_record"), batch_size=1)


def test_gcs_source_reads_directly(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    contents = [synthetic_records(i, n) for i, n in enumerate([20, 13])]
    write_tfrecord_shards(tmp_path / "in", contents)
    for output in (f"gs://{bucket}/ds", str(tmp_path / "local")):
        run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=output), ["--direct_num_workers=1"])
    remote = list(loader.load(f"gs://{bucket}/ds", batch_size=11, seed=1, num_epochs=1, decode=None))
    assert [r for b in remote for r in b] != [r for c in contents for r in c]  # shuffled...
    assert sorted(r for b in remote for r in b) == sorted(r for c in contents for r in c)  # ...exactly once each
    assert remote == list(loader.load(str(tmp_path / "local"), batch_size=11, seed=1, num_epochs=1, decode=None))


def test_every_kind_of_source_knows_its_shard_sizes_and_versions(converted, tmp_path):
    """The index is keyed by each shard's size and version: its inode, change and modification times
    (loader/format/index.py), so a touch, a chmod or a replacement changes it."""
    import os
    import shutil

    import numpy as np

    from loader.format.source import _mix, resolve

    for shard in converted.glob("*.array_record*"):  # bare files: a glob with no manifest beside them
        shutil.copy(shard, tmp_path / shard.name)
    sources = resolve(str(converted)), resolve(str(tmp_path / "*.array_record*"))
    assert [s.kind for s in sources] == ["manifest", "glob"]
    for source in sources:
        assert source.shard_bytes == tuple(os.path.getsize(p) for p in source.paths), source.kind
        assert source.total_bytes == sum(source.shard_bytes)
        stats = [os.stat(p) for p in source.paths]
        columns = [np.array([getattr(st, name) for st in stats], dtype=np.int64)
                   for name in ("st_mtime_ns", "st_ctime_ns", "st_ino")]
        assert source.shard_versions == tuple(_mix(*columns).tolist()), source.kind
        assert len(set(source.shard_versions)) == len(source.paths)
    mixed = _mix(np.array([1, 1]), np.array([2, 2]), np.array([3, 4]))  # one inode apart
    assert mixed[0] != mixed[1]


def test_where_all_names_shards_and_runs_of_records():
    from loader.format.source import ShardedSource

    source = ShardedSource(("a", "b", "c", "d", "e"), (10, 10, 10, 10, 10), "glob")
    assert source.where_all(np.array([12, 3, 4, 5, 7, 49, 25, 33, 38, 4])) == \
        "a: records 3-5, 7; b: record 2; c: record 5; and records of 2 more shards"
    assert source.where_all(np.arange(0, 20, 2), numbers_shown=3) == \
        "a: records 0, 2, 4 and 2 more; b: records 0, 2, 4 and 2 more"


# Slices by records (TFDS's split syntax): SHARD_SIZES are [37, 0, 101, 64, 55], 257 records.

def _records(source, split, **options):
    batches = loader.load(source, split=split, batch_size=1000, num_epochs=1, drop_remainder=False, decode=None,
                          **options)
    return [r for batch in batches for r in batch]


def test_slices_joined_by_a_plus_are_read_end_to_end(converted, all_records):
    split = "[250:]+[:3] + [100:102]"
    assert _records(str(converted), split, shuffle=False) == all_records[250:] + all_records[:3] + all_records[100:102]
    assert sorted(_records(str(converted), split, seed=1)) == sorted(all_records[250:] + all_records[:3] +
                                                                    all_records[100:102])
    twice = _records(str(converted), "[:2]+[:2]", shuffle=False)  # a record twice, as TFDS reads "train+train"
    assert twice == all_records[:2] * 2


@pytest.mark.parametrize("a, b, shared", [
    ("[:10]+[20:]", "[5:15]", 5),      # two runs of shard 0 in one split: both count
    ("[:10]+[5:15]", "[:20]", 15),     # a split's own runs overlap: each record once
    ("[:90%]", "[90%:]", 0),
    ("[30:40]+[200:210]", "[35:205]", 10),  # across shards
])
def test_shared_records_counts_every_run_of_a_shard(converted, a, b, shared):
    from loader.format.source import resolve, shared_records

    assert shared_records(resolve(str(converted), split=a), resolve(str(converted), split=b)) == shared
    assert shared_records(resolve(str(converted), split=b), resolve(str(converted), split=a)) == shared


@pytest.mark.parametrize("split, first, stop", [
    ("[10:200]", 10, 200),            # across the empty shard and two shard edges
    ("[:99%]", 0, 254),               # round(99 * 257 / 100) = round(254.43)
    ("[99%:]", 254, 257),
    ("[-50:]", 207, 257),
    ("[:-250]", 0, 7),
    ("[2shard:4shard]", 37, 202),     # shards 2 and 3 (shard 1 is empty)
    ("[-1shard]", 202, 257),          # the last shard alone
    ("[:0shard]", 0, 257),            # a stop of 0 shards is the end, as TFDS reads it
    ("[1_00:1_01]", 100, 101),
])
def test_a_slice_holds_those_records_of_the_whole_in_order(converted, all_records, split, first, stop):
    assert _records(str(converted), split, shuffle=False) == all_records[first:stop]


def test_slices_shuffle_within_themselves_and_partition_the_whole(converted, all_records):
    train = _records(str(converted), "[:90%]", seed=3)
    held_out = _records(str(converted), "[90%:]", seed=3)
    assert len(train) == 231 and len(held_out) == 26  # round(231.3)
    assert sorted(train) == sorted(all_records[:231]) and train != all_records[:231]
    assert sorted(held_out) == sorted(all_records[231:])
    # a fixed sequence: the permutation of 26 records for seed 3 (records 7, 17, 25, 9, 3, 24 of the slice), as a
    # source of those 26 records alone would be shuffled
    assert held_out[:6] == [b"4:36", b"4:46", b"4:54", b"4:38", b"4:32", b"4:53"]
    from loader.planning.batches import BatchPlan

    order = BatchPlan(26, 26, 3, True, 1, False, 0, 1).indices_at(np.arange(26))
    assert held_out == [all_records[231 + i] for i in order.tolist()]


def test_a_slice_reads_through_the_whole_sources_index(converted, loader_index_dir):
    from loader.format.index import RecordIndex, source_key
    from loader.format.source import resolve

    whole, part = resolve(str(converted)), resolve(str(converted), split="[40:60]")
    assert source_key(part) == source_key(whole) and part.paths == whole.paths
    assert part.lengths == (0, 0, 20, 0, 0) and part.offsets == (37, 0, 3, 0, 0)
    assert part.file_lengths == whole.lengths and len(part) == 20
    assert RecordIndex.for_source(part).path == RecordIndex.for_source(whole).path
    assert part.where(0) == f"{whole.paths[2]}: record 3"  # errors name the record of the shard's file
    assert part.where_all(np.arange(5)) == f"{whole.paths[2]}: records 3-7"


def test_tfds_slices_match_tfds(tfds_digits_array_record):
    builder = tfds.builder_from_directory(str(tfds_digits_array_record))
    for split in ("test[:10%]", "test[-7:]", "test[1shard:]", "train[33%:34%]", "test[:3]+train[-2:]+test[5:7]"):
        ours = list(loader.load(str(tfds_digits_array_record), split=split, batch_size=1000, shuffle=False,
                                num_epochs=1, drop_remainder=False))
        theirs = builder.as_data_source(split)
        labels = np.concatenate([b["label"] for b in ours])
        np.testing.assert_array_equal(labels, [theirs[i]["label"] for i in range(len(theirs))], err_msg=split)
        np.testing.assert_array_equal(ours[0]["image"][-1], theirs[len(theirs) - 1]["image"], err_msg=split)


@pytest.mark.parametrize("split, error", [
    ("train[:10%]", r"split='train\[:10%\]' names a split, but .* is not a TFDS dataset and has none; leave the "
                    r"name out \(a slice alone, e.g. split='\[:99%\]', takes part of its records\)"),
    ("[5:5]", r"split='\[5:5\]' is records \[5:5\] of 257: no records; check the slice"),
    ("[:300]", r"split='\[:300\]' passes the end of the 257 records; check the slice"),
    ("[9shard:]", r"split='\[9shard:\]' names shard 9, but there are 5 shard\(s\)"),
    ("[:101%]", r"split='\[:101%\]' passes the end of the records \(a bound beyond 100%\)"),
    ("[:" + "9" * 400 + "%]", r"passes the end of the records \(a bound beyond 100%\)"),
    ("[1%:50]", r"split='\[1%:50\]' mixes units \(%, abs\); write both bounds in records, in % or in shards"),
    ("[3]", r"split='\[3\]': a single bound is a shard \('\[3shard\]'\); for records write a slice \('\[3:4\]'\)"),
    ("[1.5:]", r"split='\[1.5:\]': records are whole numbers; a fraction is written in %"),
    ("train[:5%](pct1_dropremainder)", r"percent bounds round to the closest record, as TFDS's default does; its "
                                        r"other rounding, \(pct1_dropremainder\), is not taken: drop the option"),
    ("[:5]+", r"split='\[:5\]\+' has an empty part beside a '\+'; pass a split's name \('train'\)"),
    ("[:5]+train[5:]", r"split='train\[5:\]' names a split, but .* is not a TFDS dataset"),
    ("[:0shard]+[:0]", r"split='\[:0\]' is records \[0:0\] of 257: no records"),
    ("train[a:]", r"has a slice that does not read \[FROM:TO\]; pass a split's name \('train'\), a slice of one"),
])
def test_bad_slices_are_named_with_the_fix(converted, split, error):
    with pytest.raises(ValueError, match=error):
        loader.load(str(converted), split=split, batch_size=1)


def test_a_glob_takes_a_slice_but_no_split_name(converted, all_records):
    pattern = str(converted / "*.array_record*")
    assert _records(pattern, "[250:]", shuffle=False) == all_records[250:]
    with pytest.raises(ValueError, match=r"split='test' names a split, but .* is a glob of files, which has none"):
        loader.load(pattern, split="test", batch_size=1)


def test_a_mixture_of_slices_reads_each_components_part(converted, all_records):
    from loader.planning.mixture import COMPONENT_KEY

    batches = loader.load({"a": str(converted), "b": str(converted / "*.array_record*")}, split="[-3:]",
                          batch_size=6, num_epochs=1, shuffle=False, weights={"a": 1, "b": 1},
                          decode=lambda record: {"record": np.frombuffer(record, np.uint8)})
    rows = [bytes(r) for b in batches for r in b["record"]]
    assert sorted(rows) == sorted(all_records[-3:] * 2)


def test_token_counts_of_a_slice_are_its_records(tmp_path):
    from loader.format.source import ShardedSource
    from loader.planning.counts import TokenCounts

    counts = [np.arange(10, 17, dtype="<u4"), np.zeros(0, "<u4"), np.arange(20, 25, dtype="<u4")]
    paths = tuple(str(tmp_path / f"s{i}") for i in range(3))
    for path, column in zip(paths, counts):
        column.tofile(path + ".counts")
    whole = ShardedSource(paths, (7, 0, 5), "glob")
    part = whole.sliced(4, 9)
    np.testing.assert_array_equal(TokenCounts.of_source(part)(np.arange(5)), [14, 15, 16, 20, 21])
    assert TokenCounts.of_source(part).identity != TokenCounts.of_source(whole).identity
    with pytest.raises(ValueError, match=r"s2.counts says record 1 of .*s2 holds 21 token ids, more than a record can"):
        TokenCounts.of_source(part, max_count=20)(np.array([4]))


def test_a_glob_over_a_converted_directory_reads_its_manifest(pretokenized):
    """A glob over a pre-tokenized directory's shards (which also matches their .counts files, as MaxText-style
    `DIR/*.array_record-*` does) is those shards of its manifest: the token ids' type, the tokenizer, the counts; a
    narrower glob, the shards it names."""
    import os

    from loader.format.source import resolve, token_info

    whole = resolve(pretokenized["web"])
    names = [p.rsplit("/", 1)[-1] for p in whole.paths]
    assert len(names) == 2 and all(os.path.exists(p + ".counts") for p in whole.paths)
    everything = resolve(pretokenized["web"] + "/*.array_record*")
    assert (everything.kind, everything.paths, everything.lengths, everything.tokens_dtype, everything.tokenizer) == \
        ("manifest", whole.paths, whole.lengths, whole.tokens_dtype, whole.tokenizer)
    assert whole.tokens_dtype is not None and everything.identity == whole.identity
    second = resolve(pretokenized["web"] + "/" + names[1])
    assert (second.kind, second.paths, second.lengths) == ("manifest", whole.paths[1:], whole.lengths[1:])
    assert token_info(pretokenized["web"] + "/*.array_record*") == token_info(pretokenized["web"])
    rows = loader.load(pretokenized["web"] + "/*.array_record*", batch_size=2, packing=loader.Packing(seq_len=8))
    same = loader.load(pretokenized["web"], batch_size=2, packing=loader.Packing(seq_len=8))
    first, again = next(iter(rows)), next(iter(same))
    assert all(np.array_equal(first[k], again[k]) for k in again)


def test_a_state_names_its_slice(converted, token_data):
    def state(source, split, **options):
        it = iter(loader.load(source, split=split, batch_size=2, seed=0, **options))
        next(it)
        return it.get_state()

    saved = state(str(converted), "[:128]", decode=None)
    assert saved["records"] == [[0, 128]] and "records" not in state(str(converted), None, decode=None)
    other = iter(loader.load(str(converted), split="[128:256]", batch_size=2, seed=0, decode=None))
    with pytest.raises(ValueError, match=r"cannot restore loader state: dataset: saved '5 shards, 128 records, "
                                         r"sha256:44cdb2c42e1ac27b', now '5 shards, 128 records, sha256:9ba9a69082e96c9d'"
                                         r".*, records: saved \[\[0, 128\]\], now \[\[128, 256\]\]"):
        other.set_state(saved)
    same = iter(loader.load(str(converted), split="[:128]", batch_size=2, seed=0, decode=None))
    same.set_state(saved)  # the slice it was saved on
    packing = loader.Packing("ids", seq_len=6, tokenize=lambda v: np.asarray(v).reshape(-1))
    packed = state(token_data, "[:6]", packing=packing)
    assert packed["records"] == [[0, 6]]
    with pytest.raises(ValueError, match=r"cannot restore the packed loader's state: dataset: saved '2 shards, 6 "
                                         r"records, sha256:6c63b3db2ac10367', now '2 shards, 6 records, "
                                         r"sha256:bd349e32f8852773'"
                                         r", records: saved \[\[0, 6\]\], now \[\[6, 12\]\]; restore with"):
        iter(loader.load(token_data, split="[6:]", packing=packing, batch_size=2, seed=0)).set_state(packed)


def test_a_grain_data_source_of_a_slice(converted, all_records):
    source = loader.DataSource(str(converted), split="[-7:]")
    assert len(source) == 7 and [source[i] for i in range(7)] == all_records[-7:]
    assert source.__getitems__([6, 0]) == [all_records[-1], all_records[-7]]


def test_any_split_text_is_a_slice_within_the_records_or_a_value_error():
    """20,000 strings of the syntax's pieces (seed 0): a slice in bounds, or a ValueError naming the text, never
    another error (an index, an overflow from hundreds of digits) or a slice past the records."""
    import random

    from loader.format.source import parse_split

    pieces = list("[]:%+-_.0123456789 ()e") + ["shard", "train", "9" * 400]
    rng = random.Random(0)
    parsed = 0
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        try:
            name, selector = parse_split(text)
            if selector is not None:
                start, stop = selector.bounds((37, 0, 101, 64, 55), f"split={text!r}")
                assert 0 <= start < stop <= 257, text
            parsed += 1
        except ValueError as e:
            assert repr(text) in str(e), (text, str(e))
    assert parsed > 1000  # the strings reach the bounds, not only the errors


def test_a_resolved_source_or_a_list_of_files_takes_a_slice(converted, all_records):
    whole = loader.resolve(str(converted))
    assert _records(whole, "[-3:]", shuffle=False) == all_records[-3:]
    files = sorted(str(p) for p in converted.glob("*.array_record*"))
    source = loader.DataSource(files, split="[:2]+[-1:]")
    assert [source[i] for i in range(len(source))] == all_records[:2] + all_records[-1:]
    assert len(loader.DataSource(whole, split="[10:20]")) == 10
    with pytest.raises(ValueError, match=r"split='train\[:5\]' names a split, but .* was resolved already and holds "
                                         r"one; leave the name out"):
        loader.load(whole, split="train[:5]", batch_size=1)
