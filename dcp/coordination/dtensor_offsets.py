"""Where the local shards of DTensors that their placements do not place start.

``DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 2), stride=(2, 1))``
may hold 5 rows on one rank and 2 on the other, where torch's placement
arithmetic says 4 and 3 at offsets 0 and 4.  A rank alone cannot know where
its rows start: that depends on the other ranks' sizes.  torch 2.13 DCP
records the placements' boxes over the local bytes (overlapping, committed);
here, before a save or a load describes its tensors, :func:`agree` settles
the offsets:

1. every rank checks its own DTensors
   (:func:`dcp.core.tensors.placed_unevenly`), and the group takes the MAX of
   two flags (some shard here is uneven; this rank failed before its leaves
   were known) in one ``all_reduce`` of two integers;
2. only if some rank's shards are uneven (and none failed), one
   ``all_gather_object`` of every rank's DTensor local shapes and of the
   names it found uneven, in :mod:`dcp.coordination.wire`'s encoding; each
   rank then computes its own offsets of the DTensors uneven on any rank
   (but of an empty shard, whose box is empty anywhere), as prefix sums of
   the local sizes along each sharded mesh dimension
   (:func:`dcp.core.tensors.uneven_offsets`).

The boxes are then checked as any others: each inside the global shape (on
its rank), all of a tensor together tiling it (the save planner), so sizes
that sum past the global shape or leave rows out are refused naming the fqn.

The agreement runs in every process where a DTensor can exist
(``torch.distributed.tensor`` imported), whatever its state holds: a rank
whose Stateful raised before its leaves were known joins it all the same
(``leaves=None``), so no rank waits in a collective another never joins,
and the step then fails on every rank with that rank's error.  A process
without DTensors pays no collective.  It runs over the coordinator's gloo
group; coordinators without one (``coordination="none"``, file flags) and a
group of one rank skip it, leaving the placements' offsets.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dcp.coordination import wire
from dcp.coordination.collectives import Coordinator, CoordinatorBase
from dcp.core import tensors


def agree(coord: CoordinatorBase, leaves: Mapping[str, Any] | None) -> dict[str, tuple[int, ...]]:
    """This rank's offsets (elements, one per dimension) of the DTensors
    among ``leaves`` (fqn to leaf value; ``None`` if this rank failed before
    knowing them): for those whose local shards are uneven, on some rank of
    ``coord``'s group, in a way their placements do not give, the prefix
    sums; for the others checked, their placements' (computed here once for
    the describing that follows); other leaves are absent.  Collective over
    the group (see the module's docstring for its cost).

    Raises :class:`~dcp.errors.CheckpointError` naming the fqn for such a
    DTensor that cannot be placed (strided-shard placements, a mesh rank
    outside the group), and what checking this rank's leaves raised, after
    taking part in the agreement.
    """
    if not (isinstance(coord, Coordinator) and coord.distributed and coord.world_size > 1
            and tensors.dtensors_possible()):
        return {}
    shapes: dict[str, tuple[int, ...]] = {}
    placed: dict[str, tuple[int, ...]] = {}  # the placements' offsets, computed once
    uneven: list[str] = []
    error: Exception | None = None
    try:
        for fqn, value in (leaves or {}).items():
            box = tensors.placed_box(value)
            if box is not None:
                shapes[fqn], placed[fqn], differs = box
                if differs:
                    uneven.append(fqn)
    except Exception as e:  # raised below, once every rank has the flags
        error = e
    flags = torch.tensor([int(bool(uneven)), int(leaves is None or error is not None)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=coord.group)
    if error is not None:
        raise error
    if not int(flags[0]) or int(flags[1]):
        return placed
    gathered: list[Any] = [None] * coord.world_size
    dist.all_gather_object(gathered, wire.encode((shapes, uneven)), group=coord.group)
    by_rank: dict[int, dict[str, tuple[int, ...]]] = {}
    concerned: set[str] = set()
    for rank, data in zip(coord.members, gathered, strict=True):
        their_shapes, their_uneven = wire.decode(data, f"rank {rank}'s DTensor local shapes")
        by_rank[rank] = their_shapes
        concerned.update(their_uneven)
    assert leaves is not None  # no rank failed
    placed.update((fqn, tensors.uneven_offsets(fqn, leaves[fqn],
                                               functools.partial(_shape, by_rank, fqn)))
                  for fqn, shape in shapes.items() if fqn in concerned and 0 not in shape)
    return placed


def _shape(by_rank: dict[int, dict[str, tuple[int, ...]]], fqn: str,
           rank: int) -> tuple[int, ...] | None:
    return by_rank.get(rank, {}).get(fqn)
