"""S3-compatible object storage for tests: moto's server on 127.0.0.1, and a proxy in front of it that
injects the faults real object stores produce.

`S3Server` runs `python -m moto.server` in a process of its own, so that it keeps answering while the test
process forks ranks, waits in a collective or holds the GIL in a step. `s3_server` (a session fixture,
`tests/conftest.py`) is one per test process (one per xdist worker), started when a test first asks for it;
its buckets outlive a test, so a test makes its own (`make_bucket()` with no name is a fresh one).

Conventions:

- Everything that reaches the server does so through the environment alone, as a user's job would:
  `env()` is `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION` and `AWS_ENDPOINT_URL`, which
  botocore (and so aiobotocore and s3fs) reads when it makes a client; nothing is passed in code or YAML.
  `environ()` applies it to `os.environ` with every other `AWS_*` variable removed (a developer's
  `AWS_PROFILE` or `AWS_ENDPOINT_URL_S3`, which wins over `AWS_ENDPOINT_URL`, must not leak in); ranks
  forked or spawned inside it inherit it.
- fsspec caches filesystems by their arguments: `fsspec.filesystem("s3")` or `S3FileSystem()` made twice
  in one process is one object, whose client was made under the environment of its first request. `fs()`
  skips that cache and connects at once, under `env()`, so the filesystem it returns is bound to this
  server (or proxy) whatever the environment is later.
- `FaultProxy(server)` forwards to the server and answers, for the next `times` requests that match a
  `Fault` (method, and a substring of the unquoted path `/bucket/key`), with the fault instead:

  ============== ===========================================================================================
  ``slowdown``     503 with an S3 ``SlowDown`` error body, the request not forwarded (throttling)
  ``expired``      403 ``ExpiredToken`` (an expired session credential), not forwarded
  ``no_such_key``  404 ``NoSuchKey`` (no body for a HEAD, as S3 answers), not forwarded
  ``truncate``     forwarded; the server's status and headers, its Content-Length included, then half the
                   body and the connection closed (a connection lost mid-body)
  ``short``        forwarded; a complete response whose Content-Length and body are the first half of the
                   server's (Content-Range left as it was): a body that ends early without an error
  ============== ===========================================================================================

  Rules are set with `set_rules` from this process, or by writing `write_rules(proxy.rules_file, ...)`
  from any other (a forked rank): the proxy re-reads that JSON file at every request and starts the
  rules over when its `generation` changes. `counts()` (this process only) is, per rule, the matching
  requests seen and the faults injected; `log` is every request as `(method, path, status)`.

What s3fs and botocore retry on their own, under the defaults of this environment (s3fs 2026.9,
aiobotocore 3.10, botocore 1.43), below any retry h3train adds on top:

- botocore, per API call, in its "legacy" retry mode (`AWS_RETRY_MODE`; `AWS_MAX_ATTEMPTS`, default 5
  attempts in all): connection errors, 500/502/503/504 (so ``SlowDown``) and throttling codes, sleeping
  `random() * 2 ** (attempt - 1)` s between attempts (up to 1 + 2 + 4 + 8 s for one call). 403, 404
  and other 4xx are not retried. It reads the body of a GET only after the call returns, so it never
  retries a body cut short.
- s3fs, around each API call (`_error_wrapper`, `S3FileSystem.retries` = 5 attempts, sleeping
  `min(0.1 * 1.7 ** i, 15)` s after each failure): an error botocore gave up on whose message holds
  ``SlowDown``, ``reduce your request rate`` or ``XAmzContentSHA256Mismatch``, and socket timeouts,
  botocore's `HTTPClientError`, urllib3's `IncompleteRead`, `ResponseParserError`; each of its attempts
  is botocore's whole set, so a ``SlowDown`` that outlasts both is 5 x 5 = 25 requests (and about 40 s
  of sleeps on average). `cat_file` wraps the call and the body's read in the same loop again, which
  retries aiohttp's `ClientPayloadError` (a body shorter than its Content-Length) 5 times.
- What still fails goes through `s3fs.errors.translate_boto_error` when it is a botocore `ClientError`:
  ``ExpiredToken`` and ``AccessDenied`` are `PermissionError`, ``NoSuchKey`` `FileNotFoundError`,
  ``SlowDown`` `OSError` with errno EBUSY, a code it does not know `OSError` EIO. Anything else is raised
  as it is: a body still cut short after 5 reads is `aiohttp.ClientPayloadError` (not an `OSError`), and
  a whole object whose body does not match the checksum S3 sent for it is
  `botocore.exceptions.FlexibleChecksumError` (not retried).
- A ranged GET whose body is complete but shorter than the range asked for (``short``) returns the
  short bytes without any error: only the caller can see that it got fewer bytes than it asked for.

`tests/unit/test_s3_helpers.py` holds each of these against this server, with the exact exception types.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from h3train.parallel.dims import free_port

if TYPE_CHECKING:
    import s3fs

# moto accepts any credentials; these are what its documentation uses, and look like nobody's real ones.
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

FaultKind = Literal["slowdown", "expired", "no_such_key", "truncate", "short"]

# Headers of one connection, not of the request or response: the proxy's own connections set these.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}


def isolated_environ(env: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default `os.environ`) without any `AWS_*` variable, then `env`: for a subprocess's `env=`."""
    base = dict(os.environ if base is None else base)
    return {**{k: v for k, v in base.items() if not k.startswith("AWS_")}, **env}


