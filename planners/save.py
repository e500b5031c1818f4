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
import math
from collections import defaultdict
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

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
        """Every rank's final plan.  Dedup, coverage and the order of the
        replicated chunks run over flat numpy columns of all the items; only
        the greedy assignment itself walks the replicated chunks one by one.
        The decisions are :meth:`reference_global_plan`'s, item for item
        (tests/test_save_planner_columns.py); failures and rare inputs (a
        rank offering one chunk twice, negative offsets) are handed to it."""
        decls = _merge_decls(plans)
        cols = _Columns.of(plans)
        if cols is None:
            return self.reference_global_plan(plans)
        groups = cols.groups(decls)
        if groups is None:  # an error to name, or a case left to the reference
            return self.reference_global_plan(plans)
        single, pinned, rep = groups
        if self.save_to_minimum_rank:
            assigned, _ = _assign_columns(pinned, rep, None, minimum=True)
        else:
            assigned, load = _assign_columns(pinned, rep, None)
            mean = sum(load) / len(load)
            if self.split_replicated and max(load) > (1 + self.tolerance) * mean:
                counts = self._piece_counts(rep)
                split, split_load = _assign_columns(pinned, rep, counts)
                if max(split_load) < max(load):
                    assigned = split
        return cols.plans(plans, single, assigned, rep)

    def _piece_counts(self, rep: _Replicated) -> np.ndarray:
        """How many pieces each replicated chunk is cut into (1: whole), as
        :meth:`_pieces` cuts it."""
        rows = np.where(rep.ndim > 0, rep.rows, 1)
        count = np.minimum(np.minimum(rep.holder_count, rows),
                           rep.nbytes // max(1, self.min_piece_bytes))
        return np.where((rep.ndim > 0) & (count >= 2), count, 1)

    def reference_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The same plans as :meth:`create_global_plan`, made item by item
        (the definition the vectorized planner is tested against; it also
        makes the error messages and the rare cases the fast path leaves to it)."""
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
            if seen is decl or (seen.shape == decl.shape and seen.dtype == decl.dtype):
                first_rank.setdefault(fqn, rank)  # the usual case: declarations agree
                continue
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



# --- the vectorized planner -----------------------------------------------------

_FQN, _OFFSETS, _SIZES, _NBYTES = (attrgetter(a) for a in ("fqn", "offsets", "sizes", "nbytes"))


@dataclass
class _Replicated:
    """The chunks held by several ranks, as columns (one row each, in the
    order their keys were first seen): the index of the first holder's item,
    its ``nbytes``, ``rows`` (sizes[0], 1 for 0-dim), ``ndim``, the fqn's
    place in sorted order, the padded offsets, and the holders (CSR:
    ``holders[start[j]:start[j] + holder_count[j]]``, ascending)."""

    first: np.ndarray
    nbytes: np.ndarray
    rows: np.ndarray
    ndim: np.ndarray
    name_rank: np.ndarray
    offsets: np.ndarray
    start: np.ndarray
    holder_count: np.ndarray
    holders: np.ndarray


class _Columns:
    """Every rank's local plan items as flat columns (rank-major order)."""

    def __init__(self, items: list[WriteItem], names: dict[str, int], fqn: np.ndarray,
                 ndim: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, nbytes: np.ndarray,
                 rank: np.ndarray, counts: list[int]) -> None:
        self.items, self.names, self.fqn, self.ndim = items, names, fqn, ndim
        self.offsets, self.sizes, self.nbytes, self.rank = offsets, sizes, nbytes, rank
        self.counts = counts

    @classmethod
    def of(cls, plans: list[SavePlan]) -> _Columns | None:
        """The columns, or ``None`` for items the fast path leaves to the
        reference (boxes whose offsets and sizes differ in rank, negative
        offsets)."""
        items: list[WriteItem] = list(itertools.chain.from_iterable(p.items for p in plans))
        counts = [len(p.items) for p in plans]
        names: dict[str, int] = {}
        fqns = list(map(_FQN, items))
        for name in dict.fromkeys(fqns):
            names[name] = len(names)
        offs = list(map(_OFFSETS, items))
        sizes = list(map(_SIZES, items))
        ndims = list(map(len, offs))
        if ndims != list(map(len, sizes)):
            return None
        n = len(items)
        ndim = np.array(ndims, dtype=np.int64)
        width = max(1, int(ndim.max()) if n else 1)
        flat_o = np.fromiter(itertools.chain.from_iterable(offs), dtype=np.int64,
                             count=int(ndim.sum()))
        flat_s = np.fromiter(itertools.chain.from_iterable(sizes), dtype=np.int64,
                             count=len(flat_o))
        if len(flat_o) and flat_o.min() < 0:
            return None
        row = np.repeat(np.arange(n), ndim)
        col = np.arange(len(flat_o)) - np.repeat(np.cumsum(ndim) - ndim, ndim)
        pad_o = np.full((n, width), -1, dtype=np.int64)
        pad_s = np.ones((n, width), dtype=np.int64)
        pad_o[row, col] = flat_o
        pad_s[row, col] = flat_s
        fqn = np.fromiter(map(names.__getitem__, fqns), dtype=np.int64, count=n)
        nbytes = np.fromiter(map(_NBYTES, items), dtype=np.int64, count=n)
        rank = np.repeat(np.arange(len(plans), dtype=np.int64), counts)
        return cls(items, names, fqn, ndim, pad_o, pad_s, nbytes, rank, counts)

    def groups(self, decls: dict[str, TensorDecl]
               ) -> tuple[np.ndarray, list[int], _Replicated] | None:
        """Which items are their chunk's only holder, each rank's bytes of
        those (``pinned``), and the replicated chunks; ``None`` where the
        reference must decide (and raise): a chunk with differing sizes, a
        rank offering one chunk twice, a tensor not covered."""
        n, width = self.offsets.shape
        keys = [self.offsets[:, d] for d in reversed(range(width))] + [self.ndim, self.fqn]
        order = np.lexsort(keys)  # stable: within a chunk, rank order
        if n:
            new = np.zeros(n, dtype=bool)
            new[0] = True
            for column in keys:
                sorted_col = column[order]
                new[1:] |= sorted_col[1:] != sorted_col[:-1]
            starts = np.flatnonzero(new)
        else:
            starts = np.zeros(0, dtype=np.int64)
        counts = np.diff(np.append(starts, n))
        group_sorted = np.repeat(np.arange(len(starts)), counts)
        first = order[starts]
        ranks_sorted = self.rank[order]
        same_group = group_sorted[1:] == group_sorted[:-1]
        if np.any(same_group & (ranks_sorted[1:] == ranks_sorted[:-1])):
            return None  # a rank offers a chunk twice
        if np.any(self.sizes[order] != self.sizes[first[group_sorted]]):
            return None  # holders disagree on a chunk's sizes: the reference names them
        volume = self.sizes[first].prod(axis=1)
        covered = np.zeros(len(self.names), dtype=np.int64)
        np.add.at(covered, self.fqn[first], volume)
        for fqn, decl in decls.items():
            at = self.names.get(fqn)
            if (int(covered[at]) if at is not None else 0) != math.prod(decl.shape):
                return None  # the reference names the tensor
        group_of = np.empty(n, dtype=np.int64)
        group_of[order] = group_sorted
        single = counts[group_of] == 1
        pinned = np.zeros(len(self.counts), dtype=np.int64)
        np.add.at(pinned, self.rank[single], self.nbytes[single])
        multi = np.flatnonzero(counts > 1)
        multi = multi[np.argsort(first[multi], kind="stable")]  # first-seen order
        by_name = sorted(self.names)
        name_rank = np.empty(len(by_name), dtype=np.int64)
        name_rank[[self.names[s] for s in by_name]] = np.arange(len(by_name))
        lengths = counts[multi]
        member = np.repeat(starts[multi], lengths) + (
            np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths))
        f = first[multi]
        rep = _Replicated(first=f, nbytes=self.nbytes[f],
                          rows=np.where(self.ndim[f] > 0, self.sizes[f, 0], 1),
                          ndim=self.ndim[f], name_rank=name_rank[self.fqn[f]],
                          offsets=self.offsets[f], start=np.cumsum(lengths) - lengths,
                          holder_count=lengths, holders=ranks_sorted[member])
        return single, pinned.tolist(), rep

    def plans(self, plans: list[SavePlan], single: np.ndarray,
              assigned: list[list[tuple[int, int, int]]], rep: _Replicated) -> list[SavePlan]:
        """The final plans: each rank's single-holder items in its plan's
        order, then the replicated chunks (or pieces) it was given, in the
        order they were given."""
        items, out, at = self.items, [], 0
        mask = single.tolist()
        first, rows, nbytes = rep.first.tolist(), rep.rows.tolist(), rep.nbytes.tolist()
        for plan, count, given in zip(plans, self.counts, assigned, strict=True):
            mine = list(itertools.compress(items[at:at + count], mask[at:at + count]))
            at += count
            for j, lo, hi in given:
                item = items[first[j]]
                if hi < 0:
                    mine.append(item)
                    continue
                o, z = item.offsets, item.sizes
                mine.append(WriteItem(item.fqn, (o[0] + lo, *o[1:]), (hi - lo, *z[1:]),
                                      (hi - lo) * (nbytes[j] // rows[j])))
            out.append(SavePlan(plan.tensors, mine))
        return out


def _assign_columns(pinned: list[int], rep: _Replicated, pieces: np.ndarray | None,
                    minimum: bool = False) -> tuple[list[list[tuple[int, int, int]]], list[int]]:
    """:func:`_assign` over columns: each rank gets ``(chunk, lo, hi)``
    (rows ``lo:hi`` of replicated chunk ``chunk``; ``hi < 0``: whole) and
    its bytes.  ``pieces``: how many pieces each chunk is cut into (``None``:
    whole chunks); ``minimum``: every chunk to its lowest holder."""
    load = np.array(pinned, dtype=np.int64)
    assigned: list[list[tuple[int, int, int]]] = [[] for _ in pinned]
    count = pieces if pieces is not None else np.ones(len(rep.first), dtype=np.int64)
    rows = rep.rows
    row_bytes = rep.nbytes // np.maximum(rows, 1)
    first_piece = np.where(count >= 2, (rows // np.maximum(count, 1)) * row_bytes, rep.nbytes)
    keys = [rep.offsets[:, d] for d in reversed(range(rep.offsets.shape[1]))]
    order: list[int] = (np.lexsort([*keys, rep.name_rank, -first_piece]).tolist()
                        if len(rep.first) else [])
    holders, start, holder_count = rep.holders, rep.start, rep.holder_count
    counts, rows_l, row_bytes_l = count.tolist(), rows.tolist(), row_bytes.tolist()
    nbytes = rep.nbytes.tolist()
    for j in order:
        h = holders[start[j]:start[j] + holder_count[j]]
        if minimum:
            r = int(h[0])
            assigned[r].append((j, 0, -1))
            load[r] += nbytes[j]
            continue
        k = counts[j]
        if k < 2:
            r = int(h[int(np.argmin(load[h]))])  # the first least-loaded: the lowest rank
            assigned[r].append((j, 0, -1))
            load[r] += nbytes[j]
            continue
        n = rows_l[j]
        bounds = [n * i // k for i in range(k + 1)]
        step = row_bytes_l[j]
        spans = sorted(itertools.pairwise(bounds), key=lambda s: -(s[1] - s[0]) * step)
        heap = list(zip(load[h].tolist(), h.tolist(), strict=True))
        heapq.heapify(heap)
        for lo, hi in spans:
            least, r = heap[0]
            assigned[r].append((j, lo, hi))
            heapq.heapreplace(heap, (least + (hi - lo) * step, r))
        for value, r in heap:
            load[r] = value
    return assigned, load.tolist()
