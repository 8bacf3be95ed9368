"""Files on local disk or gs://: listing, reading, writing whole files, committing shards.

Local paths use `os` directly; remote ones (gs://, any scheme Beam knows) go through Beam's
FileSystems, imported only when a remote path is used, so the loader can import this module
without paying for Beam. Beam's GCS client honours STORAGE_EMULATOR_HOST, which the tests use.

A shard or manifest never appears half-written under its final name: local files are
written beside it under a temporary name and renamed (atomic on POSIX); remote files
are uploaded under a temporary name and renamed (a GCS object appears whole or not at all).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import uuid

_COPY_CHUNK = 16 << 20
_READ_BUFFER = 1 << 20


def _filesystems():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def _uncompressed():
    from apache_beam.io.filesystem import CompressionTypes

    return CompressionTypes.UNCOMPRESSED


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_remote(path) else os.path.basename(path.rstrip("/"))


def join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name if is_remote(directory) else os.path.join(directory, name)


def exists(path: str) -> bool:
    return _filesystems().exists(path) if is_remote(path) else os.path.exists(path)


def list_sizes(directory: str) -> dict[str, int]:
    """Base name -> size of the files directly under `directory`; {} if it does not exist."""
    if not is_remote(directory):
        try:
            return {e.name: e.stat().st_size for e in os.scandir(directory) if e.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return {}
    try:
        metas = _filesystems().match([join(directory, "*")])[0].metadata_list
    except Exception:  # noqa: BLE001 - Beam raises BeamIOError for an empty prefix: nothing there
        return {}
    return {basename(m.path): m.size_in_bytes for m in metas if not m.path.endswith("/")}


def temp_name(final_path: str) -> str:
    """A sibling of `final_path` that readers ignore (dot-prefixed, unique)."""
    directory, name = final_path.rsplit("/", 1) if "/" in final_path else ("", final_path)
    tmp = f".tmp-{uuid.uuid4().hex[:12]}-{name}"
    return f"{directory}/{tmp}" if directory else tmp


def open_source(path: str):
    """Opens a (possibly gzip-compressed, possibly remote) file for streaming reads."""
    from apache_beam.io.filesystem import CompressionTypes

    compression = CompressionTypes.detect_compression_type(path)
    if not is_remote(path) and compression == CompressionTypes.UNCOMPRESSED:
        return open(path, "rb", buffering=_READ_BUFFER)
    return _filesystems().open(path, compression_type=compression)


def read_bytes(path: str) -> bytes | None:
    """The file's contents, or None if it does not exist."""
    if not is_remote(path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    if not exists(path):
        return None
    with _filesystems().open(path, compression_type=_uncompressed()) as f:
        return f.read()


def read_text(path: str) -> str | None:
    data = read_bytes(path)
    return None if data is None else data.decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` to `path` atomically (temporary name, then rename)."""
    tmp = temp_name(path)
    if not is_remote(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return
    f = _filesystems().create(tmp, mime_type="application/octet-stream", compression_type=_uncompressed())
    f.write(data)
    f.close()
    _filesystems().rename([tmp], [path])


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def upload(local_path: str, remote_path: str) -> None:
    """Copies a finished local file to `remote_path` so that it appears whole or not at all."""
    tmp = temp_name(remote_path)
    out = _filesystems().create(tmp, mime_type="application/octet-stream", compression_type=_uncompressed())
    try:
        with open(local_path, "rb") as src:
            shutil.copyfileobj(src, out, _COPY_CHUNK)
        out.close()
    except BaseException:
        delete_quietly(tmp)
        raise
    _filesystems().rename([tmp], [remote_path])


def delete(path: str) -> None:
    if is_remote(path):
        _filesystems().delete([path])
    else:
        os.remove(path)


def delete_quietly(path: str) -> None:
    try:
        delete(path)
    except Exception:  # noqa: BLE001 - best-effort clean-up of a temporary file; the real error is raised by the caller
        pass


def check_writable(directory: str) -> None:
    """Creates `directory` if needed and proves it writable with a probe file, else raises."""
    probe = join(directory, f".write-probe-{uuid.uuid4().hex[:8]}")
    try:
        if not is_remote(directory):
            os.makedirs(directory, exist_ok=True)
        write_text(probe, "probe")
        delete(probe)
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        raise PermissionError(f"output directory {directory!r} is not writable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); choose another --output or fix "
                              "its permissions") from e
