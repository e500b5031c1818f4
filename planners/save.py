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

import numpy as np

from dcp.core.boxes import volume
from dcp.core.plan_columns import ColumnarSavePlan, PlanColumns, columns_of
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
        _check_coverage(decls, items, holders)

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
    merged: set[int] = set()  # tables already merged (decoded plans share theirs)
    for rank, plan in enumerate(plans):
        if id(plan.tensors) in merged:
            continue
        merged.add(id(plan.tensors))
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


def _check_coverage(decls: dict[str, TensorDecl], items: dict,
                    holders: dict[_Key, list[int]]) -> None:
    """The distinct chunks of each tensor must tile it: no two overlap, and
    their elements add up to the whole tensor (each box lies inside it, as
    the ranks check).  A DTensor built with ``DTensor.from_local(...,
    shape=, stride=)`` over local shards the placements do not give is
    placed at the prefix sums of its ranks' local sizes by :func:`dcp.save`
    (sizes that sum short of its shape leave rows out), by the placements'
    offsets by :func:`dcp.async_save` (its boxes overlap): refused here,
    before anything is written."""
    covered: dict[str, int] = defaultdict(int)
    boxes: dict[str, list[_Key]] = defaultdict(list)
    for key, item in items.items():
        covered[key[0]] += volume(item.sizes)
        boxes[key[0]].append(key)
    for fqn, keys in boxes.items():
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                if _boxes_overlap(a[1], items[a].sizes, b[1], items[b].sizes):
                    raise CheckpointError(
                        f"{fqn!r}: the chunk of sizes {list(items[a].sizes)} at offsets "
                        f"{list(a[1])} on rank(s) {holders[a]} overlaps the chunk of sizes "
                        f"{list(items[b].sizes)} at offsets {list(b[1])} on rank(s) "
                        f"{holders[b]}: the ranks' shards do not tile its shape "
                        f"{list(decls[fqn].shape)} (a DTensor whose local shards are "
                        f"uneven in a way its placements do not give, saved by dcp.async_save, "
                        f"which places them by the placements?)")
    for fqn, decl in decls.items():
        if covered[fqn] != volume(decl.shape):
            raise CheckpointError(
                f"{fqn!r}: the ranks' chunks cover {covered[fqn]} of its "
                f"{volume(decl.shape)} elements (shards are missing)")


def _boxes_overlap(a_offsets: tuple[int, ...], a_sizes: tuple[int, ...],
                   b_offsets: tuple[int, ...], b_sizes: tuple[int, ...]) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
               zip(a_offsets, a_sizes, b_offsets, b_sizes, strict=True))


