"""Offline access to a checkpoint, one tensor at a time, from a single process.

The conversion, verification and comparison tools work outside a training
job, on checkpoints that may be larger than memory.  This module gives them
two pieces whose memory is bounded by about the largest tensor, not the
model:

* :func:`read_tensor` — one whole tensor, consolidated from its chunks: each
  chunk's bytes are read straight into their place in the result (the byte
  runs of :func:`dcp.core.boxes.byte_runs`), and checked against the chunk's
  checksum where it has one.
* :class:`CheckpointWriter` — writes a checkpoint tensor by tensor through
  any storage plugin.  Tensors are buffered up to ``buffer_bytes`` and then
  written as one data file; the metadata is committed last and atomically,
  as :func:`dcp.save` does, so an interrupted conversion leaves no
  checkpoint.

Both work on anything presented as a :class:`~dcp.core.storage.StoragePlugin`
with :class:`~dcp.core.metadata.Metadata`, a safetensors folder included (see
:mod:`dcp.interop.safetensors_io`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from dcp.core import tensors, unpickler
from dcp.core.boxes import byte_runs
from dcp.core.compression import decode_frames
from dcp.core.metadata import (
    DTYPE_ITEMSIZE,
    METADATA_FILE,
    BlobRef,
    ChunkMeta,
    Metadata,
    ObjectMeta,
    TensorMeta,
    checksum,
)
from dcp.core.storage import StoragePlugin, open_storage
from dcp.errors import CheckpointError, CorruptCheckpointError
from dcp.orchestration.inventory import file_kind
from dcp.orchestration.save import (
    DATA_SUFFIX,
    commit_metadata,
    delete_stale,
    encode_object,
    place_pickled,
)

#: Default bytes of tensor data a :class:`CheckpointWriter` gathers into one
#: data file.
DEFAULT_BUFFER_BYTES = 64 << 20


@dataclass
class ExportResult:
    """What an export to a foreign format wrote.

    ``files``: names written, relative to the destination; ``tensors`` and
    ``nbytes``: how many tensors and bytes of tensor data were exported;
    ``skipped``: fqns of non-tensor values the format cannot hold.
    """

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    nbytes: int = 0
    skipped: list[str] = field(default_factory=list)


def conversion_data(name: str) -> bool:
    """Whether ``name`` is a data file a save or a conversion writes (a
    checkpoint overwritten by a conversion may hold either)."""
    return file_kind(name) == "data"


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A tqdm bar on stderr counting ``total`` bytes, shown only if
    ``enabled`` (the CLI enables it when stderr is a terminal)."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, leave=False)


def _is_float(dtype: str) -> bool:
    return tensors.torch_dtype(dtype).is_floating_point


def export_selection(md: Metadata, prefix: str | None, dtype: str | torch.dtype | None,
                      where: str
                      ) -> tuple[dict[str, str], dict[str, str | None]]:
    """The fqns exported, each with its name after stripping ``prefix``,
    and the dtype each is cast to (floating-point tensors only; ``dtype`` a
    name such as ``"bfloat16"`` or a ``torch.dtype``)."""
    if isinstance(dtype, torch.dtype):
        dtype = tensors.dtype_name(dtype, "export dtype")
    if dtype is not None and (dtype not in DTYPE_ITEMSIZE or not _is_float(dtype)):
        raise CheckpointError(f"export dtype {dtype!r} is not a floating-point dtype name "
                              f"(such as 'bfloat16', 'float16', 'float32')")
    selected = {f: f for f in md.tensors}
    if prefix:
        selected = {f: f[len(prefix):] for f in md.tensors if f.startswith(prefix)}
        if not selected:
            raise CheckpointError(f"{where} has no tensor whose fqn starts with {prefix!r}; its "
                                  f"first ones: {', '.join(map(repr, list(md.tensors)[:5]))}")
    casts = {f: (dtype if dtype is not None and _is_float(md.tensors[f].dtype) else None)
             for f in selected}
    return selected, casts


def renamed(fqns: Iterable[str], rename: dict[str, str] | None, where: str) -> dict[str, str]:
    """Map each fqn to its new name under ``rename`` (unlisted fqns keep
    theirs).

    Raises :class:`CheckpointError` naming the key if ``rename`` names a key
    that is not among ``fqns`` (a typo would otherwise pass silently) or if
    two keys end up with the same name; ``where`` names the source.
    """
    fqns = list(fqns)
    rename = rename or {}
    unknown = sorted(set(rename) - set(fqns))
    if unknown:
        raise CheckpointError(
            f"rename map names key(s) not in {where}: {', '.join(map(repr, unknown))}")
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for fqn in fqns:
        new = rename.get(fqn, fqn)
        if new in seen:
            raise CheckpointError(
                f"renaming {where}: {seen[new]!r} and {fqn!r} would both be named {new!r}")
        seen[new] = fqn
        out[fqn] = new
    return out


def split_file(uri: str) -> tuple[str, str]:
    """The folder of file ``uri`` (a path or URI; ``"."`` for a bare name)
    and the file's name: the storage plugin to open and the name to ask it
    for, for the converters that take one file (a ``.safetensors``, a
    MindSpore ``.ckpt``)."""
    root, _, name = uri.rstrip("/").rpartition("/")
    return root or ".", name


def read_compressed_chunk(storage: StoragePlugin, fqn: str, chunk: ChunkMeta,
                          itemsize: int) -> memoryview:
    """The logical bytes of compressed ``chunk`` of ``fqn``: its stored
    bytes read in one request, each frame's CRC-32C checked and the frame
    decoded (:func:`dcp.core.compression.decode_frames`), then the chunk's
    CRC-32C of its logical bytes.  Raises :class:`CorruptCheckpointError`
    naming the tensor, chunk and file."""
    assert chunk.frames is not None
    index = chunk.frames
    where = (f"{fqn!r}: compressed chunk at offsets {list(chunk.offsets)} (from byte "
             f"{chunk.byte_offset}) of file {chunk.file!r}")
    stored = memoryview(bytearray(index.stored_nbytes))
    try:
        storage.read_ranges(chunk.file, [(chunk.byte_offset, stored)])
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: reading it failed: {e}") from e
    out = memoryview(bytearray(chunk.nbytes))
    starts = index.stored_offsets()
    decode_frames(index, range(len(starts)),
                  [stored[s:s + n] for s, n in zip(starts, index.stored, strict=True)], out,
                  itemsize, where)
    if chunk.checksum is not None and checksum(out) != chunk.checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch of its decoded bytes: the "
                                     f"checkpoint is corrupted")
    return out


def check_readable(storage: StoragePlugin, fqn: str, meta: TensorMeta) -> None:
    """Read the last byte of each chunk of ``fqn``, so that a short file (or
    a crafted size) raises before its tensor's memory is allocated.  Raises
    :class:`CorruptCheckpointError` naming the tensor, chunk and file."""
    meta.check_coverage(fqn, storage.checkpoint_id)
    for chunk in meta.chunks:
        if chunk.nbytes:
            try:
                storage.read_ranges(chunk.file, chunk.last_byte())
            except Exception as e:
                raise CorruptCheckpointError(
                    f"{fqn!r}: reading chunk at offsets {list(chunk.offsets)} from file "
                    f"{chunk.file!r} failed: {e}") from e


def read_tensor(storage: StoragePlugin, fqn: str, meta: TensorMeta) -> torch.Tensor:
    """The whole tensor ``fqn`` as a contiguous host tensor of ``meta.shape``
    and ``meta.dtype``, read from its chunks in ``storage``.

    Each chunk's checksum is verified when it has one.

    Raises:
        CorruptCheckpointError: naming ``fqn``, the chunk and the file, if a
            read fails (missing or short file), a checksum does not match, or
            the chunks do not cover the tensor.
    """
    check_readable(storage, fqn, meta)  # no allocation for crafted sizes
    out = tensors.empty_host(meta.shape, meta.dtype)
    view = tensors.byte_view(out)
    itemsize = DTYPE_ITEMSIZE[meta.dtype]
    for chunk in meta.chunks:
        if chunk.frames is not None:  # decoded, checked, then placed
            place(read_compressed_chunk(storage, fqn, chunk, itemsize), meta, chunk, view)
            continue
        ranges, pos = [], 0
        for start, length in byte_runs(meta.shape, chunk.offsets, chunk.sizes, itemsize):
            ranges.append((chunk.byte_offset + pos, view[start:start + length]))
            pos += length
        try:
            storage.read_ranges(chunk.file, ranges)
        except Exception as e:
            raise CorruptCheckpointError(
                f"{fqn!r}: reading chunk at offsets {list(chunk.offsets)} from file "
                f"{chunk.file!r} failed: {e}") from e
        if chunk.checksum is not None:
            crc = 0
            for _, buf in ranges:
                crc = checksum(buf, crc)
            if crc != chunk.checksum:
                raise CorruptCheckpointError(
                    f"{fqn!r}: checksum mismatch in chunk at offsets {list(chunk.offsets)} "
                    f"(bytes {chunk.byte_offset}..{chunk.byte_offset + chunk.nbytes} of file "
                    f"{chunk.file!r}): the checkpoint is corrupted")
    return out


def place(data: memoryview, meta: TensorMeta, chunk: ChunkMeta, out: memoryview) -> None:
    """Copy a chunk's row-major bytes ``data`` into ``out``, the whole
    tensor's."""
    pos = 0
    for start, length in byte_runs(meta.shape, chunk.offsets, chunk.sizes,
                                   DTYPE_ITEMSIZE[meta.dtype]):
        out[start:start + length] = data[pos:pos + length]
        pos += length


