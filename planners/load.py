"""The standard load planner: match keys, intersect boxes, read once.

Local plan: each box a rank needs is intersected with every saved chunk of
its tensor as N-dimensional half-open boxes; only the intersections are
read, so a checkpoint saved with one layout (TP8, Shard(0), ...) loads into
another (TP4, Shard(1), ...) without offline conversion and without reading
whole chunks for a slice.

Global plan (``broadcast=True``, the default): a region — an intersection
``(fqn, chunk, box)`` — that several ranks need (data-parallel replicas, a
replicated tensor, or a slice several new-layout ranks share) is read from
storage by one of them and broadcast to the rest, turning R reads into one.
The reader is chosen to balance bytes read per rank: regions only one rank
needs count first, then shared regions, largest first, go to the member with
the fewest bytes so far (ties to the lowest rank).  Regions with the same
group and reader are batched into transfers of about ``batch_bytes``.  A
transfer whose members all share a host (the same non-empty
``LoadPlan.host``) goes through host shared memory
(:mod:`dcp.coordination.host_exchange`: one copy per receiver, no socket); the others
are ``torch.distributed`` broadcasts (gloo, NCCL, HCCL).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import zip_longest

from dcp.core.boxes import intersect_many, volume
from dcp.errors import CheckpointError
from dcp.core.metadata import DTYPE_ITEMSIZE, Metadata
from dcp.core.planner import LoadPlan, LoadPlanner, ReadItem, ReadRequest, Transfer


class DefaultLoadPlanner(LoadPlanner):
    """Key matching, box intersection, and read-once-then-broadcast.

    ``broadcast=False`` makes every rank read all it needs itself (for
    storage where reads are cheaper than the network).  ``batch_bytes``
    (default 16 MiB) is the size up to which small regions are packed into
    one transfer.  ``shared_memory=False`` sends every transfer by
    ``torch.distributed`` broadcast, even between ranks of one host.
    """

    def __init__(self, broadcast: bool = True, batch_bytes: int = 16 << 20,
                 shared_memory: bool = True) -> None:
        self.broadcast = broadcast
        self.batch_bytes = batch_bytes
        self.shared_memory = shared_memory

    def create_local_plan(self, metadata: Metadata, requests: list[ReadRequest],
                          objects: list[str], *, strict: bool,
                          allow_dtype_cast: bool) -> LoadPlan:
        plan = LoadPlan()
        wanted = {r.fqn for r in requests} | set(objects)
        plan.unexpected_keys = [f for f in metadata.fqns() if f not in wanted]
        plan.missing_keys = [f for f in objects if f not in metadata.objects]
        for index, req in enumerate(requests):
            saved = metadata.tensors.get(req.fqn)
            if saved is None:
                plan.missing_keys.append(req.fqn)
                continue
            if saved.shape != req.shape:
                raise CheckpointError(
                    f"{req.fqn!r}: checkpoint shape {list(saved.shape)} != target shape "
                    f"{list(req.shape)}")
            if saved.dtype != req.dtype and not allow_dtype_cast:
                raise CheckpointError(
                    f"{req.fqn!r}: checkpoint dtype {saved.dtype} != target dtype {req.dtype} "
                    f"(pass allow_dtype_cast=True to cast)")
            found = 0
            itemsize = DTYPE_ITEMSIZE[saved.dtype]
            table = saved.table()
            if volume(req.sizes):
                for number, offsets, sizes in zip(*intersect_many(
                        table.offsets, table.sizes, req.offsets, req.sizes)):
                    n = volume(sizes)
                    plan.items.append(ReadItem(req.fqn, index, number, tuple(offsets),
                                               tuple(sizes), n * itemsize))
                    found += n
            if found != volume(req.sizes):
                raise CheckpointError(
                    f"{req.fqn!r}: the checkpoint's chunks cover {found} of the "
                    f"{volume(req.sizes)} elements needed at offsets {list(req.offsets)}")
        if strict and plan.missing_keys:
            raise CheckpointError(
                f"{len(plan.missing_keys)} key(s) of the target are not in the checkpoint: "
                f"{', '.join(plan.missing_keys)} (pass strict=False to load the rest)")
        return plan

    def create_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if not self.broadcast or len(plans) == 1:
            return plans
        needers: dict[tuple, list[tuple[int, ReadItem]]] = defaultdict(list)
        for rank, plan in enumerate(plans):
            for item in plan.items:
                needers[(item.fqn, item.chunk, item.offsets, item.sizes)].append((rank, item))
        final = [LoadPlan(missing_keys=p.missing_keys, unexpected_keys=p.unexpected_keys)
                 for p in plans]
        read = [0] * len(plans)
        shared = []
        for key, holders in needers.items():
            if len(holders) == 1:
                rank, item = holders[0]
                final[rank].items.append(item)
                read[rank] += item.nbytes
            else:
                shared.append(key)
        shared.sort(key=lambda k: (-needers[k][0][1].nbytes, k))
        by_group: dict[tuple[tuple[int, ...], int], list[tuple]] = defaultdict(list)
        for key in shared:
            holders = dict(needers[key])
            src = min(holders, key=lambda r: (read[r], r))
            read[src] += holders[src].nbytes
            final[src].items.append(holders[src])
            by_group[(tuple(sorted(holders)), src)].append(key)
        # one stream of batches per (group, reader), interleaved so that every
        # reader's first broadcast comes early in the order all ranks follow
        streams = [[(ranks, src, batch) for batch in self._batches(keys, needers)]
                   for (ranks, src), keys in sorted(by_group.items())]
        hosts = [p.host for p in plans]
        same_host = {ranks: self.shared_memory and bool(hosts[ranks[0]])
                     and all(hosts[r] == hosts[ranks[0]] for r in ranks)
                     for ranks, _ in by_group}
        for ranks, src, batch in (b for wave in zip_longest(*streams) for b in wave if b):
            for rank in ranks:
                items = tuple(item for k in batch for r, item in needers[k] if r == rank)
                final[rank].transfers.append(Transfer(ranks, src, items, same_host[ranks]))
        groups = sorted(ranks for ranks, shm in same_host.items() if not shm)
        for plan in final:
            plan.groups = groups
        return final

    def _batches(self, keys: list[tuple], needers) -> list[list[tuple]]:
        batches, size = [], 0
        for key in keys:
            nbytes = needers[key][0][1].nbytes
            if not batches or size + nbytes > self.batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(key)
            size += nbytes
        return batches
