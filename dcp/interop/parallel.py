"""Conversions at disk speed: concurrent, aligned, budgeted copies between
formats, on one rank or shared over a job's ranks.

A conversion is a copy whose bytes are known in advance — where each tensor
lies in the source, where it goes in the destination — so it is planned
whole before a byte moves, then run as independent *file tasks*:

* **import** (:func:`import_checkpoint`, any source presented as a
  :class:`~dcp.core.storage.StoragePlugin` with its metadata, such as a
  safetensors folder): the tensors are packed in source order into data
  files of about ``tensor_bytes(buffer_bytes) / FILES_IN_FLIGHT``, each tensor of at
  least :data:`~dcp.core.storage.ALIGNED_CHUNK_BYTES` starting at the
  destination's alignment.  A task allocates one aligned buffer for its
  file, reads every tensor straight into its place with
  :meth:`~dcp.core.storage.StoragePlugin.read_requests` (adjacent source
  bytes as one scatter request), computes each tensor's CRC-32C on the
  just-read bytes, and hands the same buffer to ``write_file`` (one large
  aligned write: ``O_DIRECT`` on POSIX).  Nothing is copied twice.
* **export** (:func:`export_files`): each output file is written by one
  task whose buffers are produced on demand; the task's reader threads
  fetch and consolidate the next tensors ahead of the writer (read and
  write overlap) within the budget, shared by the files written at once.
  A tensor stored whole in one chunk is not read into a buffer where the
  storage maps its files: its CRC-32C is checked on the page cache's
  bytes, which the writer then writes (``O_DIRECT`` where aligned).

Tasks run on a thread pool (the destination's ``thread_count``), under a
:class:`ByteBudget` of ``buffer_bytes`` less a reserve for the process's
own working memory (:func:`tensor_bytes`) — peak memory growth stays within
the budget, or about the largest tensor where one is larger.  The plan is the
same whatever the number of ranks: with a process group, file ``k`` goes to
rank ``k % world_size``; every rank reports what it wrote, rank 0 commits
once, and the outcome is broadcast, so 2 ranks write the same bytes as 1 and
a failure on any rank leaves nothing committed (each rank deletes its files).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from dcp.coordination.collectives import coordination_group
from dcp.core import tensors
from dcp.core.boxes import byte_runs
from dcp.core.metadata import (
    DTYPE_ITEMSIZE,
    METADATA_FILE,
    ChunkMeta,
    Metadata,
    ObjectMeta,
    TensorMeta,
    checksum,
)
from dcp.core.storage import ALIGNED_CHUNK_BYTES, StoragePlugin, storage_errors
from dcp.errors import CheckpointError, CorruptCheckpointError
from dcp.interop.streaming import check_readable, conversion_data, place, read_compressed_chunk
from dcp.orchestration.save import (
    DATA_SUFFIX,
    commit_metadata,
    delete_stale,
    encode_object,
    place_pickled,
)

#: Default memory budget of a conversion, per process (bytes).
DEFAULT_BUDGET_BYTES = 512 << 20
#: Share of a conversion's budget left to the process's own working memory
#: (thread stacks, allocator slack, headers, the index); tensors' bytes get
#: the rest (:func:`tensor_bytes`), so that the process's RSS grows by no
#: more than the budget.
RESERVED_SHARE = 1 / 16
#: An import packs data files of ``tensor_bytes(buffer_bytes) / FILES_IN_FLIGHT``, so that
#: this many are read, checksummed and written at once.
FILES_IN_FLIGHT = 4


def tensor_bytes(buffer_bytes: int) -> int:
    """The bytes of tensors a conversion with a memory budget of
    ``buffer_bytes`` (per process) may hold at once: the budget less
    :data:`RESERVED_SHARE` of it."""
    return max(1, buffer_bytes - int(buffer_bytes * RESERVED_SHARE))


class ByteBudget:
    """A counting semaphore of bytes.  :meth:`acquire` waits until ``n``
    bytes fit; a request larger than the whole budget is granted once
    nothing else is held (so one tensor larger than the budget passes
    alone), and a waiter that holds bytes itself says how many
    (``holding``): when every byte held belongs to a waiter, nothing would
    ever be released, so one of them is granted (the budget is then
    exceeded by at most that one request) and nothing waits forever."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self.held = 0
        self.peak = 0
        self._stuck = 0  # bytes held by waiters
        self._cv = threading.Condition()

    def acquire(self, n: int, holding: int = 0) -> None:
        with self._cv:
            self._stuck += holding
            self._cv.notify_all()  # others may now be all waiters
            self._cv.wait_for(lambda: self.held == 0 or self.held + n <= self.capacity
                              or self.held <= self._stuck)
            self._stuck -= holding
            self.held += n
            self.peak = max(self.peak, self.held)

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` bytes if they fit now (or nothing is held); no wait."""
        with self._cv:
            if self.held and self.held + n > self.capacity:
                return False
            self.held += n
            self.peak = max(self.peak, self.held)
            return True

    def release(self, n: int) -> None:
        with self._cv:
            self.held -= n
            self._cv.notify_all()


def aligned_bytes(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` starting at a page boundary (for
    ``O_DIRECT`` writes): an anonymous mapping, returned to the system as
    soon as the last view of it goes (heap memory freed by a worker thread
    would stay in that thread's arena)."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview(mmap.mmap(-1, nbytes))


class BufferPool:
    """Page-aligned buffers (:func:`aligned_bytes`) handed back after use
    and handed out again, so that a conversion faults in and zeroes its
    memory once, not once per file.  The mappings kept, in use or free, stay
    within ``capacity`` bytes — a buffer handed out may be a larger free
    mapping cut to size, and the whole mapping counts: :meth:`take` unmaps
    free ones to make room and waits for buffers to come back while those in
    use leave no room (one request larger than ``capacity`` is allocated
    once nothing is in use).  Only for buffers whose every user is done when
    they come back (a write that has returned), each user taking one buffer
    at a time (so that a wait always ends)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[mmap.mmap] = []
        self._kept = 0  # bytes of the mappings in use or free
        self._cv = threading.Condition()

    def take(self, nbytes: int) -> memoryview:
        """A writable, page-aligned buffer of ``nbytes``."""
        if nbytes == 0:
            return memoryview(bytearray())
        with self._cv:
            self._cv.wait_for(lambda: any(len(m) >= nbytes for m in self._free)
                              or self._in_use() + nbytes <= self.capacity
                              or not self._in_use())
            fits = [m for m in self._free if len(m) >= nbytes]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return memoryview(best)[:nbytes]
            while self._free and self._kept + nbytes > self.capacity:
                self._kept -= len(self._free.pop())  # unmapped once its views are gone
            self._kept += nbytes
        return memoryview(mmap.mmap(-1, nbytes))

    def _in_use(self) -> int:
        return self._kept - sum(map(len, self._free))

    def give(self, buf: memoryview) -> None:
        """Hand ``buf`` (from :meth:`take`) back for reuse."""
        if isinstance(buf.obj, mmap.mmap):
            with self._cv:
                self._free.append(buf.obj)
                self._cv.notify_all()


# ---- ranks -----------------------------------------------------------------

@dataclass
class Ranks:
    """This process's place among the converting ranks: alone unless a
    process group is passed (a conversion is not collective by default, so
    rank 0 of a job may convert by itself; pass ``dist.group.WORLD`` to
    share it over the job).  ``group`` is the one the ranks' objects travel
    on (:func:`~dcp.coordination.collectives.coordination_group`: the
    group passed if it is gloo's, else a gloo group of its ranks)."""

    group: object = None
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, process_group) -> Ranks:
        if process_group is None or not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(coordination_group(process_group), dist.get_rank(process_group),
                   dist.get_world_size(process_group))

    def mine(self, k: int) -> bool:
        return k % self.world_size == self.rank

    def gather(self, value) -> list:
        """Every rank's ``value``, on every rank."""
        if self.world_size == 1:
            return [value]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)  # type: ignore[arg-type]
        return out

    def broadcast(self, value):
        """Rank 0's ``value``, on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self.group, group_src=0)  # type: ignore[arg-type]
        return box[0]


def run_collectively(ranks: Ranks, work: Callable[[], object],
                     finish: Callable[[list], object], cleanup: Callable[[], None]):
    """Run ``work`` on every rank, then ``finish`` (on rank 0) with every
    rank's result; returns ``finish``'s result on every rank.  If ``work``
    fails on any rank, or ``finish`` does, every rank calls ``cleanup`` and
    raises a :class:`CheckpointError` naming the failing rank and its error
    (the rank's own exception where it failed itself)."""
    error: BaseException | None = None
    try:
        result = work()
    except BaseException as e:  # noqa: BLE001  # reported to every rank, then re-raised
        error, result = e, None
    outcomes = ranks.gather((None if error is None else describe_error(error), result))
    failed = [(r, why) for r, (why, _) in enumerate(outcomes) if why is not None]
    final = None
    if not failed and ranks.rank == 0:
        try:
            final = ("ok", finish([res for _, res in outcomes]))
        except BaseException as e:  # noqa: BLE001
            error, final = e, ("error", describe_error(e))
    final = ranks.broadcast(final)
    if not failed and final[0] == "ok":
        return final[1]
    cleanup()
    if error is not None:
        raise error
    r, why = failed[0] if failed else (0, final[1])
    raise CheckpointError(f"the conversion failed on rank {r}: {why}")


def describe_error(error: BaseException) -> str:
    """An error's type and message, one line, for the other ranks' errors."""
    return "".join(traceback.format_exception_only(type(error), error)).strip()


# ---- import: tensors of any source into a checkpoint -----------------------

@dataclass
class _Piece:
    fqn: str
    meta: TensorMeta
    position: int  # byte offset in the destination file


@dataclass
class _FileTask:
    index: int
    pieces: list[_Piece] = field(default_factory=list)
    size: int = 0


def _pack(md: Metadata, file_bytes: int, alignment: int) -> list[_FileTask]:
    """Tensors in ``md``'s order packed into files of about ``file_bytes``
    (a larger tensor gets a file of its own); large tensors start at
    ``alignment``."""
    tasks: list[_FileTask] = []
    current: _FileTask | None = None
    for fqn, meta in md.tensors.items():
        nbytes = meta.nbytes
        if nbytes == 0:
            continue
        if current is None or (current.pieces and current.size + nbytes > file_bytes):
            current = _FileTask(len(tasks))
            tasks.append(current)
        if nbytes >= ALIGNED_CHUNK_BYTES and alignment > 1:
            current.size += -current.size % alignment
        current.pieces.append(_Piece(fqn, meta, current.size))
        current.size += nbytes
    return tasks


def _read_into(storage: StoragePlugin, fqn: str, meta: TensorMeta, out: memoryview,
               requests: dict[str, list[tuple[int, list[memoryview]]]]) -> None:
    """Add to ``requests`` (file -> scatter requests) the reads that put the
    whole tensor ``fqn`` into ``out``, its row-major bytes."""
    meta.check_coverage(fqn, storage.checkpoint_id)
    itemsize = DTYPE_ITEMSIZE[meta.dtype]
    for chunk in meta.chunks:
        if chunk.frames is not None:  # decoded now (its frames are not byte runs of out)
            place(read_compressed_chunk(storage, fqn, chunk, itemsize), meta, chunk, out)
            continue
        pos = 0
        for start, length in byte_runs(meta.shape, chunk.offsets, chunk.sizes, itemsize):
            source = chunk.byte_offset + pos
            pos += length
            reqs = requests.setdefault(chunk.file, [])
            view = out[start:start + length]
            if reqs and reqs[-1][0] + sum(len(v) for v in reqs[-1][1]) == source:
                reqs[-1][1].append(view)  # adjacent in the source: one scatter request
            else:
                reqs.append((source, [view]))


def read_tensors(storage: StoragePlugin, items: Sequence[tuple[str, TensorMeta, memoryview]]
                  ) -> None:
    """Read each ``(fqn, meta, out)`` whole into ``out``; the source's chunk
    checksums are verified where it records them.  Raises
    :class:`CorruptCheckpointError` naming the tensor and file."""
    requests: dict[str, list[tuple[int, list[memoryview]]]] = {}
    owners: dict[str, list[str]] = {}
    for fqn, meta, out in items:
        _read_into(storage, fqn, meta, out, requests)
        for chunk in meta.chunks:
            owners.setdefault(chunk.file, []).append(fqn)
    for file, reqs in requests.items():
        try:
            storage.read_requests(file, reqs)
        except Exception as e:
            raise CorruptCheckpointError(
                f"reading {', '.join(map(repr, dict.fromkeys(owners[file])))} from file "
                f"{file!r} of {storage.checkpoint_id!r} failed: {e}") from e
    for fqn, meta, out in items:
        verify(fqn, meta, out)


def verify(fqn: str, meta: TensorMeta, out: memoryview) -> None:
    """Check the recorded CRC-32C of each chunk of ``fqn`` against its
    bytes in ``out`` (the whole tensor, row-major).  Raises
    :class:`CorruptCheckpointError` naming the tensor, chunk and file."""
    itemsize = DTYPE_ITEMSIZE[meta.dtype]
    for chunk in meta.chunks:
        if chunk.checksum is None:
            continue
        crc = 0
        for start, length in byte_runs(meta.shape, chunk.offsets, chunk.sizes, itemsize):
            crc = checksum(out[start:start + length], crc)
        if crc != chunk.checksum:
            raise CorruptCheckpointError(
                f"{fqn!r}: checksum mismatch in chunk at offsets {list(chunk.offsets)} of "
                f"file {chunk.file!r}: the checkpoint is corrupted")


def import_checkpoint(source: StoragePlugin, md: Metadata, dest: StoragePlugin, *,
                      overwrite: bool = False, buffer_bytes: int = DEFAULT_BUDGET_BYTES,
                      process_group=None, on_bytes: Callable[[int], None] | None = None,
                      objects: dict[str, Any] | None = None, allow_pickle: bool = False
                      ) -> Metadata:
    """Copy every tensor of ``md`` (read from ``source``) into a new
    checkpoint in ``dest``, each as one chunk with its CRC-32C, plus the
    non-tensor values ``objects`` (fqn -> value: JSON, or pickled with
    ``allow_pickle``, written by rank 0); collective over ``process_group``
    when one is initialized (each rank writes the files ``k % world_size
    == rank``, rank 0 commits); ``md``'s paths
    (:attr:`~dcp.Metadata.paths`) are kept.  Returns the committed
    :class:`~dcp.Metadata` on every rank.

    Raises:
        CheckpointError: a committed checkpoint at ``dest`` without
            ``overwrite``; a non-JSON value without ``allow_pickle``, naming
            it (before anything is written); a failed read or write on any
            rank, naming the tensor and file (nothing is committed, the
            files are deleted).
    """
    encoded = {fqn: encode_object(fqn, value, allow_pickle)
               for fqn, value in (objects or {}).items()}
    ranks = Ranks.of(process_group)
    committed = None
    if not overwrite and ranks.rank == 0:
        with storage_errors(f"reading {dest.checkpoint_id!r}"):
            committed = dest.exists(METADATA_FILE)
    if not overwrite and ranks.broadcast(committed):
        raise CheckpointError(f"{dest.checkpoint_id!r} already holds a committed checkpoint; "
                              f"pass overwrite=True to replace it")
    import uuid

    save_id = ranks.broadcast(uuid.uuid4().hex[:16])
    held = tensor_bytes(buffer_bytes)
    tasks = _pack(md, max(1, held // FILES_IN_FLIGHT), dest.alignment)
    mine = [t for t in tasks if ranks.mine(t.index)]
    budget = ByteBudget(held)
    buffers = BufferPool(held)
    written: list[str] = []
    lock = threading.Lock()

    def name_of(task: _FileTask) -> str:
        return f"convert-{task.index:05d}.{save_id}{DATA_SUFFIX}"

    def run_task(task: _FileTask) -> list[tuple[str, ChunkMeta]]:
        for p in task.pieces:
            check_readable(source, p.fqn, p.meta)
        budget.acquire(task.size)
        buf = buffers.take(task.size)
        try:
            items = [(p.fqn, p.meta, buf[p.position:p.position + p.meta.nbytes])
                     for p in task.pieces]
            read_tensors(source, items)
            crcs = [checksum(out) for _, _, out in items]
            name = name_of(task)
            with lock:
                written.append(name)  # before writing: a partial file is deleted too
            try:
                dest.write_file(name, [buf])
            except Exception as e:
                raise CheckpointError(
                    f"writing {name!r} (tensors {', '.join(repr(p.fqn) for p in task.pieces)}) "
                    f"of {dest.checkpoint_id!r} failed: {e}") from e
            if on_bytes is not None:
                on_bytes(task.size)
            return [(p.fqn, ChunkMeta((0,) * len(p.meta.shape), p.meta.shape, name, p.position,
                                      p.meta.nbytes, crc, ranks.rank))
                    for p, crc in zip(task.pieces, crcs, strict=True)]
        finally:  # the write has returned (or failed): nothing uses the buffer any more
            buffers.give(buf)
            budget.release(task.size)

    def work() -> list[tuple[str, ChunkMeta]]:
        with ThreadPoolExecutor(max(1, min(dest.thread_count, len(mine) or 1))) as pool:
            futures = [pool.submit(run_task, t) for t in mine]
            return [entry for f in futures for entry in f.result()]

    def finish(results: list) -> Metadata:
        chunks = dict(entry for result in results for entry in result)
        out = Metadata(save_id=save_id, world_size=ranks.world_size, paths=md.paths)
        for fqn, meta in md.tensors.items():
            out.tensors[fqn] = TensorMeta(meta.shape, meta.dtype,
                                          [chunks[fqn]] if fqn in chunks else [])
        pickled = {f: e for f, e in encoded.items() if isinstance(e, bytes)}
        for fqn, text in encoded.items():
            if isinstance(text, str):
                out.objects[fqn] = ObjectMeta(value=json.loads(text))
        if pickled:
            name = f"convert-objects.{save_id}{DATA_SUFFIX}"
            with lock:
                written.append(name)
            try:
                dest.write_file(name, place_pickled(name, pickled, out))
            except Exception as e:
                raise CheckpointError(f"writing {name!r} (values {', '.join(map(repr, pickled))}) "
                                      f"of {dest.checkpoint_id!r} failed: {e}") from e
        try:
            commit_metadata(dest, METADATA_FILE, out, overwrite)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"committing {METADATA_FILE!r} of {dest.checkpoint_id!r} "
                                  f"failed: {e}") from e
        if overwrite:
            delete_stale(dest, out.files(), lambda name: True, conversion_data)
        return out

    return run_collectively(ranks, work, finish, lambda: dest.delete(written))


# ---- export: files produced on demand, read ahead ---------------------------

@dataclass
class OutputFile:
    """One file of an export: ``name``, its leading bytes ``header``, and
    its tensors in order, each ``(fqn, meta, cast)`` — ``cast`` a dtype name
    to convert it to, or ``None``.  ``frame``, where the format puts bytes
    between tensors (a MindSpore ``.ckpt``'s record headers), turns the
    file's buffers (header, then one per tensor, asked for in order) into
    those written."""

    name: str
    header: bytes
    tensors: list[tuple[str, TensorMeta, str | None]]
    frame: Callable[[Sequence], Sequence] | None = None


class Reader(Protocol):
    """Reads the tensors an export cannot read from their chunks (a
    remapped view's staged targets)."""

    def reads_whole(self, fqn: str) -> bool:
        """Whether it reads ``fqn``."""

    def check_readable(self, fqn: str) -> None:
        """Raise, naming ``fqn``, if its sources' files are short (before
        its memory is allocated)."""

    def read_whole(self, fqn: str, out: memoryview) -> None:
        """Fill ``out`` with the row-major bytes of the whole ``fqn``."""

    def scratch_bytes(self, fqn: str) -> int:
        """Memory (bytes) :meth:`read_whole` holds besides ``out``."""


class _ReadAhead(Sequence):
    """The buffers of one :class:`OutputFile` for ``write_file``: the
    header, then each tensor, read (by ``read`` where it reads it) and cast
    by ``pool`` ahead of the writer while the bytes in flight fit
    ``budget``, shared by every file written at once.  A tensor stored
    whole in one chunk of a file the storage maps (:meth:`StoragePlugin.mapped`)
    and not cast is not read at all: its checksum is verified on the page
    cache's bytes and the writer writes them from there (no copy, and
    aligned for direct I/O where the chunk is).  A buffer's bytes
    leave the budget when the writer asks for the one after the next: the
    writer's loop still holds the buffer it has just written when it asks
    for the next (so the budget counts what is alive); a mapped one's pages
    are unmapped then (:meth:`_unmap_written`).  A file waits for
    the budget only for the tensor it must return now (or its first), and
    says what it holds, so the budget never lets every file wait (no
    deadlock); a tensor larger than the budget passes alone."""

    def __init__(self, out: OutputFile, storage: StoragePlugin, pool: ThreadPoolExecutor,
                 budget: ByteBudget, on_bytes: Callable[[int], None] | None,
                 read: Reader | None) -> None:
        self.out = out
        self.storage = storage
        self.read = read
        self.pool = pool
        self.budget = budget
        self.held = 0
        self.on_bytes = on_bytes
        self.futures: dict[int, Future] = {}
        self.sizes: dict[int, int] = {}
        self.next = 0  # next tensor to submit
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 1 + len(self.out.tensors)

    def _size(self, i: int) -> int:
        """Bytes tensor ``i`` holds: read, its reader's scratch, its cast copy."""
        fqn, meta, cast = self.out.tensors[i]
        size = meta.nbytes
        if self.read is not None and self.read.reads_whole(fqn):
            size += self.read.scratch_bytes(fqn)
        if cast is None or cast == meta.dtype:
            return size
        return size + meta.nbytes // DTYPE_ITEMSIZE[meta.dtype] * DTYPE_ITEMSIZE[cast]

    def _fetch(self, i: int) -> tuple[memoryview, contextlib.ExitStack, int | None]:
        """Tensor ``i``'s bytes for the writer, what keeps them valid
        (closed once the writer is done with them), and where they start in
        the mapped file they are a view of (``None``: in a buffer of
        their own)."""
        fqn, meta, cast = self.out.tensors[i]
        whole = self.read is not None and self.read.reads_whole(fqn)
        if whole:
            self.read.check_readable(fqn)  # type: ignore[union-attr]
        else:
            check_readable(self.storage, fqn, meta)  # before its memory is allocated
        keep = contextlib.ExitStack()
        if (cast is None or cast == meta.dtype) and not whole and len(meta.chunks) == 1 \
                and meta.chunks[0].sizes == meta.shape and meta.chunks[0].frames is None:
            chunk = meta.chunks[0]
            mapping = keep.enter_context(self.storage.mapped(chunk.file))
            if mapping is not None:  # the page cache's bytes: checksummed and written, no copy
                view = mapping[chunk.byte_offset:chunk.byte_offset + meta.nbytes]
                try:
                    if len(view) < meta.nbytes:
                        raise CorruptCheckpointError(
                            f"{fqn!r}: file {chunk.file!r} of {self.storage.checkpoint_id!r} "
                            f"ends before the chunk's byte {chunk.byte_offset + meta.nbytes}")
                    verify(fqn, meta, view)
                except BaseException:
                    keep.close()
                    raise
                return view, keep, chunk.byte_offset
            keep.close()
        raw = aligned_bytes(meta.nbytes)
        if whole:
            self.read.read_whole(fqn, raw)  # type: ignore[union-attr]
        else:
            read_tensors(self.storage, [(fqn, meta, raw)])
        if cast is None or cast == meta.dtype or not meta.nbytes:
            return raw, keep, None
        out = aligned_bytes(meta.nbytes // DTYPE_ITEMSIZE[meta.dtype] * DTYPE_ITEMSIZE[cast])
        source = tensors.from_bytes(tensors.bytes_of(raw), meta.dtype, meta.shape)
        tensors.copy_into(tensors.from_bytes(tensors.bytes_of(out), cast, meta.shape), source)
        return out, keep, None

    def _submit_ahead(self, need: int) -> None:
        """Submit reads in order while they fit the budget, waiting for it
        up to tensor ``need`` (the one the writer asks for now)."""
        with self.lock:
            while self.next < len(self.out.tensors):
                size = self._size(self.next)
                if self.next <= need or not self.held:
                    self.budget.acquire(size, holding=self.held)
                elif not self.budget.try_acquire(size):
                    return
                self.held += size
                self.sizes[self.next] = size
                self.futures[self.next] = self.pool.submit(self._fetch, self.next)
                self.next += 1

    def __getitem__(self, i: int):  # type: ignore[override]  # read by index only
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        if i == 0:
            self._submit_ahead(-1)
            return self.out.header
        for done in [k for k in self.futures if k < i - 2]:  # dead: the writer let go of it
            self._drop(done)
        if i >= 2:
            self._unmap_written(i - 2)
        self._submit_ahead(i - 1)
        if i - 1 not in self.futures:
            raise CheckpointError(f"{self.out.name!r}: buffer {i} asked for out of order")
        view = self.futures[i - 1].result()[0]
        if self.on_bytes is not None:
            self.on_bytes(len(view))
        return view

    def _unmap_written(self, k: int) -> None:
        """Tensor ``k``, written (the writer asks for the buffer after it),
        leaves the budget now if it is a view of a mapped file: its pages
        are unmapped from this process (``MADV_DONTNEED``; the page cache
        keeps them, and a later touch maps the same bytes again), though the
        writer's loop still holds the view."""
        view, _, start = self.futures[k].result()
        if start is None or not self.sizes[k] or not hasattr(view.obj, "madvise"):
            return  # not a view of an mmap: its bytes leave the budget when dropped
        page = mmap.PAGESIZE
        begin = start - start % page
        end = min(len(view.obj), -(-(start + len(view)) // page) * page)
        view.obj.madvise(mmap.MADV_DONTNEED, begin, end - begin)
        self.held -= self.sizes[k]
        self.budget.release(self.sizes[k])
        self.sizes[k] = 0

    def _drop(self, k: int) -> None:
        future = self.futures.pop(k)
        if not future.cancelled() and future.exception() is None:
            future.result()[1].close()  # waits for a fetch still running
        size = self.sizes.pop(k)
        self.held -= size
        self.budget.release(size)

    def close(self) -> None:
        for k in list(self.futures):
            self.futures[k].cancel()
            self._drop(k)


def export_files(storage: StoragePlugin, files: list[OutputFile], dest: StoragePlugin, *,
                 buffer_bytes: int = DEFAULT_BUDGET_BYTES, process_group=None,
                 finish: Callable[[], list[str]] = lambda: [],
                 on_bytes: Callable[[int], None] | None = None,
                 read: Reader | None = None) -> list[str]:
    """Write ``files`` into ``dest``, tensors read from ``storage``;
    collective over ``process_group`` when one is passed (file ``k``
    on rank ``k % world_size``).  Then ``finish`` runs on rank 0 (writing an
    index, say) and returns the names it wrote.  Returns every name
    written, on every rank.  On a failure anywhere every rank deletes what
    it wrote and raises :class:`CheckpointError` naming the file.  ``read``
    reads the tensors it handles instead of their chunks."""
    ranks = Ranks.of(process_group)
    mine = [f for k, f in enumerate(files) if ranks.mine(k)]
    writers = max(1, min(dest.thread_count, len(mine)))
    budget = ByteBudget(tensor_bytes(buffer_bytes))
    written: list[str] = []
    lock = threading.Lock()

    def write_one(out: OutputFile, pool: ThreadPoolExecutor) -> None:
        with lock:
            written.append(out.name)
        buffers = _ReadAhead(out, storage, pool, budget, on_bytes, read)
        try:
            dest.write_file(out.name, buffers if out.frame is None else out.frame(buffers))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"writing {out.name!r} to {dest.checkpoint_id!r} failed: "
                                  f"{e}") from e
        finally:
            buffers.close()

    def work() -> None:
        readers = ThreadPoolExecutor(max(2, writers * 2))
        try:
            with ThreadPoolExecutor(writers) as pool:
                for f in [pool.submit(write_one, out, readers) for out in mine]:
                    f.result()
        finally:
            readers.shutdown(wait=True, cancel_futures=True)

    extra: list[str] = []

    def done(results: list) -> list[str]:
        extra.extend(finish())
        return extra

    def cleanup() -> None:
        dest.delete(written + extra)

    tail = run_collectively(ranks, work, done, cleanup)
    return [f.name for f in files] + list(tail)
