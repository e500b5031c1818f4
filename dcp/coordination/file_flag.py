"""The file-flag coordination protocol: the steps of a save over the
checkpoint's own storage, with no communicator at all.

Built for the clusters that choose it: thousands of ranks on a shared
filesystem or an object store, where object collectives time out.  Per step
the coordinator makes O(N) storage requests (N reads and one write when the
ranks arrive together; a sweep for late ones stops after a bounded number of
misses), every other rank O(1) (a write, two ranged reads, a delete, and
polls that back off geometrically: bounded by the timeout, not by N or the
step's time), and nobody lists a directory.

One step of the save with key ``K`` (names relative to the checkpoint root;
``NNN`` is the step number):

* every rank but the coordinator writes ``.exchange.K.NNN.in.rRRRRR`` (its
  part, or its failure) with :meth:`StoragePlugin.write_exchange` (payload,
  then a trailer holding a magic number, the payload's length and its
  CRC-32C); :meth:`StoragePlugin.read_exchange` returns ``None`` for a
  missing, torn or still-growing file, so a torn file is never taken as
  complete;
* the coordinator (rank 0) reads the N-1 inputs concurrently, through a pool
  sized by the plugin's cost model (``read_cost.concurrency`` requests per
  call times ``thread_count`` calls, at most 64), decoding each as it
  arrives, and polls the missing ones with backoff;
* it publishes **one** answer, ``.exchange.K.NNN.out``, atomically
  (:meth:`StoragePlugin.commit_file`): a table of N fixed-size entries (32
  bytes: magic, version, kind, N, the offset, length and CRC-32C of a part,
  and the entry's own CRC-32C), then the parts — one per rank (final plans)
  or one that every entry points to (the metadata, or a failure);
* rank ``r`` reads entry ``r`` at byte ``32 r`` and then its part: two
  ranged reads (:meth:`StoragePlugin.read_ranges`), never a listing and
  never another rank's part.  A missing file is a poll; a damaged entry or
  part is never decoded.

Payloads are :mod:`dcp.coordination.wire`'s versioned, zstd-compressed
columns, never pickles.

Polls (:func:`poll_times`): a wait polls at its start and after a first
pause; then the pause doubles up to :data:`POLL_FLOOR` (50 ms), and grows
beyond it once that is under :data:`POLL_LATENESS` (25%) of the time
waited.  So what a rank waits for is noticed, once past the first pause, at
most 50 ms or 25% of its wait late (whichever is more), and a wait of ``T``
seconds polls about ``log(T / 0.2 s) / log(1.25)`` times beyond its first
ten, whatever the world size and the storage's speed: 24 in a 5 s wait, 45
in a 600 s one (from a 1 ms first pause).  The first pause of a rank
waiting for an answer grows with the world (:func:`answer_first_poll`),
that of the coordinator's sweeps of the missing inputs is 1 ms.  A sweep
reads the inputs still missing in rank order, up to 32 per read-pool task,
and starts no task once ``4 * read_threads`` of them were missing: late
ranks cost each sweep a bounded number of requests, not N (so also
:meth:`FileCoordinator.close`'s checks).

Cleanup: a rank deletes its input once it has read the answer;
:meth:`FileCoordinator.close` on the coordinator deletes the answers once
every rank has deleted its last input, i.e. has read everything.  After a
successful save no exchange file remains.

Timeouts: the coordinator waits ``timeout`` seconds for the ranks' inputs and
then answers everyone with a failure naming the ranks that never arrived; a
rank waits twice as long for an answer (so that it normally gets that
failure) and then raises naming the coordinator — a coordinator killed
between steps surfaces so on every other rank.  Ranks that passed
different checkpoint ids meet only so: each waits in the folder of its own
id, where the others never write (the gloo coordination compares the ids
at once), so they fail by these timeouts, whose messages say so, and the
coordinator, lacking their parts, commits nothing.
"""

from __future__ import annotations

import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dcp.coordination import wire
from dcp.coordination.collectives import CoordinatorBase, failure_of
from dcp.core.metadata import checksum
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError

EXCHANGE_PREFIX = ".exchange."
#: The most a poll notices late what it waits for: this fraction of the
#: wait, or :data:`POLL_FLOOR` seconds if that is more.
POLL_LATENESS = 0.25
POLL_FLOOR = 0.05
_FIRST_POLL = 0.001  # seconds: the coordinator's first pause
#: The most concurrent reads of the coordinator.
MAX_READ_POOL = 64

ANSWER_VERSION = 1
_ANSWER_MAGIC = b"DCPA"
# magic, version, shared (1) or per rank (0), world size, part offset,
# part length, part CRC-32C, CRC-32C of the preceding 28 bytes
_ENTRY = struct.Struct("<4sHHIQIII")
ENTRY_BYTES = _ENTRY.size  # 32
#: What a timeout may also mean: the ranks meet under the checkpoint id
#: only, so ranks that passed different ids never meet.
_OTHER_ID = (" (a rank died or hung, or the ranks passed different checkpoint ids: they meet "
             "in exchange files under the id each passed, so a rank with another id waits in "
             "another folder, and nothing is committed)")


