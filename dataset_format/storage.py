"""Files on local disk or gs://, for the converter and the loader alike: list, read, write, upload, download.

Local paths use `os`. gs:// goes through google-cloud-storage (no Beam: a training host reads Cloud Storage
without installing it). The client honours STORAGE_EMULATOR_HOST, which the tests use.

Every Cloud Storage call retries what is transient (429, 408, 5xx, dropped connections) with exponential
backoff (0.25 s doubling to 16 s, for up to `RETRY_SECONDS`), logging each retry. What is not transient
becomes one line naming the bucket and the object: a 403 a `PermissionError`, a missing bucket a
`FileNotFoundError`; a missing object is `None` from `read_bytes` and `False` from `exists`.

Nothing appears half-written under its final name: a local file is written under a temporary name beside
it and renamed (atomic on POSIX); a Cloud Storage upload creates the object whole or not at all.

    sizes = list_sizes("gs://bucket/digits/train")       # {"manifest.json": 1234, "digits....": 56789}
    manifest = read_text("gs://bucket/digits/train/manifest.json")
    download("gs://bucket/digits/train/x.array_record-00000-of-00001", "/mnt/data/x...")
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator, Sized

log = logging.getLogger(__name__)

GCS = "gs://"
RETRY_SECONDS = 120.0
PARALLEL_REQUESTS = 32  # concurrent Cloud Storage requests one process makes (its connection pool holds as many)
_READ_BUFFER = 1 << 20
_GLOB_CHARS = re.compile(r"[*?\[]")
# Set when the interpreter starts to exit: the loader's ranged reads (loader/fetch/remote.py) waiting to retry give up
# at once instead of holding the exit for up to RETRY_SECONDS; a loader closed with reads in flight exits promptly.
_EXITING = threading.Event()


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def absolute(path: str) -> str:
    """A local path made absolute (against the working directory); a remote one as it is."""
    return path if is_remote(path) else os.path.abspath(path)


def resolved(path: str) -> str:
    """A local path as one name whatever way it is reached: absolute, its directories' symbolic links resolved (a
    rerun through a link to the same files finds them recorded). A file's own name is kept (a link may name a file
    better than its target does); a directory, or a glob's directory part, is resolved whole. Remote: as it is."""
    if is_remote(path):
        return path
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return os.path.realpath(path)
    head, tail = os.path.split(path)
    return os.path.join(os.path.realpath(head), tail)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path.rstrip("/"))


def join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name if is_remote(directory) else os.path.join(directory, name)


def makedirs(directory: str) -> None:
    """Creates a local directory and its parents (gs:// has no directories: nothing to do)."""
    if not is_remote(directory):
        os.makedirs(directory, exist_ok=True)


def has_glob(path: str) -> bool:
    return bool(_GLOB_CHARS.search(path))


def split_gcs(path: str) -> tuple[str, str]:
    """`gs://bucket/a/b` -> ("bucket", "a/b"); raises naming the path for anything else remote."""
    if not path.startswith(GCS):
        raise ValueError(f"{path!r}: only local paths and gs:// are supported; copy the data to Cloud Storage or "
                         "local disk")
    bucket, _, name = path[len(GCS):].partition("/")
    if not bucket:
        raise ValueError(f"{path!r} names no bucket; write gs://BUCKET/PATH")
    if not 3 <= len(bucket) <= 222 or not _BUCKET.match(bucket):
        raise ValueError(f"{path!r}: {bucket!r} is not a Cloud Storage bucket name (3-63 lower-case letters, digits, "
                         "'-', '_' and '.', beginning and ending with a letter or digit); check the path")
    return bucket, name


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")


# ---------------------------------------------------------------- Cloud Storage: client, retries, errors


def _client():
    return _client_for(os.getpid(), os.environ.get("STORAGE_EMULATOR_HOST"))


