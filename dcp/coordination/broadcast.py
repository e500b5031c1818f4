"""Broadcast of regions read once per replica group (the load side).

The load planner names the replica groups of a load and, in one order that
every member follows, the batches (:class:`~dcp.core.planner.Transfer`) each
group's reader sends.  This module gives each group a gloo communicator,
runs the broadcasts asynchronously so that a batch is sent as soon as it has
been read while the next reads go on, and keeps the bytes in flight under a
bound.

Every buffer is host memory and every group is gloo, whatever the backend
of the load's group: regions are read from storage into host memory, and
the targets copy them onward from there.  A group of the whole load is the
load's coordination group (:func:`dcp.coordination.collectives.coordination_group`,
gloo); any other is a gloo communicator (``ProcessGroupGloo``) that only
its members make, over the job's rendezvous store under a name of the
load's session and the group's place in the plan.  Neither
``torch.distributed.new_group`` way fits: without
``use_local_synchronization`` every rank of the *job* must call it, which
ranks outside a load's subgroup never do; with it, torch names the group
from its ranks and how many groups the calling process holds, which differ
between members that belong to different earlier groups (two overlapping
replica groups), so they would wait for each other under different names.

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
from torch.distributed.distributed_c10d import _get_default_store

from dcp.coordination.collectives import group_timeout

#: How a broadcast is issued on one group: ``(buffer, root)`` -> its work,
#: ``root`` the sender's rank in the group.
_Issue = Callable[[torch.Tensor, int], Any]


class ReplicaGroups:
    """The communicators of a load's replica groups (ranks of the load's
    group ``coordination``, a gloo group whose global ranks are
    ``members``), made by the members of each, named by ``session`` (one
    name per load, the same on every rank).  A context manager: leaving it
    shuts the communicators it made down."""

    def __init__(self, groups: list[tuple[int, ...]], coordination: Any,
                 members: tuple[int, ...], session: str) -> None:
        self._issue: dict[tuple[int, ...], _Issue] = {}
        self._made: list[Any] = []
        me = dist.get_rank()
        timeout = group_timeout(coordination) or dist.default_pg_timeout
        for k, ranks in enumerate(groups):
            if len(ranks) == len(members):
                self._issue[ranks] = _on_group(coordination)
            elif me in (mine := [members[r] for r in ranks]):
                store = dist.PrefixStore(f"hyperdcp/replicas/{session}/{k}/",
                                         _get_default_store())
                gloo = dist.ProcessGroupGloo(store, mine.index(me), len(mine), timeout)
                self._made.append(gloo)
                self._issue[ranks] = _on_backend(gloo)

    def broadcast(self, ranks: tuple[int, ...], src: int, buffer: torch.Tensor) -> Any:
        """Start the broadcast of ``buffer`` from ``src`` (a rank of the
        load) to ``ranks``; returns its work."""
        return self._issue[ranks](buffer, ranks.index(src))

    def __enter__(self) -> ReplicaGroups:
        return self

    def __exit__(self, *exc) -> None:
        self._made.clear()  # a ProcessGroupGloo joins its threads when freed


def _on_group(group: Any) -> _Issue:
    return lambda buffer, root: dist.broadcast(buffer, group=group, group_src=root,
                                               async_op=True)


def _on_backend(gloo: Any) -> _Issue:
    def issue(buffer: torch.Tensor, root: int) -> Any:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        return gloo.broadcast([buffer], options)
    return issue


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
        """Broadcast ``buffer`` (a flat uint8 host tensor) from ``src`` to
        ``ranks``."""
        while self.inflight and self.bytes + buffer.numel() > self.limit:
            self._finish_oldest()
        work = self.groups.broadcast(ranks, src, buffer)
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