def read_blob(storage: StoragePlugin, fqn: str, ref: BlobRef) -> bytes:
    """The pickled bytes of the value ``fqn``, checksum verified (not
    unpickled).  Raises :class:`CorruptCheckpointError` naming ``fqn`` and
    the file on a failed read or a checksum mismatch."""
    blob = bytearray(ref.nbytes)
    try:
        storage.read_ranges(ref.file, [(ref.byte_offset, memoryview(blob))])
    except Exception as e:
        raise CorruptCheckpointError(f"{fqn!r}: reading its pickled bytes from file {ref.file!r} "
                                     f"failed: {e}") from e
    if checksum(blob) != ref.checksum:
        raise CorruptCheckpointError(
            f"{fqn!r}: checksum mismatch in its pickled bytes in file {ref.file!r}")
    return bytes(blob)


def read_object(storage: StoragePlugin, fqn: str, meta: ObjectMeta, allow_pickle: bool) -> Any:
    """The non-tensor value ``fqn``: its JSON value, or, only with
    ``allow_pickle``, its value unpickled by :mod:`dcp.core.unpickler`
    (allow-listed globals only).  Raises :class:`CheckpointError` naming
    ``fqn`` for a pickled value without ``allow_pickle`` or one naming a
    global not allowed; :class:`CorruptCheckpointError` as
    :func:`read_blob`."""
    if meta.pickled is None:
        return meta.value
    if not allow_pickle:
        raise CheckpointError(
            f"{fqn!r} is stored pickled; reading it needs allow_pickle=True, which unpickles it "
            f"(allow-listed types only: see dcp.core.unpickler)")
    return unpickler.loads(read_blob(storage, fqn, meta.pickled),
                           f"{fqn!r} (file {meta.pickled.file!r})")


