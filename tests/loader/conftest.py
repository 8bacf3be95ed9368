import os
import shutil

import pytest

from pipelines import ConvertConfig, run_conversion
from tests.conftest import built_once, write_tfrecord_shards

SHARD_SIZES = [37, 0, 101, 64, 55]  # uneven, with an empty shard: 257 records


def record(shard: int, i: int) -> bytes:
    return f"{shard}:{i}".encode()


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """A dataset converted by the real pipeline: records b'<shard>:<i>' in 5 uneven shards."""
    def build(root):
        write_tfrecord_shards(root / "in", [[record(s, i) for i in range(n)] for s, n in enumerate(SHARD_SIZES)])
        assert run_conversion(ConvertConfig(input=str(root / "in" / "*"), output=str(root / "out")),
                              ["--direct_num_workers=1"]).ok
        return root / "out"

    return built_once(tmp_path_factory, "loader-data", build)


@pytest.fixture(scope="session")
def all_records():
    return [record(s, i) for s, n in enumerate(SHARD_SIZES) for i in range(n)]


@pytest.fixture
def rotten_copy(converted, tmp_path):
    """A copy of `converted` whose shard 2 has the right size but bad bytes in its first records' chunks."""
    broken = tmp_path / "rot"
    shutil.copytree(converted, broken)
    shard = broken / "train-00002-of-00005.array_record"
    data = bytearray(shard.read_bytes())
    data[100:2000] = os.urandom(1900)  # records' chunks near the start of the file: same size, bad content
    shard.write_bytes(bytes(data))
    return broken


@pytest.fixture(scope="session")
def photos(tmp_path_factory):
    """48 ImageNet-layout JPEG records (real photos) in 3 TFRecord shards, converted by the real pipeline."""
    from pipelines import ConvertConfig, run_conversion
    from pipelines.demo import write_photo_tfrecords

    def build(root):
        write_photo_tfrecords(str(root / "in"), 48, num_shards=3)
        assert run_conversion(ConvertConfig(input=str(root / "in" / "*"), output=str(root / "out")),
                              ["--direct_num_workers=1"]).ok
        return root / "out"

    return built_once(tmp_path_factory, "photos", build)


LENGTHS = [5, 3, 9, 2, 4, 7, 1, 6, 8, 2, 3, 5]  # targets per example; example i's ids are 100*i + 0..n


def token_ids(i: int):
    import numpy as np

    return 100 * i + np.arange(LENGTHS[i] + 1)


@pytest.fixture(scope="session")
def token_data(tmp_path_factory):
    """12 examples of int64 token ids (`ids`: 100*i + 0..LENGTHS[i]) in 2 shards, converted."""
    from dataset_format import example_proto

    root = tmp_path_factory.mktemp("tokens")
    records = [example_proto.encode_example({"ids": token_ids(i)}) for i in range(len(LENGTHS))]
    write_tfrecord_shards(root / "raw", [records[:5], records[5:]])
    run_conversion(ConvertConfig(input=str(root / "raw" / "*.tfrecord"), output=str(root / "out")),
                   ["--direct_num_workers=1"])
    return str(root / "out")


@pytest.fixture(scope="session")
def pretokenized(tmp_path_factory):
    """Three corpora of 40 texts in 2 shards each, converted by the real pipeline with one tokenizer (`convert
    --tokenizer`): token ids and .counts files. {name: directory}."""
    from dataset_format import example_proto, tokenizer

    def build(root):
        texts = {name: [f"{name} document {i} says {'word ' * (i % 9)}".encode() for i in range(40)]
                 for name in ("web", "code", "books")}
        tok = tokenizer.train_bpe([t for ts in texts.values() for t in ts], 300, str(root / "tokenizer.json"))
        out = {}
        for name, ts in texts.items():
            records = [example_proto.encode_example({"text": t}) for t in ts]
            write_tfrecord_shards(root / "raw" / name, [records[:25], records[25:]])
            out[name] = str(root / name)
            assert run_conversion(ConvertConfig(input=str(root / "raw" / name / "*"), output=out[name],
                                                tokenizer=tok), ["--direct_num_workers=1"]).ok
        return out

    return built_once(tmp_path_factory, "pretokenized", build)


@pytest.fixture(scope="session")
def web_with_eos(pretokenized, tmp_path_factory):
    """pretokenized's "web" texts converted again with the same tokenizer and --add-eos: the same documents, each
    one id longer (a corpus tokenised again)."""
    from pathlib import Path

    root = Path(pretokenized["web"]).parent
    out = str(tmp_path_factory.mktemp("eos") / "web")
    assert run_conversion(ConvertConfig(input=str(root / "raw" / "web" / "*"), output=out,
                                        tokenizer=str(root / "tokenizer.json"), add_eos=True),
                          ["--direct_num_workers=1"]).ok
    return out
