"""Staging gs:// data to local disk, against the local GCS emulator."""

import os

import pytest

import loader
from pipelines import ConvertConfig, run_conversion
from tests.conftest import synthetic_records, write_tfrecord_shards

pytestmark = pytest.mark.gcs


def test_stage_copies_verifies_and_resumes(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, n) for i, n in enumerate([30, 45, 12])])
    remote = f"gs://{bucket}/ds"
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=remote), ["--direct_num_workers=1"])
    local = tmp_path / "staged"

    first = loader.stage(remote, str(local))
    assert (first.copied, first.skipped) == (3, 0)
    assert sorted(os.listdir(local)) == [".staged.json", "manifest.json", "report.json"] + [
        f"train-{i:05d}-of-00003.array_record" for i in range(3)]
    kw = dict(batch_size=6, seed=4, num_epochs=1, decode=None)
    assert list(loader.load(str(local), **kw)) == list(loader.load(remote, **kw))

    # Interrupted or damaged copies: only those are copied again.
    os.remove(local / "train-00001-of-00003.array_record")
    with open(local / "train-00002-of-00003.array_record", "r+b") as f:
        f.truncate(100)
    again = loader.stage(remote, str(local))
    assert (again.copied, again.skipped) == (2, 1)
    assert list(loader.load(str(local), **kw)) == list(loader.load(remote, **kw))


def test_stage_refuses_a_bucket_whose_shards_disagree_with_the_manifest(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 10)])
    remote = f"gs://{bucket}/ds"
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=remote), ["--direct_num_workers=1"])
    client.bucket(bucket).blob("ds/train-00000-of-00001.array_record").upload_from_string(b"short")
    with pytest.raises(ValueError, match="train-00000-of-00001.array_record is 5 bytes but the manifest says"):
        loader.stage(remote, str(tmp_path / "staged"))
    with pytest.raises(FileNotFoundError, match="is empty or does not exist"):
        loader.stage(f"gs://{bucket}/nothing", str(tmp_path / "staged"))
    with pytest.raises(FileNotFoundError, match=rf"tfds build\); did you mean gs://{bucket}/ds\?$"):
        loader.stage(f"gs://{bucket}/dss", str(tmp_path / "staged"))  # misspelt: the bucket's entries are listed


def _rows(directory) -> list[bytes]:
    return [bytes(r) for b in loader.load(str(directory), batch_size=5, shuffle=False, num_epochs=1, decode=None)
            for r in b]


def test_a_dataset_converted_again_in_place_is_staged_again_where_it_changed(tmp_path, gcs_bucket, monkeypatch):
    """Shards are padded to 64 KiB blocks: converted again from other records of the same lengths, each keeps its
    size, and staging compared sizes only, so it kept every stale shard beside the new manifest (and verify passed).
    Now each copy's source version (the object's generation) is recorded, and a changed one is copied again."""
    from dataset_format import staged
    from loader.fetch import staging
    from pipelines.verify import verify

    bucket, _ = gcs_bucket
    remote, local = f"gs://{bucket}/ds", tmp_path / "staged"
    write_tfrecord_shards(tmp_path / "a", [synthetic_records(i, 20) for i in range(3)])
    run_conversion(ConvertConfig(input=str(tmp_path / "a" / "*"), output=remote), ["--direct_num_workers=1"])
    assert loader.stage(remote, str(local)).copied == 3
    before = {n: os.path.getsize(local / n) for n in os.listdir(local) if n.endswith(".array_record")}

    # the same shard names and record lengths, other bytes: shards 1 and 2 change, shard 0 is kept
    write_tfrecord_shards(tmp_path / "b", [[r.replace(b"x", b"y") for r in synthetic_records(i, 20)] for i in range(3)])
    for name in sorted(os.listdir(tmp_path / "b"))[1:]:
        os.replace(tmp_path / "b" / name, tmp_path / "a" / name)
    run_conversion(ConvertConfig(input=str(tmp_path / "a" / "*"), output=remote), ["--direct_num_workers=1"])
    assert {n: os.path.getsize(local / n) for n in before} == before  # (what made sizes blind to it)
    assert verify(str(local)).restage == ["train-00001-of-00003.array_record", "train-00002-of-00003.array_record"]

    again = loader.stage(remote, str(local))
    assert (again.copied, again.skipped) == (2, 1)
    assert _rows(local) == _rows(remote) and b"1:0:".ljust(100, b"y") in _rows(local)
    assert verify(str(local)).restage == []
    assert staged.read(str(local))[0] == remote

    # a re-stage that fails part way leaves no manifest: the copy is refused, not read half old, half new
    real = staging._copy

    def failing(remote_path, local_dir, name, size, version):
        if name.endswith("00002-of-00003.array_record"):
            raise OSError("the connection was reset")
        return real(remote_path, local_dir, name, size, version)

    os.remove(local / "train-00001-of-00003.array_record")
    os.remove(local / "train-00002-of-00003.array_record")
    monkeypatch.setattr(staging, "_copy", failing)
    with pytest.raises(OSError, match="the connection was reset"):
        loader.stage(remote, str(local))
    assert not (local / "manifest.json").exists()
    monkeypatch.setattr(staging, "_copy", real)
    resumed = loader.stage(remote, str(local))
    assert (resumed.copied, resumed.skipped) == (1, 2)  # the shard copied before the failure was recorded
    assert _rows(local) == _rows(remote)


