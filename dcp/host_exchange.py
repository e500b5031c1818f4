"""Fan-out of regions read once, between ranks on one host, through shared memory.

When every member of a replica group runs on the same host (the same kernel
and the same ``/dev/shm`` mount) and the targets are in host memory, sending
a region over a socket — as ``torch.distributed``'s gloo broadcast does —
costs each byte a copy into the kernel, a copy out of it, and CPU on both
ends.  Here the reading rank writes the region once into a file under
``/dev/shm`` (tmpfs: memory, no disk) and every other member maps it and
copies straight into its target tensor: one copy per receiver, no socket
(and, being a mapping, not counted as a read in ``/proc/self/io``).  Across hosts, and for accelerator targets (NCCL/HCCL), the load
uses :mod:`dcp.broadcast` instead; the load planner marks which transfers
go which way (:attr:`dcp.planner.Transfer.shared_memory`).

Protocol, per transfer (named by a key every member derives from the plan):

* the reader writes ``<prefix><key>.tmp`` and renames it to
  ``<prefix><key>`` (atomic: a receiver never sees a partial file), or
  writes ``<prefix><key>.err`` holding the reason it could not read;
* each receiver polls for either (sleeping with backoff, 50 µs to 2 ms),
  reads, and creates the marker ``<prefix><key>.<rank>``;
* the reader deletes the file and its markers once every receiver has
  marked it.  A reader publishes in the order all ranks run their
  transfers and holds at most ``max_inflight_bytes`` published but not yet
  consumed (it waits for the oldest to be consumed first), so shared memory
  stays bounded and no rank waits on a transfer that comes later in that
  order: no deadlock.

Lifetime: files live only for the transfer; a process killed mid-load can
leave ``/dev/shm/hyperdcp-*`` files behind (a reboot, or ``rm``, removes
them).  The polling has a timeout (:data:`RECEIVE_TIMEOUT_S`), so a reading
rank that died raises on its receivers instead of hanging them.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dcp.errors import CheckpointError

SHM_ROOT = "/dev/shm"
#: seconds a receiver waits for a reader (torch.distributed's default
#: collective timeout, so this path fails no later than a broadcast would)
RECEIVE_TIMEOUT_S = 1800.0
_IO_MAX = 1 << 30  # bytes per read/write system call


def host_key() -> str:
    """This process's shared-memory domain: equal strings on two ranks mean
    they share ``/dev/shm`` (same boot of the same kernel, same tmpfs
    mount); ``""`` if there is no writable ``/dev/shm``."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(SHM_ROOT)
    except OSError:
        return ""
    if not os.access(SHM_ROOT, os.W_OK):
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def _poll(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 50e-6
    while not ready():
        if time.monotonic() > deadline:
            raise CheckpointError(f"{what}: nothing after {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(2 * delay, 2e-3)


class HostExchange:
    """One rank's side of the shared-memory fan-out of one load.

    ``session`` is a name every rank of the load agrees on (it prefixes the
    files); ``max_inflight_bytes`` bounds what this rank keeps published
    and not yet consumed (bytes).  :meth:`publish`, :meth:`fail` and
    :meth:`close` are the reader's side and run on one thread, in transfer
    order; :meth:`receive` is the receiver's.
    """

    def __init__(self, session: str, rank: int, max_inflight_bytes: int,
                 timeout_s: float = RECEIVE_TIMEOUT_S) -> None:
        self.prefix = os.path.join(SHM_ROOT, f"hyperdcp-{session}-")
        self.rank = rank
        self.limit = max_inflight_bytes
        self.timeout_s = timeout_s
        self.pending: deque[tuple[str, int, tuple[int, ...]]] = deque()
        self.inflight = 0
        self.errors: list[str] = []

    def publish(self, key: str, views: list[memoryview], receivers: tuple[int, ...]) -> None:
        """Make the bytes of ``views`` (in order) available to ``receivers``
        under ``key``; waits first if the bound on bytes in flight is hit.

        Raises ``OSError`` if ``/dev/shm`` is full."""
        nbytes = sum(v.nbytes for v in views)
        while self.pending and self.inflight + nbytes > self.limit:
            self._reap_oldest()
        path = self.prefix + key
        fd = os.open(path + ".tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            for view in views:
                while view.nbytes:
                    view = view[os.write(fd, view[:_IO_MAX]):]
        except BaseException:
            os.close(fd)
            os.unlink(path + ".tmp")
            raise
        os.close(fd)
        os.rename(path + ".tmp", path)
        self.pending.append((key, nbytes, receivers))
        self.inflight += nbytes

    def fail(self, key: str, reason: str) -> None:
        """Tell the receivers of ``key`` that it will not come, and why."""
        path = self.prefix + key + ".err"
        Path(path + ".tmp").write_text(reason)
        os.rename(path + ".tmp", path)
        self.errors.append(path)

    def receive(self, key: str, src: int, consume: Callable[[memoryview], None]) -> None:
        """Wait for ``key`` from reading rank ``src`` and run ``consume`` on
        a read-only view of its bytes (valid only during the call).

        Raises :class:`CheckpointError` if the reader failed (with its
        reason) or published nothing within the timeout."""
        path = self.prefix + key
        _poll(lambda: os.path.exists(path) or os.path.exists(path + ".err"), self.timeout_s,
              f"rank {self.rank}: waiting for reading rank {src} in shared memory ({path})")
        if not os.path.exists(path):
            raise CheckpointError(Path(path + ".err").read_text())
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                              mmap.PROT_READ) as mapped, \
                    memoryview(mapped) as view:
                consume(view)
        finally:
            os.close(os.open(f"{path}.{self.rank}", os.O_CREAT | os.O_WRONLY, 0o600))

    def _reap_oldest(self) -> None:
        key, nbytes, receivers = self.pending.popleft()
        path = self.prefix + key
        markers = [f"{path}.{r}" for r in receivers]
        _poll(lambda: all(os.path.exists(m) for m in markers), self.timeout_s,
              f"rank {self.rank}: waiting for ranks {list(receivers)} to take {path}")
        for name in (path, *markers):
            os.unlink(name)
        self.inflight -= nbytes

    def close(self) -> None:
        """Wait until every receiver took what this rank published, then
        delete it."""
        while self.pending:
            self._reap_oldest()

    def remove_errors(self) -> None:
        """Delete the failure notes this rank wrote; call once every rank is
        past its transfers."""
        for path in self.errors:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.errors.clear()

