"""Hugging Face safetensors <-> checkpoint, and loading straight from safetensors.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N``
bytes of JSON header — ``{name: {"dtype", "shape", "data_offsets": [begin,
end]}, "__metadata__": {str: str}}`` — then the data: each tensor's bytes,
row-major and little-endian, at ``8 + N + begin``.  A sharded model is a
folder of such files with ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).

The ``safetensors`` library reads whole files, or memory-maps local ones, and
does not expose byte offsets; so headers are read here, through a storage
plugin, which gives:

* :class:`SafetensorsFolder` — a folder (or single file) on any storage
  plugin presented as a read-only checkpoint: each tensor is one chunk, a
  byte range of its file, with no checksum (safetensors records none).
  :func:`load_safetensors` hands it to :func:`dcp.load`, so a sharded model
  loads straight from a Hugging Face folder with resharding and ranged
  reads, each rank reading only the bytes of its own shards.
* :func:`safetensors_to_checkpoint` and :func:`checkpoint_to_safetensors` —
  streaming conversions both ways, several files at once within a memory
  budget and optionally shared over a job's ranks
  (:mod:`dcp.interop.parallel`), sharding the export by ``max_shard_size``
  as ``transformers`` does; the export can cast (``dtype``) and keep one
  prefix (``model_only``, ``prefix``).

Dtypes: every byte-sized safetensors dtype (:data:`SAFETENSORS_DTYPES`);
the sub-byte ones (``F4``, ``F6_*``) have no torch dtype a checkpoint can
hold and are refused, naming the tensor.  0-dim and zero-element tensors are
kept (a zero-element tensor has no chunk).  The free-form ``__metadata__`` is
not carried into a checkpoint; an export writes ``{"format": "pt"}`` plus
the ``metadata`` passed to it.

MindSpore's safetensors files (``mindspore.save_checkpoint(...,
format="safetensors")``) are single files of this format with
``__metadata__`` ``{"format": "ms"}``, read here as any other; a tensor that
metadata flags ``"Int4"`` (``qint4x2``: two 4-bit integers a byte, stored as
``I8``) is refused, naming it.  ``mindspore.load_checkpoint(path,
format="safetensors")`` reads an export's ``model.safetensors`` (pass
``metadata={"format": "ms"}`` to mark it as MindSpore writes it).
"""

from __future__ import annotations

import json
import math

import torch

from dcp.core.metadata import (
    DTYPE_ITEMSIZE,
    MAX_DIMS,
    MAX_INT,
    ChunkMeta,
    Metadata,
    TensorMeta,
    check_relative_path,
)
from dcp.core.planner import LoadPlanner
from dcp.core.storage import StoragePlugin, open_storage, storage_errors
from dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from dcp.interop.parallel import (
    DEFAULT_BUDGET_BYTES,
    OutputFile,
    Ranks,
    export_files,
    import_checkpoint,
)
from dcp.interop.remap import RemappedView, load_through
from dcp.interop.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from dcp.interop.streaming import (
    ExportResult,
    export_selection,
    progress_bar,
    renamed,
    split_file,
)
from dcp.interop.view import ReadOnlyView
from dcp.orchestration.load import LoadReport, load, read_metadata

#: safetensors dtype name -> checkpoint (torch) dtype name.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
}
_ST_NAMES = {ours: st for st, ours in SAFETENSORS_DTYPES.items()}
_SUB_BYTE = ("F4", "F6_E2M3", "F6_E3M2")