def test_a_damaged_shard_of_a_staged_copy_says_to_stage_it_again(tmp_path, gcs_bucket):
    bucket, _ = gcs_bucket
    remote, local = f"gs://{bucket}/ds", tmp_path / "staged"
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 200)])
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=remote), ["--direct_num_workers=1"])
    loader.stage(remote, str(local))
    shard = local / "train-00000-of-00001.array_record"
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0xFF  # a record's chunk: the size is unchanged, so a re-stage alone would keep it
    shard.write_bytes(bytes(data))
    with pytest.raises(OSError) as e:
        _rows(local)
    assert str(e.value).endswith(
        f"the shard is corrupt: delete {shard} and run `python -m loader stage {remote} {local}` again, which copies "
        f"it again (the directory is a staged copy of {remote}; if the original is damaged too, delete it there and "
        "re-run the conversion) (python -m pipelines verify --deep finds such shards)"), str(e.value)
    shard.unlink()
    assert loader.stage(remote, str(local)).copied == 1
    assert len(_rows(local)) == 200


def test_a_shard_rewritten_while_staging_is_an_error_not_a_copy_of_two_versions(tmp_path, gcs_bucket, monkeypatch):
    """The copy took each object as it was at its download, and `.staged.json` the generation listed before: a
    dataset converted again in place during staging made a local copy of two versions, loaded without a word."""
    from dataset_format import staged

    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, n) for i, n in enumerate([30, 45])])
    remote = f"gs://{bucket}/ds"
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=remote), ["--direct_num_workers=1"])
    listed = staged.versions

    def listed_then_rewritten(directory):
        found = listed(directory)
        blob = client.bucket(bucket).blob("ds/train-00001-of-00002.array_record")
        blob.upload_from_string(blob.download_as_bytes())  # (a new generation, of the same size)
        return found

    monkeypatch.setattr(staged, "versions", listed_then_rewritten)
    local = tmp_path / "staged"
    with pytest.raises(OSError, match=rf"^{remote}/train-00001-of-00002.array_record was rewritten while it was being "
                                      r"staged \(generation \d+ when listed\): the dataset is changing; stage again "
                                      r"once its writer is done \(it copies only what changed\)$"):
        loader.stage(remote, str(local))
    assert not (local / "manifest.json").exists()  # not a complete copy: the loader refuses it
    assert not (local / "train-00001-of-00002.array_record").exists()
    monkeypatch.setattr(staged, "versions", listed)
    again = loader.stage(remote, str(local))
    assert again.copied + again.skipped == 2 and again.copied >= 1  # (shard 0 may or may not be recorded as staged)
    kw = dict(batch_size=5, seed=1, num_epochs=1, decode=None)
    assert list(loader.load(str(local), **kw)) == list(loader.load(remote, **kw))


