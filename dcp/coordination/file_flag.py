"""The file-flag coordination protocol: the steps of a save over the
checkpoint's own storage, with no communicator at all.

Every file is written with :meth:`StoragePlugin.write_exchange` (payload,
then a trailer holding a magic number, the payload's length and its CRC-32)
and read with :meth:`StoragePlugin.read_exchange`, which returns ``None``
for a missing, torn or still-growing file: a reader accepts complete files
only, and polls the others with exponential backoff (1 ms doubling up to
50 ms: no busy loop).  Payloads are :mod:`dcp.coordination.wire` JSON, never pickles.

One step of the save with key ``K`` (names relative to the checkpoint root;
``NNN`` is the step number):

* every rank writes ``.exchange.K.NNN.in.rRRRRR`` (its part, or its failure);
  only the coordinator (rank 0) reads them: N reads per step;
* the coordinator answers with ``.exchange.K.NNN.out.rRRRRR`` per rank (a
  per-rank answer such as a final save plan) or one ``.exchange.K.NNN.out``
  (an answer for all, such as the committed metadata or a failure); each rank
  reads one file per step, so the protocol does no N^2 reads;
* a rank deletes its input and its per-rank answer once it has read the
  answer; :meth:`FileCoordinator.close` on the coordinator deletes the
  shared answers once every rank has deleted its last input, i.e. has read
  everything.  After a successful save no exchange file remains.

Timeouts: the coordinator waits ``timeout`` seconds for the ranks' inputs and
then answers everyone with a failure naming the ranks that never arrived; a
rank waits twice as long for an answer (so that it normally gets that
failure) and then raises naming the coordinator.
"""

from __future__ import annotations

import time

from dcp.coordination import wire
from dcp.coordination.collectives import CoordinatorBase, failure_of
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError

EXCHANGE_PREFIX = ".exchange."
_FIRST_DELAY, _MAX_DELAY = 0.001, 0.05  # seconds between polls


class FileCoordinator(CoordinatorBase):
    """Runs the steps of one save through exchange files of ``storage``.

    ``key`` must be the same on every rank and unique to this save (it names
    the files); ``rank`` and ``world_size`` place this rank; ``timeout`` (in
    seconds) bounds the coordinator's wait for the ranks at each step, twice
    it a rank's wait for the coordinator.
    """

    def __init__(self, storage: StoragePlugin, key: str, rank: int, world_size: int,
                 timeout: float) -> None:
        self.storage, self.key = storage, key
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._consumed: list[str] = []  # own files to delete once the answer is read
        self._shared: list[str] = []  # coordinator: shared answers written
        self._last_inputs: list[str] = []  # coordinator: other ranks' inputs of the last step

    def _name(self, step: int, what: str) -> str:
        return f"{EXCHANGE_PREFIX}{self.key}.{step:03d}.{what}"

    def _poll(self, names: list[str], need_all: bool, timeout: float) -> dict[str, bytes]:
        """Read complete files among ``names`` until all (``need_all``) or one
        of them is read, or ``timeout`` seconds pass; returns the payloads
        read."""
        got: dict[str, bytes] = {}
        deadline = time.monotonic() + timeout
        delay = _FIRST_DELAY
        while True:
            for name in names:
                if name not in got:
                    payload = self.storage.read_exchange(name)
                    if payload is not None:
                        got[name] = payload
            if len(got) == len(names) or (got and not need_all) or time.monotonic() > deadline:
                return got
            time.sleep(delay)
            delay = min(delay * 2, _MAX_DELAY)

    def _gather(self, step, phase, obj):
        mine = self._name(step, f"in.r{self.rank:05d}")
        self.storage.write_exchange(mine, wire.encode(obj))
        self._consumed.append(mine)
        if not self.is_coordinator:
            return None
        names = [self._name(step, f"in.r{r:05d}") for r in range(self.world_size)]
        got = self._poll(names, need_all=True, timeout=self.timeout)
        self._last_inputs = [n for n in names[1:] if n in got]
        parts = []
        for rank, name in enumerate(names):
            if name not in got:
                parts.append((None, failure_of(rank, (
                    f"rank {rank} never arrived: no complete exchange file {name!r} in "
                    f"{self.storage.checkpoint_id!r} after {self.timeout:g} s"))))
                continue
            try:
                parts.append(wire.decode(got[name], name))
            except CheckpointError as e:
                parts.append((None, failure_of(rank, str(e))))
        return parts

    def _reply(self, step, phase, shared, value):
        if self.is_coordinator:
            if shared:
                name = self._name(step, "out")
                self.storage.write_exchange(name, wire.encode(value))
                self._shared.append(name)
                mine = value
            else:
                for rank in range(1, self.world_size):
                    self.storage.write_exchange(self._name(step, f"out.r{rank:05d}"),
                                                wire.encode(value[rank]))
                mine = value[0]
        else:
            own, common = self._name(step, f"out.r{self.rank:05d}"), self._name(step, "out")
            got = self._poll([own, common], need_all=False, timeout=2 * self.timeout)
            if not got:
                self.storage.delete(self._consumed)
                raise CheckpointError(
                    f"{phase}: rank {self.rank} got no answer from the coordinator (rank 0) "
                    f"within {2 * self.timeout:g} s: no complete {own!r} or {common!r} in "
                    f"{self.storage.checkpoint_id!r}")
            name, payload = next(iter(got.items()))
            mine = wire.decode(payload, name)
            if name == own:
                self._consumed.append(own)
        self.storage.delete(self._consumed)
        self._consumed = []
        return mine

    def close(self) -> None:
        """Coordinator: delete the shared answers once every rank has read
        them (has deleted its input of the last step), waiting at most
        ``timeout`` seconds; other ranks: nothing to do."""
        if not self.is_coordinator:
            return
        deadline = time.monotonic() + self.timeout
        delay = _FIRST_DELAY
        pending = self._last_inputs
        while pending and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, _MAX_DELAY)
            pending = [n for n in pending if self.storage.exists(n)]
        self.storage.delete(self._shared)