SUFFIX = ".safetensors"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Largest header the format allows (bytes).
MAX_HEADER_BYTES = 100_000_000
#: Bytes of a header read at once at first; each next read is as large as
#: all before it, so a header declared larger than its file costs at most
#: twice the file's bytes before the read past its end fails.
_HEADER_READ = 1 << 20
class SafetensorsFolder(ReadOnlyView):
    """A safetensors model presented as a read-only checkpoint.

    ``source`` is a folder (sharded, with ``model.safetensors.index.json``,
    or holding ``*.safetensors`` files) or one ``.safetensors`` file, as a
    path or URI of any storage plugin; ``options`` go to that plugin.
    ``rename`` maps safetensors names to fqns (unlisted names are kept).

    Headers are read on first use of :attr:`metadata` (so, under
    :func:`dcp.load`, by the coordinating rank only).  Reads of tensor
    bytes go to the underlying plugin; writing raises.
    """

    def __init__(self, source: str, *, rename: dict[str, str] | None = None, **options) -> None:
        root, self._single = str(source), None  # a folder
        if root.endswith(SUFFIX):  # one file
            root, self._single = split_file(root)
        super().__init__(str(source), open_storage(root, **options), "safetensors folder")
        self.rename = rename
        self._metadata: Metadata | None = None

    @property
    def metadata(self) -> Metadata:
        """Every tensor as one chunk (a byte range of its file, no checksum),
        ``shape`` and ``dtype`` as in the headers.

        Raises:
            NotACheckpointError: no ``.safetensors`` file at the source.
            CorruptCheckpointError: a malformed header or index, naming the
                file and tensor.
            CheckpointError: a sub-byte dtype, or a bad rename map.
        """
        if self._metadata is None:
            self._metadata = self._read_metadata()
        return self._metadata

    def _where(self, name: str) -> str:
        return f"{self.inner.checkpoint_id}/{name}"

    def _files(self) -> tuple[list[str], dict[str, str]]:
        """The ``.safetensors`` files to read and the index's weight map."""
        if self._single is not None:
            return [self._single], {}
        try:
            index = self.inner.read_file(INDEX_FILE)
        except FileNotFoundError:
            names = sorted(n for n in self.inner.list_files()
                           if n.endswith(SUFFIX) and "/" not in n)
            if not names:
                raise NotACheckpointError(
                    f"{self.checkpoint_id!r} holds no {SUFFIX} file and no {INDEX_FILE}") from None
            return names, {}
        where = self._where(INDEX_FILE)
        try:
            weight_map = json.loads(index)["weight_map"]
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"{where}: not an index with a weight_map ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise CorruptCheckpointError(f"{where}: weight_map must map names to file names")
        files = [check_relative_path(f, where) for f in dict.fromkeys(weight_map.values())]
        return files, weight_map

    def _read_header(self, name: str) -> tuple[dict, int]:
        """The JSON header of file ``name`` and the offset of its data; the
        header is read in pieces that double (:data:`_HEADER_READ`), so
        memory follows the bytes the file holds, not the length it
        declares."""
        where = self._where(name)
        length = bytearray(8)
        try:
            self.inner.read_ranges(name, [(0, memoryview(length))])
            size = int.from_bytes(length, "little")
            if size > MAX_HEADER_BYTES:
                raise CorruptCheckpointError(
                    f"{where}: header length {size} exceeds the format's {MAX_HEADER_BYTES} bytes")
            raw = bytearray()
            while len(raw) < size:
                piece = bytearray(min(size - len(raw), max(len(raw), _HEADER_READ)))
                self.inner.read_ranges(name, [(8 + len(raw), memoryview(piece))])
                raw += piece
        except CheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"{where}: cannot read the safetensors header: {e}") from e
        try:
            header = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise CorruptCheckpointError(f"{where}: header is not a JSON object")
        return header, 8 + size

    def _tensor_meta(self, name: str, key: str, entry, data_start: int) -> TensorMeta:
        where = f"{self._where(name)}: tensor {key!r}"
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{where}: entry is not an object")
        st_dtype = entry.get("dtype")
        if st_dtype in _SUB_BYTE:
            raise CheckpointError(
                f"{where}: dtype {st_dtype} packs several elements per byte; no torch dtype "
                f"a checkpoint can hold matches it")
        if not isinstance(st_dtype, str) or st_dtype not in SAFETENSORS_DTYPES:
            raise CorruptCheckpointError(f"{where}: unknown dtype {st_dtype!r:.80}")
        dtype = SAFETENSORS_DTYPES[st_dtype]
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        # sizes and offsets within what a checkpoint's metadata holds
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
                and all(type(d) is int and 0 <= d < MAX_INT for d in shape)):
            raise CorruptCheckpointError(f"{where}: shape {shape!r:.80} is not a list of at most "
                                         f"{MAX_DIMS} sizes below 2**62")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] < MAX_INT - data_start):
            raise CorruptCheckpointError(f"{where}: data_offsets {offsets!r:.80} are not [begin, "
                                         f"end] below 2**62")
        shape = tuple(shape)
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise CorruptCheckpointError(
                f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but "
                f"{st_dtype}{list(shape)} needs {nbytes}")
        meta = TensorMeta(shape, dtype)
        if nbytes:
            meta.chunks.append(ChunkMeta((0,) * len(shape), shape, name, data_start + offsets[0],
                                         nbytes, None, 0))
        return meta

    def _read_metadata(self) -> Metadata:
        files, weight_map = self._files()
        found: dict[str, tuple[str, TensorMeta]] = {}
        for name in files:
            header, data_start = self._read_header(name)
            flags = header.get("__metadata__")
            if not isinstance(flags, dict) or flags.get("format") != "ms":
                flags = {}  # only MindSpore's files flag tensors
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                if flags.get(key) == "Int4":
                    raise CheckpointError(
                        f"{self._where(name)}: tensor {key!r} is MindSpore's Int4 (qint4x2: two "
                        f"4-bit integers a byte, stored as I8); no torch dtype a checkpoint can "
                        f"hold matches it")
                if key in found:
                    raise CorruptCheckpointError(
                        f"{self.checkpoint_id}: tensor {key!r} is in both {found[key][0]!r} "
                        f"and {name!r}")
                found[key] = name, self._tensor_meta(name, key, entry, data_start)
        for key, name in weight_map.items():
            if found.get(key, (None,))[0] != name:
                raise CorruptCheckpointError(
                    f"{self._where(INDEX_FILE)}: maps {key!r} to {name!r}, which does not hold it")
        names = renamed(found, self.rename, repr(self.checkpoint_id))
        md = Metadata(save_id="safetensors", world_size=1)
        for key, (_, meta) in found.items():
            md.tensors[names[key]] = meta
        return md


