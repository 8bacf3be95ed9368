import pytest

from dataset_format.naming import output_name


@pytest.mark.parametrize("source, expected", [
    ("/d/mnist-train.tfrecord-00000-of-00004", "mnist-train.array_record-00000-of-00004"),
    ("gs://b/x/train-00003-of-00016.tfrecord", "train-00003-of-00016.array_record"),
    ("/d/part-0", "part-0.array_record"),
    ("/d/data.tfrecords", "data.array_record"),
    ("/d/train.tfrecord.gz", "train.array_record"),
    ("/d/train.tfrecord.zst", "train.array_record"),  # (every suffix read decompressed: it kept .zst, .xz, .lzma)
    ("/d/train.tfrecord.zstd", "train.array_record"),
    ("/d/train.tfrecord.xz", "train.array_record"),
    ("/d/train.tfrecord.lzma", "train.array_record"),
    ("/d/mytfrecordfile", "mytfrecordfile.array_record"),  # not a token: appended
])
def test_output_name(source, expected):
    assert output_name(source) == expected
