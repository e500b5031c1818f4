"""Load: read the metadata, plan, read exactly the needed bytes, fill in place.

Phases (each a collective step, so a failure on any rank raises on all):

1. the coordinator reads the committed metadata once and broadcasts its bytes;
2. every rank matches its state dict against it (DTensor targets whose
   local shards the placements do not give placed by the ranks' agreement,
   :mod:`dcp.coordination.dtensor_offsets`) and the load planner turns
   each needed box into reads of chunk intersections; the coordinator
   refuses ranks that passed another checkpoint id than its own (they would
   read its metadata's file names in their folders), and the global plan picks,
   for each region several ranks need, who reads it from storage and the
   path it takes to the others (page cache, shared memory, broadcast: see
   ``planners.load``);
3. every rank reads, in parallel over files, the byte runs of its
   intersections, coalesced into few large requests by the storage's read
   cost (:mod:`dcp.core.read_plan`) — straight into the target tensor when
   its memory layout allows, else into a host buffer (or a whole chunk's)
   that is then copied (and cast, if allowed) into the target; copies the
   regions other ranks of its host pull into the page cache out of it as
   they arrive, while its own reads are in flight; and passes what it read
   to the others while it reads on: through host shared memory
   to ranks of its own host (:mod:`dcp.coordination.host_exchange`), by
   ``torch.distributed`` broadcast to the rest
   (:mod:`dcp.coordination.broadcast`).

CRC-32C checksums are verified as ``verify`` says: ``"chunks"`` (default)
checks every read that covers a whole chunk, including chunks read whole
because their gaps were cheaper to read than to skip — a read of part of a
chunk cannot be checked without reading the rest of it; ``"all"`` reads whole chunks where
parts are needed, so every loaded byte is checked; ``"none"`` checks
nothing.  ``hyperdcp verify`` checks a whole checkpoint offline.  Of a
compressed chunk (:mod:`dcp.core.compression`) only the frames covering the
needed bytes are read; each one's CRC-32C of its stored bytes is checked
before it is decoded (unless ``"none"``), and the chunk's CRC-32C of its
logical bytes as above, where the whole chunk is decoded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import queue
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ALL_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from dcp.coordination import dtensor_offsets
from dcp.coordination.broadcast import Broadcaster, ReplicaGroups
from dcp.coordination.collectives import Coordinator
from dcp.coordination.host_exchange import HostExchange, host_key
from dcp.coordination.independent import read_metadata_bytes
from dcp.core import compression, devices, read_plan, tensors, unpickler
from dcp.core.boxes import byte_runs, run_extent
from dcp.core.metadata import DTYPE_ITEMSIZE, METADATA_FILE, ChunkMeta, Metadata, checksum, decode
from dcp.core.planner import LoadPlan, LoadPlanner, ReadItem, ReadRequest, Transfer, default_planner
from dcp.core.state_dict import Leaf, flatten, nest, selecting_keys, shaped_like
from dcp.core.storage import (
    StoragePlugin,
    can_read_cached,
    location_key,
    open_storage,
    refuse_differing_locations,
    storage_errors,
)
from dcp.errors import CheckpointError, CorruptCheckpointError
from dcp.orchestration import pending, targets
from dcp.orchestration.gc_pause import gc_paused

#: seconds between two looks at the page cache for bytes other ranks pull
_ARRIVAL_POLL_S = 0.002


@dataclass
class _Framed:
    """The covering frames a load reads of one compressed chunk: chunk
    ``number`` of ``fqn`` for the regions ``indices``, read ``whole`` or
    not, the frame numbers and a buffer for each one's stored bytes."""

    fqn: str
    number: int
    indices: list[int]
    whole: bool
    frames: list[int]
    stored: list[memoryview]

    @property
    def stored_bytes(self) -> int:
        return sum(len(b) for b in self.stored)


@dataclass
class _Decoding:
    """A compressed chunk's frames being decoded as they arrive: its plan,
    its logical bytes once the first frame is in, the frames decoded."""

    plan: _Framed
    logical: torch.Tensor | None = None
    decoded: int = 0


@dataclass
class _Sink:
    """A buffer that storage reads fill: the bytes of one region (``items``
    holds its one index), or of the whole ``chunk``, read for its regions
    ``items``.  ``buf``: the target's own memory when ``direct``, else a
    tensor in staging memory, laid out per wave; ``check``: verify the
    chunk's CRC-32C on it."""

    chunk: ChunkMeta
    dtype: str
    items: list[int]
    nbytes: int
    buf: Any
    check: bool
    direct: bool
    whole_chunk: bool