def load_safetensors(state_dict: dict, source: str, *, rename: dict[str, str] | None = None,
                     remap: dict | None = None, strict: bool = True, allow_dtype_cast: bool = False,
                     planner: LoadPlanner | None = None, process_group=None,
                     storage_options: dict | None = None) -> LoadReport:
    """Fill ``state_dict`` in place straight from a Hugging Face safetensors
    folder or file, without converting it first; collective over the group.

    Exactly :func:`dcp.load` on :class:`SafetensorsFolder`: any target
    layout (DTensor shards, :class:`dcp.TensorShard`, plain tensors), each
    rank reading only the byte ranges of the boxes it holds.  safetensors
    records no checksums, so none are verified.

    Args:
        state_dict: the target; its fqns are the safetensors names after
            ``rename``.
        source: folder or ``.safetensors`` file, path or URI.
        rename: safetensors name -> fqn, for names that differ.
        remap: a map (:mod:`dcp.interop.remap`) filling fused or stacked
            targets from several tensors (after ``rename``); each rank
            reads only the source regions of its own boxes.
        strict, allow_dtype_cast, planner, process_group: as for
            :func:`dcp.load`.
        storage_options: options of the storage plugin holding ``source``.

    Returns:
        The :class:`dcp.LoadReport` (``unexpected_keys``: tensors of the
        folder the target lacks).

    Raises:
        NotACheckpointError: no safetensors file at ``source``.
        CorruptCheckpointError: malformed header or index, short file.
        CheckpointError: shape/dtype mismatch, missing keys, bad rename map.
    """
    folder = SafetensorsFolder(source, rename=rename, **(storage_options or {}))
    options = dict(strict=strict, allow_dtype_cast=allow_dtype_cast, planner=planner,
                   process_group=process_group,
                   verify="none")  # nothing to verify against: read only the bytes needed
    if remap is not None:
        return load_through(RemappedView(folder, folder.metadata, remap), state_dict,
                            str(source), **options)
    return load(state_dict, str(source), storage=folder, **options)