@contextlib.contextmanager
def applied_environ(env: dict[str, str]) -> Iterator[None]:
    """`os.environ` as `isolated_environ(env)` inside the block, restored after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(isolated_environ(env, saved))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _fs_under(env: dict[str, str]) -> s3fs.S3FileSystem:
    """An S3 filesystem made from the environment alone, connected (its client made) under `env`."""
    import s3fs

    with applied_environ(env):
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.connect()
    return fs


def _answers(endpoint: str, timeout: float = 1.0) -> bool:
    parsed = urllib.parse.urlsplit(endpoint)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        conn.request("GET", "/moto-api/")
        conn.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        conn.close()


class S3Server:
    """moto's S3 server in a child process on a free port of 127.0.0.1; a context manager."""

    def __init__(self, start_timeout: float = 60.0) -> None:
        self.start_timeout = start_timeout
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        # The server's output, for the error when it fails to start; closed on exit.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115

    @property
    def endpoint(self) -> str:
        assert self.port is not None, "the server is not started"
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server: the standard AWS variables only."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def environ(self) -> contextlib.AbstractContextManager[None]:
        """`os.environ` set to reach this server (and nothing else of AWS) inside the block."""
        return applied_environ(self.env())

    def fs(self, **more_env: str) -> s3fs.S3FileSystem:
        """An `s3fs.S3FileSystem()` of this server, made with no argument but the environment (`env()`,
        and `more_env`: other standard variables, such as `AWS_MAX_ATTEMPTS`)."""
        return _fs_under({**self.env(), **more_env})

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name when `name` is None) and return its name."""
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return name

    def start(self) -> S3Server:
        # The port is free when chosen but not held: another process may take it before moto binds it,
        # so a server that exits at start is started again on another one.
        for _ in range(3):
            self.port = free_port()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                # Its own session: a terminal's Ctrl-C to the test run does not reach it first, and
                # `stop` is what ends it.
                start_new_session=True,
                env=isolated_environ({}),
            )
            deadline = time.monotonic() + self.start_timeout
            while self._proc.poll() is None and time.monotonic() < deadline:
                if _answers(self.endpoint):
                    return self
                time.sleep(0.05)
            if self._proc.poll() is None:
                self.stop()
                raise TimeoutError(f"moto's server did not answer in {self.start_timeout:.0f}s: {self._output()}")
        raise RuntimeError(f"moto's server exited at start (code {self._proc.returncode}): {self._output()}")

    def _output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()


@dataclass(frozen=True)
class Fault:
    """Answer the next `times` requests whose method is `method` ("*": any) and whose unquoted path
    (`/bucket/key`, no query) contains `key` with `fault` (the table in this module's docstring)."""

    fault: FaultKind
    method: str = "*"
    key: str = ""
    times: int = 1

    def matches(self, method: str, path: str) -> bool:
        return self.method in ("*", method) and self.key in path


@dataclass
class RuleCount:
    seen: int = 0  # matching requests, faulted or not
    injected: int = 0  # of those, answered with the fault


def write_rules(path: Path, faults: list[Fault]) -> None:
    """Replace the rules of the proxy that reads `path`, from any process (written whole, then renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps({"generation": uuid.uuid4().hex, "rules": [asdict(f) for f in faults]}))
    tmp.replace(path)


def _error_body(code: str, message: str, key: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{key}</Resource>"
        f"<RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId><HostId>fault-proxy</HostId></Error>"
    ).encode()


_ERRORS: dict[str, tuple[int, str, str]] = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "expired": (403, "ExpiredToken", "The provided token has expired."),
    "no_such_key": (404, "NoSuchKey", "The specified key does not exist."),
}


class FaultProxy:
    """An HTTP proxy in front of `upstream` (an `S3Server`), in a thread of this process; a context
    manager. Its `env()` is the server's with the proxy's endpoint."""

    def __init__(self, upstream: S3Server, rules_file: Path | None = None, latency_s: float = 0.0) -> None:
        self.upstream = upstream
        # Seconds each request waits before it is forwarded: a remote store's time to first byte.
        self.latency_s = latency_s
        self._dir = tempfile.TemporaryDirectory(prefix="fault-proxy-")
        self.rules_file = rules_file or Path(self._dir.name) / "rules.json"
        self.log: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._generation: str | None = None
        self._rules: list[Fault] = []
        self._counts: list[RuleCount] = []
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        write_rules(self.rules_file, [])

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "the proxy is not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def env(self) -> dict[str, str]:
        return {**self.upstream.env(), "AWS_ENDPOINT_URL": self.endpoint}

    def environ(self) -> contextlib.AbstractContextManager[None]:
        return applied_environ(self.env())

    def fs(self, **more_env: str) -> s3fs.S3FileSystem:
        """An `s3fs.S3FileSystem()` that reaches the server through this proxy (`S3Server.fs`)."""
        return _fs_under({**self.env(), **more_env})

    def set_rules(self, *faults: Fault) -> None:
        """Replace the rules (and start their counts and the log over)."""
        write_rules(self.rules_file, list(faults))
        with self._lock:
            self._reload()

    def counts(self) -> list[RuleCount]:
        """Per rule of the current set, in order: matching requests seen and faults injected."""
        with self._lock:
            self._reload()
            return [RuleCount(c.seen, c.injected) for c in self._counts]

    def _reload(self) -> None:
        """Take the rules file's rules when its generation is new. Caller holds the lock."""
        try:
            data = json.loads(self.rules_file.read_text())
        except (OSError, ValueError):
            return  # a file being replaced is read at the next request
        if data["generation"] != self._generation:
            self._generation = data["generation"]
            self._rules = [Fault(**r) for r in data["rules"]]
            self._counts = [RuleCount() for _ in self._rules]
            self.log.clear()

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.log.append((method, path, status))

    def _decide(self, method: str, path: str) -> FaultKind | None:
        """The fault this request gets, if any; every matching rule counts it as seen."""
        chosen = None
        with self._lock:
            self._reload()
            for rule, count in zip(self._rules, self._counts, strict=True):
                if rule.matches(method, path):
                    count.seen += 1
                    if chosen is None and count.injected < rule.times:
                        count.injected += 1
                        chosen = rule.fault
        return chosen

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp's pooled connections expect

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send(self, status: int, headers: list[tuple[str, str]], body: bytes, length: int) -> None:
                self.send_response_only(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()

            def _handle(self) -> None:
                body = self._body()
                if proxy.latency_s:
                    time.sleep(proxy.latency_s)
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                fault = proxy._decide(self.command, path)
                head = self.command == "HEAD"
                if fault in _ERRORS:
                    status, code, message = _ERRORS[fault]
                    error = b"" if head else _error_body(code, message, path)
                    headers = [("Content-Type", "application/xml"), ("x-amz-request-id", "FAULTPROXY")]
                    # Logged before the answer is sent: a client may read the log once it has the answer.
                    proxy._record(self.command, path, status)
                    self._send(status, headers, error, len(error))
                    return
                status, headers, answer = self._forward(body)
                proxy._record(self.command, path, status)
                declared = next((int(v) for k, v in headers if k.lower() == "content-length"), len(answer))
                headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
                if head:
                    self._send(status, headers, b"", declared)
                elif fault == "truncate":
                    self._send(status, headers, answer[: len(answer) // 2], len(answer))
                    self.close_connection = True
                elif fault == "short":
                    half = answer[: len(answer) // 2]
                    self._send(status, headers, half, len(half))
                else:
                    self._send(status, headers, answer, len(answer))

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                parsed = urllib.parse.urlsplit(proxy.upstream.endpoint)
                conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
                try:
                    # The Host header the client signed goes through unchanged.
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                            conn.putheader(name, value)
                    conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                    response = conn.getresponse()
                    answer = response.read()
                    headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
                    return response.status, headers, answer
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
