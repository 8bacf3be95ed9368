import pytest

from pipelines import paths


@pytest.mark.parametrize("source, expected", [
    ("/d/mnist-train.tfrecord-00000-of-00004", "mnist-train.array_record-00000-of-00004"),
    ("gs://b/x/train-00003-of-00016.tfrecord", "train-00003-of-00016.array_record"),
    ("/d/part-0", "part-0.array_record"),
    ("/d/data.tfrecords", "data.array_record"),
    ("/d/train.tfrecord.gz", "train.array_record"),
    ("/d/mytfrecordfile", "mytfrecordfile.array_record"),  # not a token: appended
])
def test_output_name(source, expected):
    assert paths.output_name(source) == expected


def test_colliding_outputs_are_refused_up_front():
    with pytest.raises(ValueError, match="'/a/x.tfrecord' and '/a/x.tfrecords' would both be written as 'x.array_record'"):
        paths.check_unique_outputs(["/a/x.tfrecord", "/a/x.tfrecords"])


def test_list_inputs_sorted_and_errors(tmp_path):
    for name in ["b.tfrecord", "a.tfrecord"]:
        (tmp_path / name).write_bytes(b"")
    assert [f.path for f in paths.list_inputs(str(tmp_path / "*.tfrecord"))] == [
        str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord")]
    with pytest.raises(FileNotFoundError, match="no files match .*; check the directory and the glob"):
        paths.list_inputs(str(tmp_path / "*.nothing"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        paths.list_inputs(str(tmp_path / "missing.tfrecord"))