@functools.cache
def _client_for(pid: int, emulator: str | None):  # one per process (forked workers) and endpoint
    import requests
    from google.auth import exceptions as auth_errors
    from google.cloud import storage as gcs

    try:
        client = gcs.Client()
    except auth_errors.DefaultCredentialsError:
        raise PermissionError("gs:// paths need Google Cloud credentials, and none were found: run `gcloud auth "
                              "application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service "
                              "account's key file (on a Google Cloud VM, its service account is used)") from None
    # Runs when the interpreter exits, before it joins the thread pools that may be waiting to retry (the hooks run
    # newest first: concurrent.futures registers its join when its thread module is first imported, so import it
    # before registering this, whatever imported it so far).
    import concurrent.futures.thread  # noqa: F401

    threading._register_atexit(_EXITING.set)
    # requests keeps 10 connections a host by default: more threads than that open and drop a connection a request
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=PARALLEL_REQUESTS)
    client._http.mount("https://", adapter)
    client._http.mount("http://", adapter)
    return client


def _retry():
    """A Retry for one call (its errors are said once a kind; the later ones of that call at debug level)."""
    from google.api_core.retry import Retry
    from google.cloud.storage.retry import _should_retry  # 408, 429, 5xx, connection resets and timeouts

    said: set[str] = set()

    def on_error(exc: Exception) -> None:
        kind = type(exc).__name__
        log.log(logging.DEBUG if kind in said else logging.WARNING, "Cloud Storage: %s; retrying for up to %.0f s "
                "(not said again for this request)", str(exc).splitlines()[0] if str(exc) else kind, RETRY_SECONDS)
        said.add(kind)

    return Retry(predicate=_should_retry, initial=0.25, maximum=16.0, multiplier=2.0, timeout=RETRY_SECONDS,
                 on_error=on_error)


@contextlib.contextmanager
def _gcs_errors(path: str) -> Iterator[None]:
    """Turns a 403, or a 404 of the bucket, into one line naming the bucket and the object."""
    from google.api_core import exceptions
    from google.auth import exceptions as auth_errors

    try:
        yield
    except exceptions.RetryError as e:  # transient errors until RETRY_SECONDS ran out (each logged as it came)
        cause = str(e.cause).splitlines()[0][:300] if e.cause is not None else str(e)
        raise OSError(f"{path}: Cloud Storage did not answer within {RETRY_SECONDS:.0f} s (the last error: {cause}); "
                      "check this host's network and the path") from None
    except auth_errors.TransportError as e:  # the token's endpoint unreachable (no network, no DNS)
        raise OSError(f"{path}: cannot get a Google Cloud access token ({str(e).splitlines()[0][:300]}); check this "
                      "host's network") from None
    except auth_errors.RefreshError as e:  # a key revoked or malformed
        raise PermissionError(f"{path}: Google Cloud refused this host's credentials ({str(e).splitlines()[0][:300]})"
                              "; renew them (gcloud auth application-default login) or check "
                              "GOOGLE_APPLICATION_CREDENTIALS") from None
    except exceptions.Forbidden as e:
        bucket, name = split_gcs(path)
        raise PermissionError(f"{path}: permission denied (403) on bucket {bucket!r}, object {name!r}; grant this "
                              "account access to the bucket (roles/storage.objectViewer to read, objectAdmin to "
                              "write) or check the path") from e
    except exceptions.NotFound as e:
        bucket, name = split_gcs(path)
        if not _client().bucket(bucket).exists(retry=_retry()):
            raise FileNotFoundError(f"{path}: bucket {bucket!r} does not exist (404); check the bucket name, or "
                                    f"create it (gcloud storage buckets create gs://{bucket})") from e
        raise FileNotFoundError(f"{path}: no such object {name!r} in bucket {bucket!r} (404)") from e


def _blob(path: str):
    bucket, name = split_gcs(path)
    return _client().bucket(bucket).blob(name)


def _list(prefix_path: str, *, delimiter: str | None, max_results: int | None = None) -> Iterator:
    bucket, prefix = split_gcs(prefix_path)
    with _gcs_errors(prefix_path):
        yield from _client().list_blobs(bucket, prefix=prefix, delimiter=delimiter, max_results=max_results,
                                        retry=_retry())


def entries(directory: str, limit: int = 10_000) -> list[str]:
    """The base names of the files and directories directly under `directory` (gs://: objects and prefixes; at most
    `limit`), for a suggestion; [] when it cannot be listed."""
    if not is_remote(directory):
        try:
            return os.listdir(directory or ".")[:limit]
        except OSError:
            return []
    bucket, prefix = split_gcs(directory.rstrip("/") + "/")
    prefix = "" if prefix == "/" else prefix
    try:
        pages = _client().list_blobs(bucket, prefix=prefix, delimiter="/", max_results=limit, retry=_retry())
        names = [b.name[len(prefix):] for b in pages]
        return names + [p[len(prefix):].rstrip("/") for p in pages.prefixes]
    except Exception:  # noqa: BLE001 - no suggestion, rather than another error in the way of the first
        return []