def safetensors_to_checkpoint(source: str, checkpoint_id: str, *,
                              rename: dict[str, str] | None = None, overwrite: bool = False,
                              buffer_bytes: int = DEFAULT_BUDGET_BYTES,
                              source_options: dict | None = None,
                              storage_options: dict | None = None,
                              progress: bool = False, process_group=None) -> Metadata:
    """Convert a safetensors folder or file into a checkpoint, streaming.

    Every tensor becomes one chunk with its checksum; bytes are copied
    unchanged, read straight into the buffer that is written, several data
    files at once (:func:`dcp.interop.parallel.import_checkpoint`).  With a
    ``process_group`` (``torch.distributed.group.WORLD`` for the whole job)
    each rank of it converts a share of the files and rank 0 commits once; the
    checkpoint's bytes are the same as from one process.

    Args:
        source: folder (single or sharded with its index) or
            ``.safetensors`` file, path or URI; ``source_options`` go to its
            storage plugin.
        checkpoint_id: destination path or URI; ``storage_options`` go to
            its plugin.
        rename: safetensors name -> fqn.
        overwrite: replace a committed checkpoint at ``checkpoint_id``.
        buffer_bytes: memory budget per process, bytes: tensors held at once
            take 15/16 of it, the rest is left to the process's own memory
            (at least the largest tensor is let through).
        progress: show a progress bar (tqdm, bytes) on stderr.
        process_group: share the conversion over this group's ranks
            (collective); ``None``: this process alone.

    Returns:
        The committed :class:`dcp.Metadata` (on every rank).

    Raises:
        CheckpointError: as :class:`SafetensorsFolder`, or a failed read or
            write naming the tensor and file; nothing is committed.
    """
    view = SafetensorsFolder(source, rename=rename, **(source_options or {}))
    md = view.metadata
    dest = open_storage(str(checkpoint_id), **(storage_options or {}))
    with progress_bar(md.stored_bytes, "import", progress) as bar:
        return import_checkpoint(view, md, dest, overwrite=overwrite, buffer_bytes=buffer_bytes,
                                 process_group=process_group, on_bytes=bar.update)


def encode_header(entries: list[tuple[str, str, tuple[int, ...], int, int]],
                  metadata: dict[str, str], alignment: int = 8) -> bytes:
    """The header bytes of a ``.safetensors`` file (length prefix included).

    ``entries`` are ``(name, checkpoint dtype, shape, begin, end)``, offsets
    relative to the data.  The JSON is padded with spaces (which the format
    allows) so that the data starts at a multiple of ``alignment`` bytes, a
    multiple of 8 (8, as the reference writer pads; a destination's direct-I/O
    alignment, so that the tensors after the header are written without a
    copy).
    """
    doc: dict = {"__metadata__": metadata}
    for name, dtype, shape, begin, end in entries:
        doc[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % alignment)
    return len(text).to_bytes(8, "little") + text


def _shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Greedy split in checkpoint order (as ``transformers`` does): a new
    shard starts when the next tensor would take the current one past
    ``limit``; a larger tensor gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for fqn, nbytes in sizes.items():
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(fqn)
        size += nbytes
    return shards