class CheckpointWriter:
    """Writes one checkpoint from a single process, tensor by tensor.

    Use as a context manager: leaving the block by an exception deletes the
    data files written so far, and nothing is committed::

        with CheckpointWriter("s3://bucket/ckpt") as writer:
            for fqn, tensor in source:
                writer.add_tensor(fqn, tensor)
            metadata = writer.commit()

    Memory: tensors are written as one data file as soon as they add up to
    ``buffer_bytes``, so the writer holds less than ``buffer_bytes`` plus
    the tensor just added.

    Args:
        checkpoint_id: path or URI; its scheme picks the storage plugin.
        overwrite: replace a committed checkpoint there (its data files are
            deleted after the new metadata commits).
        allow_pickle: store non-JSON values pickled (see :func:`dcp.save`).
        buffer_bytes: bytes of tensor data per data file (about).
        storage: a ready plugin instead of ``open_storage(checkpoint_id,
            **storage_options)``.

    Raises:
        CheckpointError: at construction if a committed checkpoint exists
            and ``overwrite`` is false.
    """

    def __init__(self, checkpoint_id: str, *, overwrite: bool = False, allow_pickle: bool = False,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, storage: StoragePlugin | None = None,
                 storage_options: dict | None = None) -> None:
        self.storage = storage or open_storage(str(checkpoint_id), **(storage_options or {}))
        self.overwrite = overwrite
        self.allow_pickle = allow_pickle
        self.buffer_bytes = buffer_bytes
        if not overwrite and self.storage.exists(METADATA_FILE):
            raise CheckpointError(
                f"{self.storage.checkpoint_id!r} already holds a committed checkpoint; "
                f"pass overwrite=True to replace it")
        self.metadata = Metadata(save_id=uuid.uuid4().hex[:16], world_size=1)
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._pickled: dict[str, bytes] = {}
        self._written: list[str] = []
        self._committed = False

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None and not self._committed:
            self.storage.delete(self._written)

    def _claim(self, fqn: str) -> None:
        if fqn in self.metadata.tensors or fqn in self.metadata.objects or fqn in self._pickled:
            raise CheckpointError(f"{fqn!r} was added twice")

    def add_tensor(self, fqn: str, tensor: torch.Tensor) -> None:
        """Add the whole tensor ``fqn`` (any shape, a supported dtype, any
        device).  Raises :class:`CheckpointError` naming ``fqn`` for an
        unsupported dtype or a repeated fqn."""
        self._claim(fqn)
        shape = tuple(tensor.shape)
        self.metadata.tensors[fqn] = TensorMeta(shape, tensors.dtype_name(tensor.dtype, fqn))
        if tensor.numel() == 0:
            return
        host = tensors.to_host(tensor)
        self._pending.append((fqn, host))
        self._pending_bytes += host.numel() * host.element_size()
        if self._pending_bytes >= self.buffer_bytes:
            self._flush()

    def add_object(self, fqn: str, value: Any) -> None:
        """Add a non-tensor value: stored as JSON, or pickled if the writer
        allows it.  Raises :class:`CheckpointError` naming ``fqn`` otherwise."""
        self._claim(fqn)
        encoded = encode_object(fqn, value, self.allow_pickle)
        if isinstance(encoded, str):
            self.metadata.objects[fqn] = ObjectMeta(value=json.loads(encoded))
        else:
            self._pickled[fqn] = encoded

    def _write(self, name: str, buffers) -> None:
        self._written.append(name)  # before writing: a partial file is deleted too
        try:
            self.storage.write_file(name, buffers)
        except Exception as e:
            raise CheckpointError(
                f"writing {name!r} of {self.storage.checkpoint_id!r} failed: {e}") from e

    def _flush(self) -> None:
        name = f"convert-{len(self._written):05d}.{self.metadata.save_id}{DATA_SUFFIX}"
        buffers = [tensors.byte_view(host) for _, host in self._pending]
        with ThreadPoolExecutor(1) as pool:  # hash while writing: both only read the buffers
            crcs = pool.submit(lambda: [checksum(buf) for buf in buffers])
            self._write(name, buffers)
            offset = 0
            for (fqn, _), buf, crc in zip(self._pending, buffers, crcs.result(), strict=True):
                meta = self.metadata.tensors[fqn]
                meta.chunks.append(ChunkMeta((0,) * len(meta.shape), meta.shape, name, offset,
                                             len(buf), crc, 0))
                offset += len(buf)
        self._pending, self._pending_bytes = [], 0

    def commit(self) -> Metadata:
        """Write what is buffered, then commit the metadata atomically; with
        ``overwrite``, delete the replaced checkpoint's data files.  Returns
        the committed :class:`~dcp.Metadata`.

        Raises :class:`CheckpointError` if a write fails or another writer
        committed at the same place first."""
        if self._pending:
            self._flush()
        if self._pickled:
            name = f"convert-objects.{self.metadata.save_id}{DATA_SUFFIX}"
            self._write(name, place_pickled(name, self._pickled, self.metadata))
        try:
            commit_metadata(self.storage, METADATA_FILE, self.metadata, self.overwrite)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"committing {METADATA_FILE!r} of {self.storage.checkpoint_id!r} "
                f"failed: {e}") from e
        self._committed = True
        if self.overwrite:
            delete_stale(self.storage, self.metadata.files(), lambda name: True,
                         conversion_data)
        return self.metadata
