"""The standard save planner: validate, deduplicate, balance.

Dedup key is ``(fqn, global offsets)``: all holders of a chunk hold the same
bytes (whether they really do is checked against checksums at commit), so
exactly one writes it.  Assignment, after PyTorch DCP's greedy dedup but with
two fixes — weights are the chunk's own bytes (DCP uses the whole tensor's
size for DTensor chunks) and ties go to the lowest rank (DCP's depend on set
order):

1. chunks held by a single rank go to that rank;
2. replicated chunks, largest first, each go to the holder with the fewest
   bytes so far (ties to the lowest rank) — the LPT heuristic, whose makespan
   is within 4/3 of optimal.

``save_to_minimum_rank=True`` instead gives every replicated chunk to its
lowest-ranked holder (Megatron's "replica 0 writes").
"""

from __future__ import annotations

from collections import defaultdict

from dcp.boxes import volume
from dcp.errors import CheckpointError
from dcp.planner import SavePlan, SavePlanner, TensorDecl, WriteItem


class DefaultSavePlanner(SavePlanner):
    """Dedup + balanced assignment of chunks to writing ranks."""

    def __init__(self, save_to_minimum_rank: bool = False) -> None:
        self.save_to_minimum_rank = save_to_minimum_rank

    def create_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        decls = _merge_decls(plans)
        holders: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
        items: dict[tuple[str, tuple[int, ...]], WriteItem] = {}
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

        load = [0] * len(plans)
        assigned: list[list[WriteItem]] = [[] for _ in plans]
        replicated = []
        for key, ranks in holders.items():
            if len(ranks) == 1:
                assigned[ranks[0]].append(items[key])
                load[ranks[0]] += items[key].nbytes
            else:
                replicated.append(key)
        replicated.sort(key=lambda k: (-items[k].nbytes, k))
        for key in replicated:
            ranks = holders[key]
            rank = min(ranks) if self.save_to_minimum_rank else min(ranks, key=lambda r: (load[r], r))
            assigned[rank].append(items[key])
            load[rank] += items[key].nbytes
        return [SavePlan(plan.tensors, mine) for plan, mine in zip(plans, assigned)]


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