def poll_times(first: float) -> Iterator[float]:
    """Seconds after the start of a wait at which to poll: 0, ``first``,
    then pauses that double up to :data:`POLL_FLOOR` and are at least
    :data:`POLL_LATENESS` of the time waited."""
    yield 0.0
    at, pause = first, first
    while True:
        yield at
        pause = max(min(2 * pause, POLL_FLOOR), POLL_LATENESS * at)
        at += pause


def answer_first_poll(world_size: int) -> float:
    """The first pause of a rank polling for an answer (seconds): 50 us per
    rank, at least 1 ms (the coordinator's step takes several times that:
    it reads, decodes and answers each rank)."""
    return max(_FIRST_POLL, world_size * 5e-5)


def wait_for(poll: Callable[[], Any], first: float, timeout: float) -> Any:
    """``poll()`` at :func:`poll_times` until it returns something other
    than ``None`` (returned) or ``timeout`` seconds have passed (``None``)."""
    start, times = time.monotonic(), poll_times(first)
    while True:
        at = min(next(times), timeout)
        pause = start + at - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        value = poll()
        if value is not None or at >= timeout:
            return value


def pack_answer(parts: list[bytes], shared: bool, world_size: int) -> bytes:
    """The answer file: ``world_size`` entries, then the parts (one for
    all if ``shared``, else one per rank)."""
    table = bytearray(ENTRY_BYTES * world_size)
    offset = len(table)
    placed = []
    for part in parts:
        placed.append((offset, len(part), checksum(part)))
        offset += len(part)
    for rank in range(world_size):
        at, length, crc = placed[0 if shared else rank]
        head = _ENTRY.pack(_ANSWER_MAGIC, ANSWER_VERSION, int(shared), world_size, at, length,
                           crc, 0)[:-4]
        table[rank * ENTRY_BYTES:(rank + 1) * ENTRY_BYTES] = head + struct.pack(
            "<I", checksum(head))
    return b"".join([bytes(table), *parts])


def read_part(storage: StoragePlugin, name: str, rank: int, world_size: int,
              requests: Counter | None = None) -> bytes | None:
    """Rank ``rank``'s part of the answer ``name`` in two ranged reads, or
    ``None`` if there is no such file yet or its entry or part is damaged
    (``requests`` counts the reads and misses)."""
    requests = requests if requests is not None else Counter()
    entry = bytearray(ENTRY_BYTES)
    try:
        storage.read_ranges(name, [(rank * ENTRY_BYTES, memoryview(entry))])
    except (OSError, EOFError):  # not published yet
        requests["miss"] += 1
        return None
    requests["read"] += 1
    magic, version, _, count, at, length, crc, own = _ENTRY.unpack(entry)
    if (magic != _ANSWER_MAGIC or version != ANSWER_VERSION or count != world_size
            or own != checksum(bytes(entry[:-4]))):
        return None
    part = bytearray(length)
    if length:
        try:
            storage.read_ranges(name, [(at, memoryview(part))])
        except (OSError, EOFError):
            return None
        requests["read"] += 1
    return bytes(part) if checksum(part) == crc else None


