"""A local GCS emulator (gcp-storage-emulator) and the environment its clients need: for the tests' fixture and for
benchmarks that measure against gs:// (benchmarks/plan_bench.py --gcs, benchmarks/gcs_read_bench.py)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The emulator's server answers one connection at a time with the socket module's default backlog of 5: more
# connections at once (the loader's reads) had their SYNs dropped and waited ~1 s to resend them. A deeper backlog
# queues them instead.
# Its media downloads also lack the x-goog-generation header Cloud Storage sends: tensorstore (orbax's array writer)
# then reads generation 0 and orbax's second checkpoint fails ("Malformed StorageGeneration"). The wrapper adds it.
_START = (
    "import http.server, sys\n"
    "http.server.HTTPServer.request_queue_size = 1024\n"
    "from gcp_storage_emulator.handlers import objects\n"
    "_download = objects.download\n"
    "def download(request, response, storage, *args, **kwargs):\n"
    "    _download(request, response, storage, *args, **kwargs)\n"
    "    try:\n"
    "        obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])\n"
    "        response['x-goog-generation'] = str(obj['generation'])\n"
    "    except Exception:\n"
    "        pass\n"
    "objects.download = download\n"
    "from gcp_storage_emulator.__main__ import main\n"
    "sys.argv[0] = 'gcp-storage-emulator'\n"
    "sys.exit(main())\n"
)


@contextlib.contextmanager
def running(config_dir: Path, data_dir: Path | None = None, stock: bool = False):
    """Starts the emulator, sets its client environment in this process (Beam's GCS filesystem and
    google-cloud-storage read it; the C++ client inside array_record reads CLOUD_STORAGE_EMULATOR_ENDPOINT) and
    yields it for subprocesses; restores the environment and stops the emulator after. In memory, or kept in
    `data_dir` (its `.cloudstorage/.meta` and object files, read again at the next start: see `seed`). `stock`: the
    emulator as its package starts it (`gcp-storage-emulator start`: an accept queue of 5, no x-goog-generation), as
    users run it."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    store = ["--in-memory"] if data_dir is None else []
    start = ["-m", "gcp_storage_emulator"] if stock else ["-c", _START]
    proc = subprocess.Popen([sys.executable, *start, "start", "--host", "127.0.0.1", "--port", str(port), *store],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "STORAGE_BASE": str(data_dir or config_dir)})
    creds = config_dir / "credentials.json"
    creds.write_text(json.dumps({"type": "authorized_user", "client_id": "test", "client_secret": "test",
                                 "refresh_token": "test", "token": "test-token",
                                 "expiry": "2099-01-01T00:00:00Z"}))
    env = {"STORAGE_EMULATOR_HOST": endpoint, "CLOUD_STORAGE_EMULATOR_ENDPOINT": endpoint,
           # orbax: tensorstore writes the arrays, etils.epath (through fsspec/gcsfs, not TensorFlow's GCS client,
           # which cannot be pointed at an emulator) the rest; gcsfs's bucket-type probe waits ~60 s on an emulator
           "TENSORSTORE_GCS_HTTP_URL": endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
           "EPATH_USE_TF": "false", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "NO_GCE_CHECK": "true", "GOOGLE_CLOUD_PROJECT": "test", "CLOUDSDK_CONFIG": str(config_dir),
           "GOOGLE_APPLICATION_CREDENTIALS": str(creds)}
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"gcp-storage-emulator did not start on {endpoint}")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=10)


def upload_files(client, bucket: str, directory: Path, prefix: str) -> str:
    """The files directly in `directory` (a converted dataset: not its converter's .shards/ records) uploaded to
    gs://bucket/prefix/ through `client`; that URL."""
    for f in Path(directory).iterdir():
        if f.is_file():
            client.bucket(bucket).blob(f"{prefix}/{f.name}").upload_from_filename(str(f))
    return f"gs://{bucket}/{prefix}"