def checkpoint_to_safetensors(checkpoint_id: str, folder: str, *,
                              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                              rename: dict[str, str] | None = None,
                              metadata: dict[str, str] | None = None, overwrite: bool = False,
                              dtype: str | torch.dtype | None = None, model_only: bool = False,
                              remap: dict | None = None,
                              prefix: str | None = None,
                              buffer_bytes: int = DEFAULT_BUDGET_BYTES,
                              storage_options: dict | None = None,
                              dest_options: dict | None = None,
                              progress: bool = False, process_group=None) -> ExportResult:
    """Export a checkpoint's tensors as a Hugging Face safetensors folder,
    streaming.

    Each tensor is consolidated from its chunks (checksums verified) by
    reader threads ahead of the writer, several output files at once, with
    the bytes in flight within 15/16 of ``buffer_bytes``
    (:func:`dcp.interop.parallel.export_files`).  One shard is written as
    ``model.safetensors``; more as ``model-00001-of-0000N.safetensors``
    with ``model.safetensors.index.json`` (written last).  Within a shard
    tensors are ordered by descending item size, so each starts aligned to
    it; the header is padded so that the data starts at the destination's
    :attr:`~dcp.core.storage.StoragePlugin.alignment` (4096 bytes for a
    local folder written with ``fsync``: the tensors go to disk with direct
    I/O).  With a ``process_group`` each rank of it writes a share of the shards
    and rank 0 the index (collective).

    Args:
        checkpoint_id: the checkpoint, path or URI; ``storage_options`` go
            to its plugin.
        folder: destination folder, path or URI; ``dest_options`` go to its
            plugin.
        max_shard_size: bytes of tensor data per file, an int or a string
            like ``"5GB"`` / ``"500MiB"`` (see :func:`parse_size`).
        rename: fqn -> safetensors name (names after ``prefix`` stripping).
        metadata: extra ``__metadata__`` entries (str -> str) besides
            ``{"format": "pt"}``.
        overwrite: allow a destination that already holds safetensors files;
            those the export does not rewrite are deleted after it.
        dtype: cast floating-point tensors to this dtype (a name such as
            ``"bfloat16"``, or a ``torch.dtype``); integer and bool tensors
            are kept.
        remap: a map applied first (:mod:`dcp.interop.remap`), e.g.
            ``remap.inverse(fused_map, metadata)`` to publish a fused
            training layout under the Hugging Face names.
        model_only: export only the tensors under ``model.`` (the prefix
            stripped), as ``prefix="model."``.
        prefix: export only the tensors whose fqn starts with it, named
            without it.
        buffer_bytes: memory budget per process.
        progress: show a progress bar (tqdm, bytes) on stderr.
        process_group: share the export over this group's ranks
            (collective); ``None``: this process alone.

    Returns:
        An :class:`~dcp.interop.streaming.ExportResult`; ``skipped`` lists the
        checkpoint's non-tensor values, which safetensors cannot hold.

    Raises:
        NotACheckpointError / CorruptCheckpointError: as :func:`dcp.load`.
        CheckpointError: destination not empty without ``overwrite``, bad
            size, dtype, prefix, rename map or metadata, or a failed write
            (the files written are removed).
    """
    limit = parse_size(max_shard_size)
    header_meta = {"format": "pt", **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in header_meta.items()):
        raise CheckpointError(f"safetensors metadata must map str to str, got {metadata!r}")
    storage: StoragePlugin = open_storage(str(checkpoint_id), **(storage_options or {}))
    md = read_metadata(str(checkpoint_id), storage=storage)
    view = None
    if remap is not None:
        view = RemappedView(storage, md, remap)
        storage = view
        md = Metadata(md.save_id, md.world_size, view.remapped.targets(), md.objects)
    where = repr(str(checkpoint_id))
    stripped, casts = export_selection(md, "model." if model_only and not prefix else prefix,
                                        dtype, where)
    final = renamed(stripped.values(), rename, where)
    names = {f: final[s] for f, s in stripped.items()}
    out_dtype = {f: casts[f] or md.tensors[f].dtype for f in stripped}
    sizes = {f: math.prod(md.tensors[f].shape) * DTYPE_ITEMSIZE[out_dtype[f]] for f in stripped}
    dest = open_storage(str(folder), **(dest_options or {}))
    ranks = Ranks.of(process_group)
    old = None
    if ranks.rank == 0:  # rank 0 looks, before any rank writes
        with storage_errors(f"listing {str(folder)!r}"):
            old = [n for n in dest.list_files()
                   if "/" not in n and (n.endswith(SUFFIX) or n == INDEX_FILE)]
    old = ranks.broadcast(old)
    if old and not overwrite:
        raise CheckpointError(
            f"{str(folder)!r} already holds {', '.join(old)}; pass overwrite=True to replace them")
    shards = _shards(sizes, limit)
    count = len(shards)
    file_names = [SINGLE_FILE] if count == 1 else [
        f"model-{k + 1:05d}-of-{count:05d}{SUFFIX}" for k in range(count)]
    result = ExportResult(skipped=list(md.objects))
    weight_map: dict[str, str] = {}
    outputs = []
    for file, shard in zip(file_names, shards, strict=True):
        shard.sort(key=lambda f: -DTYPE_ITEMSIZE[out_dtype[f]])
        entries, offset = [], 0
        for fqn in shard:
            entries.append((names[fqn], out_dtype[fqn], md.tensors[fqn].shape, offset,
                            offset + sizes[fqn]))
            offset += sizes[fqn]
            weight_map[names[fqn]] = file
        outputs.append(OutputFile(file, encode_header(entries, header_meta,
                                                      math.lcm(8, dest.alignment)),
                                  [(f, md.tensors[f], casts[f]) for f in shard]))
        result.tensors += len(shard)
        result.nbytes += offset

    def write_index() -> list[str]:
        if count == 1:
            return []
        index = {"metadata": {"total_size": result.nbytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        _write(dest, INDEX_FILE, [json.dumps(index, indent=2).encode()])
        return [INDEX_FILE]

    with progress_bar(result.nbytes, "export", progress) as bar:
        result.files = export_files(storage, outputs, dest, buffer_bytes=buffer_bytes,
                                    process_group=process_group, finish=write_index,
                                    on_bytes=bar.update, read=view)
    if overwrite and ranks.rank == 0:
        dest.delete(set(old) - set(result.files))
    return result


def _write(dest: StoragePlugin, name: str, buffers) -> None:
    try:
        dest.write_file(name, buffers)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"writing {name!r} to {dest.checkpoint_id!r} failed: {e}") from e
