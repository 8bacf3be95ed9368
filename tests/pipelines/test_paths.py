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


def test_a_glob_takes_wildcards_in_directory_parts(tmp_path, monkeypatch):
    """`*raw/*.tfrecord` (relative or absolute) matches in every directory its first part matches."""
    for d, name in [("a_raw", "a.tfrecord"), ("b_raw", "b.tfrecord"), ("b_raw", "c.tfrecord"), ("cooked", "d.tfrecord")]:
        (tmp_path / d).mkdir(exist_ok=True)
        (tmp_path / d / name).write_bytes(b"")
    want = [str(tmp_path / "a_raw" / "a.tfrecord"), str(tmp_path / "b_raw" / "b.tfrecord"),
            str(tmp_path / "b_raw" / "c.tfrecord")]
    assert [f.path for f in paths.list_inputs(str(tmp_path / "*raw" / "*.tfrecord"))] == want
    monkeypatch.chdir(tmp_path)
    assert [f.path for f in paths.list_inputs("*raw/*.tfrecord")] == ["a_raw/a.tfrecord", "b_raw/b.tfrecord",
                                                                       "b_raw/c.tfrecord"]