def seed(data_dir: Path, bucket: str, objects: dict[str, bytes | tuple[bytes, dict[str, str]]]) -> None:
    """Adds `objects` ({name: bytes, or (bytes, custom metadata)}) to `bucket` in a stopped emulator's `data_dir`
    directly, their resources made from an object already in the bucket (with each one's own name, size, md5 and
    crc32c). The emulator rewrites
    all its metadata on every upload (quadratic: ~60 uploads/s at a few thousand objects), so 100,000 objects are
    only practical this way; it reads them at its next start."""
    import base64
    import hashlib
    import struct

    import google_crc32c

    root = data_dir / ".cloudstorage"
    meta = json.loads((root / ".meta").read_text())
    existing = meta["objects"][bucket]
    template = next(iter(existing.values()))
    generation = time.time_ns()
    for name, content in objects.items():
        content, custom = content if isinstance(content, tuple) else (content, None)
        generation += 1
        target = root / bucket / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        md5 = base64.b64encode(hashlib.md5(content).digest()).decode()
        existing[name] = {
            **template, "name": name, "id": f"{bucket}/{name}/{generation}", "generation": str(generation),
            "size": str(len(content)), "md5Hash": md5, "etag": md5,
            "crc32c": base64.b64encode(struct.pack(">I", google_crc32c.value(content))).decode(),
            "selfLink": f"/storage/v1/b/{bucket}/o/{name}",
            "mediaLink": template["mediaLink"].split("/o/")[0] + f"/o/{name}?generation={generation}&alt=media"}
        existing[name].pop("metadata", None)
        if custom:
            existing[name]["metadata"] = custom
    (root / ".meta").write_text(json.dumps(meta))


class FaultFront(http.server.ThreadingHTTPServer):
    """An HTTP front on 127.0.0.1 that forwards to the emulator and answers the next requests whose path contains a
    given text with a given status instead (`fail_next`); `failed` lists what it answered so, `seen` every request.
    (Benchmarks shape the link with tests/shaped_link.py.)"""

    daemon_threads = True
    request_queue_size = 1024  # many connections may open at once (the loader's reads)

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream = urllib.parse.urlsplit(upstream)
        self.faults: list[tuple[str, int]] = []  # (text in the path, status), consumed in order
        self.failed: list[tuple[int, str]] = []
        self.seen: list[tuple[str, str, str | None]] = []  # every request: (method, path, Range header)
        self.edits: list[tuple[str, Callable[[dict], None]]] = []  # (text in the path, an edit of the JSON answer)
        self.lock = threading.Lock()

    def handle_error(self, request, client_address) -> None:
        """A client that drops its connection mid-answer is not an error of the front's."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, BrokenPipeError)):
            super().handle_error(request, client_address)

    def edit_answers(self, edit: Callable[[dict], None], where: str = "") -> None:
        """Every later JSON answer to a request whose path contains `where` is changed by `edit` (in place, on its
        parsed body): what Cloud Storage answers where the emulator answers otherwise."""
        with self.lock:
            self.edits.append((where, edit))

    def fail_next(self, status: int, times: int = 1, where: str = "") -> None:
        """The next `times` requests whose path contains `where` are answered with `status`; status 0: answered in
        full, but their body stops halfway and the connection drops."""
        with self.lock:
            self.faults += [(where, status)] * times


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body go out in separate writes: with Nagle's algorithm the body waits for the client's delayed ACK
    # of the headers (~40 ms on Linux), a latency of the front's own on every small answer
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server: FaultFront = self.server
        with server.lock:
            server.seen.append((self.command, self.path, self.headers.get("Range")))
            fault = next((f for f in server.faults if f[0] in self.path), None)
            if fault:
                server.faults.remove(fault)
                server.failed.append((fault[1], f"{self.command} {self.path}"))
        cut = bool(fault) and fault[1] == 0  # status 0: the answer's body stops halfway, the connection dropped
        if fault and not cut:
            payload = b'{"error": {"code": %d, "message": "injected"}}' % fault[1]
            self.send_response(fault[1])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(server.upstream.hostname, server.upstream.port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        edits = [edit for where, edit in server.edits if where in self.path]
        if edits and response.status == 200 and "json" in (response.getheader("Content-Type") or ""):
            body = json.loads(data)
            for edit in edits:
                edit(body)
            data = json.dumps(body).encode()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[:len(data) // 2] if cut else data)
        self.close_connection = cut
        conn.close()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


@contextlib.contextmanager
def fault_front(upstream: str):
    """A running FaultFront before `upstream` (the emulator's endpoint); point STORAGE_EMULATOR_HOST at its `url`."""
    front = FaultFront(upstream)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    try:
        yield front
    finally:
        front.shutdown()
        front.server_close()