@dataclass
class LoadReport:
    """What a load did on this rank.

    ``missing_keys``: fqns of the target absent from the checkpoint (left
    untouched; only possible with ``strict=False``).  ``unexpected_keys``:
    fqns of the checkpoint the target lacks.  ``bytes_read``: bytes this rank
    read from storage (gap bytes read through and dropped included);
    ``requests``: the storage requests it made for them.
    ``bytes_from_cache``: bytes it read after another rank of its host had
    pulled them into the storage's shared cache (the page cache path: a
    memory copy, not a storage read), in ``cache_requests`` reads (each
    piece taken as it arrived counts one).
    ``paths``: per replica group (its ranks), the path its regions took and
    the bytes moved that way — ``"storage"`` (read from storage, as stored),
    ``"page_cache"``, ``"shared_memory"``, ``"broadcast"`` — the same list
    on every rank.  ``materialized``: fqns whose target was on the meta
    device, replaced by a real tensor of the saved dtype (on the load's
    ``device``; in the caller's container, or in the state dict handed to a
    Stateful's ``load_state_dict()``).
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    bytes_read: int = 0
    requests: int = 0
    bytes_from_cache: int = 0
    cache_requests: int = 0
    paths: list[tuple[tuple[int, ...], str, int]] = field(default_factory=list)
    materialized: list[str] = field(default_factory=list)


def read_metadata(checkpoint_id: str, *, storage: StoragePlugin | None = None,
                  storage_options: dict | None = None) -> Metadata:
    """The :class:`~dcp.Metadata` of a committed checkpoint (local call, no
    collectives): every tensor's global shape, dtype and chunks (global
    offsets and sizes, file, byte range, CRC-32C, writing rank), and every
    non-tensor value.

    Raises:
        NotACheckpointError: no committed metadata at ``checkpoint_id``.
        CorruptCheckpointError: the metadata is malformed.
    """
    if storage is None:
        storage = open_storage(str(checkpoint_id), **(storage_options or {}))
    with storage_errors(f"reading the metadata of {checkpoint_id!r}"):
        data = read_metadata_bytes(storage)
    return decode(data, f"{checkpoint_id}/{METADATA_FILE}")


def _read_error_kind(error: Exception) -> type[CheckpointError]:
    """What a failed read of a checkpoint's file says about it: corrupt
    (:class:`CorruptCheckpointError`) where the file is missing or too
    short; any other failure (a timeout, a dropped connection, ``EIO``)
    says nothing about the checkpoint (:class:`CheckpointError`)."""
    return CorruptCheckpointError if isinstance(error, FileNotFoundError | EOFError) \
        else CheckpointError


class _Load:
    """State of one load on one rank."""

    #: the checkpoint's metadata, read first by :meth:`run`
    metadata: Metadata

    def __init__(self, state_dict, storage, planner, coordinator, strict,
                 allow_dtype_cast, allow_pickle, max_inflight_bytes, verify, host) -> None:
        if verify not in ("chunks", "all", "none"):
            raise CheckpointError(f"verify must be 'chunks', 'all' or 'none', not {verify!r}")
        self.max_inflight_bytes = max_inflight_bytes
        self.verify = verify
        self.host = host
        # [storage, page cache] x [bytes, requests]
        self.counts = {False: [0, 0], True: [0, 0]}
        self.lock = threading.Lock()
        self.storage = storage
        self.planner = planner
        self.coord = coordinator
        self.strict = strict
        self.allow_dtype_cast = allow_dtype_cast
        self.allow_pickle = allow_pickle
        self.state_dict = state_dict
        self.leaves: dict[str, Leaf] = {}
        self.targets: list[tensors.LocalChunk] = []
        self.requests: list[ReadRequest] = []
        self.objects: list[str] = []
        self.exchange: HostExchange | None = None
        #: chunks this rank checks for its host (None: every chunk it reads whole)
        self.checks: set[tuple[str, int]] | None = None
        #: regions of chunks this rank reads whole and sends whole to its host,
        #: and those chunks
        self.whole: set[ReadItem] = set()
        self.forced: set[tuple[str, int]] = set()
        self.staging = threading.local()
        #: the caller's streams of the targets' accelerator devices (set by
        #: :meth:`read`): every copy into a target is queued there
        self.streams = devices.CallerStreams([])
        #: the load's name in the job, from its first step
        self.session = ""

    #: Called with the metadata before planning, inside the planning step
    #: (so what it raises fails the load on every rank): :func:`load` sets
    #: it to materialize meta-device targets (:mod:`dcp.orchestration.targets`).
    before_planning: Callable[[Metadata | None], None] | None = None

    def local_plan(self) -> LoadPlan:
        try:
            if self.before_planning is not None:
                self.before_planning(self.metadata)
            self.leaves = flatten(self.state_dict, tensors.is_tensor)
        except BaseException:
            dtensor_offsets.agree(self.coord, None)  # the others wait in the agreement
            raise
        # the offsets of DTensor targets whose local shards the placements do not give
        offsets = dtensor_offsets.agree(
            self.coord, {fqn: leaf.value for fqn, leaf in self.leaves.items()})
        for fqn, leaf in self.leaves.items():
            if tensors.is_tensor(leaf.value):
                for chunk in tensors.load_chunks(fqn, leaf.value, offsets.get(fqn)):
                    self.targets.append(chunk)
                    self.requests.append(ReadRequest(fqn, chunk.offsets, chunk.sizes,
                                                     chunk.global_shape, chunk.dtype))
            else:
                self.objects.append(fqn)
        plan = self.planner.create_local_plan(
            self.metadata, self.requests, self.objects, strict=self.strict,
            allow_dtype_cast=self.allow_dtype_cast)
        plan.host = host_key() if self.host is None else self.host
        plan.shared_memory = self.exchange is not None and bool(plan.host)
        plan.shared_cache = self.storage.read_cost.shared_cache
        plan.read_cost = self.storage.read_cost
        by_chunk: dict[tuple[str, int], list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_chunk[(item.fqn, item.chunk)].append(item)
        plan.whole_chunks = [
            (fqn, number, self.metadata.tensors[fqn].chunks[number].nbytes)
            for (fqn, number), items in by_chunk.items() if self._whole_chunk(fqn, number, items)]
        return plan

    def global_plan(self, parts: list[tuple[str, LoadPlan]]) -> list[LoadPlan]:
        """The coordinator's plan from every rank's ``(location, local
        plan)``; refuses ranks that name other checkpoints than the
        coordinator's, whose metadata they planned with."""
        refuse_differing_locations(
            [where for where, _ in parts], "one load",
            "the coordinator read the metadata of its own, and the others would read the files "
            "it names in theirs; nothing was read")
        return self.planner.create_global_plan([plan for _, plan in parts])

    def read(self, plan: LoadPlan) -> None:
        """Read this rank's items and run its transfers."""
        me = self.coord.rank
        self.checks = None if plan.checks is None else set(plan.checks)
        sourced = [t for t in plan.transfers if t.src == me]
        keep = {i for t in sourced if not t.whole_chunk for i in t.items}
        self.whole = {i for t in sourced if t.whole_chunk for i in t.items}
        self.forced = {(i.fqn, i.chunk) for i in self.whole}
        runs = self._arriving_runs(plan)
        later = [i for i in plan.cached if i not in runs]
        self.streams = devices.CallerStreams([t.data for t in self.targets])
        # the pool's copies into accelerator targets run on the caller's streams
        with ThreadPoolExecutor(self._read_threads(plan), initializer=self.streams.enter) as pool:
            try:
                # reads feeding transfers first, in the order the transfers
                # run, one read call per transfer and file; then the rank's
                # own regions; last those another rank of the host pulls
                # into the page cache
                reads: dict[ReadItem, tuple[Future, int]] = {}
                futures = []
                batches = [(t.items, False) for t in sourced]
                for items, cached in [*batches, (plan.items, False), (later, True)]:
                    todo = [i for i in dict.fromkeys(items) if i not in reads]
                    for name, group in self._by_file(todo).items():
                        futures.append(pool.submit(self._read_file, name, group, cached, keep))
                        reads.update((item, (futures[-1], k)) for k, item in enumerate(group))
                if plan.transfers:
                    self._run_transfers(plan, reads)
                if runs:
                    futures += self._read_arriving(runs, futures, pool)
                for future in futures:
                    future.result()
            except BaseException:  # reads not started are dropped; the pool is joined
                pool.shutdown(cancel_futures=True)
                raise
        self._load_objects()

    def _arriving_runs(self, plan: LoadPlan) -> dict[ReadItem, tuple[int, memoryview]]:
        """The regions another rank of the host pulls into the page cache
        that this rank copies out of it as they arrive, while its own reads
        are in flight (:meth:`_read_arriving`), each with its byte run (see
        :meth:`_cache_run`): none where it reads nothing of its own or the
        storage cannot look at its cache, nor of a chunk it reads whole."""
        if not plan.items or not can_read_cached(self.storage):
            return {}
        by_chunk: dict[tuple[str, int], list[ReadItem]] = defaultdict(list)
        for item in dict.fromkeys(plan.cached):
            by_chunk[(item.fqn, item.chunk)].append(item)
        return {item: run for (fqn, number), items in by_chunk.items()
                if not self._reads_whole(fqn, number, items)
                for item in items if (run := self._cache_run(item)) is not None}

    def _cache_run(self, item: ReadItem) -> tuple[int, memoryview] | None:
        """``(file offset, target bytes)`` of a region that is one byte run
        of its chunk and lands in its target's own memory as stored, else
        ``None``; ``None`` too for a region smaller than a request's worth
        of bytes (:attr:`~dcp.core.read_cost.ReadCost.hole_bytes`): looking
        for it in the cache again and again costs more than it overlaps."""
        if item.nbytes < max(1, self.storage.read_cost.hole_bytes):
            return None
        saved = self.metadata.tensors[item.fqn]
        chunk = saved.chunks[item.chunk]
        dest = self._target_region(item)
        if chunk.frames is not None or not tensors.is_direct_target(dest, saved.dtype):
            return None
        rel = [o - c for o, c in zip(item.offsets, chunk.offsets, strict=True)]
        extent = run_extent(chunk.sizes, rel, item.sizes, DTYPE_ITEMSIZE[saved.dtype])
        if extent is None or extent[1] - extent[0] != item.nbytes:
            return None
        return chunk.byte_offset + extent[0], tensors.byte_view(dest)

    def _read_arriving(self, runs: dict[ReadItem, tuple[int, memoryview]],
                       own: list[Future], pool: ThreadPoolExecutor) -> list[Future]:
        """Copy regions other ranks of the host pull into the page cache
        (``runs``: each one's byte run, see :meth:`_cache_run`) into their
        targets as their bytes arrive there, while this rank's own reads
        ``own`` are in flight; then hand what is left to ``pool``, as
        coalesced reads that wait for it, and return their futures.

        Reading one's own share first and copying the others' after it
        leaves the cores idle while the device reads and the device idle
        while they copy; taking what has arrived
        (:meth:`~dcp.core.storage.StoragePlugin.read_cached`) between waits
        overlaps the two.  Measured at W=4 on one 2-core host, a replicated
        512 MiB load: 0.51 s against 0.64 s (medians of 8, alternating in
        one run)."""
        left = {name: [(item, *runs[item]) for item in group]
                for name, group in self._by_file(list(runs)).items()}
        while left and not all(f.done() for f in own):
            arrived = 0
            for name in list(left):
                try:
                    filled = self.storage.read_cached(name, [(o, v) for _, o, v in left[name]])
                except Exception as e:
                    self._raise_read_error(left[name], e)
                pending = []
                for (item, offset, view), n in zip(left[name], filled, strict=True):
                    arrived += n
                    if n:
                        with self.lock:
                            self.counts[True][0] += n
                            self.counts[True][1] += 1
                    if n < len(view):
                        pending.append((item, offset + n, view[n:]))
                left[name] = pending
                if not pending:
                    del left[name]
            if not arrived:  # nothing new: wait a little, or until the own reads end
                wait(own, timeout=_ARRIVAL_POLL_S, return_when=ALL_COMPLETED)
        return [pool.submit(self._read_rest, name, rest) for name, rest in left.items()]

    def _read_rest(self, name: str, rest: list[tuple[ReadItem, int, memoryview]]) -> None:
        """Read the byte runs ``rest`` (region, file offset, target bytes)
        of file ``name`` from the host's cache, waiting for them, in the
        requests the planner makes of them."""
        views = [view for _, _, view in rest]
        runs = [read_plan.Run(offset, len(view), k, 0)
                for k, (_, offset, view) in enumerate(rest)]
        requests = self.planner.create_requests(runs, self.storage.read_cost)
        try:
            self.storage.read_requests(name, _calls(requests, views))
        except Exception as e:
            self._raise_read_error(rest, e)
        with self.lock:
            self.counts[True][0] += sum(r.length for r in requests)
            self.counts[True][1] += len(requests)

    def _raise_read_error(self, rest: list[tuple[ReadItem, int, memoryview]],
                          error: Exception) -> NoReturn:
        """Raise the error naming the region of ``rest`` (region, file
        offset, target bytes) whose read fails alone, else the first."""
        for item, offset, view in rest:
            self._fetch(item.fqn, self.metadata.tensors[item.fqn].chunks[item.chunk],
                        [(offset, view)])
        item = rest[0][0]
        raise self._read_error(item.fqn, self.metadata.tensors[item.fqn].chunks[item.chunk],
                               error) from error

    def _read_threads(self, plan: LoadPlan) -> int:
        """Files read at once: the plugin's ``thread_count``; from a cache the
        host shares (reads that are memory copies, CPU-bound), at most this
        rank's share of the host's cores."""
        threads = max(1, self.storage.thread_count)
        if self.storage.read_cost.shared_cache:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                os.cpu_count() or 1)
            threads = min(threads, max(1, cores // plan.host_ranks))
        return threads

    def _by_file(self, items) -> dict[str, list[ReadItem]]:
        """``items`` by data file, the files in an order that starts at this
        rank's share of them: ranks that read the same files (a resharded
        load, or the page cache path) start on different ones, so the
        storage serves them in parallel and each file is cold for one rank
        only."""
        by_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in items:
            by_file[self.metadata.tensors[item.fqn].chunks[item.chunk].file].append(item)
        names = sorted(by_file)
        start = len(names) * self.coord.rank // self.coord.world_size
        return {name: by_file[name] for name in names[start:] + names[:start]}

    @staticmethod
    def _region(reads: dict, item: ReadItem):
        """The host tensor holding ``item`` once its read is done."""
        future, k = reads[item]
        return future.result()[k]

    @property
    def _host_exchange(self) -> HostExchange:
        """The shared-memory exchange, which every load of several ranks has
        (and only those have transfers)."""
        if self.exchange is None:
            raise CheckpointError("a load of one rank has no transfers between ranks")
        return self.exchange

    def _run_transfers(self, plan: LoadPlan, reads: dict) -> None:
        """Send what this rank read, receive the rest; a failure of a
        transfer is raised only after every transfer ran, so no member is
        left waiting.  Any other failure withdraws what the publisher has
        not handed over yet (:meth:`HostExchange.abort`), so that its thread
        ends; it is joined on every path."""
        failures: list[Exception] = []
        me = self.coord.rank
        exchange = self._host_exchange
        published = [t for t in plan.transfers if t.shared_memory and t.src == me]
        publisher = threading.Thread(target=self._publish, args=(published, reads, failures),
                                     name="dcp-host-exchange")
        publisher.start()
        try:
            with ReplicaGroups(plan.groups, self.coord.group, self.coord.members,
                               self.session) as groups:
                sender = Broadcaster(groups, self.max_inflight_bytes)
                for transfer in plan.transfers:
                    self._transfer(transfer, reads, sender, failures)
                sender.finish()
        except BaseException:
            exchange.abort()
            raise
        finally:
            publisher.join()
        if failures:
            raise failures[0]

    def _transfer(self, transfer: Transfer, reads: dict, sender: Broadcaster,
                  failures: list[Exception]) -> None:
        """This rank's part of one transfer: receive it from shared memory,
        or start its broadcast (host buffers, over gloo); a failure to read
        or unpack is added to ``failures`` (a source that cannot read sends
        zeros, so its receivers are not left waiting)."""
        me = self.coord.rank
        if transfer.shared_memory:
            if transfer.src != me:
                try:
                    self._host_exchange.receive(_key(transfer), transfer.src,
                                                functools.partial(self._unpack_view, transfer))
                except Exception as e:  # raised after all transfers ran
                    failures.append(e)
        elif transfer.src == me:
            try:
                buffer = tensors.flat_bytes([self._region(reads, i) for i in transfer.items])
            except Exception as e:  # raised after all transfers ran
                failures.append(e)
                buffer = tensors.zeros_bytes(transfer.nbytes)
            sender.start(transfer.ranks, transfer.src, buffer, lambda: None)
        else:
            buffer = tensors.zeros_bytes(transfer.nbytes)
            sender.start(transfer.ranks, transfer.src, buffer,
                         functools.partial(self._unpack, transfer, buffer, failures))

    def _publish(self, transfers: list[Transfer], reads: dict,
                 failures: list[Exception]) -> None:
        """Publish, in transfer order, what this rank read for same-host
        members (runs on its own thread, so receiving never waits on it)."""
        exchange = self._host_exchange
        for transfer in transfers:
            key = _key(transfer)
            try:
                # a whole chunk: every item of the source's maps to the same copy
                wanted = transfer.items[:1] if transfer.whole_chunk else transfer.items
                parts = [self._region(reads, i) for i in wanted]
                exchange.publish(key, [tensors.byte_view(p) for p in parts],
                                      tuple(r for r in transfer.ranks if r != transfer.src))
            except Exception as e:  # raised after all transfers ran
                failures.append(e)
                exchange.fail(key, f"reading rank {transfer.src} failed: {e}")
        try:
            exchange.close()
        except Exception as e:  # raised after all transfers ran
            failures.append(e)

    def _unpack_view(self, transfer: Transfer, view: memoryview) -> None:
        """Copy the regions of a transfer from shared memory straight into
        their targets (through a host buffer where the target's layout or
        dtype needs it)."""
        if transfer.whole_chunk:
            item = transfer.items[0]
            saved = self.metadata.tensors[item.fqn]
            chunk = saved.chunks[item.chunk]
            whole = tensors.readonly_view(view, saved.dtype, chunk.sizes)
            for item in transfer.items:
                rel = [o - c for o, c in zip(item.offsets, chunk.offsets, strict=True)]
                tensors.copy_into(self._target_region(item), tensors.region(whole, rel, item.sizes))
            return
        pos = 0
        for item in transfer.items:
            dtype = self.metadata.tensors[item.fqn].dtype
            dest = self._target_region(item)
            direct = tensors.is_direct_target(dest, dtype)
            buf = dest if direct else tensors.empty_host(item.sizes, dtype)
            tensors.byte_view(buf)[:] = view[pos:pos + item.nbytes]
            if not direct:
                tensors.copy_into(dest, buf)
            pos += item.nbytes

    def _unpack(self, transfer, buffer, failures: list[Exception]) -> None:
        """Copy the regions of a received broadcast into their targets."""
        try:
            pos = 0
            for item in transfer.items:
                dtype = self.metadata.tensors[item.fqn].dtype
                src = tensors.from_bytes(buffer[pos:pos + item.nbytes], dtype, item.sizes)
                tensors.copy_into(self._target_region(item), src)
                pos += item.nbytes
        except Exception as e:  # raised after all transfers ran
            failures.append(e)

    def _target_region(self, item: ReadItem):
        target = self.targets[item.request]
        rel = [o - t for o, t in zip(item.offsets, target.offsets, strict=True)]
        return tensors.region(target.data, rel, item.sizes)

    def _read_file(self, name: str, items: list[ReadItem], cached: bool,
                   keep: set[ReadItem]) -> list:
        """Read regions of one file into their targets, in few large
        requests; returns, per region of ``keep`` (those this rank sends on),
        a host tensor of the saved dtype holding it (the target's own memory
        where it was read in place).

        The regions go in waves of at most about one request's worth of
        buffers, laid out in this thread's reused staging memory; per wave,
        the load planner decides which chunks to read whole and coalesces
        the byte runs into requests by the storage's read cost, and the
        storage reads them with one ``read_requests`` call.  ``cached``: the
        regions are in the host's shared cache, pulled (and checked) by
        another rank."""
        cost = self.storage.read_cost
        budget = min(self.max_inflight_bytes, max(cost.max_request_bytes, 32 << 20))
        by_chunk: dict[tuple[str, int], list[int]] = defaultdict(list)
        for k, item in enumerate(items):
            by_chunk[(item.fqn, item.chunk)].append(k)
        out: list = [None] * len(items)
        with contextlib.ExitStack() as stack:
            # from a cache the host shares, chunks read whole are mapped, not read
            mapping = None
            if cost.shared_cache:
                try:
                    mapping = stack.enter_context(self.storage.mapped(name))
                except Exception as e:
                    first = items[0]
                    chunk = self.metadata.tensors[first.fqn].chunks[first.chunk]
                    raise self._read_error(first.fqn, chunk, e) from e
            wave: list[_Sink] = []
            framed: list[_Framed] = []
            held = framed_held = 0
            for (fqn, number), indices in by_chunk.items():
                if self.metadata.tensors[fqn].chunks[number].frames is not None:
                    plan = self._frames_of(fqn, number, items, indices)
                    if framed and framed_held + plan.stored_bytes > budget:
                        self._read_framed(name, framed, items, cached, keep, out)
                        framed, framed_held = [], 0
                    framed.append(plan)
                    framed_held += plan.stored_bytes
                    continue
                sinks = self._sinks(fqn, number, items, indices, cached)
                if mapping is not None and any(s.whole_chunk or not s.direct for s in sinks):
                    self._from_mapping(name, mapping, fqn, number, items, indices, sinks,
                                       cached, keep, out)
                    continue
                need = sum(s.nbytes for s in sinks if not s.direct)
                if wave and held + need > budget:
                    self._read_wave(name, items, wave, cached, keep, out)
                    wave, held = [], 0
                wave += sinks
                held += need
            if wave:
                self._read_wave(name, items, wave, cached, keep, out)
            if framed:
                self._read_framed(name, framed, items, cached, keep, out)
        return out

    def _from_mapping(self, name: str, mapping: memoryview, fqn: str, number: int,
                      items: list[ReadItem], indices: list[int], sinks: list[_Sink],
                      cached: bool, keep: set[ReadItem], out: list) -> None:
        """Copy the regions ``indices`` of a chunk straight out of the mapped
        file into their targets (checking the chunk if a sink says so)."""
        chunk = sinks[0].chunk
        end = chunk.byte_offset + chunk.nbytes
        if end > len(mapping):
            raise CorruptCheckpointError(
                f"{fqn!r}: file {name!r} ends at byte {len(mapping)}, before the end of its "
                f"chunk at offsets {list(chunk.offsets)} (byte {end}): truncated")
        view = mapping[chunk.byte_offset:end]
        whole = _Sink(chunk, sinks[0].dtype, indices, chunk.nbytes,
                      tensors.from_bytes(tensors.bytes_of(view), sinks[0].dtype, chunk.sizes),
                      any(s.check for s in sinks), False, True)
        with self.lock:
            self.counts[cached][0] += sum(items[k].nbytes for k in indices)
            self.counts[cached][1] += 1
        try:
            self._finish(whole, view, items, keep, out)
        finally:
            whole.buf = None
            with contextlib.suppress(BufferError):  # a traceback still holds a tensor of it
                view.release()

    def _frames_of(self, fqn: str, number: int, items: list[ReadItem],
                   indices: list[int]) -> _Framed:
        """The frames of compressed chunk ``number`` of ``fqn`` that cover
        the bytes of its regions ``indices`` (all of them where the chunk is
        read whole), with buffers for their stored bytes."""
        chunk = self.metadata.tensors[fqn].chunks[number]
        index = chunk.frames
        assert index is not None
        itemsize = DTYPE_ITEMSIZE[self.metadata.tensors[fqn].dtype]
        regions = [items[k] for k in indices]
        whole = (any(i.sizes == chunk.sizes for i in regions)
                 or self._reads_whole(fqn, number, regions))
        frames: set[int] = set()
        if whole:
            frames.update(range(len(index.stored)))
        else:
            for item in regions:
                rel = [o - c for o, c in zip(item.offsets, chunk.offsets, strict=True)]
                extent = run_extent(chunk.sizes, rel, item.sizes, itemsize)
                if extent is not None:
                    frames.update(index.covering(extent[0], extent[1]))
        wanted = sorted(frames)
        return _Framed(fqn, number, indices, whole, wanted,
                       [memoryview(bytearray(index.stored[f])) for f in wanted])

    def _read_framed(self, name: str, plans: list[_Framed], items: list[ReadItem],
                     cached: bool, keep: set[ReadItem], out: list) -> None:
        """Read the covering frames of the compressed chunks ``plans`` of
        file ``name`` (:meth:`_frames_of`) in the planner's requests over
        their stored bytes (per chunk; requests of chunks that lie end to
        end joined), in one :meth:`~dcp.core.storage.StoragePlugin.read_streamed`
        call for them all (as uncompressed chunks go in waves), and decode
        each frame on this thread (a reader's) as soon as its stored bytes
        have arrived, while the later ones are still in flight: its CRC-32C
        of its stored bytes first, then into a buffer of the chunk's logical
        size, whose pages outside the decoded frames are never touched.  A
        chunk whose frames are all decoded goes to its targets at once, its
        CRC-32C of its logical bytes checked where all were decoded."""
        cost = self.storage.read_cost
        requests: list[read_plan.Request] = []
        stored: list[memoryview] = []
        owner: list[tuple[int, int]] = []  # per stored buffer: its plan and frame position
        for p, plan in enumerate(plans):
            chunk = self.metadata.tensors[plan.fqn].chunks[plan.number]
            assert chunk.frames is not None
            starts = chunk.frames.stored_offsets()
            requests += self.planner.create_requests(
                [read_plan.Run(chunk.byte_offset + starts[f], chunk.frames.stored[f],
                               len(stored) + k, 0) for k, f in enumerate(plan.frames)], cost)
            stored += plan.stored
            owner += [(p, k) for k in range(len(plan.frames))]
        # each chunk's frames planned on their own (no bytes of another chunk
        # read through), those that lie end to end in one request
        requests = read_plan.join_adjacent(requests, cost.max_request_bytes)
        sinks = _view_sinks(requests)
        views_left = [0] * len(stored)  # a frame may be cut over several requests
        for row in sinks:
            for sink in row:
                if sink is not None:
                    views_left[sink] += 1
        decoding = [_Decoding(plan) for plan in plans]
        arrivals: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        reads = self.storage.read_streamed(name, _calls(requests, stored),
                                           lambda i, j: arrivals.put((i, j)))
        reads.add_done_callback(lambda _: arrivals.put(None))
        try:
            while (got := arrivals.get()) is not None:
                sink = sinks[got[0]][got[1]]
                if sink is None:
                    continue
                views_left[sink] -= 1
                if not views_left[sink]:
                    p, k = owner[sink]
                    if self._decode_frame(decoding[p], k):
                        self._decode_done(decoding[p], items, cached, keep, out)
        except BaseException:
            reads.cancel()
            wait([reads])
            raise
        try:
            reads.result()
        except Exception as e:
            for plan in plans:  # the chunk whose frames fail alone, else the first
                chunk = self.metadata.tensors[plan.fqn].chunks[plan.number]
                assert chunk.frames is not None
                starts = chunk.frames.stored_offsets()
                self._fetch(plan.fqn, chunk, [(chunk.byte_offset + starts[f], buf)
                                              for f, buf in zip(plan.frames, plan.stored,
                                                                strict=True)])
            first = self.metadata.tensors[plans[0].fqn].chunks[plans[0].number]
            raise self._read_error(plans[0].fqn, first, e) from e
        with self.lock:
            self.counts[cached][0] += sum(r.length for r in requests)
            self.counts[cached][1] += len(requests)

    def _decode_frame(self, state: _Decoding, k: int) -> bool:
        """Decode frame position ``k`` of ``state``'s plan into the chunk's
        logical bytes; whether that was its last frame."""
        plan = state.plan
        saved = self.metadata.tensors[plan.fqn]
        chunk = saved.chunks[plan.number]
        assert chunk.frames is not None
        if state.logical is None:
            state.logical = tensors.empty_bytes(chunk.nbytes)
        compression.decode_frames(
            chunk.frames, plan.frames[k:k + 1], plan.stored[k:k + 1],
            tensors.byte_view(state.logical), DTYPE_ITEMSIZE[saved.dtype],
            f"{plan.fqn!r}: compressed chunk at offsets {list(chunk.offsets)} (from byte "
            f"{chunk.byte_offset}) of file {chunk.file!r}", check=self.verify != "none")
        state.decoded += 1
        return state.decoded == len(plan.frames)

    def _decode_done(self, state: _Decoding, items: list[ReadItem], cached: bool,
                     keep: set[ReadItem], out: list) -> None:
        """Hand the regions of a chunk whose frames are all decoded to
        their targets."""
        plan, logical = state.plan, state.logical
        assert logical is not None
        saved = self.metadata.tensors[plan.fqn]
        chunk = saved.chunks[plan.number]
        designated = self.checks is None or (plan.fqn, plan.number) in self.checks
        check = plan.whole and self.verify != "none" and designated and not cached
        sink = _Sink(chunk, saved.dtype, plan.indices, chunk.nbytes,
                     tensors.from_bytes(logical, saved.dtype, chunk.sizes), check, False, True)
        self._finish(sink, tensors.byte_view(logical), items, keep, out)
        state.logical = None

    def _whole_chunk(self, fqn: str, number: int, items: list[ReadItem]) -> bool:
        """Whether this rank reads chunk ``number`` of ``fqn`` whole for its
        regions ``items`` of it: with ``verify="all"`` when they do not cover
        it, else where the load planner finds it no dearer than their runs
        (never for a compressed chunk: its covering frames are read)."""
        saved = self.metadata.tensors[fqn]
        chunk = saved.chunks[number]
        partial = [i for i in items if i.sizes != chunk.sizes]
        if not partial:
            return False
        if self.verify == "all":
            return True
        if chunk.frames is not None:
            return False
        itemsize = DTYPE_ITEMSIZE[saved.dtype]
        extents = []
        for item in partial:
            rel = [o - c for o, c in zip(item.offsets, chunk.offsets, strict=True)]
            extent = run_extent(chunk.sizes, rel, item.sizes, itemsize)
            if extent is not None:
                extents.append(extent)
        return self.planner.read_whole_chunk(chunk.nbytes, extents, self.storage.read_cost)

    def _reads_whole(self, fqn: str, number: int, items: list[ReadItem]) -> bool:
        """Whether this rank reads chunk ``number`` of ``fqn`` whole for its
        regions ``items`` of it: it checks the chunk for its host, sends it
        whole, or finds it no dearer (:meth:`_whole_chunk`)."""
        key = (fqn, number)
        return ((self.checks is not None and key in self.checks) or key in self.forced
                or self._whole_chunk(fqn, number, items))

    def _sinks(self, fqn: str, number: int, items: list[ReadItem], indices: list[int],
               cached: bool) -> list[_Sink]:
        """Where the regions ``items[k]`` (``k`` in ``indices``) of chunk
        ``number`` of ``fqn`` are read to: the whole chunk into one buffer,
        else each region straight into its target when the layout allows,
        or into a buffer.  Checked: reads of a whole chunk, unless the host's
        shared cache is checked by another rank (:attr:`LoadPlan.checks`)."""
        saved = self.metadata.tensors[fqn]
        chunk = saved.chunks[number]
        checks = self.checks
        if self._reads_whole(fqn, number, [items[k] for k in indices]):
            designated = checks is not None and (fqn, number) in checks
            if self.verify == "all":
                # the chunk's last byte first: crafted metadata declaring a huge
                # chunk fails here, before a buffer of its size is allocated
                self._fetch(fqn, chunk, chunk.last_byte())
            check = self.verify != "none" and (checks is None or designated)
            return [_Sink(chunk, saved.dtype, indices, chunk.nbytes, None, check, False, True)]
        sinks = []
        for k in indices:
            item = items[k]
            dest = self._target_region(item)
            direct = tensors.is_direct_target(dest, saved.dtype)
            check = item.sizes == chunk.sizes and self.verify != "none" and not cached
            sinks.append(_Sink(chunk, saved.dtype, [k], item.nbytes, dest if direct else None,
                               check, direct, False))
        return sinks

    def _runs(self, sinks: list[_Sink], items: list[ReadItem]) -> list[read_plan.Run]:
        """The file byte runs that fill ``sinks`` (numbered by position)."""
        runs = []
        for number, sink in enumerate(sinks):
            chunk = sink.chunk
            if sink.whole_chunk:
                runs.append(read_plan.Run(chunk.byte_offset, chunk.nbytes, number, 0))
                continue
            pos = 0
            for start, length in _byte_runs(chunk, items[sink.items[0]],
                                            DTYPE_ITEMSIZE[sink.dtype]):
                runs.append(read_plan.Run(chunk.byte_offset + start, length, number, pos))
                pos += length
        return runs

    def _staging(self, nbytes: int):
        """This thread's reused staging memory, at least ``nbytes`` long:
        page-locked where targets are on an accelerator, once the copies
        out of its last use have run (:meth:`_read_wave`)."""
        local = self.staging
        for event in getattr(local, "events", ()):
            event.synchronize()
        local.events = []
        buf = getattr(local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = local.buf = tensors.empty_bytes(nbytes, pinned=bool(self.streams))
        return buf

    def _read_wave(self, name: str, items: list[ReadItem], sinks: list[_Sink], cached: bool,
                   keep: set[ReadItem], out: list) -> None:
        """Read ``sinks`` with the planner's requests, then verify and copy
        into the targets, filling ``out`` for the regions of ``keep``."""
        staged = [s for s in sinks if not s.direct]
        offsets = [0]
        for sink in staged:
            offsets.append(offsets[-1] + -(-sink.nbytes // 64) * 64)  # 64-byte aligned
        staging = self._staging(offsets[-1])
        for sink, pos in zip(staged, offsets, strict=False):
            shape = sink.chunk.sizes if sink.whole_chunk else items[sink.items[0]].sizes
            sink.buf = tensors.from_bytes(staging[pos:pos + sink.nbytes], sink.dtype, shape)
        views = [tensors.byte_view(s.buf) for s in sinks]
        runs = self._runs(sinks, items)
        requests = self.planner.create_requests(runs, self.storage.read_cost)
        try:
            self.storage.read_requests(name, _calls(requests, views))
        except Exception as e:  # find the region at fault, to name it
            for number, sink in enumerate(sinks):
                ranges = [(r.offset, views[number][r.pos:r.pos + r.length])
                          for r in runs if r.sink == number]
                self._fetch(items[sink.items[0]].fqn, sink.chunk, ranges)
            # each region alone reads (a failure that passed): name the first
            raise self._read_error(items[sinks[0].items[0]].fqn, sinks[0].chunk, e) from e
        with self.lock:
            self.counts[cached][0] += sum(r.length for r in requests)
            self.counts[cached][1] += len(requests)
        for sink, view in zip(sinks, views, strict=True):
            self._finish(sink, view, items, keep, out)
        if self.streams:  # copies into accelerator targets queued: reuse the staging after them
            self.staging.events = self.streams.record()

    def _fetch(self, fqn: str, chunk, ranges) -> None:
        try:
            self.storage.read_ranges(chunk.file, ranges)
        except Exception as e:
            raise self._read_error(fqn, chunk, e) from e

    def _read_error(self, fqn: str, chunk: ChunkMeta, error: Exception) -> CheckpointError:
        """The error naming the region whose read failed (:func:`_read_error_kind`)."""
        kind = _read_error_kind(error)
        return kind(f"{fqn!r}: reading chunk at offsets {list(chunk.offsets)} from file "
                    f"{chunk.file!r} failed on rank {self.coord.rank}: "
                    f"{type(error).__name__}: {error}")

    def _finish(self, sink: _Sink, view: memoryview, items: list[ReadItem],
                keep: set[ReadItem], out: list) -> None:
        """Verify the CRC-32C if due, then copy into the targets; ``out[k]``
        becomes the host tensor holding region ``k`` if this rank sends it
        on."""
        chunk = sink.chunk
        fqn = items[sink.items[0]].fqn
        if sink.check and chunk.checksum is not None and checksum(view) != chunk.checksum:
            raise CorruptCheckpointError(
                f"{fqn!r}: checksum mismatch in chunk at offsets {list(chunk.offsets)} "
                f"(bytes {chunk.byte_offset}..{chunk.byte_offset + chunk.nbytes} of file "
                f"{chunk.file!r}): the checkpoint is corrupted")
        sent = None  # the whole chunk, kept for sending it on
        for k in sink.items:
            item = items[k]
            if sink.direct:
                out[k] = sink.buf
                continue
            buf = sink.buf
            if sink.whole_chunk:
                rel = [o - c for o, c in zip(item.offsets, chunk.offsets, strict=True)]
                buf = tensors.region(buf, rel, item.sizes)
            tensors.copy_into(self._target_region(item), buf)
            # the staging memory is reused: keep a copy of what is sent on
            if item in self.whole:
                sent = tensors.contiguous_copy(sink.buf) if sent is None else sent
                out[k] = sent
            elif item in keep:
                out[k] = tensors.contiguous_copy(buf)

    def _read_blob(self, fqn: str, ref, what: str) -> bytearray:
        """The bytes of a blob, checksum verified; its last byte is read
        first, so crafted metadata declaring a huge blob fails before a
        buffer of its size is allocated."""
        try:
            if ref.nbytes:
                self.storage.read_ranges(
                    ref.file, [(ref.byte_offset + ref.nbytes - 1, memoryview(bytearray(1)))])
            blob = bytearray(ref.nbytes)
            self.storage.read_ranges(ref.file, [(ref.byte_offset, memoryview(blob))])
        except Exception as e:
            raise _read_error_kind(e)(
                f"{fqn!r}: reading its {what} bytes from file {ref.file!r} failed on rank "
                f"{self.coord.rank}: {e}") from e
        if checksum(blob) != ref.checksum:
            raise CorruptCheckpointError(
                f"{fqn!r}: checksum mismatch in its {what} bytes in file {ref.file!r}")
        with self.lock:
            self.counts[False][0] += ref.nbytes
            self.counts[False][1] += 1
        return blob

    def _load_objects(self) -> None:
        for fqn in self.objects:
            saved = self.metadata.objects.get(fqn)
            if saved is None:
                continue
            value: Any
            if saved.raw is not None:  # raw bytes, never unpickled
                blob = self._read_blob(fqn, saved.raw, "raw")
                value = io.BytesIO(blob) if saved.raw_type == "BytesIO" else bytes(blob)
            elif saved.pickled is None:
                value = shaped_like(self.leaves[fqn].value, saved.value)
            else:
                if not self.allow_pickle:
                    raise CheckpointError(
                        f"{fqn!r} is stored pickled; loading it can run code, so it needs "
                        f"allow_pickle=True (only for checkpoints you trust)")
                blob = self._read_blob(fqn, saved.pickled, "pickled")
                value = unpickler.loads(blob, f"{fqn!r} (file {saved.pickled.file!r})")
            self.leaves[fqn].replace(fqn, value)

    def run(self, checkpoint_id: str) -> LoadReport:
        data, self.session = self.coord.broadcast(
            "load: reading metadata", lambda: (read_metadata_bytes(self.storage), uuid.uuid4().hex))
        self.metadata = decode(data, f"{checkpoint_id}/{METADATA_FILE}")
        if self.coord.world_size > 1:
            self.exchange = HostExchange(self.session, self.coord.rank, self.max_inflight_bytes)
        where = location_key(self.storage.checkpoint_id)
        plan = self.coord.gather_scatter("load planning", lambda: (where, self.local_plan()),
                                         self.global_plan)
        try:
            self.coord.run_all("load reading", lambda: self.read(plan))
        finally:
            if self.exchange is not None:  # every rank is past its transfers
                self.exchange.remove_errors()
        (read, requests), (cached, cache_requests) = self.counts[False], self.counts[True]
        return LoadReport(plan.missing_keys, plan.unexpected_keys, read, requests, cached,
                          cache_requests, plan.paths)


def _calls(requests: list[read_plan.Request],
           views: list[memoryview]) -> list[tuple[int, list[memoryview]]]:
    """``requests`` as :meth:`StoragePlugin.read_requests` takes them: each
    run's bytes into ``views[run.sink]`` at ``run.pos``, the gap bytes
    between runs into one scratch buffer."""
    scratch = memoryview(bytearray(read_plan.largest_gap(requests)))
    calls = []
    for request in requests:
        parts, pos = [], request.offset
        for run in request.runs:
            if run.offset > pos:
                parts.append(scratch[:run.offset - pos])
            parts.append(views[run.sink][run.pos:run.pos + run.length])
            pos = run.offset + run.length
        calls.append((request.offset, parts))
    return calls


def _view_sinks(requests: list[read_plan.Request]) -> list[list[int | None]]:
    """Per request, per view of it as :func:`_calls` lays them out: the
    ``views`` index its bytes go to, ``None`` for a gap's scratch view."""
    out = []
    for request in requests:
        row: list[int | None] = []
        pos = request.offset
        for run in request.runs:
            if run.offset > pos:
                row.append(None)
            row.append(run.sink)
            pos = run.offset + run.length
        out.append(row)
    return out


def _byte_runs(chunk: ChunkMeta, item: ReadItem, itemsize: int):
    """The byte runs of region ``item`` inside ``chunk`` (chunk-relative)."""
    rel = [o - c for o, c in zip(item.offsets, chunk.offsets, strict=True)]
    return byte_runs(chunk.sizes, rel, item.sizes, itemsize)


def _key(transfer: Transfer) -> str:
    """A name for ``transfer`` that all its members derive alike: its first
    region is read by one rank into one transfer only (for a whole chunk,
    the chunk, whose regions differ between members)."""
    item = transfer.items[0]
    region = (item.chunk,) if transfer.whole_chunk else (item.chunk, item.offsets, item.sizes)
    ident = repr((transfer.ranks, transfer.src, item.fqn, *region))
    return hashlib.blake2b(ident.encode(), digest_size=12).hexdigest()


def load(state_dict: dict, checkpoint_id: str, *, strict: bool = True,
         allow_dtype_cast: bool = False, allow_pickle: bool = False,
         planner: LoadPlanner | None = None, storage: StoragePlugin | None = None,
         process_group=None, storage_options: dict | None = None,
         max_inflight_bytes: int = 256 << 20, verify: str = "chunks",
         host: str | None = None, device: Any = None) -> LoadReport:
    """Fill ``state_dict`` in place from a checkpoint; collective over the group.

    The target's layout may differ from the saved one (other world size,
    other placements, TP8 -> TP4): each rank reads just the bytes of the
    boxes it holds.  Tensors (and DTensor local shards) are filled in place,
    so tied tensors stay tied; non-tensor leaves are replaced (``bytes`` and
    ``io.BytesIO`` values come back as the type they were saved as).

    A Stateful value (``state_dict()`` / ``load_state_dict()``, at any depth)
    is loaded through its ``state_dict()``, whose tensors are the in-place
    targets; once every read has finished its ``load_state_dict()`` is called
    with the loaded values.  A target on the meta device is replaced by a
    real tensor of the saved dtype on ``device`` and listed in
    :attr:`LoadReport.materialized`; one the checkpoint lacks raises.

    Copies into accelerator targets are queued on the caller's current
    stream of each target's device (``torch.accelerator.current_stream``):
    work queued on that stream after the call sees the loaded values
    without a synchronization; another stream must wait for it first
    (``docs/devices.md``).

    Args:
        state_dict: the target, structured like the saved one.
        checkpoint_id: path or URI of a committed checkpoint.
        strict: raise if a target key is missing from the checkpoint
            (listing all of them); with ``False`` they are reported in
            :attr:`LoadReport.missing_keys` and left untouched.
        allow_dtype_cast: cast when the saved dtype differs from the
            target's, instead of raising.
        allow_pickle: unpickle values saved with ``allow_pickle=True``,
            resolving only the globals :mod:`dcp.core.unpickler` allows
            (containers, scalars, numpy and torch values; add others with
            ``torch.serialization.add_safe_globals``).
        planner, storage, process_group, storage_options: as for
            :func:`dcp.save`.  The default planner reads each region once
            per replica group (per host where the storage's cache is
            shared) and passes it on by the cheapest path
            (``planners.load.DefaultLoadPlanner(replica_path=...)`` picks
            one; ``"none"`` makes every rank read all it needs).
        max_inflight_bytes: bound on the bytes this rank has in flight to
            other ranks at once: broadcast buffers outstanding, and regions
            published in shared memory not yet taken (default 256 MiB).
        verify: which reads are checked against the chunks' CRC-32C:
            ``"chunks"`` every read of a whole chunk (a resharded read of
            part of a chunk is not: that would need the rest of the chunk);
            ``"all"`` every byte, reading whole chunks where parts are
            needed; ``"none"`` nothing.  A chunk the read planner reads
            whole anyway (its gaps cheaper to read than to skip) is checked
            under ``"chunks"`` too.
        host: this rank's host identity: ranks with equal values share the
            storage's page cache and host shared memory.  Default: derived
            from the kernel's boot id and the ``/dev/shm`` mount.  Tests
            pass it to simulate several hosts on one machine.
        device: where targets on the meta device are materialized
            (``torch.device`` or its name); default: the current
            accelerator with its index (``cuda:3``), for a DTensor its
            mesh's device type, else the host.

    A save to ``checkpoint_id`` still in flight in this process
    (:func:`dcp.async_save`) is waited for first.

    Raises:
        NotACheckpointError: nothing committed at ``checkpoint_id``.
        CorruptCheckpointError: a checksum mismatch, or a missing or
            truncated file, naming the fqn, chunk and file.
        CheckpointError: shape or dtype mismatch, missing keys, ranks
            that passed different checkpoint ids (naming each), or a
            failure on another rank (naming it).
    """
    return _run(state_dict, checkpoint_id, None, strict=strict,
                allow_dtype_cast=allow_dtype_cast, allow_pickle=allow_pickle, planner=planner,
                storage=storage, process_group=process_group, storage_options=storage_options,
                max_inflight_bytes=max_inflight_bytes, verify=verify, host=host, device=device)


def _run(state_dict: dict, checkpoint_id: str, fill: Callable[[Metadata], None] | None, *,
         strict: bool, allow_dtype_cast: bool, allow_pickle: bool,
         planner: LoadPlanner | None, storage: StoragePlugin | None, process_group,
         storage_options: dict | None, max_inflight_bytes: int, verify: str,
         host: str | None, device: Any) -> LoadReport:
    """:func:`load`'s phases; ``fill(metadata)``, if given, adds the targets
    to ``state_dict`` once the metadata is known (:func:`load_keys`)."""
    pending.wait(str(checkpoint_id))  # this process's save in flight to it, if any
    coordinator = Coordinator(process_group)
    if storage is None:
        storage = open_storage(str(checkpoint_id), **(storage_options or {}))
    if planner is None:
        planner = default_planner("load")
    prepared = targets.Targets(state_dict, device)
    job = _Load(prepared.state_dict, storage, planner, coordinator, strict, allow_dtype_cast,
                allow_pickle, max_inflight_bytes, verify, host)

    def before_planning(metadata: Metadata | None) -> None:
        if fill is not None and metadata is not None:
            fill(metadata)
        prepared.before_planning(metadata)

    job.before_planning = before_planning
    with gc_paused():
        report = job.run(str(checkpoint_id))
    prepared.finish(report)
    return report


def load_keys(checkpoint_id: str, keys: str | Iterable[str] | None = None,
              prefix: str | None = None, *, allow_pickle: bool = False,
              process_group=None, storage_options: dict | None = None,
              verify: str = "chunks") -> dict[str, Any]:
    """Load entries of a checkpoint without a state dict to fill: a model
    without its optimizer, one optimizer's state, a value or two.

    Returns the selected entries nested as the saved state dict held them,
    as PyTorch DCP's private ``_load_state_dict_from_keys`` returns them:
    each value placed along its fqn's path (:attr:`dcp.Metadata.paths`;
    dict keys as ``str``, list indices as ``int``), so a save of
    ``{"model": model.state_dict(), "blocks": [{"w": w}]}`` gives
    ``{"model": {"layer.weight": t}, "blocks": [{"w": t}]}``; a list holds
    ``None`` at the indices not selected.  Each tensor is whole, a new
    contiguous CPU tensor of its saved shape and dtype; each other value as
    :func:`load` gives it (``bytes`` and ``io.BytesIO`` as saved, JSON
    tuples as lists).  ``keys`` (one or several) selects the fqns whose
    path starts with a key's parts: a key is the dotted join of leading
    parts of the path, the whole fqn included (``"optim.state"`` selects
    ``optim.state.0.exp_avg``; ``"model.a"`` selects ``model.a.w``, not
    ``model.ab``); ``prefix`` selects the same way for one key; both: the
    fqns both select; neither: every fqn; ``keys=[]``: none (``{}``).

    A checkpoint that records no paths (saved by a hyperdcp build that did
    not record them, or converted from a source without them) gives a flat
    ``{fqn: value}``, keys and prefix matched against the fqns' dotted
    parts.  In a process group the call is collective and every rank gets
    every value (a region is read from storage once per host or group and
    passed on, as for :func:`load`).  ``dcp.compat`` routes torch's helper
    here.

    Raises:
        NotACheckpointError: nothing committed at ``checkpoint_id``.
        CheckpointError: a key that selects nothing (naming it), a value
            saved pickled without ``allow_pickle=True``, or what
            :func:`load` raises (a corrupted chunk, naming it).
    """
    wanted = None if keys is None else [keys] if isinstance(keys, str) else list(keys)

    def choose(metadata: Metadata) -> list[str]:
        fqns = select_fqns(metadata, None, prefix)
        if wanted is not None:
            held = {k for f in fqns for k in selecting_keys(f, metadata.path(f))}
            unmatched = [k for k in wanted if k not in held]
            if unmatched:
                raise CheckpointError(
                    f"load_keys: {len(unmatched)} key(s) select nothing in {checkpoint_id!r}"
                    f"{f' under the prefix {prefix!r}' if prefix else ''}: "
                    f"{', '.join(map(repr, unmatched))}")
        return select_fqns(metadata, wanted, prefix)

    return read_selected(checkpoint_id, choose, allow_pickle=allow_pickle,
                         process_group=process_group, storage_options=storage_options,
                         verify=verify)


def select_fqns(metadata: Metadata, keys: Iterable[str] | None,
                prefix: str | None = None) -> list[str]:
    """The fqns of ``metadata``, in its order, that :func:`load_keys`'s
    ``keys`` and ``prefix`` select (``None``: no condition); a key that
    selects nothing is no error here."""
    wanted = None if keys is None else set(keys)
    out = []
    for fqn in metadata.fqns():
        selecting = selecting_keys(fqn, metadata.path(fqn))
        if (prefix is None or prefix in selecting) and (
                wanted is None or not wanted.isdisjoint(selecting)):
            out.append(fqn)
    return out


def read_selected(checkpoint_id: str, choose: Callable[[Metadata], list[str]], *,
                  allow_pickle: bool = False, process_group=None,
                  storage_options: dict | None = None, verify: str = "chunks") -> dict[str, Any]:
    """:func:`load_keys` for the fqns ``choose(metadata)`` returns: their
    values nested by their paths (flat by fqn where the checkpoint records
    none)."""
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[str | int, ...] | None] = {}

    def fill(metadata: Metadata) -> None:
        for fqn in choose(metadata):
            saved = metadata.tensors.get(fqn)
            flat[fqn] = None if saved is None else tensors.empty_host(saved.shape, saved.dtype)
            paths[fqn] = metadata.path(fqn)

    _run(flat, checkpoint_id, fill, strict=True, allow_dtype_cast=False,
         allow_pickle=allow_pickle, planner=None, storage=None, process_group=process_group,
         storage_options=storage_options, max_inflight_bytes=256 << 20, verify=verify,
         host=None, device=None)
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        nest(out, paths[fqn] or (fqn,), value, fqn)
    return out
