"""Fault injection around any other storage plugin (``faulty://`` URLs).

``faulty://<checkpoint id>`` opens the plugin of ``<checkpoint id>``
(``faulty:///mnt/ckpt/step100`` the POSIX one, ``faulty://s3://bucket/run``
the S3 one) and passes every call through to it, except that a chosen
fraction of calls fails first with the error the real backend raises for the
fault: ``ENOSPC`` and ``EIO`` of a filesystem, timeouts, 5xx answers and
throttling (``SlowDown``) of an object store.  It is an ordinary plugin,
registered under the entry point ``faulty``, so any job or test can rehearse
storage failures with nothing but a URL and ``storage_options``::

    dcp.save(state, "faulty:///mnt/ckpt/step100",
             storage_options={"rate": 0.3, "max_consecutive": 2,
                              "options": {"thread_count": 8}})

Options:

* ``faults`` — kinds to inject, drawn in turn: ``"ENOSPC"``, ``"EIO"``
  (``OSError``, as a filesystem raises them), ``"timeout"`` (``TimeoutError``
  after ``delay_s`` seconds, as a request that never got an answer),
  ``"503"`` and ``"slowdown"`` (``OSError(EBUSY)``, as s3fs reports
  ``ServiceUnavailable`` and ``SlowDown``), ``"500"`` (``OSError(EREMOTEIO)``,
  ``InternalError``).  Default: ``ENOSPC`` and ``EIO`` for a path,
  ``timeout``, ``503``, ``slowdown`` and ``500`` for any other URL.
* ``rate`` (default 0.1) — the probability that a call fails.
* ``max_consecutive`` (default ``None``: no limit) — after this many faults
  in a row on one ``(method, file)`` the next call goes through, so with
  ``rate=1.0, max_consecutive=2`` every call fails twice and then succeeds:
  a deterministic transient fault; ``rate=1.0`` alone is a persistent one.
* ``methods`` (default ``["write_file"]``) — which plugin calls fail:
  any of ``write_file``, ``read_ranges``, ``read_file``, ``commit_file``,
  ``exists``, ``list_files``, ``delete``.
* ``seed`` (default 0) — faults are drawn from a hash of the seed, the
  method, the file name and how many times that call was made, so a run is
  reproducible whatever the order of the writer threads.
* ``partial_writes`` (default ``True``) — a failing ``write_file`` first
  writes the first half of the bytes through the wrapped plugin, as a disk
  that fills up half-way does (on an object store that is a smaller
  object than a real failed upload would leave, which is none).
* ``delay_s`` (default 0.05) — seconds a ``timeout`` fault waits.
* ``options`` (default ``{}``) — the wrapped plugin's ``storage_options``.

Injected faults count as transient (:meth:`is_transient`), so the core
retries them under the wrapped plugin's retry policy; other failures are
classified by the wrapped plugin.  ``injected`` counts the faults raised in
this process, by kind.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import threading
import time
from collections.abc import Iterable, Sequence

from dcp.core.storage import StoragePlugin, open_storage, scheme_of
from dcp.errors import CheckpointError

PREFIX = "faulty://"
LOCAL_FAULTS = ("ENOSPC", "EIO")
REMOTE_FAULTS = ("timeout", "503", "slowdown", "500")
METHODS = ("write_file", "read_ranges", "read_file", "commit_file", "exists", "list_files",
           "delete")
_EREMOTEIO = getattr(errno, "EREMOTEIO", errno.EIO)


def _fault(kind: str, where: str) -> Exception:
    """The exception a real backend raises for ``kind`` on ``where``."""
    if kind == "ENOSPC":
        return OSError(errno.ENOSPC, "No space left on device (injected fault)", where)
    if kind == "EIO":
        return OSError(errno.EIO, "Input/output error (injected fault)", where)
    if kind == "timeout":
        return TimeoutError(f"{where}: request timed out (injected fault)")
    if kind == "503":
        return OSError(errno.EBUSY, f"{where}: ServiceUnavailable, 503 (injected fault)")
    if kind == "slowdown":
        return OSError(errno.EBUSY, f"{where}: SlowDown, please reduce your request rate "
                                    f"(injected fault)")
    return OSError(_EREMOTEIO, f"{where}: InternalError, 500 (injected fault)")


class FaultyStorage(StoragePlugin):
    """The plugin of ``checkpoint_id`` without its ``faulty://`` prefix,
    failing calls as the options say (module docstring)."""

    def __init__(self, checkpoint_id: str, *, faults: Sequence[str] | None = None,
                 rate: float = 0.1, max_consecutive: int | None = None,
                 methods: Sequence[str] = ("write_file",), seed: int = 0,
                 partial_writes: bool = True, delay_s: float = 0.05,
                 options: dict | None = None) -> None:
        super().__init__(checkpoint_id)
        if not checkpoint_id.startswith(PREFIX):
            raise CheckpointError(
                f"{checkpoint_id!r}: a faulty checkpoint id starts with {PREFIX!r}")
        target = checkpoint_id[len(PREFIX):]
        if faults is None:
            faults = LOCAL_FAULTS if scheme_of(target) == "file" else REMOTE_FAULTS
        unknown = set(faults) - set(LOCAL_FAULTS + REMOTE_FAULTS) or set(methods) - set(METHODS)
        if unknown or not faults or not 0.0 <= rate <= 1.0:
            raise CheckpointError(
                f"{checkpoint_id!r}: invalid fault options (faults {list(faults)}, methods "
                f"{list(methods)}, rate {rate}): faults are {LOCAL_FAULTS + REMOTE_FAULTS}, "
                f"methods {METHODS}, and rate is in [0, 1]")
        self.inner = open_storage(target, **(options or {}))
        self.faults, self.rate, self.max_consecutive = tuple(faults), float(rate), max_consecutive
        self.methods, self.seed = frozenset(methods), seed
        self.partial_writes, self.delay_s = partial_writes, delay_s
        self.thread_count, self.alignment = self.inner.thread_count, self.inner.alignment
        self.read_cost = self.inner.read_cost
        self.retry_policy = self.inner.retry_policy
        self.injected: collections.Counter = collections.Counter()
        self._calls: collections.Counter = collections.Counter()  # (method, name) -> calls
        # (method, name) -> faults in a row
        self._streak: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _draw(self, method: str, name: str) -> str | None:
        """The kind of fault this call gets, or ``None``."""
        if method not in self.methods:
            return None
        key = (method, name)
        with self._lock:
            n = self._calls[key]
            self._calls[key] += 1
            digest = hashlib.sha256(f"{self.seed}/{method}/{name}/{n}".encode()).digest()
            chance = int.from_bytes(digest[:8], "little") / 2**64
            capped = self.max_consecutive is not None and self._streak[key] >= self.max_consecutive
            if capped or chance >= self.rate:
                self._streak[key] = 0
                return None
            self._streak[key] += 1
            kind = self.faults[digest[8] % len(self.faults)]
            self.injected[kind] += 1
            return kind

    def _maybe_fail(self, method: str, name: str) -> None:
        kind = self._draw(method, name)
        if kind is not None:
            if kind == "timeout":
                time.sleep(self.delay_s)
            error = _fault(kind, f"{self.inner.checkpoint_id}/{name}")
            error.injected_fault = True  # type: ignore[attr-defined]
            raise error

    def is_transient(self, error: BaseException) -> bool:
        return getattr(error, "injected_fault", False) or self.inner.is_transient(error)

    def write_file(self, name: str, buffers: Sequence[memoryview | bytes]) -> None:
        try:
            self._maybe_fail("write_file", name)
        except Exception:
            if self.partial_writes:
                data = b"".join(memoryview(b).cast("B") for b in buffers)
                self.inner.write_file(name, [data[:len(data) // 2]])
            raise
        self.inner.write_file(name, buffers)

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        self._maybe_fail("read_ranges", name)
        self.inner.read_ranges(name, ranges)

    def read_file(self, name: str) -> bytes:
        self._maybe_fail("read_file", name)
        return self.inner.read_file(name)

    def commit_file(self, name: str, data: bytes, *, overwrite: bool) -> None:
        self._maybe_fail("commit_file", name)
        self.inner.commit_file(name, data, overwrite=overwrite)

    def exists(self, name: str) -> bool:
        self._maybe_fail("exists", name)
        return self.inner.exists(name)

    def list_files(self) -> list[str]:
        self._maybe_fail("list_files", "")
        return self.inner.list_files()

    def delete(self, names: Iterable[str]) -> None:
        names = list(names)
        self._maybe_fail("delete", ",".join(names))
        self.inner.delete(names)

    def location_exists(self) -> bool | None:
        return self.inner.location_exists()

    def remove_if_empty(self) -> None:
        self.inner.remove_if_empty()