def _objects_in(directory: str) -> Iterator[tuple]:
    """(base name, blob) of the gs:// objects directly under `directory`, from one listing."""
    for b in _list(directory.rstrip("/") + "/", delimiter="/"):
        if not b.name.endswith("/"):
            yield basename(GCS + b.bucket.name + "/" + b.name), b


# ---------------------------------------------------------------- the operations


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    with _gcs_errors(path):
        return _blob(path).exists(retry=_retry())


def names_something(path: str) -> bool:
    """A file, or a directory (on gs://: a prefix) that holds anything; one lookup, then at most one listing of one
    object."""
    if not is_remote(path):
        return os.path.exists(path)
    if split_gcs(path)[1].strip("/") and exists(path.rstrip("/")):  # (a bucket's root is no object)
        return True
    return next(iter(_list(path.rstrip("/") + "/", delimiter=None, max_results=1)), None) is not None


def list_sizes(directory: str) -> dict[str, int]:
    """Base name -> size of the files directly under `directory`; {} if it does not exist (raises if its bucket
    does not)."""
    if not is_remote(directory):
        try:
            return {e.name: e.stat().st_size for e in os.scandir(directory) if e.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return {}
    return {name: b.size for name, b in _objects_in(directory)}


def list_details(directory: str) -> dict[str, tuple[int, float]]:
    """Base name -> (size, modification time in seconds) of the files directly under `directory`; {} if none."""
    if not is_remote(directory):
        try:
            return {e.name: (st.st_size, st.st_mtime) for e in os.scandir(directory) if e.is_file()
                    for st in [e.stat()]}
        except (FileNotFoundError, NotADirectoryError):
            return {}
    return {name: (b.size, b.updated.timestamp()) for name, b in _objects_in(directory)}


def list_generations(directory: str) -> dict[str, tuple[int, int]]:
    """Base name -> (size, generation) of the gs:// objects directly under `directory`, in one listing. An object's
    generation changes with every write of it, whatever its size and times: what a cache of its contents is keyed by."""
    return {name: (b.size, int(b.generation or 0)) for name, b in _objects_in(directory)}


def generations_of(paths: list[str]) -> dict[str, tuple[int, int]]:
    """Path -> (size, generation) of the gs:// objects among `paths` that exist, in one listing of each directory
    they are in (a page a 1,000 objects)."""
    found: dict[str, tuple[int, int]] = {}
    for directory in sorted({p.rsplit("/", 1)[0] for p in paths}):
        found.update({f"{directory}/{name}": d for name, d in list_generations(directory).items()})
    return found


def list_metadata(directory: str) -> dict[str, dict[str, str]]:
    """Base name -> custom metadata of the gs:// objects directly under `directory`, in one listing (a page per
    1,000 objects); {} for a local directory."""
    if not is_remote(directory):
        return {}
    return {name: b.metadata or {} for name, b in _objects_in(directory)}


def glob(pattern: str) -> list[str]:
    """Files matching `pattern`, sorted. On gs://, `*` and `?` stay within one path segment and `**` crosses
    them (as Beam and gsutil read globs); the listing starts at the literal prefix before the first wildcard."""
    if not is_remote(pattern):
        import glob as globlib

        return sorted(globlib.glob(os.path.expanduser(pattern)))
    bucket, name = split_gcs(pattern)
    if not has_glob(name):
        return [pattern] if exists(pattern) else []
    prefix = name[: _GLOB_CHARS.search(name).start()]
    regex = re.compile(translate(name))
    return sorted(f"{GCS}{bucket}/{b.name}" for b in _list(f"{GCS}{bucket}/{prefix}", delimiter=None)
                  if regex.fullmatch(b.name) and not b.name.endswith("/"))


def translate(pattern: str) -> str:
    """A regular expression of the paths `pattern` matches: `*` and `?` within a path segment, `**` across them."""
    out = []
    for part in re.split(r"(\*\*|\*|\?)", pattern):
        out.append({"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part) or fnmatch.translate(part)[4:-3])
    return "".join(out)


def temp_name(final_path: str) -> str:
    """A sibling of `final_path` that readers ignore (dot-prefixed, unique)."""
    directory, name = final_path.rsplit("/", 1) if "/" in final_path else ("", final_path)
    tmp = f".tmp-{uuid.uuid4().hex[:12]}-{name}"
    return f"{directory}/{tmp}" if directory else tmp


def read_bytes(path: str) -> bytes | None:
    """The file's contents, or None if it does not exist."""
    if not is_remote(path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    try:
        with _gcs_errors(path):
            return _blob(path).download_as_bytes(retry=_retry())
    except FileNotFoundError as e:
        if "no such object" in str(e):
            return None
        raise


def read_range(path: str, start: int, end: int, *, exact: bool = True, generation: int | None = None) -> bytes:
    """Bytes [start, end) of a file (gs://: one ranged request). `exact`: fewer bytes (the file ends sooner) raise
    OSError; otherwise they are returned. `generation`: a gs:// object's, as listed (another is ObjectChanged)."""
    if end <= start:
        return b""
    if not is_remote(path):
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    else:
        from google.api_core.exceptions import RequestRangeNotSatisfiable

        try:
            with _gcs_errors(path), _at_generation(path, generation) as blob:
                data = blob.download_as_bytes(start=start, end=end - 1, checksum=None, retry=_retry())
        except RequestRangeNotSatisfiable:  # 416: the object ends before `start` (an empty one, for any range)
            data = b""
    if exact:
        check_length(path, start, end, data)
    return data


class ObjectChanged(OSError):
    """A gs:// object rewritten while a job read it: its generation is not the one listed (and its index, caches and
    the records read so far are the listed one's). Not transient: reading on would mix two versions."""

    def __init__(self, path: str, listed: int, now: int | None):
        self.path, self.listed, self.now = path, listed, now
        found = (f"rewritten while this job read it (generation {listed} when listed, it is generation {now} now)"
                 if now else f"rewritten or deleted while this job read it (generation {listed} when listed is gone)")
        super().__init__(f"{path}: the object was {found}; the records read so far are of the listed version: "
                         "restart the job to read the new one (write a new version of a dataset to a new directory to "
                         "let running jobs finish on the old)")

    def __reduce__(self):  # (it crosses processes: the loader's workers, Ray's actors)
        return type(self), (self.path, self.listed, self.now)


@contextlib.contextmanager
def _at_generation(path: str, generation: int | None) -> Iterator:
    """The blob of gs:// `path` at `generation` (None or 0: as it is now) for one download; ObjectChanged when that
    generation is gone (rewritten or deleted since it was listed) or the answer names another."""
    from google.api_core.exceptions import NotFound

    blob = _blob(path)
    if generation:
        blob = blob.bucket.blob(blob.name, generation=generation)
    try:
        yield blob
    except NotFound:
        if generation:
            raise ObjectChanged(path, generation, None) from None
        raise
    if generation and blob.generation and int(blob.generation) != generation:
        raise ObjectChanged(path, generation, int(blob.generation))


def check_length(path: str, start: int, end: int, data: Sized) -> None:
    """Raises OSError unless `data` is all of bytes [start, end) of `path` (fewer: the file ends sooner)."""
    if len(data) != end - start:
        raise OSError(f"{path}: read {len(data)} bytes at {start}, expected {end - start}; the file is shorter than "
                      "its index says (truncated or replaced): re-run the conversion or restage the data")


def media_url(path: str) -> str:
    """The URL that downloads a gs:// object's bytes (a GET, with a Range for part of them)."""
    return _media_url(path, os.getpid())


def credentials():
    """The credentials this process's Cloud Storage client uses (for requests made without it)."""
    return _client()._credentials


def exiting() -> bool:
    """Whether the interpreter has started to exit (a wait to retry should end)."""
    return _EXITING.is_set()


@functools.lru_cache(maxsize=4096)
def _media_url(path: str, pid: int) -> str:
    return _blob(path)._get_download_url(_client())


def read_text(path: str) -> str | None:
    data = read_bytes(path)
    return None if data is None else data.decode("utf-8")


def open_read(path: str, chunk_size: int = _READ_BUFFER):
    """A binary file object for streaming reads (buffered; on gs:// ranged reads of `chunk_size` bytes)."""
    if not is_remote(path):
        return open(path, "rb", buffering=_READ_BUFFER)
    with _gcs_errors(path):
        return _blob(path).open("rb", chunk_size=chunk_size, retry=_retry())


def write_bytes(path: str, data: bytes, *, metadata: dict[str, str] | None = None) -> None:
    """Writes `data` to `path` so that it appears whole or not at all. `metadata`: a gs:// object's custom
    metadata (which listings return, see list_metadata; at most 8 KiB); local files have none."""
    if not is_remote(path):
        tmp = temp_name(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return
    with _gcs_errors(path):
        blob = _blob(path)
        blob.metadata = metadata
        blob.upload_from_string(data, content_type="application/octet-stream", retry=_retry())


def write_text(path: str, text: str, *, metadata: dict[str, str] | None = None) -> None:
    write_bytes(path, text.encode("utf-8"), metadata=metadata)


def create(path: str, data: bytes) -> bool:
    """Writes `path` only if nothing is there, whole or not at all: a local file written aside and hard-linked to
    its name (which fails when the name exists; where the filesystem has no hard links, opened with O_EXCL and then
    written), a gs:// object uploaded with `if_generation_match=0`. False when something already is."""
    if not is_remote(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = temp_name(path)
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some FUSE mounts): a reader may see the file before its bytes
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        finally:
            os.unlink(tmp)
    if exists(path):  # real Cloud Storage also refuses the upload below (412); the GCS emulator does not
        return False
    return write_versioned(path, data, generation=0) is not None


def read_versioned(path: str) -> tuple[bytes | None, int | None]:
    """(contents or None, the gs:// object's generation, 0 when absent; None for local files)."""
    if not is_remote(path):
        return read_bytes(path), None
    blob = _blob(path)
    with _gcs_errors(path):
        if not blob.exists(retry=_retry()):
            return None, 0
        data = blob.download_as_bytes(retry=_retry())
    return data, blob.generation


def write_versioned(path: str, data: bytes, *, generation: int | None) -> int | None:
    """Writes `path` if it is still at `generation` (gs://; 0: absent; None: unconditionally) and returns the new
    generation, or None when another writer got there first. Local files are replaced unconditionally."""
    if not is_remote(path):
        write_bytes(path, data)
        return None
    from google.api_core import exceptions

    blob = _blob(path)
    try:
        with _gcs_errors(path):
            blob.upload_from_string(data, content_type="application/octet-stream", if_generation_match=generation,
                                    retry=_retry())
    except exceptions.PreconditionFailed:
        return None
    return blob.generation


def upload(local_path: str, remote_path: str) -> None:
    """Copies a finished local file to `remote_path`; the object appears whole or not at all."""
    with _gcs_errors(remote_path):
        _blob(remote_path).upload_from_filename(local_path, content_type="application/octet-stream",
                                                retry=_retry())


def download(remote_path: str, local_path: str, *, expected_size: int | None = None,
             generation: int | None = None) -> int:
    """Copies `remote_path` (gs:// or local) to `local_path` under a temporary name, then renames it; returns
    the bytes copied. Cloud Storage downloads are checked against the object's checksum; with `expected_size`
    a copy of another size raises `OSError` and leaves nothing under `local_path`. `generation`: the gs:// object's
    as listed (another, or none left, is ObjectChanged, and nothing is left under `local_path`)."""
    tmp = temp_name(local_path)
    try:
        if is_remote(remote_path):
            with _gcs_errors(remote_path), _at_generation(remote_path, generation) as blob, open(tmp, "wb") as f:
                blob.download_to_file(f, retry=_retry())
        else:
            shutil.copyfile(remote_path, tmp)
        size = os.path.getsize(tmp)
        if expected_size is not None and size != expected_size:
            raise OSError(f"copied {size} bytes of {remote_path}, expected {expected_size}; the file changed since "
                          "it was listed: copy it again")
        os.replace(tmp, local_path)
        return size
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def delete(path: str) -> None:
    if not is_remote(path):
        os.remove(path)
        return
    with _gcs_errors(path):
        _blob(path).delete(retry=_retry())


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
    except FileNotFoundError:
        raise  # a missing bucket: its message already names it and the fix
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        raise PermissionError(f"output directory {directory!r} is not writable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); choose another --output or fix "
                              "its permissions") from e
