"""Fan-out of regions read once, between ranks on one host, through shared memory.

When every member of a replica group runs on the same host (the same kernel
and the same ``/dev/shm`` mount) and the targets are in host memory, sending
a region over a socket — as ``torch.distributed``'s gloo broadcast does —
costs each byte a copy into the kernel, a copy out of it, and CPU on both
ends.  Here the reading rank writes the region once into a file under
``/dev/shm`` (tmpfs: memory, no disk) and every other member maps it and
copies straight into its target tensor: one copy per receiver, no socket
(and, being a mapping, not counted as a read in ``/proc/self/io``).  Across
hosts the load uses :mod:`dcp.coordination.broadcast` instead; the load
planner marks which transfers go which way
(:attr:`dcp.core.planner.Transfer.shared_memory`).

Protocol, per transfer (named by a key every member derives from the plan):

* the reader writes the bytes into one of its *slot* files
  ``<prefix>r<rank>.<slot>`` (reused from transfer to transfer: writing
  over pages tmpfs already holds costs half as much as allocating new
  ones), then publishes the flag file ``<prefix><key>`` naming the slot and
  the length (written to a temporary name and renamed: atomic, so a
  receiver never sees a partial flag), or ``<prefix><key>.err`` holding the
  reason it could not read;
* each receiver polls for either (sleeping with backoff, 50 µs to 2 ms),
  maps the slot, copies into its target, and creates the marker
  ``<prefix><key>.<rank>``;
* the reader reuses a slot, and deletes the flag and its markers, once
  every receiver has marked it.  A reader publishes in the order all ranks
  run their transfers and keeps at most ``max_inflight_bytes`` published
  but not yet consumed (it waits for the oldest to be consumed first), so
  shared memory stays bounded and no rank waits on a transfer that comes
  later in that order: no deadlock.

Lifetime: files live only for the transfer; a process killed mid-load can
leave ``/dev/shm/hyperdcp-*`` files behind (a reboot, or ``rm``, removes
them).  The polling has a timeout (:data:`RECEIVE_TIMEOUT_S`), so a reading
rank that died raises on its receivers instead of hanging them.
"""

from __future__ import annotations

import contextlib
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
        self.pending: deque[tuple[str, int, tuple[int, ...], int]] = deque()
        self.inflight = 0
        self.free_slots: list[int] = []
        self.slots = 0
        self.errors: list[str] = []
        self.aborted = False

    def _slot_path(self, slot: int) -> str:
        return f"{self.prefix}r{self.rank}.{slot}"

    def publish(self, key: str, views: list[memoryview], receivers: tuple[int, ...]) -> None:
        """Make the bytes of ``views`` (in order) available to ``receivers``
        under ``key``; waits first if the bound on bytes in flight is hit.

        Raises ``OSError`` if ``/dev/shm`` is full, :class:`CheckpointError`
        once :meth:`abort` was called."""
        if self.aborted:
            raise CheckpointError(f"rank {self.rank}: the load failed here")
        nbytes = sum(v.nbytes for v in views)
        while self.pending and self.inflight + nbytes > self.limit:
            self._reap_oldest()
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot, self.slots = self.slots, self.slots + 1
        fd = os.open(self._slot_path(slot), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            pos = 0
            for view in views:
                while view.nbytes:
                    n = os.pwrite(fd, view[:_IO_MAX], pos)
                    view, pos = view[n:], pos + n
            if os.fstat(fd).st_size > nbytes:  # free the pages of a longer earlier use
                os.ftruncate(fd, nbytes)
        except BaseException:
            self.free_slots.append(slot)
            raise
        finally:
            os.close(fd)
        self._flag(self.prefix + key, f"{slot} {nbytes}")
        self.pending.append((key, nbytes, receivers, slot))
        self.inflight += nbytes

    def fail(self, key: str, reason: str) -> None:
        """Tell the receivers of ``key`` that it will not come, and why."""
        self._flag(self.prefix + key + ".err", reason)
        self.errors.append(self.prefix + key + ".err")

    @staticmethod
    def _flag(path: str, text: str) -> None:
        Path(path + ".tmp").write_text(text)
        os.rename(path + ".tmp", path)

    def receive(self, key: str, src: int, consume: Callable[[memoryview], None]) -> None:
        """Wait for ``key`` from reading rank ``src`` and run ``consume`` on
        a read-only view of its bytes (valid only during the call).

        Raises :class:`CheckpointError` if the reader failed (with its
        reason) or published nothing within the timeout."""
        flag = self.prefix + key
        _poll(lambda: os.path.exists(flag) or os.path.exists(flag + ".err"), self.timeout_s,
              f"rank {self.rank}: waiting for reading rank {src} in shared memory ({flag})")
        try:
            slot, nbytes = (int(v) for v in Path(flag).read_text().split())
        except FileNotFoundError:
            raise CheckpointError(Path(flag + ".err").read_text()) from None
        try:
            if nbytes:
                with open(f"{self.prefix}r{src}.{slot}", "rb") as f, \
                        mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                  mmap.PROT_READ) as mapped, memoryview(mapped) as view:
                    consume(view)
        finally:
            os.close(os.open(f"{flag}.{self.rank}", os.O_CREAT | os.O_WRONLY, 0o600))

    def _reap_oldest(self) -> None:
        key, nbytes, receivers, slot = self.pending.popleft()
        flag = self.prefix + key
        markers = [f"{flag}.{r}" for r in receivers]
        _poll(lambda: self.aborted or all(os.path.exists(m) for m in markers), self.timeout_s,
              f"rank {self.rank}: waiting for ranks {list(receivers)} to take {flag}")
        if self.aborted:  # withdrawn: a receiver still to come reads why
            self.fail(key, f"rank {self.rank}: the load failed on this rank")
        for name in (flag, *markers):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        self.inflight -= nbytes
        self.free_slots.append(slot)

    def abort(self) -> None:
        """The load failed on this rank: stop waiting for receivers (call
        from any thread).  What is published and not yet taken is
        withdrawn, each with a failure note its receivers read at once, and
        further publishing raises, so the reader's thread ends promptly."""
        self.aborted = True

    def close(self) -> None:
        """Wait until every receiver took what this rank published (after
        :meth:`abort`, withdraw it instead), then delete it and the slot
        files."""
        while self.pending:
            self._reap_oldest()
        for slot in range(self.slots):
            os.unlink(self._slot_path(slot))
        self.slots, self.free_slots = 0, []

    def remove_errors(self) -> None:
        """Delete the failure notes this rank wrote; call once every rank is
        past its transfers."""
        for path in self.errors:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.errors.clear()