def test_a_pretokenized_corpus_staged_again_copies_none_of_its_token_counts(tmp_path, gcs_bucket, pretokenized,
                                                                            monkeypatch):
    """Each shard's .counts file was copied as metadata: at every stage, all of them again, one at a time (10,000
    requests in a row for a corpus of 10,000 shards staged already). They go with their shards now."""
    from dataset_format import storage

    bucket, client = gcs_bucket
    names = sorted(n for n in os.listdir(pretokenized["web"]) if not n.startswith("."))
    for name in names:
        client.bucket(bucket).blob(f"web/{name}").upload_from_filename(os.path.join(pretokenized["web"], name))
    remote, local = f"gs://{bucket}/web", str(tmp_path / "staged")
    counts = [n for n in names if n.endswith(".counts")]
    assert len(counts) == 2
    first = loader.stage(remote, local)
    assert (first.copied, first.skipped) == (4, 0)  # 2 shards and their counts
    downloads, download = [], storage.download
    monkeypatch.setattr(storage, "download", lambda path, *a, **k: downloads.append(storage.basename(path)) or
                        download(path, *a, **k))
    again = loader.stage(remote, local)
    assert (again.copied, again.skipped) == (0, 4)
    assert sorted(downloads) == [n for n in names if ".array_record" not in n]  # the metadata alone
    kw = dict(batch_size=2, seed=1, packing=loader.Packing(seq_len=16))
    staged_it, remote_it = iter(loader.load(local, **kw)), iter(loader.load(remote, **kw))
    for _ in range(3):
        assert next(staged_it)["tokens"].tolist() == next(remote_it)["tokens"].tolist()
    staged_it.close()
    remote_it.close()


@pytest.fixture
def local_dataset(tmp_path):
    """A converted local dataset of 12 small shards (sources local: no emulator needed)."""
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 5) for i in range(12)])
    out = tmp_path / "ds"
    assert run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(out)),
                          ["--direct_num_workers=1"]).ok
    return out


def test_a_stage_onto_its_source_or_inside_it_is_refused_and_the_source_is_kept(local_dataset, monkeypatch):
    """`stage SRC SRC` removed the source's manifest.json (a re-stage removes the copy's metadata first): the dataset
    could no longer be loaded."""
    before = sorted(os.listdir(local_dataset))
    monkeypatch.chdir(local_dataset.parent)
    for copy in (str(local_dataset), f"{local_dataset}/", "./ds", "ds/."):
        with pytest.raises(ValueError, match=r"local_dir .* is the source itself \(.*ds\): name another directory, "
                                             r"e\.g\. .*ds-staged$"):
            loader.stage(str(local_dataset), copy)
    with pytest.raises(ValueError, match=r"local_dir ds/copy is inside the source"):
        loader.stage("ds", "ds/copy")
    with pytest.raises(ValueError, match=r"parallelism=0: files copied at once must be >= 1"):
        loader.stage("ds", "elsewhere", parallelism=0)
    assert sorted(os.listdir(local_dataset)) == before and not os.path.exists("elsewhere")


def test_a_source_spelt_otherwise_resumes_the_same_copy(local_dataset, tmp_path, monkeypatch):
    """The staged record compared the source as typed: `ds/`, `./ds` or a link to it after `ds` copied every shard
    again."""
    monkeypatch.chdir(tmp_path)
    assert loader.stage(str(local_dataset), "copy").copied == 12
    os.symlink(local_dataset, tmp_path / "link")
    for spelling in ("ds/", "./ds", str(local_dataset) + "/", "link"):
        again = loader.stage(spelling, "copy")
        assert (again.copied, again.skipped) == (0, 12), spelling


def test_an_interrupted_stage_stops_after_the_copies_under_way_and_records_them(local_dataset, tmp_path,
                                                                                  monkeypatch):
    """A Ctrl-C waited for every queued copy, then recorded only the copies the loop had seen: the next stage copied
    them again."""
    import threading

    from dataset_format import storage
    from loader.fetch import staging

    download, started = storage.download, []

    def slow(remote, local, **kw):
        started.append(remote)
        if len(started) == 3:  # the third copy: as a Ctrl-C would, while two copies are under way
            raise KeyboardInterrupt
        threading.Event().wait(0.2)
        return download(remote, local, **kw)

    monkeypatch.setattr(storage, "download", slow)
    with pytest.raises(KeyboardInterrupt):
        staging.stage(str(local_dataset), str(tmp_path / "copy"), parallelism=2)
    assert len(started) <= 6  # the queued copies (12 in all) were dropped (those the 2 threads took meanwhile ran)
    monkeypatch.setattr(storage, "download", download)
    again = loader.stage(str(local_dataset), str(tmp_path / "copy"))
    assert again.copied + again.skipped == 12 and again.skipped == len(started) - 1 >= 2