def _any_overlap(fqn: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether two of the distinct chunks (rows; offsets and sizes padded
    alike) of one tensor overlap.  Sorted by tensor and first offset, each
    chunk is tested against the later ones of its tensor that begin before
    it ends along dimension 0: the chunks of its row band, not all pairs.
    ``True`` also where the sort key would not fit 63 bits (the reference
    decides then)."""
    n, width = offsets.shape
    if n < 2 or width == 0:
        return False
    lo0, hi0 = offsets[:, 0] + 1, offsets[:, 0] + sizes[:, 0] + 1  # padding is -1
    span = int(hi0.max()) + 1
    if span * (int(fqn.max()) + 1) >= 1 << 62:
        return True
    order = np.lexsort((lo0, fqn))
    key = fqn[order] * span + lo0[order]
    ends = np.searchsorted(key, fqn[order] * span + hi0[order], side="left")
    later = np.maximum(ends - np.arange(n) - 1, 0)  # candidates after each, in its band
    if not later.any():
        return False
    i = np.repeat(np.arange(n), later)
    j = i + 1 + (np.arange(len(i)) - np.repeat(np.cumsum(later) - later, later))
    a, b = order[i], order[j]
    hi = offsets + sizes
    return bool(np.any(np.all((offsets[a] < hi[b]) & (offsets[b] < hi[a]), axis=1)))


# --- the vectorized planner -----------------------------------------------------

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
    """Every rank's local plan items as flat columns (rank-major order):
    the fqn's index in ``names``, the box's rank, its offsets and sizes
    padded to the widest box (offsets with -1, sizes with 1) and flat
    (``flat_offsets``, ``flat_sizes``, ``ndim`` values per item, from
    ``flat_start``), its bytes and its rank."""

    def __init__(self, names: list[str], index: dict[str, int], fqn: np.ndarray,
                 ndim: np.ndarray, flat_offsets: np.ndarray, flat_sizes: np.ndarray,
                 nbytes: np.ndarray, counts: list[int]) -> None:
        n = len(fqn)
        self.names, self.index, self.fqn, self.ndim, self.nbytes = names, index, fqn, ndim, nbytes
        self.flat_offsets, self.flat_sizes, self.counts = flat_offsets, flat_sizes, counts
        self.rank = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        self.flat_start = np.cumsum(ndim) - ndim
        width = max(1, int(ndim.max()) if n else 1)
        row = np.repeat(np.arange(n), ndim)
        col = np.arange(len(flat_offsets)) - np.repeat(self.flat_start, ndim)
        self.offsets = np.full((n, width), -1, dtype=np.int64)
        self.sizes = np.ones((n, width), dtype=np.int64)
        self.offsets[row, col] = flat_offsets
        self.sizes[row, col] = flat_sizes

    @classmethod
    def of(cls, plans: list[SavePlan]) -> _Columns | None:
        """The columns, or ``None`` for items the fast path leaves to the
        reference (boxes whose offsets and sizes differ in rank, negative
        offsets)."""
        try:
            per_plan = [columns_of(p) for p in plans]
        except ValueError:
            return None
        names: list[str] = []
        index: dict[str, int] = {}
        fqns = []
        known: dict[tuple[str, ...], np.ndarray] = {}  # ranks of a replica group: one table
        for c in per_plan:
            table = tuple(c.names)
            ids = known.get(table)
            if ids is None:
                ids = known[table] = np.array(
                    [index.setdefault(n, len(index)) for n in c.names] or [0], dtype=np.int64)
            fqns.append(ids[c.fqn])
        names = list(index)

        def cat(arrays: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)

        flat_offsets = cat([c.offsets for c in per_plan])
        if len(flat_offsets) and flat_offsets.min() < 0:
            return None
        return cls(names, index, cat(fqns), cat([c.ndim for c in per_plan]), flat_offsets,
                   cat([c.sizes for c in per_plan]), cat([c.nbytes for c in per_plan]),
                   [len(c) for c in per_plan])

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
            at = self.index.get(fqn)
            if (int(covered[at]) if at is not None else 0) != math.prod(decl.shape):
                return None  # the reference names the tensor
        if _any_overlap(self.fqn[first], self.offsets[first], self.sizes[first]):
            return None  # the reference names the tensor and the ranks
        group_of = np.empty(n, dtype=np.int64)
        group_of[order] = group_sorted
        single = counts[group_of] == 1
        pinned = np.zeros(len(self.counts), dtype=np.int64)
        np.add.at(pinned, self.rank[single], self.nbytes[single])
        multi = np.flatnonzero(counts > 1)
        multi = multi[np.argsort(first[multi], kind="stable")]  # first-seen order
        by_name = sorted(self.names)
        name_rank = np.empty(len(by_name), dtype=np.int64)
        name_rank[[self.index[s] for s in by_name]] = np.arange(len(by_name))
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

    def plans(self, plans: list[SavePlan], single: np.ndarray, assigned: _Assigned,
              rep: _Replicated) -> list[SavePlan]:
        """The final plans, as columns: each rank's single-holder items in
        its plan's order, then the replicated chunks (or pieces) it was
        given, in the order they were given."""
        singles = np.flatnonzero(single)
        a_rank, a_j, a_lo, a_hi = (np.array(c, dtype=np.int64) for c in assigned)
        src = np.concatenate([singles, rep.first[a_j]])
        rank = np.concatenate([self.rank[singles], a_rank])
        phase = np.concatenate([np.zeros(len(singles), np.int64), np.ones(len(a_j), np.int64)])
        seq = np.concatenate([singles, np.arange(len(a_j), dtype=np.int64)])
        lo = np.concatenate([np.zeros(len(singles), np.int64), a_lo])
        hi = np.concatenate([np.full(len(singles), -1, np.int64), a_hi])
        order = np.lexsort([seq, phase, rank])
        src, rank, lo, hi = src[order], rank[order], lo[order], hi[order]
        ndim = self.ndim[src]
        piece = hi >= 0
        nbytes = self.nbytes[src].copy()
        rows = np.maximum(self.sizes[src, 0], 1)
        nbytes[piece] = (hi[piece] - lo[piece]) * (nbytes[piece] // rows[piece])
        # the flat boxes of the rows, pieces moved along dimension 0
        starts = np.cumsum(ndim) - ndim
        flat = np.repeat(self.flat_start[src] - starts, ndim) + np.arange(int(ndim.sum()))
        offsets, sizes = self.flat_offsets[flat], self.flat_sizes[flat]
        head = starts[piece]
        offsets[head] += lo[piece]
        sizes[head] = hi[piece] - lo[piece]
        per_rank = np.bincount(rank, minlength=len(plans)).tolist()
        row_at = np.cumsum([0, *per_rank]).tolist()
        flat_at = np.concatenate([[0], np.cumsum(ndim)])[row_at].tolist()
        fqn, names = self.fqn[src], self.names
        out: list[SavePlan] = []
        for r, plan in enumerate(plans):
            a, b, fa, fb = row_at[r], row_at[r + 1], flat_at[r], flat_at[r + 1]
            out.append(ColumnarSavePlan(plan.tensors, PlanColumns(
                names, fqn[a:b], ndim[a:b], offsets[fa:fb], sizes[fa:fb], nbytes[a:b])))
        return out


#: Replicated chunks (or rows ``lo:hi`` of them; ``hi < 0``: whole) given to
#: ranks, in the order given: four columns (rank, chunk, lo, hi).
_Assigned = tuple[list[int], list[int], list[int], list[int]]


def _assign_columns(pinned: list[int], rep: _Replicated, pieces: np.ndarray | None,
                    minimum: bool = False) -> tuple[_Assigned, list[int]]:
    """:func:`_assign` over columns: what each rank is given
    (:data:`_Assigned`) and each rank's bytes.  ``pieces``: how many pieces
    each chunk is cut into (``None``: whole chunks); ``minimum``: every
    chunk to its lowest holder."""
    load = np.array(pinned, dtype=np.int64)
    to_rank: list[int] = []
    chunk: list[int] = []
    lows: list[int] = []
    highs: list[int] = []

    def give(r: int, j: int, lo: int, hi: int) -> None:
        to_rank.append(r)
        chunk.append(j)
        lows.append(lo)
        highs.append(hi)

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
            give(r, j, 0, -1)
            load[r] += nbytes[j]
            continue
        k = counts[j]
        if k < 2:
            r = int(h[int(np.argmin(load[h]))])  # the first least-loaded: the lowest rank
            give(r, j, 0, -1)
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
            give(r, j, lo, hi)
            heapq.heapreplace(heap, (least + (hi - lo) * step, r))
        for value, r in heap:
            load[r] = value
    return (to_rank, chunk, lows, highs), load.tolist()
