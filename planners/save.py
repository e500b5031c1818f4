"""The standard save planner: validate, deduplicate, balance.

Dedup key is ``(fqn, global offsets)``: all holders of a chunk hold the same
bytes (whether they really do is checked against fingerprints at commit), so
exactly one writes each byte.  Assignment, after PyTorch DCP's greedy dedup
but with two fixes — weights are the chunk's own bytes (DCP uses the whole
tensor's size for DTensor chunks) and ties go to the lowest rank (DCP's
depend on set order):

1. chunks held by a single rank go to that rank;
2. replicated chunks, largest first, each go to the holder with the fewest
   bytes so far (ties to the lowest rank) — the LPT heuristic, whose makespan
   is within 4/3 of optimal.

Splitting replicated chunks (``split_replicated=True``, the default): when
whole chunks leave the busiest writer more than ``tolerance`` above the mean,
a few large replicated chunks held by many ranks (weights replicated over
data parallelism) cannot be spread evenly.  The plan is then made again with
every replicated chunk of at least ``2 * min_piece_bytes`` cut into pieces
along dimension 0, one per holder at most and none under ``min_piece_bytes``;
each piece goes to the least-loaded holder of its chunk, so the pieces of a
chunk usually go to different holders (as in Orbax, where each replica
writes 1/R of a shared shard).  The split plan is kept only if
its busiest writer writes less.  Each piece is a chunk of its own in the
metadata; pieces along dimension 0 are contiguous byte ranges of the
row-major chunk, so a writer writes a slice of its buffer (no copy) and a
reader of the whole chunk reads one run per piece.  Balanced plans — every
small case, equal tensors over equal ranks — keep whole chunks.

``save_to_minimum_rank=True`` instead gives every replicated chunk, whole, to
its lowest-ranked holder (Megatron's "replica 0 writes").
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

from dcp.core.boxes import volume
from dcp.core.planner import SavePlan, SavePlanner, TensorDecl, WriteItem
from dcp.errors import CheckpointError

_Key = tuple[str, tuple[int, ...]]


class DefaultSavePlanner(SavePlanner):
    """Dedup + balanced assignment of chunks (or pieces of them) to writing ranks.

    Args:
        save_to_minimum_rank: every replicated chunk is written whole by its
            lowest-ranked holder.
        split_replicated: cut replicated chunks into pieces written by
            different holders when whole chunks cannot be balanced (see the
            module docstring).
        min_piece_bytes: the smallest piece a chunk is cut into (bytes).
        tolerance: whole chunks are kept while the busiest writer writes at
            most ``1 + tolerance`` times the mean bytes per rank.
    """

    cacheable = True  # the plan depends only on the local plans and the arguments below

    def __init__(self, save_to_minimum_rank: bool = False, split_replicated: bool = True,
                 min_piece_bytes: int = 1 << 20, tolerance: float = 0.05) -> None:
        self.save_to_minimum_rank = save_to_minimum_rank
        self.split_replicated = split_replicated
        self.min_piece_bytes = min_piece_bytes
        self.tolerance = tolerance

    def create_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        decls = _merge_decls(plans)
        holders: dict[_Key, list[int]] = defaultdict(list)
        items: dict[_Key, WriteItem] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                key = (item.fqn, item.offsets)
                first = items.setdefault(key, item)
                if first.sizes != item.sizes:
                    raise CheckpointError(
                        f"{item.fqn!r}: chunk at offsets {list(item.offsets)} has sizes "
                        f"{list(first.sizes)} on rank {holders[key][0]} but {list(item.sizes)} "
                        f"on rank {rank}")
                holders[key].append(rank)
        _check_coverage(decls, items)

        pinned = [0] * len(plans)
        single: list[list[WriteItem]] = [[] for _ in plans]
        replicated = []
        for key, ranks in holders.items():
            if len(ranks) == 1:
                single[ranks[0]].append(items[key])
                pinned[ranks[0]] += items[key].nbytes
            else:
                replicated.append((items[key], ranks))
        if self.save_to_minimum_rank:
            assigned, _ = _assign(pinned, single, [([i], r[:1]) for i, r in replicated])
        else:
            assigned, load = _assign(pinned, single, [([i], r) for i, r in replicated])
            mean = sum(load) / len(load)
            if self.split_replicated and max(load) > (1 + self.tolerance) * mean:
                pieces = [(self._pieces(i, len(r)), r) for i, r in replicated]
                split, split_load = _assign(pinned, single, pieces)
                if max(split_load) < max(load):
                    assigned = split
        return [SavePlan(plan.tensors, mine) for plan, mine in zip(plans, assigned, strict=True)]

    def _pieces(self, item: WriteItem, holders: int) -> list[WriteItem]:
        """``item`` cut along dimension 0 into at most ``holders`` near-equal
        pieces of at least ``min_piece_bytes`` (``[item]`` if it cannot be cut)."""
        if not item.sizes:
            return [item]
        rows = item.sizes[0]
        count = min(holders, rows, item.nbytes // max(1, self.min_piece_bytes))
        if count < 2:
            return [item]
        row_bytes = item.nbytes // rows
        bounds = [rows * k // count for k in range(count + 1)]
        return [WriteItem(item.fqn, (item.offsets[0] + lo, *item.offsets[1:]),
                          (hi - lo, *item.sizes[1:]), (hi - lo) * row_bytes)
                for lo, hi in itertools.pairwise(bounds)]


def _assign(pinned: list[int], single: list[list[WriteItem]],
            replicated: list[tuple[list[WriteItem], list[int]]]
            ) -> tuple[list[list[WriteItem]], list[int]]:
    """Each rank's items and bytes: ``single`` (bytes ``pinned``) plus the
    pieces of every replicated chunk ``(pieces, holders)``, largest first,
    each to the holder of its chunk with the fewest bytes so far (ties to the
    lowest rank).  Chunks go in decreasing order of their largest piece; the
    near-equal pieces of one chunk go one after the other."""
    load = list(pinned)
    assigned = [list(items) for items in single]
    order = sorted(range(len(replicated)),
                   key=lambda n: (-replicated[n][0][0].nbytes, replicated[n][0][0].fqn,
                                  replicated[n][0][0].offsets))
    for n in order:
        pieces, ranks = replicated[n]
        if len(pieces) == 1:
            rank = min(ranks, key=lambda r: (load[r], r))
            assigned[rank].append(pieces[0])
            load[rank] += pieces[0].nbytes
            continue
        heap = [(load[r], r) for r in ranks]
        heapq.heapify(heap)
        for piece in sorted(pieces, key=lambda p: -p.nbytes):
            least, rank = heap[0]
            assigned[rank].append(piece)
            load[rank] = least + piece.nbytes
            heapq.heapreplace(heap, (load[rank], rank))
    return assigned, load


def _merge_decls(plans: list[SavePlan]) -> dict[str, TensorDecl]:
    """Every tensor's declaration; raises if ranks disagree on one."""
    decls: dict[str, TensorDecl] = {}
    first_rank: dict[str, int] = {}
    for rank, plan in enumerate(plans):
        for fqn, decl in plan.tensors.items():
            seen = decls.setdefault(fqn, decl)
            first_rank.setdefault(fqn, rank)
            if seen != decl:
                raise CheckpointError(
                    f"{fqn!r}: rank {first_rank[fqn]} has shape {list(seen.shape)} {seen.dtype} "
                    f"but rank {rank} has shape {list(decl.shape)} {decl.dtype}")
    return decls


def _check_coverage(decls: dict[str, TensorDecl], items: dict) -> None:
    """The distinct chunks of each tensor must add up to the whole tensor."""
    covered: dict[str, int] = defaultdict(int)
    for (fqn, _), item in items.items():
        covered[fqn] += volume(item.sizes)
    for fqn, decl in decls.items():
        if covered[fqn] != volume(decl.shape):
            raise CheckpointError(
                f"{fqn!r}: the ranks' chunks cover {covered[fqn]} of its "
                f"{volume(decl.shape)} elements (shards overlap or are missing)")

