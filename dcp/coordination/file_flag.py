"""The file-flag coordination protocol: the steps of a save over the
checkpoint's own storage, with no communicator at all.

Built for the clusters that choose it: thousands of ranks on a shared
filesystem or an object store, where object collectives time out.  Per step
the coordinator makes O(N) storage requests and every other rank O(1) (plus
its polls, which back off), and nobody lists a directory.

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

Payloads are :mod:`dcp.coordination.wire`'s versioned, zstd-compressed,
columnar JSON, never pickles.  Polls start 1 ms apart and double: up to
50 ms for the coordinator's inputs, and, for an answer, up to
:func:`answer_poll_cap` (longer at larger worlds, whose steps take longer),
so a rank's polls per step stay few at any scale.

Cleanup: a rank deletes its input once it has read the answer;
:meth:`FileCoordinator.close` on the coordinator deletes the answers once
every rank has deleted its last input, i.e. has read everything.  After a
successful save no exchange file remains.

Timeouts: the coordinator waits ``timeout`` seconds for the ranks' inputs and
then answers everyone with a failure naming the ranks that never arrived; a
rank waits twice as long for an answer (so that it normally gets that
failure) and then raises naming the coordinator — a coordinator killed
between steps surfaces so on every other rank.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dcp.coordination import wire
from dcp.coordination.collectives import CoordinatorBase, failure_of
from dcp.core.metadata import checksum
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError

EXCHANGE_PREFIX = ".exchange."
_FIRST_DELAY, _MAX_DELAY = 0.001, 0.05  # seconds between polls
#: The most concurrent reads of the coordinator.
MAX_READ_POOL = 64

ANSWER_VERSION = 1
_ANSWER_MAGIC = b"DCPA"
# magic, version, shared (1) or per rank (0), world size, part offset,
# part length, part CRC-32C, CRC-32C of the preceding 28 bytes
_ENTRY = struct.Struct("<4sHHIQIII")
ENTRY_BYTES = _ENTRY.size  # 32


def poll_delays(cap: float) -> Iterator[float]:
    """Seconds between successive polls: 1 ms, doubling up to ``cap``."""
    delay = _FIRST_DELAY
    while True:
        yield delay
        delay = min(delay * 2, cap)


def answer_poll_cap(world_size: int) -> float:
    """The longest pause between a rank's polls for an answer: 50 ms up to
    500 ranks, then 0.1 ms per rank up to 1 s (a coordinator's step costs
    about a millisecond per rank, so a rank polls a bounded number of times
    and detects the answer within a few percent of the step)."""
    return max(_MAX_DELAY, min(1.0, world_size * 1e-4))


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

    def _read_input(self, name: str) -> bytes | None:
        return self.storage.read_exchange(name)

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
        deadline = time.monotonic() + self.timeout
        delays = poll_delays(_MAX_DELAY)
        with ThreadPoolExecutor(self.read_threads) as pool:
            while True:
                # decoded here as they arrive, while the pool reads on
                payloads = pool.map(self._read_input, [names[r] for r in pending])
                for rank, payload in zip(pending, payloads, strict=True):
                    if payload is None:
                        self.requests["miss"] += 1
                        continue
                    self.requests["read"] += 1
                    try:
                        parts[rank] = wire.decode(payload, names[rank])
                    except CheckpointError as e:
                        parts[rank] = (None, failure_of(rank, str(e)))
                pending = [r for r in pending if r not in parts]
                if not pending or time.monotonic() > deadline:
                    break
                time.sleep(next(delays))
        self._last_inputs = [names[r] for r in names if r not in pending]
        for rank in pending:
            parts[rank] = (None, failure_of(rank, (
                f"rank {rank} never arrived: no complete exchange file {names[rank]!r} in "
                f"{self.storage.checkpoint_id!r} after {self.timeout:g} s")))
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
        deadline = time.monotonic() + 2 * self.timeout
        delays = poll_delays(answer_poll_cap(self.world_size))
        while (part := read_part(self.storage, name, self.rank, self.world_size,
                                 self.requests)) is None:
            if time.monotonic() > deadline:
                self._delete_consumed()
                raise CheckpointError(
                    f"{phase}: rank {self.rank} got no answer from the coordinator (rank 0) "
                    f"within {2 * self.timeout:g} s: no complete {name!r} in "
                    f"{self.storage.checkpoint_id!r}")
            time.sleep(next(delays))
        self._delete_consumed()
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
        deadline = time.monotonic() + self.timeout
        delays = poll_delays(_MAX_DELAY)
        pending = self._last_inputs
        with ThreadPoolExecutor(self.read_threads) as pool:
            while pending and time.monotonic() < deadline:
                time.sleep(next(delays))
                self.requests["exists"] += len(pending)
                pending = [n for n, there in zip(pending, pool.map(self.storage.exists, pending),
                                                         strict=True) if there]
        if self._answers:
            self.storage.delete(self._answers)
            self.requests["delete"] += 1
            self._answers = []