class FileCoordinator(CoordinatorBase):
    """Runs the steps of one save through exchange files of ``storage``.

    ``key`` must be the same on every rank and unique to this save (it names
    the files); ``rank`` and ``world_size`` place this rank; ``timeout`` (in
    seconds) bounds the coordinator's wait for the ranks at each step, twice
    it a rank's wait for the coordinator.  ``read_threads`` overrides the
    size of the coordinator's read pool (by default from the plugin's
    ``read_cost`` and ``thread_count``).  :attr:`requests` counts this
    rank's storage requests by kind (``write``, ``read``, ``miss``,
    ``delete``, ``exists``).
    """

    def __init__(self, storage: StoragePlugin, key: str, rank: int, world_size: int,
                 timeout: float, *, read_threads: int | None = None) -> None:
        self.storage, self.key = storage, key
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        cost = storage.read_cost
        self.read_threads = max(1, min(MAX_READ_POOL, read_threads or
                                       cost.concurrency * max(1, storage.thread_count)))
        self.requests: Counter = Counter()
        self._consumed: list[str] = []  # own input to delete once the answer is read
        self._answers: list[str] = []  # coordinator: answers published
        self._last_inputs: list[str] = []  # coordinator: other ranks' inputs of the last step

    def _name(self, step: int, what: str) -> str:
        return f"{EXCHANGE_PREFIX}{self.key}.{step:03d}.{what}"

    def _sweep(self, pool: ThreadPoolExecutor, ask: Callable[[str], Any],
               names: list[str], bounded: bool = True) -> Iterator[tuple[int, Any]]:
        """``ask(name)`` (a storage request; ``None``: not there yet) over
        ``names`` in order, up to 32 per pool task and at most ``2 *
        read_threads`` tasks in flight, yielding each ``(index, answer)`` in
        order (handled here while the pool asks on).  No task starts once
        ``4 * read_threads`` answers were misses: a sweep asks in vain a
        bounded number of times, so the sweeps of a wait cost O(N) requests
        in all, plus a bounded number per sweep (``bounded=False``: every
        name is asked, for the last sweep before a timeout is reported)."""
        threads = self.read_threads
        size = max(1, min(32, -(-len(names) // (4 * threads))))
        tasks = iter([list(range(i, min(i + size, len(names))))
                      for i in range(0, len(names), size)])

        def run(task: list[int]) -> list[Any]:
            return [ask(names[i]) for i in task]

        flying: deque = deque()
        misses = 0
        while True:
            while len(flying) < 2 * threads and (misses < 4 * threads or not bounded):
                task = next(tasks, None)
                if task is None:
                    break
                flying.append((task, pool.submit(run, task)))
            if not flying:
                return
            task, future = flying.popleft()
            for i, answer in zip(task, future.result(), strict=True):
                misses += answer is None
                yield i, answer

    def _gather(self, step, phase, obj):
        if not self.is_coordinator:
            mine = self._name(step, f"in.r{self.rank:05d}")
            self.storage.write_exchange(mine, wire.encode(obj))
            self.requests["write"] += 1
            self._consumed.append(mine)
            return None
        names = {r: self._name(step, f"in.r{r:05d}") for r in range(1, self.world_size)}
        parts: dict[int, Any] = {0: obj}
        pending = list(names)

        def sweep(bounded: bool = True) -> bool | None:
            """Read missing inputs (decoded as they arrive); ``True`` once
            none is missing."""
            nonlocal pending
            for i, payload in self._sweep(pool, self.storage.read_exchange,
                                          [names[r] for r in pending], bounded):
                rank = pending[i]
                if payload is None:
                    self.requests["miss"] += 1
                    continue
                self.requests["read"] += 1
                try:
                    parts[rank] = wire.decode(payload, names[rank])
                except CheckpointError as e:
                    parts[rank] = (None, failure_of(rank, str(e)))
            pending = [r for r in pending if r not in parts]
            return None if pending else True

        with ThreadPoolExecutor(self.read_threads) as pool:
            if wait_for(sweep, _FIRST_POLL, self.timeout) is None:
                sweep(bounded=False)  # ranks a bounded sweep never asked are not blamed unread
        self._last_inputs = [names[r] for r in names if r not in pending]
        for rank in pending:
            parts[rank] = (None, failure_of(rank, (
                f"rank {rank} never arrived: no complete exchange file {names[rank]!r} in "
                f"{self.storage.checkpoint_id!r} after {self.timeout:g} s{_OTHER_ID}")))
        return [parts[r] for r in range(self.world_size)]

    def _reply(self, step, phase, shared, value):
        name = self._name(step, "out")
        if self.is_coordinator:
            if shared:
                parts = [wire.encode(value)]
            else:
                parts = [b"", *wire.encode_many(value[1:])]
            data = pack_answer(parts, shared, self.world_size)
            self.storage.retrying(lambda: self.storage.commit_file(name, data, overwrite=True))
            self.requests["write"] += 1
            self._answers.append(name)
            return value if shared else value[0]
        part = wait_for(lambda: read_part(self.storage, name, self.rank, self.world_size,
                                          self.requests),
                        answer_first_poll(self.world_size), 2 * self.timeout)
        self._delete_consumed()
        if part is None:
            raise CheckpointError(
                f"{phase}: rank {self.rank} got no answer from the coordinator (rank 0) "
                f"within {2 * self.timeout:g} s: no complete {name!r} in "
                f"{self.storage.checkpoint_id!r}{_OTHER_ID}")
        return wire.decode(part, name)

    def _delete_consumed(self) -> None:
        if self._consumed:
            self.storage.delete(self._consumed)
            self.requests["delete"] += 1
            self._consumed = []

    def close(self) -> None:
        """Coordinator: delete the answers once every rank has read them
        (has deleted its input of the last step), waiting at most
        ``timeout`` seconds; other ranks: nothing to do."""
        if not self.is_coordinator:
            return
        pending = self._last_inputs

        def gone() -> bool | None:
            nonlocal pending
            left = set(pending)
            for i, deleted in self._sweep(pool, lambda n: None if self.storage.exists(n) else 1,
                                          pending):
                self.requests["exists"] += 1
                if deleted:
                    left.discard(pending[i])
            pending = [n for n in pending if n in left]
            return None if pending else True

        if pending:
            with ThreadPoolExecutor(self.read_threads) as pool:
                wait_for(gone, _FIRST_POLL, self.timeout)
        if self._answers:
            self.storage.delete(self._answers)
            self.requests["delete"] += 1
            self._answers = []
