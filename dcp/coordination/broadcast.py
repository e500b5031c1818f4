"""Broadcast of regions read once per replica group (the load side).

The load planner names the replica groups of a load and, in one order that
every member follows, the batches (:class:`~dcp.core.planner.Transfer`) each
group's reader sends.  This module creates those groups with
``torch.distributed.new_group`` (all ranks, in the plan's order, so they
agree without extra traffic), runs the broadcasts asynchronously so that a
batch is sent as soon as it has been read while the next reads go on, keeps
the bytes in flight under a bound, and destroys the groups afterwards.

No deadlock: every rank issues its transfers in the one global order and
only ever waits on transfers it has already issued; the earliest unfinished
transfer therefore always has all its members issuing it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dcp.errors import CheckpointError


class ReplicaGroups:
    """The process groups of a load's replica groups (ranks of
    ``process_group``); a context manager that destroys the ones it made."""

    def __init__(self, groups: list[tuple[int, ...]], process_group, world_size: int) -> None:
        self._groups: dict[tuple[int, ...], object] = {}
        self._created: list[Any] = []
        for ranks in groups:
            if len(ranks) == world_size:
                self._groups[ranks] = process_group
                continue
            global_ranks = [dist.get_global_rank(process_group, r) if process_group else r
                            for r in ranks]
            group = dist.new_group(global_ranks)
            self._groups[ranks] = group
            self._created.append(group)
        self._parent = process_group

    def group(self, ranks: tuple[int, ...]):
        """The process group of ``ranks``."""
        return self._groups[ranks]

    def global_rank(self, src: int) -> int:
        """``src`` (a rank of the load's group) as a global rank."""
        return dist.get_global_rank(self._parent, src) if self._parent else src

    def __enter__(self) -> ReplicaGroups:
        return self

    def __exit__(self, *exc) -> None:
        for group in self._created:
            dist.destroy_process_group(group)


def comm_device(process_group) -> torch.device:
    """Where broadcast buffers live: host memory for gloo, else the current
    accelerator (CUDA/NCCL, NPU/HCCL)."""
    backend = str(dist.get_backend(process_group))
    if "gloo" in backend:
        return torch.device("cpu")
    device = torch.accelerator.current_accelerator()
    if device is None:
        raise CheckpointError(f"process group backend {backend!r} is not gloo, and torch finds "
                              f"no accelerator to hold its broadcast buffers")
    return device


class Broadcaster:
    """Issues asynchronous broadcasts with at most ``max_inflight_bytes`` of
    buffers outstanding; each finished one runs its ``on_done`` callback."""

    def __init__(self, groups: ReplicaGroups, max_inflight_bytes: int) -> None:
        self.groups = groups
        self.limit = max_inflight_bytes
        self.inflight: deque[tuple[Any, int, Callable[[], None]]] = deque()
        self.bytes = 0

    def start(self, ranks: tuple[int, ...], src: int, buffer: torch.Tensor,
              on_done: Callable[[], None]) -> None:
        """Broadcast ``buffer`` (a flat uint8 tensor) from ``src`` to ``ranks``."""
        while self.inflight and self.bytes + buffer.numel() > self.limit:
            self._finish_oldest()
        work = dist.broadcast(buffer, self.groups.global_rank(src),
                              group=self.groups.group(ranks), async_op=True)
        self.inflight.append((work, buffer.numel(), on_done))
        self.bytes += buffer.numel()

    def _finish_oldest(self) -> None:
        work, nbytes, on_done = self.inflight.popleft()
        work.wait()
        self.bytes -= nbytes
        on_done()

    def finish(self) -> None:
        """Wait for every broadcast and run the callbacks, oldest first."""
        while self.inflight:
            self._finish_oldest()
