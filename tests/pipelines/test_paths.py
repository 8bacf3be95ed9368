import pytest

from pipelines import paths


def test_colliding_outputs_are_refused_up_front():
    with pytest.raises(ValueError, match="'/a/x.tfrecord' and '/a/x.tfrecords' would both be written as 'x.array_record'"):
        paths.output_names(["/a/x.tfrecord", "/a/x.tfrecords"])


def test_list_inputs_sorted_and_errors(tmp_path):
    for name in ["b.tfrecord", "a.tfrecord"]:
        (tmp_path / name).write_bytes(b"")
    assert [f.path for f in paths.list_inputs(str(tmp_path / "*.tfrecord"))] == [
        str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord")]
    with pytest.raises(FileNotFoundError, match="no files match .*; check the directory and the glob"):
        paths.list_inputs(str(tmp_path / "*.nothing"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        paths.list_inputs(str(tmp_path / "missing.tfrecord"))
