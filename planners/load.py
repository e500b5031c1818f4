"""The standard load planner: match keys, intersect boxes, read once.

Local plan: each box a rank needs is intersected with every saved chunk of
its tensor as N-dimensional half-open boxes; only the intersections are
read, so a checkpoint saved with one layout (TP8, Shard(0), ...) loads into
another (TP4, Shard(1), ...) without offline conversion and without reading
whole chunks for a slice.

Global plan: a region — an intersection ``(fqn, chunk, box)`` — that
several ranks need (data-parallel replicas, a replicated tensor, or a slice
several new-layout ranks share) is read from storage once per replica
group, or once per host of it where the host shares a cache of the storage,
and reaches the other members by the cheapest path (``replica_path``):

* ``page_cache`` — the storage's data is cached per host and shared by its
  ranks (POSIX, network filesystems: the page cache;
  :attr:`~dcp.core.read_cost.ReadCost.shared_cache`): on each host one
  member pulls the region from storage and every other member reads it
  itself, from the page cache, taking what has arrived while its own pulls
  are in flight (:meth:`~dcp.core.storage.StoragePlugin.read_cached`) — one
  storage read per host and one memory copy per rank, nothing passed
  between ranks.  A region of a compressed chunk would cost every one of
  them a decoding of its covering frames as well: where the read cost
  says a copy through host shared memory is cheaper than a re-read and a
  decoding (per extra rank: its bytes at the storage's bandwidth, against
  the frames' stored bytes plus their logical bytes at
  :attr:`~dcp.core.read_cost.ReadCost.decode_bps`; at POSIX's defaults
  always, for any frame that is coded), the puller decodes it once for the
  host and passes it on as ``shared_memory`` below does.  An uncompressed
  region costs the same both ways and keeps the page cache.
* ``shared_memory`` — nothing is shared (object stores): one member reads,
  passes the bytes to the members of its host through host shared memory
  (:mod:`dcp.coordination.host_exchange`, one copy per receiver) and to the
  members on other hosts by ``torch.distributed`` broadcast (gloo, from
  host memory, whatever the job's backend).  Storage bytes: once for the
  whole group.
* ``broadcast`` — one member reads and broadcasts to all the others.
* ``none`` — every rank reads all it needs itself.

``auto`` (the default) takes ``page_cache`` where the storage's cache is
shared and ``shared_memory`` elsewhere.  Readers (and pullers) are chosen
to balance the seconds each rank spends reading from storage and decoding,
as the storage's :class:`~dcp.core.read_cost.ReadCost` estimates them
(:meth:`~dcp.core.planner.ReadItem.seconds`: a request's latency, the
stored bytes, the logical bytes of coded frames): regions only one rank
needs count first, then shared regions, dearest first, go to the member
with the fewest seconds so far (seconds within one request's latency of
each other count as ties, to the lowest rank: regions of like cost keep
their key order, and chunks that lie end to end in a file one reader).
Bytes alone would count a compressed region by its stored bytes, though
decoding it takes its reader longer than reading it (1.5 GB/s of logical
bytes per thread, against POSIX's 2 GB/s of stored bytes).  Regions with the
same group and reader are batched into transfers of about ``batch_bytes``.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections import Counter, defaultdict
from itertools import zip_longest

from dcp.core.boxes import intersect_many, run_extent, volume
from dcp.core.compression import RAW, FrameIndex
from dcp.core.metadata import DTYPE_ITEMSIZE, Metadata, ObjectMeta
from dcp.core.planner import (
    BROADCAST,
    PAGE_CACHE,
    SHARED_MEMORY,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    ReadRequest,
    Transfer,
)
from dcp.core.read_cost import ReadCost
from dcp.errors import CheckpointError

REPLICA_PATHS = ("auto", PAGE_CACHE, SHARED_MEMORY, BROADCAST, "none")


class DefaultLoadPlanner(LoadPlanner):
    """Key matching, box intersection, and each replica group's region read
    once (per host where the page cache is shared), passed on by the
    cheapest path.

    ``replica_path`` is one of :data:`REPLICA_PATHS` (see the module
    docstring; ``"auto"`` by default).  ``batch_bytes`` (default 16 MiB) is
    the size up to which small regions are packed into one transfer.

    Raises:
        CheckpointError: an unknown ``replica_path``.
    """

    def __init__(self, replica_path: str = "auto", batch_bytes: int = 16 << 20) -> None:
        if replica_path not in REPLICA_PATHS:
            raise CheckpointError(f"replica_path must be one of {', '.join(REPLICA_PATHS)}, "
                                  f"not {replica_path!r}")
        self.replica_path = replica_path
        self.batch_bytes = batch_bytes

    def create_local_plan(self, metadata: Metadata, requests: list[ReadRequest],
                          objects: list[str], *, strict: bool,
                          allow_dtype_cast: bool) -> LoadPlan:
        plan = LoadPlan()
        wanted = {r.fqn for r in requests} | set(objects)
        plan.unexpected_keys = [f for f in metadata.fqns() if f not in wanted]
        for fqn in objects:
            if fqn in metadata.tensors:
                tensor = metadata.tensors[fqn]
                raise CheckpointError(
                    f"{fqn!r}: the target holds a plain value there, but the checkpoint holds a "
                    f"tensor of shape {list(tensor.shape)} and dtype {tensor.dtype}")
        plan.missing_keys = [f for f in objects if f not in metadata.objects]
        for index, req in enumerate(requests):
            saved = metadata.tensors.get(req.fqn)
            if saved is None:
                if req.fqn in metadata.objects:
                    raise CheckpointError(
                        f"{req.fqn!r}: the target holds a tensor there, but the checkpoint holds "
                        f"{_describe(metadata.objects[req.fqn])}")
                if req.fqn not in plan.missing_keys[-1:]:  # a rank's boxes of it follow on
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
                        table.offsets, table.sizes, req.offsets, req.sizes), strict=True):
                    n = volume(sizes)
                    item = ReadItem(req.fqn, index, number, tuple(offsets), tuple(sizes),
                                    n * itemsize)
                    frames = table.frames.get(number)
                    if frames is not None:
                        item = _with_frames(item, frames, table.offsets[number].tolist(),
                                            table.sizes[number].tolist(), itemsize)
                    plan.items.append(item)
                    found += n
            if found != volume(req.sizes):
                raise CheckpointError(
                    f"{req.fqn!r}: the checkpoint's chunks cover {found} of the "
                    f"{volume(req.sizes)} elements needed at offsets {list(req.offsets)}")
        if strict and plan.missing_keys:
            raise CheckpointError(
                f"{len(plan.missing_keys)} key(s) of the target are not in the checkpoint: "
                f"{', '.join(plan.missing_keys)}{_nearest(plan.missing_keys, metadata)} "
                f"(pass strict=False to load the rest)")
        if plan.missing_keys and len(plan.missing_keys) == len(wanted):
            warnings.warn(
                f"strict=False load matched none of the target's {len(wanted)} key(s): nothing "
                f"was loaded{_nearest(plan.missing_keys, metadata)}", stacklevel=4)
        return plan

    def resolve_path(self, plans: list[LoadPlan]) -> str:
        """The path every replica group of this load takes."""
        if self.replica_path != "auto":
            return self.replica_path
        return PAGE_CACHE if plans and plans[0].shared_cache else SHARED_MEMORY

    def create_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if len(plans) == 1:
            return plans
        final = self._assign(plans)
        if plans[0].shared_cache:
            _designate_checks(plans, final)
        per_host = Counter(p.host or f"rank {r}" for r, p in enumerate(plans))
        for rank, plan in enumerate(final):
            plan.host_ranks = per_host[plans[rank].host or f"rank {rank}"]
        return final

    def _assign(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Who reads each region from storage, and how it reaches the other
        ranks that need it."""
        path = self.resolve_path(plans)
        if path == "none":
            return [LoadPlan(items=p.items, missing_keys=p.missing_keys,
                             unexpected_keys=p.unexpected_keys) for p in plans]
        needers: dict[tuple, list[tuple[int, ReadItem]]] = defaultdict(list)
        for rank, plan in enumerate(plans):
            for item in plan.items:
                needers[(item.fqn, item.chunk, item.offsets, item.sizes)].append((rank, item))
        final = [LoadPlan(missing_keys=p.missing_keys, unexpected_keys=p.unexpected_keys)
                 for p in plans]
        cost = plans[0].read_cost
        read = [0.0] * len(plans)  # estimated seconds of each rank's storage reads
        shared = []
        single: list[list[ReadItem]] = [[] for _ in plans]
        for key, holders in needers.items():
            if len(holders) == 1:
                rank, item = holders[0]
                single[rank].append(item)
                read[rank] += item.seconds(cost)
            else:
                shared.append(key)
        # dearest first; regions within one request's latency of each other
        # in key order, so that chunks lying end to end go to one reader
        slack = cost.latency_s

        def dearest_first(k: tuple) -> tuple:
            seconds = needers[k][0][1].seconds(cost)
            return -(seconds // slack) if slack else -seconds, k

        shared.sort(key=dearest_first)
        hosts = [p.host for p in plans]
        moved: dict[tuple[tuple[int, ...], str], int] = defaultdict(int)
        chunk_stream: list[dict[int, Transfer]] = []
        if path == SHARED_MEMORY:
            chunk_stream = _share_chunks(plans, single, read, moved)
        for rank, items in enumerate(single):
            final[rank].items.extend(items)
        by_group: dict[tuple[tuple[int, ...], int, bool], list[tuple]] = defaultdict(list)
        for key in shared:
            holder_of = dict(needers[key])
            ranks = tuple(sorted(holder_of))
            first = holder_of[ranks[0]]
            nbytes = first.nbytes
            if path == PAGE_CACHE:
                decode_once = _decode_once(first, cost)
                for part in _by_host(ranks, hosts):
                    puller = _least_read(part, read, cost.latency_s)
                    read[puller] += first.seconds(cost)
                    final[puller].items.append(holder_of[puller])
                    moved[(ranks, "storage")] += first.read_nbytes
                    others = len(part) - 1
                    if others and decode_once and all(plans[r].shared_memory for r in part):
                        by_group[(part, puller, True)].append(key)
                        moved[(ranks, SHARED_MEMORY)] += nbytes * others
                        continue
                    for r in part:
                        if r != puller:
                            final[r].cached.append(holder_of[r])
                            moved[(ranks, PAGE_CACHE)] += nbytes
                continue
            src = _least_read(ranks, read, cost.latency_s)
            read[src] += first.seconds(cost)
            final[src].items.append(holder_of[src])
            moved[(ranks, "storage")] += first.read_nbytes
            local: tuple[int, ...] = ()
            if path == SHARED_MEMORY and hosts[src] and plans[src].shared_memory:
                local = tuple(r for r in ranks if r != src and hosts[r] == hosts[src]
                              and plans[r].shared_memory)
            remote = tuple(r for r in ranks if r != src and r not in local)
            for members, shm in ((local, True), (remote, False)):
                if members:
                    by_group[(tuple(sorted((src, *members))), src, shm)].append(key)
                    moved[(ranks, SHARED_MEMORY if shm else BROADCAST)] += nbytes * len(members)
        # one stream of batches per (group, reader, path), interleaved so that
        # every reader's first transfer comes early in the order all ranks follow
        streams = [[{rank: Transfer(ranks, src, tuple(item for k in batch for r, item in needers[k]
                                                      if r == rank), shm)
                     for rank in ranks}
                    for batch in self._batches(keys, needers)]
                   for (ranks, src, shm), keys in sorted(by_group.items())]
        for wave in zip_longest(chunk_stream, *streams):
            for entry in wave:
                for rank, transfer in (entry or {}).items():
                    final[rank].transfers.append(transfer)
        groups = sorted({ranks for ranks, _, shm in by_group if not shm})
        paths = sorted((ranks, way, n) for (ranks, way), n in moved.items())
        for plan in final:
            plan.groups = groups
            plan.paths = paths
        return final

    def _batches(self, keys: list[tuple], needers) -> list[list[tuple]]:
        batches: list[list[tuple]] = []
        size = 0
        for key in keys:
            nbytes = needers[key][0][1].nbytes
            if not batches or size + nbytes > self.batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(key)
            size += nbytes
        return batches


def _with_frames(item: ReadItem, frames: FrameIndex, chunk_offsets: list[int],
                 chunk_sizes: list[int], itemsize: int) -> ReadItem:
    """``item``, a region of a compressed chunk at ``chunk_offsets`` of
    ``chunk_sizes`` (elements of ``itemsize`` bytes) framed as ``frames``,
    with the stored bytes of the frames covering its byte runs and the
    logical bytes of those of them that are coded (not raw): a slice of the
    two frame tables, no loop over frames."""
    rel = [o - c for o, c in zip(item.offsets, chunk_offsets, strict=True)]
    extent = run_extent(chunk_sizes, rel, item.sizes, itemsize)
    if extent is None:
        return item
    covering = frames.covering(extent[0], extent[1])
    first, stop = covering.start, covering.stop
    stored = sum(frames.stored[first:stop])
    coded = (stop - first) - frames.kinds[first:stop].count(RAW)
    if coded and frames.kinds[stop - 1] != RAW:  # the chunk's last frame may be short
        last = frames.logical_size(stop - 1, volume(chunk_sizes) * itemsize)
        decoded = (coded - 1) * frames.frame_bytes + last
    else:
        decoded = coded * frames.frame_bytes
    return dataclasses.replace(item, stored_nbytes=stored, decode_nbytes=decoded)


def _by_host(ranks: tuple[int, ...], hosts: list[str]) -> list[tuple[int, ...]]:
    """``ranks`` split by host, in rank order; a rank with no host (``""``)
    is a host of its own."""
    parts: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        parts[hosts[r] or f"rank {r}"].append(r)
    return [tuple(p) for p in parts.values()]


def _describe(saved: ObjectMeta) -> str:
    """What a non-tensor entry of a checkpoint holds, for messages."""
    if saved.pickled is not None:
        return "a pickled value"
    if getattr(saved, "raw", None) is not None:
        return "a bytes value"
    text = repr(saved.value)
    text = text if len(text) <= 40 else text[:37] + "..."
    kind = type(saved.value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} value ({text})"


def _nearest(missing: list[str], metadata: Metadata) -> str:
    """A hint naming the checkpoint key nearest to the first missing key:
    the same key under another prefix (``module.``, ``model.``), or the
    closest spelling; empty if none is near."""
    keys = metadata.fqns()
    fqn = missing[0]
    for key in keys:
        if key.endswith("." + fqn):
            return (f"; the checkpoint has {key!r}: its keys carry the prefix "
                    f"{key[:-len(fqn)]!r} that the target's lack")
        if fqn.endswith("." + key):
            return (f"; the checkpoint has {key!r}: the target's keys carry the prefix "
                    f"{fqn[:-len(key)]!r} that the checkpoint's lack")
    close = difflib.get_close_matches(fqn, keys, n=1)
    return f"; nearest key in the checkpoint to {fqn!r}: {close[0]!r}" if close else ""


def _share_chunks(plans: list[LoadPlan], single: list[list[ReadItem]], read: list[float],
                  moved: dict[tuple[tuple[int, ...], str], int]) -> list[dict[int, Transfer]]:
    """Chunks that several ranks of one host read whole, each for regions
    only it needs (a resharded load): one of them reads the chunk, the others
    take their regions out of it through host shared memory, instead of
    every rank fetching the whole chunk.  Moves the receivers' items out of
    ``single`` and updates ``read``; returns the transfers, one entry (rank
    -> its :class:`Transfer`) per chunk."""
    wanted = {(rank, fqn, number): nbytes for rank, p in enumerate(plans) if p.shared_memory
              and p.host for fqn, number, nbytes in p.whole_chunks}
    members: dict[tuple[str, str, int], dict[int, list[ReadItem]]] = defaultdict(
        lambda: defaultdict(list))
    for rank, items in enumerate(single):
        for item in items:
            if (rank, item.fqn, item.chunk) in wanted:
                members[(plans[rank].host, item.fqn, item.chunk)][rank].append(item)
    stream = []
    cost = plans[0].read_cost
    received: list[set[ReadItem]] = [set() for _ in plans]
    sizes = {(fqn, number): nbytes for (_, fqn, number), nbytes in wanted.items()}
    for key in sorted(members, key=lambda k: (-sizes[k[1:]], k)):
        fqn, number, of_rank = key[1], key[2], members[key]
        if len(of_rank) < 2:
            continue
        ranks = tuple(sorted(of_rank))
        for r in ranks:
            read[r] -= sum(i.seconds(cost) for i in of_rank[r])
        src = _least_read(ranks, read, cost.latency_s)
        nbytes = wanted[(src, fqn, number)]
        read[src] += cost.seconds(nbytes)
        for r in ranks:
            if r != src:
                received[r].update(of_rank[r])
        moved[(ranks, "storage")] += nbytes
        moved[(ranks, SHARED_MEMORY)] += nbytes * (len(ranks) - 1)
        stream.append({r: Transfer(ranks, src, tuple(of_rank[r]), True, whole_chunk=True)
                       for r in ranks})
    for r, taken in enumerate(received):
        if taken:
            single[r] = [i for i in single[r] if i not in taken]
    return stream


def _designate_checks(plans: list[LoadPlan], final: list[LoadPlan]) -> None:
    """On storage whose cache a host shares, give each chunk that ranks of
    one host read whole (for parts of it) one checker among them, balancing
    the bytes each checks: the others read the same cached bytes."""
    reads = [{(i.fqn, i.chunk) for i in [*p.items, *p.cached]} for p in final]
    checked = [0] * len(plans)
    candidates: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    sizes: dict[tuple[str, int], int] = {}
    for rank, plan in enumerate(plans):
        for fqn, number, nbytes in plan.whole_chunks:
            if (fqn, number) in reads[rank]:
                candidates[(plan.host or f"rank {rank}", fqn, number)].append(rank)
                sizes[(fqn, number)] = nbytes
    for plan in final:
        plan.checks = []
    for (_, fqn, number), ranks in sorted(candidates.items(), key=lambda kv: (
            -sizes[kv[0][1:]], kv[0])):
        checker = min(ranks, key=lambda r: (checked[r], r))
        checked[checker] += sizes[(fqn, number)]
        checks = final[checker].checks
        assert checks is not None
        checks.append((fqn, number))


def _least_read(ranks: tuple[int, ...], read: list[float], slack: float) -> int:
    """The lowest rank of ``ranks`` whose estimated seconds of reading so
    far are within ``slack`` (a request's latency: below the model's
    resolution) of the fewest."""
    least = min(read[r] for r in ranks)
    return min(r for r in ranks if read[r] <= least + slack)


def _decode_once(item: ReadItem, cost: ReadCost) -> bool:
    """Whether a region that several ranks of a host need, on storage whose
    cache the host shares, is cheaper read and decoded by one of them and
    copied to each other through host shared memory than re-read from the
    cache and decoded by each: per extra rank, a copy of its ``nbytes``
    (costed as a read of them from the cache) against a read of the
    covering frames' stored bytes and their decoding.  Not for an
    uncompressed region: the two then cost the same, and the page cache
    needs no rank to wait for another's read."""
    return cost.seconds(item.nbytes) < cost.seconds(item.read_nbytes, item.decode_nbytes)
