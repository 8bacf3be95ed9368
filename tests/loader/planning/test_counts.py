"""Token counts of a pre-tokenized corpus on gs://: copied once to the loader's index directory and memory-mapped,
not read into each process's memory (4 bytes a document: 4 GB a process at 1e9 documents)."""

import os

import numpy as np
import pytest

import loader
from dataset_format import storage
from loader.planning.counts import TokenCounts


@pytest.fixture
def remote_web(gcs_bucket, pretokenized):
    """The pretokenized "web" corpus uploaded to a fresh bucket: (its gs:// directory, the bucket's client side)."""
    bucket, client = gcs_bucket
    for name in sorted(os.listdir(pretokenized["web"])):
        if not name.startswith("."):
            client.bucket(bucket).blob(f"web/{name}").upload_from_filename(os.path.join(pretokenized["web"], name))
    return f"gs://{bucket}/web", client.bucket(bucket)


def test_gs_token_counts_are_mapped_from_one_local_copy_made_once(remote_web, pretokenized, tmp_path, monkeypatch):
    """The counts files are downloaded to the directory once (a second load copies nothing), memory-mapped there, and
    give the local corpus's counts; one written again (a new generation) is copied again, alone."""
    remote, bucket = remote_web
    copies = tmp_path / "index"
    downloads, download = [], storage.download
    monkeypatch.setattr(storage, "download", lambda path, *a, **k: downloads.append(storage.basename(path)) or
                        download(path, *a, **k))
    source, local = loader.resolve(remote), loader.resolve(pretokenized["web"])
    monkeypatch.setattr(storage, "read_bytes", lambda path: pytest.fail(f"{path} read into memory"))
    counts = TokenCounts.of_source(source, directory=str(copies))
    want = TokenCounts.of_source(local)(np.arange(len(local)))
    assert len(want) == 40 and want.sum() > 40
    np.testing.assert_array_equal(counts(np.arange(40)), want)
    assert all(isinstance(c, np.memmap) for c in counts._columns)
    names = sorted(storage.basename(p) + ".counts" for p in source.paths)
    assert sorted(downloads) == names and len(os.listdir(copies)) == 2
    assert TokenCounts.of_source(source, directory=str(copies)).identity == counts.identity
    assert len(downloads) == 2  # (the second copies nothing)

    first = bucket.blob(f"web/{names[0]}")
    changed = np.frombuffer(first.download_as_bytes(), "<u4").copy()
    changed[0] += 1
    first.upload_from_string(changed.tobytes())
    again = TokenCounts.of_source(source, directory=str(copies))
    assert downloads[2:] == [names[0]]
    assert again(np.arange(1))[0] == want[0] + 1


def test_a_gs_token_counts_file_of_the_wrong_size_is_named_before_it_is_copied(remote_web, tmp_path):
    remote, bucket = remote_web
    source = loader.resolve(remote)
    name = storage.basename(source.paths[1]) + ".counts"
    bucket.blob(f"web/{name}").upload_from_string(b"\0" * 8)
    with pytest.raises(ValueError, match=rf"^{remote}/{name} is 8 bytes but its shard has 15 records \(60 bytes of "
                                         r"counts\); the file is damaged or from another conversion"):
        TokenCounts.of_source(source, directory=str(tmp_path / "index"))
    assert not (tmp_path / "index").exists()
    bucket.blob(f"web/{name}").delete()
    with pytest.raises(FileNotFoundError, match=rf"^{remote}/{name} is missing: a pre-tokenized shard's token counts"):
        TokenCounts.of_source(source, directory=str(tmp_path / "index"))
