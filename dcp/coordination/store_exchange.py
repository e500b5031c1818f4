"""Collective steps over the job's key-value store (``torch.distributed``
``Store``), for ranks that share no process group.

An async save whose ranks do not all run in a background process yet (one
still runs in its trainer, :mod:`dcp.asynchronous.async_save`) cannot use
the background processes' gloo group; its steps go through the store the
group meets in instead.  A step is one key per rank: each rank sets its
part (:mod:`dcp.coordination.wire` bytes, never pickle), the coordinator
waits for all of them (``multi_get``: one round trip) and sets one answer
key per rank, which that rank reads and deletes.  A wait polls the keys
(``check``, backing off to 50 ms) and asks ``aborted()`` once per ``poll_s``
seconds whether the save failed elsewhere, so that a rank blocked on a dead
peer fails in about ``poll_s`` instead of ``timeout`` (a thread, unlike a
process, cannot be killed: its waits must end by themselves).

Cost per step: one ``set`` per rank and one ``multi_get`` of ``world_size``
keys at the coordinator, then ``world_size - 1`` answer ``set`` s and one
``get`` per rank, plus up to 20 ``check`` s a second per waiting rank; the
payloads of a save are kilobytes per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dcp.coordination import wire
from dcp.coordination.collectives import CoordinatorBase, failure_of
from dcp.errors import CheckpointError


class StoreCoordinator(CoordinatorBase):
    """The steps of one save over ``store`` under the key prefix ``prefix``
    (unique to the save), as group rank ``rank`` of ``world_size``.

    ``timeout``: seconds any one wait for the other ranks may last.
    ``aborted()``: called once per ``poll_s`` seconds of waiting; a reason
    it returns fails the step on this rank at once, naming it.

    Raises (from every step): :class:`CheckpointError` naming this rank and
    the phase on a timeout, an abort, a store that cannot be reached, or a
    payload that does not encode."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout: float,
                 aborted: Callable[[], str | None] = lambda: None, poll_s: float = 1.0) -> None:
        self.store, self.prefix = store, prefix
        self.rank, self.world_size = rank, world_size
        self.timeout, self.aborted, self.poll_s = timeout, aborted, poll_s

    def _key(self, step: int, what: str) -> str:
        return f"{self.prefix}step{step}/{what}"

    def _wait(self, keys: list[str], phase: str) -> None:
        """Poll until every key of ``keys`` is set (``check``: 1 ms doubling
        to 50 ms; a store's own timed ``wait`` logs a warning per timeout),
        asking ``aborted()`` once per ``poll_s``."""
        deadline = time.monotonic() + self.timeout
        asked = time.monotonic()
        pause = 0.001
        while True:
            try:
                if self.store.check(keys):
                    return
            except Exception as e:  # the store is gone
                raise CheckpointError(f"{phase}: rank {self.rank} lost the job's store: "
                                      f"{type(e).__name__}: {e}") from e
            now = time.monotonic()
            if now - asked >= self.poll_s:
                asked = now
                reason = self.aborted()
                if reason is not None:
                    raise CheckpointError(f"{phase}: rank {self.rank} stopped waiting: the "
                                          f"save failed on another rank: {reason}")
            if now >= deadline:
                raise CheckpointError(
                    f"{phase}: rank {self.rank} waited timeout={self.timeout:g} s for the "
                    f"other ranks (a rank died, hung or timed out)")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _encode(self, value: Any, phase: str) -> bytes:
        try:
            return wire.encode(value)
        except TypeError as e:
            raise CheckpointError(f"{phase}: rank {self.rank}: a payload the store exchange "
                                  f"cannot carry: {e}") from e

    def _gather(self, step, phase, obj):
        self.store.set(self._key(step, f"part{self.rank}"), self._encode(obj, phase))
        if not self.is_coordinator:
            return None
        keys = [self._key(step, f"part{r}") for r in range(self.world_size)]
        self._wait(keys, phase)
        parts = []
        for r, data in enumerate(self.store.multi_get(keys)):
            try:
                parts.append(wire.decode(bytes(data), f"rank {r}'s part of {phase}"))
            except CheckpointError as e:
                parts.append((None, failure_of(r, str(e))))
        for key in keys:
            self.store.delete_key(key)
        return parts

    def _reply(self, step, phase, shared, value):
        if self.is_coordinator:
            data = self._encode(value, phase) if shared else None
            for r in range(1, self.world_size):
                self.store.set(self._key(step, f"reply{r}"),
                               data if shared else self._encode(value[r], phase))
            return value if shared else value[0]
        key = self._key(step, f"reply{self.rank}")
        self._wait([key], phase)
        data = self.store.get(key)
        self.store.delete_key(key)
        return wire.decode(bytes(data), f"the coordinator's answer to {phase}")
