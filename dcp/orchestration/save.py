"""Synchronous save: plan, deduplicate, write, commit.

Phases, each a collective step of :class:`~dcp.coordination.collectives.Coordinator` so a
failure anywhere fails the save on every rank:

1. *planning* — every rank describes what it holds (DTensors whose local
   shards the placements do not give placed by the ranks' agreement,
   :mod:`dcp.coordination.dtensor_offsets`); the coordinator refuses
   to replace a committed checkpoint unless ``overwrite=True``, and the save
   planner deduplicates and balances the chunks;
2. *writing* — every rank stages what it writes from accelerators into
   reused page-locked host memory, on the caller's current streams
   (:class:`dcp.core.devices.HostStaging`), then writes its chunks into
   ``thread_count`` size-balanced files in parallel, computing each chunk's
   CRC-32C as it goes, and fingerprints the replicas it holds but does not
   write (:func:`fingerprint`; of an accelerator replica only the sample
   crosses to the host);
3. *commit* — the coordinator checks that every replica of a chunk has the
   same fingerprint, builds the metadata, runs the caller's
   ``before_commit`` action with it (a checkpoint manager names the step in
   its pointer there: :class:`dcp.manager.steps.NamePointer`) and commits it
   atomically, last.  Only then, with ``overwrite=True``, are the previous
   checkpoint's data files deleted: new data files carry the save's id in
   their names, so until the commit the previous checkpoint stays whole and
   loadable.

On failure every rank deletes the files it wrote, interrupted or not
(``KeyboardInterrupt``, ``SystemExit`` from a ``SIGTERM`` handler), then the
checkpoint's folder if the save made it; nothing is committed.  What a
killed process could not delete (``SIGKILL``) is listed as orphaned by
``hyperdcp list`` and ``hyperdcp verify``, and deleted by ``hyperdcp prune``
or by the next save that commits there.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import re
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from dcp.coordination import dtensor_offsets, wire
from dcp.coordination.collectives import Coordinator, CoordinatorBase
from dcp.coordination.plan_cache import PlanCache
from dcp.core import compression as codec
from dcp.core import devices, mindspore_tensors, stateful, tensors
from dcp.core.metadata import (
    DTYPE_ITEMSIZE,
    METADATA_FILE,
    BlobRef,
    ChunkMeta,
    Metadata,
    ObjectMeta,
    TensorMeta,
    _ChunkTable,
    checksum,
    decode,
    encode,
    is_rank_metadata_file,
    min_version,
    rank_metadata_file,
)
from dcp.core.planner import SavePlan, SavePlanner, TensorDecl, WriteItem, default_planner
from dcp.core.state_dict import flatten
from dcp.core.storage import ALIGNED_CHUNK_BYTES, StoragePlugin, open_storage
from dcp.errors import CheckpointError, CorruptCheckpointError
from dcp.orchestration import pending
from dcp.orchestration.gc_pause import gc_paused

DATA_SUFFIX = ".data"

#: The plan caches of :func:`save`, one per group (by its members' global
#: ranks): a save of a structure saved before skips the planning exchange.
_plan_caches: dict[tuple[int, ...], PlanCache] = {}


#: Replicas up to this many bytes are compared in full; larger ones by a
#: sample of the same size (:func:`fingerprint`).
REPLICA_SAMPLE_BYTES = 1 << 20
_SAMPLE_PIECES = 256

#: Host memory the accelerator bytes of :func:`save` are staged into,
#: page-locked and kept for the next save of the process.
_host_staging = devices.HostStaging()


def sample_ranges(nbytes: int) -> list[tuple[int, int]]:
    """The ``(start, length)`` byte ranges of a chunk of ``nbytes`` that
    :func:`fingerprint` hashes: all of it up to :data:`REPLICA_SAMPLE_BYTES`,
    else 256 evenly spaced 4 KiB pieces (the first starts the chunk, the
    last ends it)."""
    if nbytes <= REPLICA_SAMPLE_BYTES:
        return [(0, nbytes)]
    piece = REPLICA_SAMPLE_BYTES // _SAMPLE_PIECES
    return [(i * (nbytes - piece) // (_SAMPLE_PIECES - 1), piece) for i in range(_SAMPLE_PIECES)]


def fingerprint(buffer: memoryview) -> int:
    """What replicas of a chunk are compared by: the CRC-32C of its bytes, or,
    for a chunk over :data:`REPLICA_SAMPLE_BYTES`, of 256 evenly spaced 4 KiB
    pieces of them (:func:`sample_ranges`), which equals the CRC-32C of the
    pieces put end to end (:func:`dcp.core.devices.byte_sample` gathers them
    on an accelerator).

    Hashing every replica in full would cost every holder a pass over all
    its replicated bytes (measured: 2.5x the time of a replicated save at
    W=4); replicas that diverged in training (other seeds, a missed
    all-reduce) differ throughout and are caught by the sample, while a
    difference confined to a few elements of a large chunk can escape it.
    """
    value = 0
    for start, length in sample_ranges(len(buffer)):
        value = checksum(buffer[start:start + length], value)
    return value


@dataclass
class WriteResult:
    """What a rank reports after writing: its chunks, the fingerprints of its
    written chunks larger than :data:`REPLICA_SAMPLE_BYTES` and of the
    replicas it holds but did not write whole (``replicas``: of the whole
    held chunk, also when the rank wrote a piece of it), and its non-tensor
    values (JSON text or pickle), and the paths of its fqns where they are
    not the fqn alone (:attr:`SaveState.paths`); ``frames``: the frame
    index of each chunk it wrote compressed, by ``(fqn, offsets)``."""

    chunks: list[tuple[str, ChunkMeta]] = field(default_factory=list)
    fingerprints: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)
    replicas: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)
    json_values: dict[str, str] = field(default_factory=dict)
    pickled: dict[str, bytes] = field(default_factory=dict)
    paths: dict[str, list[str | int]] = field(default_factory=dict)
    frames: dict[tuple[str, tuple[int, ...]], codec.FrameIndex] = field(default_factory=dict)


wire.register(WriteResult, *wire.write_result_codec(WriteResult), columnar=True)


def build_metadata(save_id: str, world_size: int, decls: dict[str, TensorDecl],
                   results: list[WriteResult]) -> Metadata:
    """The tensors' metadata from every rank's write results (index = rank).

    Raises :class:`CheckpointError` naming the fqn and both ranks if a rank
    holds a replica whose fingerprint differs from the written chunk's.  A
    chunk written in pieces by several holders (the planner split it; its
    first piece has the chunk's offsets, and that piece's writer reports the
    whole chunk among its replicas) is checked by comparing every holder's
    fingerprint of its whole replica with the others'.
    """
    md = _metadata_from_columns(save_id, world_size, decls, results)
    if md is None:
        md = _metadata_from_objects(save_id, world_size, decls, results)
    _attach_frames(md, results)
    return md


def _attach_frames(md: Metadata, results: list[WriteResult]) -> None:
    """Give the chunks of ``md`` the frame indexes of the results that
    wrote them compressed."""
    frames: dict[str, dict[tuple[int, ...], codec.FrameIndex]] = defaultdict(dict)
    for result in results:
        for (fqn, offsets), index in result.frames.items():
            frames[fqn][offsets] = index
    for fqn, by_offsets in frames.items():
        saved = md.tensors[fqn]
        table = saved.table()
        table.frames = {row: by_offsets[tuple(o)]
                        for row, o in enumerate(table.offsets.tolist()) if tuple(o) in by_offsets}
        saved._store = table


def merge_paths(md: Metadata, results: list[WriteResult]) -> dict[str, tuple[str | int, ...]]:
    """:attr:`Metadata.paths` from every rank's write results: the first
    rank's path of each fqn of ``md``.  Raises :class:`CheckpointError`
    naming the fqn and both ranks where two ranks give it different paths
    (``{"a.b": t}`` on one, ``{"a": {"b": t}}`` on another)."""
    first = _agreed([r.paths for r in results], lambda fqn, r0, a, r1, b: (
        f"{fqn!r}: ranks {r0} and {r1} hold it at different paths ({a} vs {b}); give "
        f"each rank the same state dict structure"))
    return {fqn: tuple(path) for fqn, path in first.items()
            if fqn in md.tensors or fqn in md.objects}


def _agreed(per_rank: list[dict[str, Any]],
            mismatch: Callable[[str, int, Any, int, Any], str]) -> dict[str, Any]:
    """Each key's value, the same on every rank that has the key; raises
    :class:`CheckpointError` with ``mismatch(key, rank_a, a, rank_b, b)``
    where two ranks differ."""
    first: dict[str, tuple[int, Any]] = {}
    for rank, values in enumerate(per_rank):
        for key, value in values.items():
            seen = first.setdefault(key, (rank, value))
            if seen[1] != value:
                raise CheckpointError(mismatch(key, seen[0], seen[1], rank, value))
    return {key: value for key, (_, value) in first.items()}


def _pad(ndim: np.ndarray, flat: np.ndarray, fill: int) -> np.ndarray:
    """Boxes of ``ndim`` values each, flat, as rows padded with ``fill``."""
    n = len(ndim)
    width = max(1, int(ndim.max()) if n else 1)
    out = np.full((n, width), fill, dtype=np.int64)
    starts = np.cumsum(ndim) - ndim
    out[np.repeat(np.arange(n), ndim), np.arange(len(flat)) - np.repeat(starts, ndim)] = flat
    return out


def _metadata_from_columns(save_id: str, world_size: int, decls: dict[str, TensorDecl],
                           results: list[WriteResult]) -> Metadata | None:
    """:func:`build_metadata` over the results' columns (no object per
    chunk: each tensor's chunks become a columnar table), or ``None`` where
    :func:`_metadata_from_objects` must decide: a replica that differs (it
    names it), and rare inputs (a chunk of an undeclared tensor, a chunk
    reported twice, a byte count that is not the box's)."""
    cols = [wire.result_columns(r) for r in results]
    ids: dict[str, int] = {}
    maps = [np.array([ids.setdefault(s, len(ids)) for s in c.strings] or [0], dtype=np.int64)
            for c in cols]

    def cat(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)

    fqn = cat([m[c.fqn] for m, c in zip(maps, cols, strict=True)])
    file = cat([m[c.file] for m, c in zip(maps, cols, strict=True)])
    ndim, at, nbytes, crc, rank = (cat([getattr(c, a) for c in cols])
                                   for a in ("ndim", "at", "nbytes", "crc", "rank"))
    offsets = _pad(ndim, cat([c.offsets for c in cols]), -1)
    sizes = _pad(ndim, cat([c.sizes for c in cols]), 1)
    names = list(decls)
    tensor_of = np.full(max(1, len(ids)), -1, dtype=np.int64)
    for t, name in enumerate(names):
        if name in ids:
            tensor_of[ids[name]] = t
    tensor = tensor_of[fqn]
    if any(d.dtype not in DTYPE_ITEMSIZE for d in decls.values()):
        return None
    dims = np.array([len(d.shape) for d in decls.values()] or [0], dtype=np.int64)
    itemsize = np.array([DTYPE_ITEMSIZE[d.dtype] for d in decls.values()] or [0], dtype=np.int64)
    n = len(fqn)
    if n and ((tensor < 0).any() or (ndim != dims[tensor]).any()
              or (nbytes != sizes.prod(axis=1) * itemsize[tensor]).any()):
        return None
    if not _replicas_agree(cols, maps, fqn, ndim, offsets, crc, rank, len(results)):
        return None
    # each tensor's chunks by offsets, in rank order where equal (a stable sort)
    order = np.lexsort([np.arange(n), *(offsets[:, d] for d in reversed(range(offsets.shape[1]))),
                        tensor])
    used = set(np.unique(file).tolist())
    names_of_files = sorted(s for s, i in ids.items() if i in used)
    file_index = np.zeros(max(1, len(ids)), dtype=np.int64)
    for k, name in enumerate(names_of_files):
        file_index[ids[name]] = k
    counts = np.bincount(tensor, minlength=len(names)).tolist() if n else [0] * len(names)
    md = Metadata(save_id=save_id, world_size=world_size)
    start = 0
    for name, decl, count in zip(names, decls.values(), counts, strict=True):
        rows = order[start:start + count]
        start += count
        k = len(decl.shape)
        table = _ChunkTable(np.ascontiguousarray(offsets[rows, :k]),
                            np.ascontiguousarray(sizes[rows, :k]), file_index[file[rows]],
                            at[rows], crc[rows], rank[rows], names_of_files)
        md.tensors[name] = TensorMeta._from_table(decl.shape, decl.dtype, table)
    return md


def _group_rows(keys: np.ndarray) -> np.ndarray:
    """The group of each row of ``keys`` (equal rows, one group)."""
    order = np.lexsort(keys.T[::-1])
    ordered = keys[order]
    new = np.ones(len(keys), dtype=bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    group = np.empty(len(keys), dtype=np.int64)
    group[order] = np.cumsum(new) - 1
    return group


def _replicas_agree(cols: list, maps: list[np.ndarray], fqn: np.ndarray, ndim: np.ndarray,
                    offsets: np.ndarray, crc: np.ndarray, rank: np.ndarray, world: int) -> bool:
    """Whether every replica's fingerprint is its chunk's, as
    :func:`_metadata_from_objects` checks it (``False`` also where it must
    decide: a replica of no written chunk, a chunk or fingerprint reported
    twice)."""
    def keyed(which: str) -> tuple[np.ndarray, ...]:
        parts = [getattr(c, which) for c in cols]
        f = np.concatenate([m[p[0]] for m, p in zip(maps, parts, strict=True)]
                           or [np.zeros(0, np.int64)])
        k = np.concatenate([p[1] for p in parts] or [np.zeros(0, np.int64)])
        flat = np.concatenate([p[2] for p in parts] or [np.zeros(0, np.int64)])
        v = np.concatenate([p[3] for p in parts] or [np.zeros(0, np.int64)])
        holder = np.repeat(np.arange(len(parts)), [len(p[3]) for p in parts])
        return f, k, _pad(k, flat, -1), v, holder

    rf, rk, ro, rv, holder = keyed("replicas")
    if not len(rv):
        return True
    pf, pk, po, pv, _ = keyed("prints")
    width = max(offsets.shape[1], ro.shape[1], po.shape[1])

    def widen(a: np.ndarray) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=-1)

    keys = np.concatenate([np.column_stack([f, k, widen(o)]) for f, k, o in
                           ((fqn, ndim, offsets), (pf, pk, po), (rf, rk, ro))])
    group = _group_rows(keys)
    n, p = len(fqn), len(pv)
    gw, gp, gr = group[:n], group[n:n + p], group[n + p:]
    size = int(group.max()) + 1
    if len(np.unique(gw)) != n or len(np.unique(gp)) != p:
        return False
    written = np.full(size, -1, dtype=np.int64)
    written[gw] = np.arange(n)
    w = written[gr]
    if (w < 0).any():
        return False
    writer = rank[w]
    if (writer < 0).any() or (writer >= world).any():
        return False
    pieces_of = np.zeros(size, dtype=bool)
    pieces_of[gr[holder == writer]] = True  # the writer reports the whole chunk: pieces
    pieces = pieces_of[gr]
    if pieces.any():
        low = np.full(size, np.iinfo(np.int64).max, dtype=np.int64)
        high = np.full(size, np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(low, gr[pieces], rv[pieces])
        np.maximum.at(high, gr[pieces], rv[pieces])
        if (low[gr[pieces]] != high[gr[pieces]]).any():
            return False
    whole = ~pieces
    printed = np.zeros(size, dtype=bool)
    printed[gp] = True
    value_of = np.zeros(size, dtype=np.int64)
    value_of[gp] = pv
    g = gr[whole]
    expected = np.where(printed[g], value_of[g], crc[w[whole]])
    no_value = ~printed[g] & (crc[w[whole]] < 0)  # no checksum: never equal
    return not ((rv[whole] != expected) | no_value).any()


def _metadata_from_objects(save_id: str, world_size: int, decls: dict[str, TensorDecl],
                           results: list[WriteResult]) -> Metadata:
    """:func:`build_metadata` chunk by chunk (and the errors it raises)."""
    md = Metadata(save_id=save_id, world_size=world_size)
    for fqn, decl in decls.items():
        md.tensors[fqn] = TensorMeta(decl.shape, decl.dtype)
    written: dict[tuple[str, tuple[int, ...]], ChunkMeta] = {}
    prints: dict[tuple[str, tuple[int, ...]], int] = {}
    for result in results:
        for fqn, chunk in result.chunks:
            md.tensors[fqn].chunks.append(chunk)
            written[(fqn, chunk.offsets)] = chunk
        prints.update(result.fingerprints)
    first_holder: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    for rank, result in enumerate(results):
        for key, value in result.replicas.items():
            chunk = written[key]
            expected: int | None  # the value's fingerprint, or its checksum (None: no checksum)
            if key in results[chunk.rank].replicas:  # written in pieces
                expected, other = first_holder.setdefault(key, (value, rank))
            else:
                expected, other = prints.get(key, chunk.checksum), chunk.rank
            if value != expected:
                raise CheckpointError(
                    f"{key[0]!r}: ranks {other} and {rank} hold different values for the "
                    f"chunk at offsets {list(key[1])} (a replicated tensor must be equal on "
                    f"every rank; give per-rank values distinct keys)")
    for t in md.tensors.values():
        t.chunks.sort(key=lambda c: c.offsets)
    return md


def commit_metadata(storage: StoragePlugin, name: str, md: Metadata, overwrite: bool) -> None:
    """Publish ``md`` as ``name`` atomically, last, a transient failure
    retried under the plugin's retry policy (as the data files' writes are);
    a retry that finds ``name`` holding these very bytes has succeeded (the
    earlier attempt's answer was lost after it committed).  Raises
    :class:`CheckpointError` if another save committed there first."""
    data = encode(md)
    wire.remember_metadata(md, data)  # the answer to every rank carries these bytes
    attempts = 0

    def commit() -> None:
        nonlocal attempts
        attempts += 1
        try:
            storage.commit_file(name, data, overwrite=overwrite)
        except FileExistsError:
            if attempts == 1 or storage.read_file(name) != data:
                raise

    try:
        storage.retrying(commit)
    except FileExistsError as e:
        raise CheckpointError(
            f"{storage.checkpoint_id!r}: another save committed a checkpoint here first") from e


def is_data_file(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint) is named like the data
    files saves write there (``rRRRRR-K.<save id>.data``, at the top)."""
    return re.fullmatch(r"r\d{5}-[^/]*" + re.escape(DATA_SUFFIX), name) is not None


def delete_stale(storage: StoragePlugin, keep: set[str], owned: Callable[[str], bool],
                 kind: Callable[[str], bool] | None = None) -> None:
    """After a commit: delete the files of ``kind`` (default: data files)
    not in ``keep`` for which ``owned(name)`` holds — a replaced
    checkpoint's, and those of saves that died before deleting theirs.  The
    new checkpoint is already committed, so a failure here only leaves
    garbage: warn."""
    kind = kind or is_data_file
    try:
        storage.delete(n for n in storage.list_files()
                       if kind(n) and n not in keep and owned(n))
    except OSError as e:
        warnings.warn(f"{storage.checkpoint_id!r}: could not delete the replaced "
                      f"checkpoint's data files: {e}", stacklevel=2)


#: How a raw blob (a ``bytes`` or ``io.BytesIO`` value) is told apart from a
#: pickle among a rank's blobs (:attr:`SaveState.pickled`): this prefix, its
#: type name and a NUL byte lead its bytes.  A pickle never starts with NUL.
RAW_TAG = b"\0hyperdcp-raw\0"


def raw_blob(value: bytes | io.BytesIO) -> bytes:
    """A ``bytes`` or ``io.BytesIO`` value as a tagged raw blob (the whole
    buffer of a BytesIO, whatever its position)."""
    if isinstance(value, io.BytesIO):
        return RAW_TAG + b"BytesIO\0" + value.getvalue()
    return RAW_TAG + b"bytes\0" + bytes(value)


def split_raw(blob: bytes) -> tuple[str, bytes] | None:
    """``(type name, bytes)`` of a tagged raw blob; ``None`` for a pickle."""
    if not blob.startswith(RAW_TAG):
        return None
    kind, _, data = blob[len(RAW_TAG):].partition(b"\0")
    return kind.decode(), data


def place_pickled(name: str, blobs: dict[str, bytes], md: Metadata) -> list[bytes]:
    """Record in ``md.objects`` that the blobs ``blobs`` (fqn -> bytes:
    pickles, or raw blobs tagged by :func:`raw_blob`, stored untagged) lie
    one after the other in the data file ``name``; returns the buffers to
    write there."""
    offset, buffers = 0, []
    for fqn, blob in blobs.items():
        raw = split_raw(blob)
        data = blob if raw is None else raw[1]
        ref = BlobRef(name, offset, len(data), checksum(data))
        md.objects[fqn] = (ObjectMeta(pickled=ref) if raw is None
                           else ObjectMeta(raw=ref, raw_type=raw[0]))
        md.version = max(md.version, min_version(md))
        buffers.append(data)
        offset += len(data)
    return buffers


def encode_object(fqn: str, value: Any, allow_pickle: bool) -> str | bytes:
    """A non-tensor value as JSON text (``str``), a ``bytes`` or
    ``io.BytesIO`` value as a raw blob (:func:`raw_blob`, never pickled), or
    anything else pickled (``bytes``) if the caller opted in; raises
    :class:`CheckpointError` naming ``fqn`` otherwise."""
    if _is_json(value):
        return json.dumps(value, sort_keys=True, allow_nan=True)
    if type(value) is bytes or isinstance(value, io.BytesIO):
        return raw_blob(value)
    if not allow_pickle:
        raise CheckpointError(
            f"{fqn!r}: a value of type {type(value).__name__} is not JSON-representable; "
            f"convert it, or pass allow_pickle=True to save (and to load) it pickled")
    return pickle.dumps(value)


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


def _balance_files(items: list[WriteItem], count: int) -> list[list[WriteItem]]:
    """Split items into at most ``count`` groups of similar byte size."""
    groups: list[list[WriteItem]] = [[] for _ in range(min(count, len(items)))]
    sizes = [0] * len(groups)
    for item in sorted(items, key=lambda i: -i.nbytes):
        k = sizes.index(min(sizes))
        groups[k].append(item)
        sizes[k] += item.nbytes
    return groups


@dataclass
class SaveState:
    """What one rank saves: its tensor chunks, keyed by ``(fqn, offsets)``
    (box and data: the caller's tensors for :func:`save`, staged host copies
    for :func:`dcp.async_save`), each chunk's replica slot (see
    :func:`dcp.core.tensors.replica_slot`), and its non-tensor values encoded as
    JSON text, or as blobs in ``pickled``: raw ``bytes`` / ``io.BytesIO``
    values (:func:`raw_blob`) and, if the caller allowed it, pickles;
    ``paths``: each fqn's path in the state dict (:class:`dcp.core.state_dict.Leaf`)
    where it is not ``[fqn]``, for :attr:`dcp.Metadata.paths`."""

    chunks: dict[tuple[str, tuple[int, ...]], tensors.LocalChunk] = field(default_factory=dict)
    slots: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = field(default_factory=dict)
    json_values: dict[str, str] = field(default_factory=dict)
    pickled: dict[str, bytes] = field(default_factory=dict)
    paths: dict[str, list[str | int]] = field(default_factory=dict)


#: How the ranks agree on the offsets of DTensors their placements do not
#: place: the leaves by fqn (``None``: this rank failed before knowing them)
#: to this rank's offsets of those concerned (:func:`dcp.coordination.dtensor_offsets.agree`).
AgreeOffsets = Callable[[dict[str, Any] | None], dict[str, tuple[int, ...]]]


def describe_state(state_dict: dict, allow_pickle: bool, rank: int = 0,
                   world_size: int = 1, agree: AgreeOffsets | None = None) -> SaveState:
    """Flatten ``state_dict`` into a :class:`SaveState` whose chunks refer to
    the caller's tensors (no copy); ``rank`` of ``world_size`` places the
    caller for the replica slots.  Stateful values are saved as what their
    ``state_dict()`` returns now (:mod:`dcp.core.stateful`), MindSpore
    tensors as torch tensors over their host bytes
    (:mod:`dcp.core.mindspore_tensors`).  ``agree`` (collective, on every
    rank or none) places DTensors whose local shards the placements do not
    give; without it they are placed by their placements.  Raises
    :class:`CheckpointError` naming the fqn for an unsupported leaf."""
    state = SaveState()
    try:
        resolved = stateful.resolve(
            state_dict, tensors.is_tensor,
            substitute=mindspore_tensors.for_save if mindspore_tensors.imported() else None
        ).state_dict
        leaves = flatten(resolved, tensors.is_tensor)
    except BaseException:
        if agree is not None:  # the others wait in the agreement
            agree(None)
        raise
    offsets = agree({fqn: leaf.value for fqn, leaf in leaves.items()}) if agree else {}
    for fqn, leaf in leaves.items():
        if leaf.path != (fqn,):
            state.paths[fqn] = list(leaf.path)
        if tensors.is_tensor(leaf.value):
            for chunk in tensors.describe_chunks(fqn, leaf.value, offsets.get(fqn)):
                state.chunks[(fqn, chunk.offsets)] = chunk
                state.slots[(fqn, chunk.offsets)] = tensors.replica_slot(
                    leaf.value, rank, world_size)
        else:
            encoded = encode_object(fqn, leaf.value, allow_pickle)
            if isinstance(encoded, str):
                state.json_values[fqn] = encoded
            else:
                state.pickled[fqn] = encoded
    return state


def data_file_prefix(rank: int) -> str:
    """The prefix of the names of every data file ``rank`` writes."""
    return f"r{rank:05d}-"


#: An action the coordinator runs with a save's metadata right before
#: committing it (:func:`save`'s ``before_commit``).
BeforeCommit = Callable[[Metadata], None]


class _Save:
    """State of one save on one rank.

    ``describe`` produces the rank's :class:`SaveState`; it runs inside the
    first step, so a bad leaf on one rank fails the save on every rank.
    """

    #: The file :meth:`commit` publishes.
    metadata_file = METADATA_FILE

    def __init__(self, describe: Callable[[], SaveState], storage: StoragePlugin,
                 planner: SavePlanner, coordinator: CoordinatorBase, overwrite: bool,
                 before_commit: BeforeCommit | None = None,
                 compression: codec.Compression | None = None) -> None:
        self.describe = describe
        #: how the writer threads compress chunks (None: stored as they are)
        self.compression = compression
        self.storage = storage
        self.planner = planner
        self.coord = coordinator
        self.overwrite = overwrite
        self.before_commit = before_commit
        self.state = SaveState()
        self.save_id: str | None = None
        self.written: list[str] = []
        #: the checkpoint's folder did not exist as the save began on this rank
        self.fresh = storage.location_exists() is False
        self.decls: dict[str, TensorDecl] = {}
        #: the dtype name of each fqn this rank holds (set by :meth:`write`)
        self.dtypes: dict[str, str] = {}
        self._by_fqn: dict[str, list[tensors.LocalChunk]] | None = None  # built for pieces
        #: host copies of the accelerator items this rank writes, by
        #: ``(fqn, offsets)``, and the samples of its accelerator replicas
        self.staged: dict[tuple[str, tuple[int, ...]], Any] = {}
        self.samples: dict[tuple[str, tuple[int, ...]], Any] = {}

    # -- phase 1: planning
    def offered(self) -> SavePlan:
        """Describe the state; every chunk this rank holds, before the
        planner's local step."""
        self.state = self.describe()
        self._by_fqn = None
        plan = SavePlan()
        for (fqn, offsets), chunk in self.state.chunks.items():
            plan.tensors[fqn] = TensorDecl(chunk.global_shape, chunk.dtype)
            plan.items.append(WriteItem(fqn, offsets, chunk.sizes,
                                        chunk.data.numel() * chunk.data.element_size()))
        return plan

    def local_plan(self) -> SavePlan:
        return self.planner.create_local_plan(self.offered())

    def global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.check_target()
        final = self.planner.create_global_plan(plans)
        for plan in plans:
            self.decls.update(plan.tensors)
        return final

    def check_target(self) -> None:
        """Refuse to replace a committed checkpoint unless ``overwrite``:
        one committed by a coordinated save (``metadata.json``) or by a save
        without traffic (its ranks' metadata files)."""
        if self.overwrite:
            return
        for name in (METADATA_FILE, rank_metadata_file(0)):
            if self.storage.exists(name):
                raise CheckpointError(
                    f"{self.storage.checkpoint_id!r} already holds a committed checkpoint "
                    f"({name}); pass overwrite=True to replace it")

    # -- phase 2: writing
    def write(self, save_id: str, plan: SavePlan) -> WriteResult:
        self.save_id = save_id
        result = WriteResult(json_values=self.state.json_values, pickled=self.state.pickled,
                             paths=self.state.paths)
        chunks = self.state.chunks
        mine = {(i.fqn, i.offsets) for i in plan.items
                if chunks.get((i.fqn, i.offsets)) is not None
                and chunks[(i.fqn, i.offsets)].sizes == i.sizes}  # written whole
        self.dtypes = {fqn: c.dtype for (fqn, _), c in chunks.items()}
        groups = _balance_files(plan.items, self.storage.thread_count)
        prefix = data_file_prefix(self.coord.rank)
        names = [f"{prefix}{k}.{save_id}{DATA_SUFFIX}" for k in range(len(groups))]
        self.written = names
        replicas = [key for key, c in self.state.chunks.items()
                    if key not in mine and c.data.numel() > 0]
        self._stage(plan.items, replicas)
        workers = max(1, self.storage.thread_count)
        # checksums, and the fingerprints of the replicas this rank does not
        # write, are computed on their own threads while the bytes are written
        with ThreadPoolExecutor(workers) as hashers, ThreadPoolExecutor(workers) as pool:
            writes = [pool.submit(self._write_file, name, group, hashers)
                      for name, group in zip(names, groups, strict=True)]
            batches = [replicas[k::workers] for k in range(workers)]
            hashes = [hashers.submit(self._hash_all, batch) for batch in batches if batch]
            for future in writes:
                chunks, prints, frames = future.result()
                result.chunks.extend(chunks)
                result.fingerprints.update(prints)
                result.frames.update(frames)
            for future in hashes:  # one task per thread: thousands of small replicas are cheap
                result.replicas.update(future.result())
        return result

    def _stage(self, items: list[WriteItem], replicas: list) -> None:
        """On the caller's thread, before any writer starts: copy what this
        rank writes from accelerators, and the samples of the accelerator
        replicas it fingerprints (:func:`sample_ranges`, gathered on the
        device), into the process's reused page-locked staging
        (:class:`dcp.core.devices.HostStaging`).  The copies run on the
        caller's current streams, so what the caller queued before the call
        is what is saved."""
        keys: list[tuple[bool, tuple[str, tuple[int, ...]]]] = []
        sources = []
        for item in items:
            source = self._source(item)
            if devices.is_accelerator(source.device):
                keys.append((False, (item.fqn, item.offsets)))
                sources.append(source)
        for key in replicas:
            data = self.state.chunks[key].data
            if devices.is_accelerator(data.device):
                keys.append((True, key))
                sources.append(devices.byte_sample(
                    data, sample_ranges(data.numel() * data.element_size())))
        self.staged, self.samples = {}, {}
        for (sample, key), host in zip(keys, _host_staging.stage(sources) if sources else [],
                                       strict=True):
            (self.samples if sample else self.staged)[key] = host

    def _hash_all(self, keys: list) -> dict:
        return {key: checksum(tensors.byte_view(self.samples[key])) if key in self.samples
                else fingerprint(tensors.byte_view(tensors.to_host(self.state.chunks[key].data)))
                for key in keys}

    def _source(self, item: WriteItem):
        """The tensor holding ``item``: a chunk this rank holds, or a box
        inside one (a piece of a chunk the planner split; a slice along
        dimension 0 is a view, not a copy)."""
        chunk = self.state.chunks.get((item.fqn, item.offsets))
        if chunk is not None and chunk.sizes == item.sizes:
            return chunk.data
        if self._by_fqn is None:  # writer threads may build it twice, never see it half-built
            by_fqn = defaultdict(list)
            for (fqn, _), c in self.state.chunks.items():
                by_fqn[fqn].append(c)
            self._by_fqn = by_fqn
        chunk = next(c for c in self._by_fqn[item.fqn]
                     if all(o <= i and i + n <= o + s for o, s, i, n
                            in zip(c.offsets, c.sizes, item.offsets, item.sizes, strict=True)))
        rel = [i - o for i, o in zip(item.offsets, chunk.offsets, strict=True)]
        return tensors.region(chunk.data, rel, item.sizes)

    def _bytes(self, item: WriteItem) -> memoryview:
        """The bytes of ``item`` in host memory (staged, if it lives on an
        accelerator)."""
        staged = self.staged.get((item.fqn, item.offsets))
        return tensors.byte_view(staged if staged is not None
                                 else tensors.to_host(self._source(item)))

    def _write_file(self, name: str, group: list[WriteItem], hashers: ThreadPoolExecutor):
        """Write one data file while ``hashers`` computes its chunks'
        checksums (of their logical bytes); returns its chunks' metadata, the
        fingerprints of those over :data:`REPLICA_SAMPLE_BYTES` and the
        frame indexes of those it compressed (on this thread, the writer's:
        :attr:`compression`)."""
        buffers: list[memoryview | bytes] = []
        placed, offset = [], 0
        align = self.storage.alignment
        frames: dict[tuple[str, tuple[int, ...]], codec.FrameIndex] = {}
        for item in group:
            buf = self._bytes(item)
            parts: list[memoryview | bytes] = [buf]
            policy = self.compression if len(buf) else None
            if policy is not None:
                dtype = self.dtypes[item.fqn]
                parts, index = codec.compress(buf, dtype, DTYPE_ITEMSIZE[dtype], policy)
                frames[(item.fqn, item.offsets)] = index
            # compressed chunks are decoded, never mapped or read direct: no padding
            if policy is None and len(buf) >= ALIGNED_CHUNK_BYTES and offset % align:
                buffers.append(bytes(align - offset % align))
                offset += align - offset % align
            buffers.extend(parts)
            placed.append((item, buf, offset))
            offset += sum(len(p) for p in parts)
        sums = hashers.submit(lambda: [
            (checksum(buf), fingerprint(buf) if len(buf) > REPLICA_SAMPLE_BYTES else None)
            for _, buf, _ in placed])
        try:
            self.storage.retrying(self.storage.write_file, name, buffers)
        except Exception as e:
            attempts = getattr(e, "attempts", 1)
            tries = f" ({attempts} attempts)" if attempts > 1 else ""
            raise CheckpointError(
                f"rank {self.coord.rank}: writing {name!r} failed{tries}: {e}") from e
        out, prints = [], {}
        for (item, buf, start), (crc, sample) in zip(placed, sums.result(), strict=True):
            out.append((item.fqn, ChunkMeta(item.offsets, item.sizes, name, start, len(buf), crc,
                                            self.coord.rank)))
            if sample is not None:
                prints[(item.fqn, item.offsets)] = sample
        return out, prints, frames

    # -- phase 3: commit (coordinator)
    def commit(self, save_id: str, results: list[WriteResult]) -> Metadata:
        md = build_metadata(save_id, self.coord.world_size, self.decls, results)
        self._merge_objects(md, results, save_id)
        md.paths = merge_paths(md, results)
        if self.before_commit is not None:
            self.before_commit(md)
        commit_metadata(self.storage, self.metadata_file, md, self.overwrite)
        # the replaced checkpoint's data files, and those an interrupted save
        # left (a process killed before it could delete them)
        delete_stale(self.storage, md.files(), self._owns)
        if self.metadata_file == METADATA_FILE:
            # a checkpoint saved without traffic replaced: its ranks' metadata
            # files name data files now deleted (metadata.json is read first)
            delete_stale(self.storage, set(), self._owns, is_rank_metadata_file)
        return md

    def _owns(self, name: str) -> bool:
        """Whether this commit removes ``name`` when it is a replaced
        checkpoint's data file (all of them, for a coordinated save)."""
        return True

    def _merge_objects(self, md: Metadata, results: list[WriteResult], save_id: str) -> None:
        texts = _agreed([r.json_values for r in results], lambda fqn, r0, a, r1, b: (
            f"{fqn!r}: ranks {r0} and {r1} hold different values ({a:.60} vs {b:.60}); give "
            f"per-rank values distinct keys"))
        for fqn, text in texts.items():
            md.objects[fqn] = ObjectMeta(value=json.loads(text))
        blobs: dict[str, bytes] = {}
        holders: dict[str, int] = {}
        for rank, result in enumerate(results):
            for fqn, blob in result.pickled.items():
                kept = blobs.setdefault(fqn, blob)  # pickles of equal objects may differ
                holders.setdefault(fqn, rank)
                if kept is not blob and split_raw(blob) is not None and kept != blob:
                    raise CheckpointError(
                        f"{fqn!r}: ranks {holders[fqn]} and {rank} hold different bytes; "
                        f"give per-rank values distinct keys")
        if blobs:
            name = f"{data_file_prefix(self.coord.rank)}objects.{save_id}{DATA_SUFFIX}"
            self.written.append(name)
            self.storage.retrying(self.storage.write_file, name, place_pickled(name, blobs, md))

    def persist(self, save_id: str, plan: SavePlan) -> Metadata:
        """Phases 2 and 3: write ``plan``, then commit on the coordinator.
        On failure every rank deletes the files it wrote, also when
        interrupted (``KeyboardInterrupt``, a signal handler's exception)."""
        try:
            return self.coord.gather_broadcast(
                "save writing/commit", lambda: self.write(save_id, plan),
                lambda results: self.commit(save_id, results))
        except BaseException:  # any rank's failure, the transport's (a timeout), an interrupt
            self.discard()
            raise

    def discard(self) -> None:
        """After a failure: delete the files this rank wrote, unless this
        save's metadata is committed.  A failure can follow the commit (the
        coordinator, or a rank waiting for its answer, loses a peer after the
        metadata was published); the files are then the checkpoint's.  If
        the metadata cannot be read, the files are kept: garbage is better
        than a committed checkpoint without its data.  Then the folder goes
        too if the save made it (:meth:`remove_folder`)."""
        if self.written:
            try:
                committed = (decode(self.storage.read_file(self.metadata_file)).save_id
                             == self.save_id)
            except (FileNotFoundError, CorruptCheckpointError):
                committed = False
            except Exception:  # unknown: keep the files
                committed = True
            if committed:
                return
            self.storage.delete(self.written)
            self.written = []
        self.remove_folder()

    def remove_folder(self) -> None:
        """After a failure, once this rank's files are deleted: remove the
        checkpoint's folder if it did not exist when this rank's save began
        and is empty now (:meth:`StoragePlugin.remove_if_empty`; each rank
        tries, so the last to delete its files removes it)."""
        if self.fresh:
            self.storage.remove_if_empty()

    def plan_all(self, plans: list[SavePlan], save_id: str | None) -> list[tuple[str, SavePlan]]:
        """The coordinator's planning: each rank's final plan, with the
        save's id (``save_id``, or a fresh random ``<16 hex digits>00000000``)."""
        chosen = save_id or f"{uuid.uuid4().hex[:16]}{0:08x}"
        return [(chosen, plan) for plan in self.global_plan(plans)]

    def run(self, save_id: str | None = None) -> Metadata:
        """The whole save, as ``save_id`` (by default the coordinator draws
        a fresh one)."""
        save_id, plan = self.coord.gather_scatter(
            "save planning", self.local_plan, lambda plans: self.plan_all(plans, save_id))
        return self.persist(save_id, plan)


def save(state_dict: dict, checkpoint_id: str, *, planner: SavePlanner | None = None,
         storage: StoragePlugin | None = None, process_group=None, overwrite: bool = False,
         allow_pickle: bool = False, storage_options: dict | None = None,
         before_commit: BeforeCommit | None = None,
         compression: codec.Compression | str | None = None) -> Metadata:
    """Save a (sharded) state dict as one checkpoint; collective over the group.

    Args:
        state_dict: nested dicts/lists/tuples whose leaves are tensors
            (``torch.Tensor`` = replicated on every rank; ``DTensor``;
            :class:`dcp.TensorShard`) or JSON-representable values.
        checkpoint_id: a path or URI; its scheme picks the storage plugin.
        planner: the :class:`~dcp.core.planner.SavePlanner` (default: dedup +
            balanced writes, ``planners.save.DefaultSavePlanner``).
        storage: a ready :class:`~dcp.core.storage.StoragePlugin` instead of
            ``open_storage(checkpoint_id, **storage_options)``.
        process_group: the group saving together (default: the default group
            if ``torch.distributed`` is initialized, else a single process).
        overwrite: replace a committed checkpoint at ``checkpoint_id``; the
            old one stays loadable until the new metadata commits.
        allow_pickle: store values that are not JSON-representable pickled.
        storage_options: keyword options of the storage plugin (e.g.
            ``thread_count``, ``fsync`` for POSIX).
        before_commit: ``fn(metadata)``, run once, by the coordinator, after
            every rank has written and right before the metadata is
            committed: what must be durable before the checkpoint exists
            (the checkpoint manager names the step in its pointer there).
            Raising fails the save on every rank: nothing is committed.
        compression: compress tensor chunks losslessly: ``"zstd"`` or a
            :class:`dcp.Compression` (level, frame size); ``None`` (the
            default) stores them as they are.  See ``docs/compression.md``.

    A save waits first for this process's :func:`dcp.async_save` in flight,
    if any (one save in flight per job).  A save of a structure this group
    saved before reuses its plan (:mod:`dcp.coordination.plan_cache`): the ranks write
    right away, and one gather of the write results and one broadcast of
    the commit are all the coordination.

    Returns:
        The committed :class:`~dcp.Metadata` (on every rank).

    Raises:
        CheckpointError: on every rank, naming the rank, fqn or file at
        fault, if anything fails (ranks that passed different checkpoint
        ids: each id and its ranks); nothing is committed then.
    """
    policy = codec.resolve(compression)
    pending.wait()
    coordinator = Coordinator(process_group)
    if storage is None:
        storage = open_storage(str(checkpoint_id), **(storage_options or {}))
    planner = planner if planner is not None else cast(SavePlanner, default_planner("save"))
    agree = functools.partial(dtensor_offsets.agree, coordinator)
    job = _Save(lambda: describe_state(state_dict, allow_pickle, agree=agree), storage, planner,
                coordinator, overwrite, before_commit, policy)
    with gc_paused():
        if coordinator.world_size == 1:  # nothing to exchange
            return job.run()
        return _plan_caches.setdefault(coordinator.members, PlanCache()).save(job).metadata
