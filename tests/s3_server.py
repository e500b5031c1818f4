"""The tests' S3: moto's server on 127.0.0.1, one per process, started on first
use (``dcp.testing.local_s3_server``), with one bucket for every test; and
:class:`FaultProxy`, which puts real transport faults (error statuses, reset
connections, delays) between a client and that server.

Importing this module gives the test process (and the ranks it spawns, which
import the test modules) a hermetic AWS environment: fake credentials, a
region, and no EC2 metadata probing.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import http.server
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable

import s3fs

from dcp.testing import local_s3_server

os.environ.update({
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
})

BUCKET = "hyperdcp-tests"
#: S3's minimum part size (5 MiB), lowered on the test server so that small
#: objects can go as multipart uploads.
MIN_PART_SIZE = 1024


@functools.cache
def endpoint() -> str:
    """The endpoint URL of this process's server, started (with the bucket
    ``BUCKET`` created) on the first call and stopped at exit."""
    stack = contextlib.ExitStack()
    url = stack.enter_context(local_s3_server(min_part_size=MIN_PART_SIZE))
    atexit.register(stack.close)
    client(url).mkdir(BUCKET)
    return url


def options(url: str, **extra) -> dict:
    """``storage_options`` for the server at ``url``."""
    return {"endpoint_url": url, "key": "testing", "secret": "testing", **extra}


def client(url: str) -> s3fs.S3FileSystem:
    """A raw s3fs client of the server (to inspect what the plugin left)."""
    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options(url))


def fresh_url(label: str) -> str:
    """An ``s3://`` checkpoint id no other test uses."""
    return f"s3://{BUCKET}/{label}-{uuid.uuid4().hex[:8]}"


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """Clients drop keep-alive connections at will (and the faults drop
        some on purpose): not worth a traceback; anything else is."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FaultProxy:
    """An HTTP proxy to the S3 server at ``upstream`` that injects faults.

    ``inject(match, fault, times)`` applies ``fault`` to the first ``times``
    requests (every one if ``None``) for which ``match(method, target)`` holds
    (``target``: path and query, e.g. ``/bucket/key?partNumber=2&uploadId=..``).
    A fault is an HTTP status (answered with an S3 error body), ``"reset"``
    (the connection is dropped without an answer), ``"lose-answer"`` (the
    request is served, then the connection is dropped instead of answering)
    or a function, run in the proxy's thread before the request is forwarded.
    ``requests`` records every ``(method, target)`` received; ``idle()`` waits
    until none is in flight.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.requests: list[tuple[str, str]] = []
        self._faults: list[list] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def inject(self, match: Callable[[str, str], bool], fault: int | str | Callable[[], None],
               times: int | None = None) -> None:
        """Apply ``fault`` to matching requests (see the class docstring)."""
        with self._lock:
            self._faults.append([match, fault, times])

    def count(self, match: Callable[[str, str], bool]) -> int:
        """How many requests received so far ``match``."""
        with self._lock:
            return sum(1 for method, target in self.requests if match(method, target))

    def idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is being handled."""
        deadline = time.monotonic() + timeout
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()

    def _fault_for(self, method: str, target: str):
        with self._lock:
            self.requests.append((method, target))
            for rule in self._faults:
                match, fault, times = rule
                if (times is None or times > 0) and match(method, target):
                    if times is not None:
                        rule[2] = times - 1
                    return fault
        return None

    def _handler(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _serve(self) -> None:
                with proxy._lock:
                    proxy._in_flight += 1
                try:
                    self._forward(proxy._fault_for(self.command, self.path), self._body())
                finally:
                    with proxy._lock:
                        proxy._in_flight -= 1

            def _drop_connection(self) -> None:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.close_connection = True

            def _forward(self, fault, body: bytes) -> None:
                if fault == "reset":
                    self._drop_connection()
                    return
                if isinstance(fault, int):
                    error = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InjectedFault'
                             b'</Code><Message>fault injected by the test proxy</Message></Error>')
                    self.send_response(fault)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                if callable(fault):
                    fault()
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection",
                                                "content-length")}
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                if fault == "lose-answer":
                    self._drop_connection()
                    return
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length",
                                           "date", "server"):
                        self.send_header(key, value)
                length = (response.getheader("Content-Length") if self.command == "HEAD"
                          else len(data))
                self.send_header("Content-Length", str(length or 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler
