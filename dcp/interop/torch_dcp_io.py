"""Interop with PyTorch DCP (``torch.distributed.checkpoint``), both ways.

* **import** (:func:`torch_dcp_to_checkpoint`): torch's ``.metadata`` gives
  each chunk's byte range in its ``.distcp`` file, a ``torch.save`` archive
  (zip) of one tensor that stores its bytes uncompressed.  The archive's
  directory and its small ``data.pkl`` are read (without running the
  pickle: only the tensor's rebuild call is accepted, see
  :func:`_tensor_pickle`) to find where the raw bytes start, so
  :class:`TorchDcpFolder` presents the checkpoint as ours and the
  conversion runs as the safetensors import does: budgeted concurrent
  file tasks, optionally shared over a job's ranks
  (:func:`dcp.interop.parallel.import_checkpoint`).  A tensor torch stored
  otherwise (through a stream extension, strided) sends the conversion
  through torch's own loader instead.  Keys are regrouped by the paths
  torch records (``planner_data``), so nested state dicts round-trip.
* **export** (:func:`checkpoint_to_torch_dcp`): torch's own planner and
  writer, given placeholder (meta) tensors to plan with, write the
  ``.metadata`` and the values; each tensor's file is ``torch.save``'s
  archive written here around the tensor's bytes (read straight from our
  checkpoint into the buffer written, within a byte budget, several files
  at once); over a job's ranks, each writes a share through torch's
  collective save.

Both take local paths (or ``file://`` URIs) for the PyTorch DCP side.

**Reading runs code from the checkpoint.**  PyTorch DCP's ``.metadata`` is a
pickle, and its non-tensor values are ``torch.save`` pickles: reading them
can execute arbitrary code.  :func:`torch_dcp_to_checkpoint` therefore
refuses unless called with ``trusted=True``, which you should pass only for
checkpoints you trust (``hyperdcp convert --trust-pickle``).  The checkpoint
it writes is ours: JSON metadata and raw bytes, safe to read from then on.
"""

from __future__ import annotations

import contextlib
import io
import math
import struct
import warnings
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from tqdm import tqdm

from dcp.core import tensors, unpickler
from dcp.core.metadata import TORCH_METADATA_FILE, ChunkMeta, Metadata, TensorMeta
from dcp.core.state_dict import flatten
from dcp.core.storage import StoragePlugin, open_storage, scheme_of
from dcp.errors import CheckpointError, NotACheckpointError
from dcp.interop.parallel import (
    DEFAULT_BUDGET_BYTES,
    BufferPool,
    ByteBudget,
    Ranks,
    describe_error,
    import_checkpoint,
    read_tensors,
    tensor_bytes,
)
from dcp.interop.streaming import (
    CheckpointWriter,
    ExportResult,
    check_readable,
    progress_bar,
    read_object,
    renamed,
)
from dcp.interop.view import ReadOnlyView
from dcp.orchestration.load import read_metadata


def _local_path(uri: str) -> str:
    if scheme_of(uri) != "file":
        raise CheckpointError(
            f"{uri!r}: PyTorch DCP checkpoints are read and written here through torch's "
            f"FileSystemReader/Writer, which take local paths (or file:// URIs)")
    return uri.removeprefix("file://")


@contextlib.contextmanager
def _single_process():
    """Around torch's save/load with ``no_dist=True``: silence its warnings
    that it assumes a single process, and that it overwrites a checkpoint
    (both what we ask for)."""
    with warnings.catch_warnings():
        for message in ("torch.distributed is disabled", "Detected an existing checkpoint"):
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def _torch_error(what: str, e: BaseException) -> CheckpointError:
    """A :class:`CheckpointError` for a failure inside torch's DCP; one of
    ours raised from a callback inside it is returned as it was."""
    if isinstance(e, CheckpointException):
        inner = [exc for exc, _ in e.failures.values()]
        if len(inner) == 1 and isinstance(inner[0], CheckpointError):
            return inner[0]
        detail = "; ".join(f"{type(exc).__name__}: {exc}" for exc in inner)
    else:
        detail = f"{type(e).__name__}: {e}"
    return CheckpointError(f"{what} failed in torch.distributed.checkpoint: {detail}")


def _batches(items: list[tuple[str, str]], nbytes, limit: int) -> list[list[tuple[str, str]]]:
    """Consecutive groups of at most ``limit`` bytes (a larger item alone)."""
    groups: list[list[tuple[str, str]]] = [[]]
    size = 0
    for item in items:
        n = nbytes(item[1])
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


class _Range(io.RawIOBase):
    """Bytes ``[start, start + length)`` of file ``name`` as a read-only,
    seekable file (for :mod:`zipfile`), read through ``storage``."""

    def __init__(self, storage: StoragePlugin, name: str, start: int, length: int) -> None:
        super().__init__()
        self.storage, self.name, self.start, self.length, self.pos = (
            storage, name, start, length, 0)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:  # type: ignore[override]
        n = max(0, min(len(b), self.length - self.pos))
        if n:
            self.storage.read_ranges(self.name, [(self.start + self.pos, memoryview(b)[:n])])
        self.pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        """At most the bytes left in the range: :mod:`zipfile` asks for the
        sizes an archive declares, and a buffer of a declared size is never
        allocated beyond what the range holds."""
        left = max(0, self.length - self.pos)
        buf = bytearray(left if size is None or size < 0 else min(size, left))
        return bytes(memoryview(buf)[:self.readinto(buf)])


def _rebuild(storage, offset, size, stride, *rest):
    return storage, offset, tuple(size), tuple(stride)


def _tensor_pickle(data: bytes, where: str) -> tuple:
    """The ``data.pkl`` of a ``torch.save`` of one tensor, read by the
    restricted unpickler without running anything: ``_rebuild_tensor_v2``
    gives back its storage's persistent id, offset, size and stride; any
    other global refuses."""
    allowed: dict[str, Any] = {f"torch.{name}": name for name in _STORAGE_DTYPES}
    allowed.update({"torch._utils._rebuild_tensor_v2": _rebuild, "collections.OrderedDict": dict})
    return unpickler.loads(data, where, allowed, persistent_load=tuple)


def _raw_offset(storage: StoragePlugin, info: _StorageInfo, dtype: torch.dtype,
                sizes: tuple[int, ...]) -> int | str:
    """Where the raw row-major bytes of the chunk ``info`` (a ``torch.save``
    of one tensor of ``sizes`` and ``dtype`` in torch's file) start in its
    file, or why they cannot be read raw (compressed, strided, ...)."""
    if info.transform_descriptors:
        return f"stored through {list(info.transform_descriptors)}"
    nbytes = math.prod(sizes) * dtype.itemsize
    try:  # every value below comes from the file: anything odd means "not raw"
        with zipfile.ZipFile(_Range(storage, info.relative_path, info.offset, info.length)) as z:
            infos = z.infolist()
            pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
            data = [i for i in infos if "/data/" in i.filename]
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            if len(pkl) != 1 or len(data) != 1:
                return "not one little-endian storage"
            if any(i.compress_type != zipfile.ZIP_STORED for i in (*pkl, *order)):
                return "compressed records"  # torch.save stores them as they are
            if order and z.read(order[0]) != b"little":
                return "not one little-endian storage"
            (kind, storage_type, key, _, numel), offset, size, stride = _tensor_pickle(
                z.read(pkl[0]), f"{info.relative_path}: {pkl[0].filename}")
            entry = data[0]
            header = bytearray(30)
            storage.read_ranges(info.relative_path,
                                [(info.offset + entry.header_offset, memoryview(header))])
        contiguous = tuple(size) == sizes and len(stride) == len(size) and all(
            stride[d] == math.prod(size[d + 1:]) for d in range(len(size)) if size[d] > 1)
        names = int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
        start = entry.header_offset + 30 + names  # within torch's byte range of the chunk
        raw = (kind == "storage" and _STORAGE_DTYPES.get(storage_type) == dtype and offset == 0
               and tuple(size) == sizes and contiguous and numel * dtype.itemsize == nbytes
               and entry.file_size == nbytes and entry.compress_type == zipfile.ZIP_STORED
               and entry.filename.endswith(f"/data/{key}") and header[:4] == b"PK\x03\x04"
               and start + nbytes <= info.length)
    except Exception as e:  # a damaged or unusual archive: torch's own loader reads it
        return f"not a torch.save of one tensor ({type(e).__name__}: {e})"
    if not raw:
        return f"a {storage_type} of size {size}, stride {stride}, offset {offset}"
    return info.offset + start


_STORAGE_DTYPES = {name: dtype for name, dtype in
                   torch.storage._storage_type_to_dtype_map().items()}


class TorchDcpFolder(ReadOnlyView):
    """A PyTorch DCP checkpoint's tensors presented as a read-only
    checkpoint: each chunk is the byte range of its raw data inside torch's
    ``.distcp`` file (a ``torch.save`` archive stores it uncompressed), no
    checksum.  ``keys`` maps our fqn to torch's key.  :attr:`unreadable`
    names a tensor whose bytes are not stored raw (with the reason), if
    any; its metadata is then incomplete.  Reading the headers runs no
    pickle code (see :func:`_tensor_pickle`)."""

    def __init__(self, local: str, source: Any, keys: dict[str, str]) -> None:
        super().__init__(local, open_storage(local), "PyTorch DCP checkpoint")
        self.unreadable: str | None = None
        self._metadata = Metadata(save_id="torch-dcp", world_size=1)
        entries, storage_data = source.state_dict_metadata, source.storage_data
        for fqn, key in keys.items():
            m = entries[key]
            meta = TensorMeta(tuple(m.size), tensors.dtype_name(m.properties.dtype, key))
            for chunk in m.chunks:
                sizes = tuple(chunk.sizes)
                if not math.prod(sizes):
                    continue
                info = storage_data[MetadataIndex(key, chunk.offsets)]
                where = _raw_offset(self.inner, info, m.properties.dtype, sizes)
                if isinstance(where, str):
                    self.unreadable = f"{key!r} ({info.relative_path}): {where}"
                    return
                meta.chunks.append(ChunkMeta(tuple(chunk.offsets), sizes, info.relative_path,
                                             where, math.prod(sizes) * m.properties.dtype.itemsize,
                                             None, 0))
            self._metadata.tensors[fqn] = meta

    @property
    def metadata(self) -> Metadata:
        return self._metadata


class _TensorAt:
    """Stands for torch's tensor ``key`` in a nested state dict."""

    def __init__(self, key: str) -> None:
        self.key = key


def _regroup(keys: list[str], values: dict[str, Any], mapping) -> tuple[
        dict[str, str], dict[str, Any], dict[str, tuple[str | int, ...]] | None]:
    """Our fqns for torch's flattened keys: torch's ``planner_data`` maps
    each key to its path in the state dict that was saved, so the nested
    state is rebuilt and flattened as :func:`dcp.load` flattens a target
    (``optim.param_groups.0.lr``... become the one value
    ``optim.param_groups``, as ``optimizer.state_dict()`` holds it).
    Returns (fqn -> tensor key, fqn -> value, fqn -> its path in that
    state, for :attr:`dcp.Metadata.paths`); without torch's paths the keys
    keep their names and the paths are ``None`` (unknown)."""
    flat = {k: values[k] if k in values else _TensorAt(k) for k in keys}
    paths: dict[str, tuple[str | int, ...]] | None = None
    if not isinstance(mapping, dict) or not all(
            isinstance(mapping.get(k), tuple) and mapping[k] for k in keys):
        leaves = flat
    else:
        nested = unflatten_state_dict(flat, mapping)
        found = flatten(nested, lambda v: isinstance(v, _TensorAt))
        leaves = {fqn: leaf.value for fqn, leaf in found.items()}
        paths = {fqn: leaf.path for fqn, leaf in found.items()}
    tensor_keys = {f: v.key for f, v in leaves.items() if isinstance(v, _TensorAt)}
    return (tensor_keys, {f: v for f, v in leaves.items() if not isinstance(v, _TensorAt)},
            paths)


def torch_dcp_to_checkpoint(path: str, checkpoint_id: str, *, trusted: bool = False,
                            rename: dict[str, str] | None = None, overwrite: bool = False,
                            allow_pickle: bool = False, buffer_bytes: int = DEFAULT_BUDGET_BYTES,
                            storage_options: dict | None = None,
                            progress: bool = False, process_group=None) -> Metadata:
    """Convert a PyTorch DCP checkpoint into ours.

    Tensors are consolidated (every rank's chunks into one) and written
    one chunk each with its checksum, bytes and dtype unchanged: read
    straight from torch's files (a ``torch.save`` archive stores a tensor's
    bytes uncompressed) several data files at once within ``buffer_bytes``
    (:func:`dcp.interop.parallel.import_checkpoint`), shared over the
    ranks of ``process_group`` if one is passed.  A tensor torch stored
    otherwise (through an extension, strided) makes the whole conversion
    go through torch's loader instead, in groups of about ``buffer_bytes``,
    in one process.  Non-tensor values become JSON values, or pickles with
    ``allow_pickle``.  fqns are those :func:`dcp.load` gives the state dict
    that was saved: torch's flattened keys regrouped by the paths its
    metadata records, so ``{"model": model.state_dict(), "optim":
    optimizer.state_dict()}`` loads from the result (``optim.state.0.
    exp_avg`` is a tensor, ``optim.param_groups`` one value).

    Args:
        path: the PyTorch DCP checkpoint directory (local, or ``file://``).
        checkpoint_id: destination path or URI of any storage plugin;
            ``storage_options`` go to it.
        trusted: required: the source's metadata and non-tensor values are
            pickles, which can run code.  Pass ``True`` only for
            checkpoints you trust.
        rename: fqn (after regrouping) -> our fqn.
        overwrite: replace a committed checkpoint at ``checkpoint_id``.
        allow_pickle: store non-JSON values pickled instead of raising.
        buffer_bytes: memory budget per process, bytes: tensors held at once
            take 15/16 of it, the rest is left to the process's own memory
            (at least the largest tensor is let through).
        progress: show a progress bar (tqdm, bytes) on stderr.
        process_group: share the conversion over this group's ranks
            (collective; every rank reads the source's metadata); ``None``:
            this process alone.

    Returns:
        The committed :class:`dcp.Metadata` (on every rank).

    Raises:
        CheckpointError: without ``trusted``; a dtype we cannot hold, a
            non-JSON value without ``allow_pickle``, a bad rename map, a
            failure inside torch (its message included), a failed read or
            write naming the tensor and file, or a process group with
            tensors only torch's loader reads; nothing is committed then.
        NotACheckpointError: ``path`` has no ``.metadata``.
    """
    if not trusted:
        raise CheckpointError(
            f"{path!r}: a PyTorch DCP checkpoint's metadata is a pickle, and reading it can run "
            f"code; pass trusted=True (hyperdcp convert --trust-pickle) only for checkpoints "
            f"you trust")
    local = _local_path(str(path))
    reader = tdcp.FileSystemReader(local)
    try:
        source = reader.read_metadata()
    except FileNotFoundError:
        raise NotACheckpointError(
            f"{path!r} is not a PyTorch DCP checkpoint: it has no {TORCH_METADATA_FILE}") from None
    except (Exception, CheckpointException) as e:
        raise _torch_error(f"reading {path!r}", e) from e
    entries = source.state_dict_metadata
    tensor_entries = {k: m for k, m in entries.items() if isinstance(m, TensorStorageMetadata)}
    for key, m in tensor_entries.items():  # refuse what we cannot hold, first
        tensors.dtype_name(m.properties.dtype, key)

    def load_from_torch(state: dict) -> None:
        try:
            with _single_process():
                tdcp.load(state, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as e:
            raise _torch_error(f"loading {', '.join(list(state)[:3])}... from {path!r}", e) from e

    values = dict.fromkeys(k for k in entries if k not in tensor_entries)
    if values:
        load_from_torch(values)
    tensor_keys, objects, paths = _regroup(list(entries), values, source.planner_data)
    names = renamed([*tensor_keys, *objects], rename, repr(str(path)))
    # a renamed fqn's place in the state is unknown: it is recorded as the fqn alone
    new_paths = None if paths is None else {
        names[f]: p for f, p in paths.items() if names[f] == f}
    view = TorchDcpFolder(local, source, {names[f]: k for f, k in tensor_keys.items()})
    view.metadata.paths = new_paths
    if view.unreadable is None:
        dest = open_storage(str(checkpoint_id), **(storage_options or {}))
        with progress_bar(view.metadata.stored_bytes, "import", progress) as bar:
            return import_checkpoint(view, view.metadata, dest, overwrite=overwrite,
                                     buffer_bytes=buffer_bytes, process_group=process_group,
                                     on_bytes=bar.update, allow_pickle=allow_pickle,
                                     objects={names[f]: v for f, v in objects.items()})
    if Ranks.of(process_group).world_size > 1:
        raise CheckpointError(f"{path!r}: tensor {view.unreadable}: only torch's loader reads it, "
                              f"in one process; convert without a process group")

    def nbytes(key: str) -> int:
        m = tensor_entries[key]
        return m.size.numel() * m.properties.dtype.itemsize

    with CheckpointWriter(checkpoint_id, overwrite=overwrite, allow_pickle=allow_pickle,
                          buffer_bytes=buffer_bytes, storage_options=storage_options) as writer, \
            progress_bar(sum(map(nbytes, tensor_keys.values())), "import", progress) as bar:
        for group in _batches(list(tensor_keys.items()), nbytes, buffer_bytes):
            state = {key: torch.empty(tuple(tensor_entries[key].size),
                                      dtype=tensor_entries[key].properties.dtype)
                     for _, key in group}
            load_from_torch(state)
            for fqn, key in group:  # popped: the writer holds the only reference
                writer.add_tensor(names[fqn], state.pop(key))
                bar.update(nbytes(key))
        for fqn, value in objects.items():
            writer.add_object(names[fqn], value)
        writer.metadata.paths = new_paths
        return writer.commit()


class _Sink(io.RawIOBase):
    """A seekable file that keeps what is written to it by position."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[tuple[int, bytes]] = []
        self.pos = self.size = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.parts.append((self.pos, bytes(b)))
        self.pos += len(b)
        self.size = max(self.size, self.pos)
        return len(b)

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + pos
        return self.pos


_U16, _U32 = struct.Struct("<H"), struct.Struct("<I")


@dataclass
class _Frame:
    """A ``torch.save`` archive of one tensor without its data: the bytes
    before (``head``) and after (``tail``) its data record, and where the
    record's CRC-32 goes (zip's local header, data descriptor and central
    directory: ``(head or tail, offset)``)."""

    head: bytearray
    tail: bytearray
    crcs: list[tuple[bytearray, int]]

    def with_crc(self, crc: int) -> tuple[bytes, bytes]:
        for part, offset in self.crcs:
            _U32.pack_into(part, offset, crc)
        return bytes(self.head), bytes(self.tail)


def _frame(shape: tuple[int, ...], dtype: torch.dtype) -> _Frame | None:
    """The archive ``torch.save`` writes for a contiguous CPU tensor of
    ``shape`` and ``dtype``, without the data (its ``skip_data`` mode,
    which leaves the record's bytes and CRC out), so the data can be
    written here with its CRC; ``None`` if the archive is not laid out as
    expected (one gap, the data record's, of the tensor's size)."""
    nbytes = math.prod(shape) * dtype.itemsize
    sink = _Sink()
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=dtype), sink)  # type: ignore[arg-type]  # untouched
    covered, gap = 0, None
    for pos, data in sorted(sink.parts):
        if pos > covered:
            if gap is not None:
                return None
            gap = (covered, pos)
        covered = max(covered, pos + len(data))
    if gap is None or gap[1] - gap[0] != nbytes or not nbytes:
        return None
    head, tail = bytearray(gap[0]), bytearray(sink.size - gap[1])
    for pos, data in sink.parts:
        if pos < gap[0]:
            head[pos:pos + len(data)] = data
        else:
            tail[pos - gap[1]:pos - gap[1] + len(data)] = data
    entry = tail.find(b"PK\x01\x02")
    while entry >= 0:  # the central directory entry of the record whose data is the gap
        n = _U16.unpack_from(tail, entry + 28)[0]
        at = _U32.unpack_from(tail, entry + 42)[0]  # its local header
        if head[at:at + 4] == b"PK\x03\x04" and at + 30 + n + _U16.unpack_from(
                head, at + 28)[0] == gap[0] and head[at + 30:at + 30 + n] == tail[
                entry + 46:entry + 46 + n]:
            crcs = [(head, at + 14), (tail, entry + 16)]
            if _U16.unpack_from(head, at + 6)[0] & 8:  # a data descriptor follows the data
                crcs.append((tail, 4 if tail[:4] == b"PK\x07\x08" else 0))
            return _Frame(head, tail, crcs)
        entry = tail.find(b"PK\x01\x02", entry + 4)
    return None


class _Writer(tdcp.FileSystemWriter):
    """torch's file writer (its plan, its ``.metadata``, its values'
    files), with each tensor's file written here: ``torch.save``'s archive
    around the tensor's bytes, read from our checkpoint (checksums
    verified) straight into a buffer that is written as it is, its zip
    CRC-32 computed by ``zlib``; several files at once, on a thread pool,
    within a byte budget (:mod:`dcp.interop.parallel`)."""

    def __init__(self, local: str, overwrite: bool, storage: StoragePlugin,
                 source: dict[str, tuple[str, TensorMeta]], buffer_bytes: int, bar: tqdm) -> None:
        super().__init__(local, single_file_per_rank=False, overwrite=overwrite)
        self.local, self.storage, self.source, self.bar = local, storage, source, bar
        self.buffer_bytes = buffer_bytes

    def write_data(self, plan, planner):
        values = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        results = super().write_data(replace(plan, items=values), planner).value() if values \
            else []
        prefix = plan.storage_data.prefix
        dest = open_storage(self.local)
        held = tensor_bytes(self.buffer_bytes)
        budget, buffers = ByteBudget(held), BufferPool(held)

        def write_one(k: int, item) -> WriteResult:
            fqn, meta = self.source[item.index.fqn]
            name = f"{prefix}{len(values) + k}{DEFAULT_SUFFIX}"
            check_readable(self.storage, fqn, meta)  # before any memory of its size
            frame = _frame(meta.shape, tensors.torch_dtype(meta.dtype))
            budget.acquire(meta.nbytes)
            buf = buffers.take(meta.nbytes)
            try:
                read_tensors(self.storage, [(fqn, meta, buf)])
                if frame is None:  # torch lays this one out otherwise: its own torch.save
                    sink = io.BytesIO()
                    torch.save(tensors.from_bytes(tensors.bytes_of(buf), meta.dtype, meta.shape),
                               sink)
                    parts: list = [sink.getbuffer()]
                else:
                    head, tail = frame.with_crc(zlib.crc32(buf))
                    parts = [head, buf, tail]
                try:
                    dest.write_file(name, parts)
                except Exception as e:
                    raise CheckpointError(f"writing {name!r} ({fqn!r}) to {self.local!r} failed: "
                                          f"{e}") from e
                self.bar.update(meta.nbytes)
                size = sum(len(p) for p in parts)
                return WriteResult(index=item.index, size_in_bytes=size,
                                   storage_data=_StorageInfo(name, 0, size))
            finally:
                buffers.give(buf)
                budget.release(meta.nbytes)

        with ThreadPoolExecutor(max(1, min(dest.thread_count, len(items)))) as pool:
            futures = [pool.submit(write_one, k, item) for k, item in enumerate(items)]
            try:
                results += [f.result() for f in futures]
            except BaseException:  # the first failure: no file not yet started is written
                for future in futures:
                    future.cancel()
                raise
        done: Future = Future()
        done.set_result(results)
        return done


def _shares(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """The fqns split over ``world_size`` ranks, largest first to the rank
    with the fewest bytes (the same on every rank)."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for fqn in sorted(sizes, key=lambda f: (-sizes[f], f)):
        r = loads.index(min(loads))
        shares[r].append(fqn)
        loads[r] += sizes[fqn]
    return shares


def checkpoint_to_torch_dcp(checkpoint_id: str, path: str, *,
                            rename: dict[str, str] | None = None, overwrite: bool = False,
                            allow_pickle: bool = False, buffer_bytes: int = DEFAULT_BUDGET_BYTES,
                            storage_options: dict | None = None,
                            progress: bool = False, process_group=None) -> ExportResult:
    """Export a checkpoint as a PyTorch DCP checkpoint that
    ``torch.distributed.checkpoint.load`` reads.

    torch's planner and writer make its ``.metadata`` and its values'
    files; each tensor's file (one ``.distcp`` each) is the archive
    ``torch.save`` writes, written here (:class:`_Writer`): the tensor is
    consolidated from its chunks (checksums verified) straight into the
    buffer that is written, several files at once, the tensors held at
    once within ``buffer_bytes`` (a larger one passes alone).  With a ``process_group``
    each rank of it writes a share of the tensors (balanced by bytes)
    through torch's collective save, one ``.metadata`` in all.  Non-tensor
    values are handed to torch (rank 0's), which flattens nested ones as it
    flattens a state dict and pickles them, so the result loads into the
    nested state dict that was saved (``optim.param_groups`` into
    ``optimizer.state_dict()``'s).

    Args:
        checkpoint_id: our checkpoint, path or URI; ``storage_options`` go
            to its plugin.
        path: destination directory (local, or ``file://``).
        rename: our fqn -> torch fqn.
        overwrite: replace a PyTorch DCP checkpoint at ``path``.
        allow_pickle: unpickle values we stored pickled, to hand them on
            (allow-listed types only: :mod:`dcp.core.unpickler`).
        buffer_bytes: memory budget per process (bytes of tensors held).
        progress: show a progress bar (tqdm, bytes) on stderr.
        process_group: share the export over this group's ranks
            (collective); ``None``: this process alone.

    Returns:
        An :class:`~dcp.interop.streaming.ExportResult` (files: torch's, on
        every rank).

    Raises:
        CheckpointError: destination holds a checkpoint without
            ``overwrite``, a pickled value without ``allow_pickle``, a bad
            rename map, or a failure inside torch.
        CorruptCheckpointError: a checksum mismatch or unreadable chunk,
            naming the fqn and file.
    """
    local = _local_path(str(path))
    storage = open_storage(str(checkpoint_id), **(storage_options or {}))
    md = read_metadata(str(checkpoint_id), storage=storage)
    names = renamed(md.fqns(), rename, repr(str(checkpoint_id)))
    ranks = Ranks.of(process_group)
    if not overwrite and ranks.broadcast((Path(local) / TORCH_METADATA_FILE).exists()
                                         if ranks.rank == 0 else None):
        raise CheckpointError(f"{path!r} already holds a PyTorch DCP checkpoint; "
                              f"pass overwrite=True to replace it")
    mine = _shares({f: m.nbytes for f, m in md.tensors.items()}, ranks.world_size)[ranks.rank]
    state: dict[str, Any] = {}
    for fqn in mine:
        meta = md.tensors[fqn]
        state[names[fqn]] = torch.empty(meta.shape, dtype=tensors.torch_dtype(meta.dtype),
                                        device="meta")
    # the values, read on rank 0: a failure there fails every rank before
    # torch's collective save starts (the others would wait in it)
    failure: BaseException | None = None
    if ranks.rank == 0:
        try:
            for fqn, obj in md.objects.items():
                state[names[fqn]] = read_object(storage, fqn, obj, allow_pickle)
        except Exception as e:  # reported to every rank, then re-raised here
            failure = e
    why = ranks.broadcast(None if failure is None else describe_error(failure))
    if failure is not None:
        raise failure
    if why is not None:
        raise CheckpointError(f"the export failed on rank 0: {why}")
    source = {names[fqn]: (fqn, md.tensors[fqn]) for fqn in mine}
    with progress_bar(sum(md.tensors[f].nbytes for f in mine), "export", progress) as bar:
        try:
            writer = _Writer(local, overwrite, storage, source, buffer_bytes, bar)
            planner = DefaultSavePlanner()
            with _single_process():
                if ranks.world_size == 1:
                    saved = tdcp.save(state, storage_writer=writer, no_dist=True,
                                      planner=planner)
                else:
                    saved = tdcp.save(state, storage_writer=writer, planner=planner,
                                      process_group=ranks.group)
        except (Exception, CheckpointException) as e:
            raise _torch_error(f"saving {path!r}", e) from e
    files = sorted({info.relative_path for info in saved.storage_data.values()})
    return ExportResult(files=[TORCH_METADATA_FILE, *files], tensors=len(md.tensors),
                        nbytes=md.unique_bytes)
