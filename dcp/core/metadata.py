"""The checkpoint's metadata (the "seating chart") and its encoding.

Metadata is the contract between save and load.  For every tensor it records
the global shape and dtype, and for every saved chunk its global offsets and
sizes, the data file and byte range holding it (row-major, C order), the
writing rank and a CRC-32C checksum of its bytes.  Non-tensor values are stored
inline as JSON, ``bytes`` and ``io.BytesIO`` values as raw blobs in a data
file, or (only when the caller opted in) as pickled bytes in a data file.

The encoding is versioned JSON: decoding it can never execute code (contrast
PyTorch DCP's pickled ``.metadata``).  :func:`decode` validates every field and
raises :class:`~dcp.errors.CorruptCheckpointError` for anything malformed, so
a crafted file yields a clean error, never another exception.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from typing import Any, NoReturn

import crc32c
import numpy as np
import zstandard

from dcp.core.compression import CODECS, FRAME_INDEX_VERSION, FrameIndex, check_index
from dcp.errors import CheckpointError, CorruptCheckpointError

FORMAT = "hyperdcp"
#: The newest format version this build reads and writes.  A document is
#: written with the lowest version that expresses it (:func:`min_version`),
#: so builds that read only version 1 still read every checkpoint without
#: raw blobs; they refuse the others cleanly, by their version.
#: Version 2 adds raw blobs (``"raw"`` object entries); version 3 compressed
#: chunks (a ``"frames"`` section: :mod:`dcp.core.compression`).
VERSION = 3
READ_VERSIONS = (1, 2, 3)
#: The types a raw blob loads back as (:attr:`ObjectMeta.raw_type`).
RAW_TYPES = ("bytes", "BytesIO")
METADATA_FILE = "metadata.json"
#: The metadata file of a PyTorch DCP checkpoint (a pickle), for messages
#: that tell one apart (:mod:`dcp.interop.torch_dcp_io` reads it).
TORCH_METADATA_FILE = ".metadata"


def rank_metadata_file(rank: int) -> str:
    """Name of the metadata file rank ``rank`` commits in a save without
    cross-rank traffic (``coordination="none"``)."""
    return f"metadata.rank{rank:05d}.json"


def is_rank_metadata_file(name: str) -> bool:
    """Whether ``name`` is named like :func:`rank_metadata_file`'s files."""
    return len(name) == len("metadata.rank00000.json") and name.startswith("metadata.rank") \
        and name[13:18].isdigit() and name.endswith(".json")
CHECKSUM = "crc32c"
#: Most dimensions of a tensor, and the bound below which every size,
#: offset and byte count of the metadata lies (:func:`decode` refuses more).
MAX_DIMS = 64
MAX_INT = 2**62
#: The chunk table's checksum for a chunk that has none (``ChunkMeta.checksum
#: is None``); CRC-32C values are never negative.
NO_CHECKSUM = -1

# Item sizes in bytes of the dtypes a checkpoint may hold: every byte-sized
# dtype of safetensors (named as in torch).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "complex64": 8,
}


def checksum(buffer, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``buffer`` (any buffer-protocol object),
    continuing ``value``.

    CRC-32C is the checksum of iSCSI, ext4 and cloud object stores; the
    ``crc32c`` library computes it with the CPU's CRC instructions at several
    GB/s, releasing the GIL (zlib's CRC-32 runs at about 1.3 GB/s here).
    """
    return crc32c.crc32c(buffer, value)


@dataclass(frozen=True)
class ChunkMeta:
    """One saved chunk: a box of the global tensor.

    ``offsets``/``sizes`` are in elements, global coordinates; the bytes
    ``[byte_offset, byte_offset + nbytes)`` of ``file`` hold it in row-major
    order; ``checksum`` is their CRC-32C, or ``None`` where none was recorded
    (chunks of a foreign format presented as a checkpoint, such as a
    safetensors folder: see :mod:`dcp.interop.safetensors_io`); ``rank`` wrote it.
    ``frames``: where the chunk is compressed, its frames
    (:class:`~dcp.core.compression.FrameIndex`); it then takes
    :attr:`stored_nbytes` bytes of ``file`` from ``byte_offset``, and
    ``nbytes`` and ``checksum`` are those of its logical (decoded) bytes.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    byte_offset: int
    nbytes: int
    checksum: int | None
    rank: int
    frames: FrameIndex | None = None

    @property
    def stored_nbytes(self) -> int:
        """Bytes the chunk takes in its data file."""
        return self.nbytes if self.frames is None else self.frames.stored_nbytes

    def last_byte(self) -> list[tuple[int, memoryview]]:
        """``read_ranges`` ranges reading only the chunk's last byte: read
        first, it proves the file holds the whole chunk before a buffer of
        the declared size is allocated (crafted metadata)."""
        return [(self.byte_offset + self.stored_nbytes - 1, memoryview(bytearray(1)))]


class TensorMeta:
    """Global ``shape`` and ``dtype`` name of one tensor and its saved chunks.

    ``chunks`` is a list of :class:`ChunkMeta`.  A decoded checkpoint keeps
    them as a columnar table (numpy arrays) and builds a tensor's list only
    when it is first asked for, so reading the metadata of millions of chunks
    costs array decoding, not millions of Python objects.
    """

    __slots__ = ("shape", "dtype", "_store")

    def __init__(self, shape, dtype: str, chunks=None) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        # the chunks as rows; a decoded tensor's as its columnar table until rows are asked for
        self._store: list[ChunkMeta] | _ChunkTable = list(chunks) if chunks is not None else []

    @classmethod
    def _from_table(cls, shape, dtype: str, table: _ChunkTable) -> TensorMeta:
        meta = cls(shape, dtype)
        meta._store = table
        return meta

    def check_coverage(self, fqn: str, where: str) -> None:
        """Raise :class:`CorruptCheckpointError` naming ``where`` and
        ``fqn`` unless the chunks hold exactly as many elements as the
        shape (damaged or crafted metadata)."""
        held = sum(math.prod(c.sizes) for c in self.chunks)
        if held != math.prod(self.shape):
            raise CorruptCheckpointError(
                f"{where}: {fqn!r} has shape {list(self.shape)} ({math.prod(self.shape)} "
                f"elements) but its chunks hold {held}")

    @property
    def chunks(self) -> list[ChunkMeta]:
        if isinstance(self._store, _ChunkTable):
            self._store = self._store.rows(DTYPE_ITEMSIZE[self.dtype])
        return self._store

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unique) tensor."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def stored_bytes(self) -> int:
        """Bytes of its saved chunks."""
        store = self._store
        if isinstance(store, _ChunkTable):
            return int(store.sizes.prod(axis=1).sum()) * DTYPE_ITEMSIZE[self.dtype]
        return sum(c.nbytes for c in store)

    @property
    def file_bytes(self) -> int:
        """Bytes its saved chunks take in data files: :attr:`stored_bytes`,
        fewer where chunks are compressed."""
        store = self._store
        if isinstance(store, _ChunkTable) and not store.frames:
            return self.stored_bytes
        return sum(c.stored_nbytes for c in self.chunks)

    @property
    def compressed(self) -> bool:
        """Whether any of its chunks is compressed."""
        store = self._store
        if isinstance(store, _ChunkTable):
            return bool(store.frames)
        return any(c.frames is not None for c in store)

    def files(self) -> set[str]:
        """Data files holding its chunks."""
        store = self._store
        if isinstance(store, _ChunkTable):
            return {store.files[i] for i in np.unique(store.file).tolist()}
        return {c.file for c in store}

    def table(self) -> _ChunkTable:
        """Its chunks as a columnar table."""
        store = self._store
        if isinstance(store, _ChunkTable):
            return store
        return _ChunkTable.from_rows(store, len(self.shape))

    def __eq__(self, other) -> bool:
        return (isinstance(other, TensorMeta) and (self.shape, self.dtype, self.chunks)
                == (other.shape, other.dtype, other.chunks))

    def __repr__(self) -> str:
        return f"TensorMeta(shape={self.shape}, dtype={self.dtype!r}, chunks={len(self.chunks)})"


@dataclass
class _ChunkTable:
    """Chunks of one tensor as columns: ``offsets``/``sizes`` int64
    ``[n, ndim]``; ``file`` int64 ``[n]`` indexing ``files``;
    ``byte_offset``, ``checksum``, ``rank`` int64 ``[n]`` (``checksum``
    :data:`NO_CHECKSUM` for a chunk without one); ``frames``: the frame
    index of each compressed chunk, by row."""

    offsets: np.ndarray
    sizes: np.ndarray
    file: np.ndarray
    byte_offset: np.ndarray
    checksum: np.ndarray
    rank: np.ndarray
    files: list[str]
    frames: dict[int, FrameIndex] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, chunks: list[ChunkMeta], ndim: int) -> _ChunkTable:
        files = sorted({c.file for c in chunks})
        index = {f: i for i, f in enumerate(files)}
        n = len(chunks)
        return cls(
            offsets=np.array([c.offsets for c in chunks], dtype=np.int64).reshape(n, ndim),
            sizes=np.array([c.sizes for c in chunks], dtype=np.int64).reshape(n, ndim),
            file=np.array([index[c.file] for c in chunks], dtype=np.int64),
            byte_offset=np.array([c.byte_offset for c in chunks], dtype=np.int64),
            checksum=np.array([NO_CHECKSUM if c.checksum is None else c.checksum for c in chunks],
                              dtype=np.int64),
            rank=np.array([c.rank for c in chunks], dtype=np.int64),
            files=files,
            frames={i: c.frames for i, c in enumerate(chunks) if c.frames is not None})

    def rows(self, itemsize: int) -> list[ChunkMeta]:
        files, frames = self.files, self.frames
        return [ChunkMeta(tuple(o), tuple(s), files[f], b, math.prod(s) * itemsize,
                          None if c == NO_CHECKSUM else c, r, frames.get(i))
                for i, (o, s, f, b, c, r) in enumerate(zip(
                    self.offsets.tolist(), self.sizes.tolist(), self.file.tolist(),
                    self.byte_offset.tolist(), self.checksum.tolist(), self.rank.tolist(),
                    strict=True))]


@dataclass(frozen=True)
class BlobRef:
    """Bytes of a non-tensor value (raw or pickled) inside a data file."""

    file: str
    byte_offset: int
    nbytes: int
    checksum: int


@dataclass
class ObjectMeta:
    """A non-tensor value: inline JSON ``value``, a ``raw`` blob (``bytes``
    or ``io.BytesIO``, as ``raw_type`` says; never unpickled), or a
    ``pickled`` blob."""

    value: Any = None
    pickled: BlobRef | None = None
    raw: BlobRef | None = None
    raw_type: str = "bytes"

    @property
    def blob(self) -> BlobRef | None:
        """Where its bytes lie in a data file (raw or pickled), if anywhere."""
        return self.raw if self.raw is not None else self.pickled


@dataclass
class Metadata:
    """Everything a load needs to find the bytes of every fqn.

    Returned by :func:`dcp.save` and :func:`dcp.read_metadata`.

    ``paths`` maps an fqn to its path in the state dict that was saved
    (dict keys as ``str``, list indices as ``int``: see
    :mod:`dcp.core.state_dict`) where that is not the fqn alone; ``None``
    where the checkpoint records no paths (saved by an older build, or
    made by a conversion that could not tell them).  :meth:`path` reads it.
    """

    save_id: str
    world_size: int
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    objects: dict[str, ObjectMeta] = field(default_factory=dict)
    version: int = 1
    paths: dict[str, tuple[str | int, ...]] | None = None

    def path(self, fqn: str) -> tuple[str | int, ...] | None:
        """``fqn``'s path in the saved state dict (``("optim", "state",
        "0", "exp_avg")``), or ``None`` if the checkpoint records none."""
        if self.paths is None:
            return None
        return self.paths.get(fqn, (fqn,))

    def files(self) -> set[str]:
        """Names (relative to the checkpoint root) of every data file used."""
        names = set().union(*(t.files() for t in self.tensors.values()))
        names.update(o.blob.file for o in self.objects.values() if o.blob)
        return names

    def fqns(self) -> list[str]:
        """Every fqn in the checkpoint, tensors and objects."""
        return [*self.tensors, *self.objects]

    @property
    def stored_bytes(self) -> int:
        """Bytes of tensor data stored (each distinct chunk once)."""
        return sum(t.stored_bytes for t in self.tensors.values())

    @property
    def unique_bytes(self) -> int:
        """Bytes of the global tensors: the state's size without replicas."""
        return sum(t.nbytes for t in self.tensors.values())


# ---------------------------------------------------------------- encoding


_COLUMNS = ("offsets", "sizes", "file", "byte_offset", "checksum", "rank")


def _pack(array: np.ndarray) -> str:
    raw = np.ascontiguousarray(array, dtype="<i8").tobytes()
    return base64.b64encode(zstandard.ZstdCompressor(level=3).compress(raw)).decode("ascii")


def encode(md: Metadata) -> bytes:
    """Encode ``md`` as UTF-8 JSON.

    The document names every tensor with its shape, dtype and its rows
    ``[start, count]`` in one chunk table shared by all tensors.  The table
    is columnar: each column (``offsets`` and ``sizes`` flattened row-major,
    ``file`` indexing the ``files`` list, ``byte_offset``, ``checksum``
    (-1: none), ``rank``) is little-endian int64, zstd-compressed, base64-encoded — about
    25 bytes per chunk, so a million chunks decode in a fraction of a second.
    The columns of tensors given as chunk lists are gathered in Python lists
    and converted once (no per-tensor arrays: thousands of small tensors
    encode in milliseconds); decoded tensors contribute their arrays.
    ``paths`` (:attr:`Metadata.paths`), where recorded, maps each fqn whose
    path is not the fqn alone to the path as a list; builds that do not
    know the entry ignore it (no version change).
    """
    index: dict[str, int] = {}  # file -> index in first-seen order, sorted at the end
    tensors, start = {}, 0
    columns: dict[str, list[np.ndarray]] = {c: [] for c in _COLUMNS}
    pending: dict[str, list[int]] = {c: [] for c in _COLUMNS}  # chunk-list tensors' values
    remaps: dict[int, np.ndarray] = {}  # files list of a table (by id) -> first-seen indices
    frames: list[tuple[int, FrameIndex]] = []  # (row, index) of each compressed chunk

    def flush() -> None:
        for name in _COLUMNS:
            if pending[name]:
                columns[name].append(np.array(pending[name], dtype=np.int64))
                pending[name] = []

    for fqn, t in md.tensors.items():
        store = t._store
        if not isinstance(store, _ChunkTable):
            chunks = store
            for i, c in enumerate(chunks):
                if c.frames is not None:
                    frames.append((start + i, c.frames))
                pending["offsets"].extend(c.offsets)
                pending["sizes"].extend(c.sizes)
                pending["file"].append(index.setdefault(c.file, len(index)))
                pending["byte_offset"].append(c.byte_offset)
                pending["checksum"].append(NO_CHECKSUM if c.checksum is None else c.checksum)
                pending["rank"].append(c.rank)
            count = len(chunks)
        else:
            flush()
            table = store
            remap = remaps.get(id(table.files))
            if remap is None:  # tables of one save share their files list: mapped once
                remap = remaps[id(table.files)] = np.array(
                    [index.setdefault(f, len(index)) for f in table.files] or [0],
                    dtype=np.int64)
            for name in _COLUMNS:
                column = getattr(table, name)
                columns[name].append((remap[column] if name == "file" else column).reshape(-1))
            count = len(table.file)
            frames.extend((start + i, f) for i, f in sorted(table.frames.items()))
        tensors[fqn] = {"shape": list(t.shape), "dtype": t.dtype, "rows": [start, count]}
        start += count
    flush()
    for o in md.objects.values():
        if o.blob is not None:
            index.setdefault(o.blob.file, len(index))
    files = sorted(index)
    order = np.empty(max(1, len(index)), dtype=np.int64)  # first-seen index -> sorted index
    order[[index[f] for f in files]] = np.arange(len(files), dtype=np.int64)
    columns["file"] = [order[column] for column in columns["file"]]
    index = {name: i for i, name in enumerate(files)}
    chunk_table = {"rows": start, "codec": "zstd"}
    for name in _COLUMNS:
        chunk_table[name] = _pack(np.concatenate(columns[name]) if columns[name]
                                  else np.zeros(0, np.int64))
    objects = {}
    for fqn, o in md.objects.items():
        if o.raw is not None:
            b = o.raw
            objects[fqn] = {"raw": [index[b.file], b.byte_offset, b.nbytes, b.checksum],
                            "type": o.raw_type}
        elif o.pickled is not None:
            b = o.pickled
            objects[fqn] = {"pickled": [index[b.file], b.byte_offset, b.nbytes, b.checksum]}
        else:
            objects[fqn] = {"value": o.value}
    doc = {
        "format": FORMAT,
        "version": max(md.version, min_version(md)),
        "checksum": CHECKSUM,
        "save_id": md.save_id,
        "world_size": md.world_size,
        "files": files,
        "tensors": tensors,
        "chunk_table": chunk_table,
        "objects": objects,
    }
    if frames:
        doc["frames"] = _frames_doc(frames)
    if md.paths is not None:  # builds that do not know the field ignore it
        doc["paths"] = {fqn: list(p) for fqn, p in md.paths.items()
                        if p != (fqn,) and (fqn in md.tensors or fqn in md.objects)}
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


def _frames_doc(frames: list[tuple[int, FrameIndex]]) -> dict:
    """The ``frames`` section: the codec, the index format's version, and
    columns (packed like the chunk table's): per compressed chunk its
    ``row`` in the chunk table, ``frame_bytes`` and frame ``count``; per
    frame, in chunk order, its ``stored`` bytes, ``kind`` and ``crc``
    (CRC-32C of its stored bytes)."""
    flat = [f for _, index in frames for f in zip(index.stored, index.kinds, index.crcs,
                                                  strict=True)]
    doc: dict[str, Any] = {"codec": CODECS[0], "version": FRAME_INDEX_VERSION,
                           "chunks": len(frames), "frames": len(flat)}
    for name, values in (("row", [r for r, _ in frames]),
                         ("frame_bytes", [f.frame_bytes for _, f in frames]),
                         ("count", [len(f.stored) for _, f in frames]),
                         ("stored", [v[0] for v in flat]), ("kind", [v[1] for v in flat]),
                         ("crc", [v[2] for v in flat])):
        doc[name] = _pack(np.array(values, dtype=np.int64))
    return doc


def _frames_of(value, rows: int, nbytes: np.ndarray, itemsizes: np.ndarray, size: int,
               where: str) -> dict[int, FrameIndex]:
    """The ``frames`` section decoded and validated: chunk row -> its
    :class:`FrameIndex`.  ``nbytes``/``itemsizes``: per row of the chunk
    table, its logical bytes and item size; ``size``: the document's bytes
    (bounding every count).  Raises :class:`CheckpointError` for a codec this
    build does not know, :class:`CorruptCheckpointError` for anything
    malformed."""
    section = _dict(value, where, "frames")
    codec = section.get("codec")
    if codec not in CODECS:
        raise CheckpointError(
            f"{where}: the checkpoint is compressed with codec {codec!r:.40}, which this build "
            f"cannot read (it reads {', '.join(CODECS)}); load it with a build that knows it")
    version = section.get("version")
    if type(version) is int and version > FRAME_INDEX_VERSION:
        raise CheckpointError(
            f"{where}: the checkpoint's frame index is version {version}, newer than this "
            f"build reads ({FRAME_INDEX_VERSION}); load it with a newer hyperdcp")
    if version != FRAME_INDEX_VERSION:
        _fail(where, f"unsupported frame index version {version!r:.40}")
    chunks = _int(section.get("chunks"), where, "frames.chunks", 0, rows + 1)
    count = _int(section.get("frames"), where, "frames.frames", 0, size + 1)
    row, frame_bytes, counts = (_unpack(section, n, chunks, where)
                                for n in ("row", "frame_bytes", "count"))
    stored, kind, crc = (_unpack(section, n, count, where) for n in ("stored", "kind", "crc"))
    if chunks and not (row.min() >= 0 and row.max() < rows and (np.diff(row) > 0).all()):
        _fail(where, "frames.row must name chunk rows in increasing order")
    if chunks and not (counts.min() >= 1 and int(counts.sum()) == count):
        _fail(where, f"frames.count must be positive and add up to {count}")
    out: dict[int, FrameIndex] = {}
    starts = np.cumsum(counts) - counts
    for r, fb, first, n in zip(row.tolist(), frame_bytes.tolist(), starts.tolist(),
                               counts.tolist(), strict=True):
        index = FrameIndex(fb, tuple(stored[first:first + n].tolist()),
                           tuple(kind[first:first + n].tolist()),
                           tuple(crc[first:first + n].tolist()))
        check_index(index, int(nbytes[r]), int(itemsizes[r]), f"{where}: chunk row {r}")
        out[r] = index
    return out


def min_version(md: Metadata) -> int:
    """The lowest format version that expresses ``md``: 3 if it holds
    compressed chunks, 2 if it holds raw blobs, else 1."""
    if any(t.compressed for t in md.tensors.values()):
        return 3
    return 2 if any(o.raw is not None for o in md.objects.values()) else 1


def _fail(where: str, problem: str) -> NoReturn:
    raise CorruptCheckpointError(f"{where}: invalid metadata: {problem}")


def _int(value, where: str, what: str, low: int = 0, high: int = MAX_INT) -> int:
    if type(value) is not int or not low <= value < high:
        _fail(where, f"{what} must be an integer in [{low}, {high}), got {value!r:.40}")
    return value


def _ints(value, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        _fail(where, f"{what} must be a list of at most {MAX_DIMS} integers")
    return tuple(_int(v, where, what) for v in value)


def _dict(value, where: str, what: str) -> dict:
    if not isinstance(value, dict):
        _fail(where, f"{what} must be an object, got {type(value).__name__}")
    return value


def check_relative_path(name, where: str) -> str:
    """Refuse file names that could escape the checkpoint root."""
    if (not isinstance(name, str) or not name or name.startswith(("/", "\\"))
            or "\\" in name or ":" in name or "\0" in name
            or any(part in ("", ".", "..") for part in name.split("/"))):
        _fail(where, f"file name {name!r:.80} is not a plain relative path")
    return name


def _unpack(table: dict, name: str, length: int, where: str) -> np.ndarray:
    """Decode one column of ``length`` int64 values, allocating no more than
    that however the compressed bytes were crafted."""
    text = table.get(name)
    if not isinstance(text, str):
        _fail(where, f"chunk_table.{name} must be a string")
    try:
        packed = base64.b64decode(text, validate=True)
        raw = zstandard.ZstdDecompressor().stream_reader(packed).read(8 * length + 1)
    except (ValueError, zstandard.ZstdError) as e:
        _fail(where, f"chunk_table.{name} does not decode ({e})")
    if len(raw) != 8 * length:
        _fail(where, f"chunk_table.{name} holds {len(raw)} bytes, expected {8 * length}")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)


def _check_bounds(entries: list, offsets: np.ndarray, sizes: np.ndarray, where: str) -> None:
    """Every chunk lies inside its tensor's shape: one vectorized pass over
    the flat ``offsets``/``sizes`` columns, whatever the number of tensors.
    ``entries``: ``(fqn, shape, dtype, start row, row count, start in the
    flat columns)`` per tensor."""
    if not len(offsets):
        return
    ndims = np.array([len(e[1]) for e in entries], dtype=np.int64)
    lengths = np.array([e[4] for e in entries], dtype=np.int64) * ndims
    shapes = np.array([d for e in entries for d in e[1]] or [0], dtype=np.int64)
    shape_starts = np.cumsum(ndims) - ndims
    tensor = np.repeat(np.arange(len(entries)), lengths)  # tensor of each flat value
    within = np.arange(len(offsets)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    limits = shapes[shape_starts[tensor] + within % np.maximum(ndims[tensor], 1)]
    over = np.flatnonzero(offsets + sizes > limits)
    if len(over):
        fqn, shape, _, _, _, dim0 = entries[int(tensor[over[0]])]
        row = dim0 + (int(over[0]) - dim0) // len(shape) * len(shape)
        _fail(f"{where}: tensor {fqn!r:.200}",
              f"chunk at {offsets[row:row + len(shape)].tolist()} of sizes "
              f"{sizes[row:row + len(shape)].tolist()} exceeds shape {list(shape)}")


def decode(data: bytes, where: str = METADATA_FILE) -> Metadata:
    """Decode and validate metadata bytes.

    Raises :class:`~dcp.errors.CorruptCheckpointError` naming ``where`` and
    the problem for anything that is not a well-formed document, and
    :class:`~dcp.errors.CheckpointError` naming the codec of compressed
    chunks this build cannot decode; memory allocated is bounded by a
    multiple of ``len(data)`` (the frame index: one small Python object per
    frame, at most ``len(data)`` frames).  Versions 1 to 3 are read
    (:data:`READ_VERSIONS`).
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        _fail(where, f"not JSON ({e})")
    doc = _dict(doc, where, "document")
    if doc.get("format") != FORMAT:
        _fail(where, f"format is {doc.get('format')!r:.40}, expected {FORMAT!r}")
    version: Any = doc.get("version")  # a JSON value, checked just below
    if type(version) is not int or version not in READ_VERSIONS:
        _fail(where, f"unsupported version {version!r:.40} (this build reads versions "
                     f"{', '.join(map(str, READ_VERSIONS))})")
    if doc.get("checksum") != CHECKSUM:
        _fail(where, f"unsupported checksum {doc.get('checksum')!r:.40}")
    save_id = doc.get("save_id")
    if not isinstance(save_id, str):
        _fail(where, "save_id must be a string")
    world_size = _int(doc.get("world_size"), where, "world_size", 1)
    files = doc.get("files")
    if not isinstance(files, list):
        _fail(where, "files must be a list")
    files = [check_relative_path(f, where) for f in files]

    table = _dict(doc.get("chunk_table"), where, "chunk_table")
    if table.get("codec") != "zstd":
        _fail(where, f"unsupported chunk_table codec {table.get('codec')!r:.40}")
    rows = _int(table.get("rows"), where, "chunk_table.rows", 0, len(data) + 1)
    entries = []
    dims, next_row = 0, 0
    for fqn, t in _dict(doc.get("tensors"), where, "tensors").items():
        ctx = f"{where}: tensor {fqn!r:.200}"
        t = _dict(t, ctx, "tensor entry")
        shape = _ints(t.get("shape"), ctx, "shape")
        dtype = t.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            _fail(ctx, f"unknown dtype {dtype!r:.40}")
        span = t.get("rows")
        if not isinstance(span, list) or len(span) != 2:
            _fail(ctx, "rows must be [start, count]")
        start, count = _int(span[0], ctx, "rows start"), _int(span[1], ctx, "rows count")
        if start != next_row or start + count > rows:
            _fail(ctx, f"rows {span} do not follow row {next_row} within {rows} rows")
        entries.append((fqn, shape, dtype, start, count, dims))
        next_row += count
        dims += count * len(shape)
    if next_row != rows:
        _fail(where, f"tensors use {next_row} of the chunk table's {rows} rows")
    columns = {name: _unpack(table, name, dims if name in ("offsets", "sizes") else rows, where)
               for name in _COLUMNS}
    if rows and not (columns["file"].min() >= 0 and columns["file"].max() < len(files)):
        _fail(where, f"a chunk names a file index outside the {len(files)} files")
    for name in ("byte_offset", "rank", "offsets", "sizes"):
        if len(columns[name]) and not (columns[name].min() >= 0 and columns[name].max() < MAX_INT):
            _fail(where, f"chunk_table.{name} holds a value outside [0, 2**62)")
    crcs = columns["checksum"]
    if rows and not (crcs.min() >= NO_CHECKSUM and crcs.max() < 2**32):
        _fail(where, "chunk_table.checksum holds a value that is not a CRC-32C (or -1: none)")

    _check_bounds(entries, columns["offsets"], columns["sizes"], where)
    frames: dict[int, FrameIndex] = {}
    if "frames" in doc:
        if version < 3:
            _fail(where, f"a frames section in a version {version} document")
        itemsizes = np.repeat([DTYPE_ITEMSIZE[e[2]] for e in entries] or [0],
                              [e[4] for e in entries] or [0]).astype(np.int64)
        elements = np.ones(rows, dtype=np.int64)
        for _, shape, _, start, count, dim0 in entries:
            if shape:
                elements[start:start + count] = columns["sizes"][
                    dim0:dim0 + count * len(shape)].reshape(count, len(shape)).prod(axis=1)
        frames = _frames_of(doc["frames"], rows, elements * itemsizes, itemsizes, len(data),
                            where)
    md = Metadata(save_id=save_id, world_size=world_size, version=version)
    for fqn, shape, dtype, start, count, dim0 in entries:
        ndim = len(shape)
        offsets = columns["offsets"][dim0:dim0 + count * ndim].reshape(count, ndim)
        sizes = columns["sizes"][dim0:dim0 + count * ndim].reshape(count, ndim)
        file, byte_offset, crc, rank = (columns[n][start:start + count]
                                        for n in ("file", "byte_offset", "checksum", "rank"))
        chunk_table = _ChunkTable(offsets, sizes, file, byte_offset, crc, rank, files)
        if frames:
            chunk_table.frames = {r - start: frames[r] for r in range(start, start + count)
                                  if r in frames}
        md.tensors[fqn] = TensorMeta._from_table(shape, dtype, chunk_table)

    def file_at(i, ctx):
        _int(i, ctx, "file index")
        if i >= len(files):
            _fail(ctx, f"file index {i} out of range ({len(files)} files)")
        return files[i]

    def blob_ref(p, what: str, ctx: str) -> BlobRef:
        if not isinstance(p, list) or len(p) != 4:
            _fail(ctx, f"{what} must be [file_index, byte_offset, nbytes, checksum]")
        return BlobRef(file=file_at(p[0], ctx), byte_offset=_int(p[1], ctx, "byte offset"),
                       nbytes=_int(p[2], ctx, "nbytes"),
                       checksum=_int(p[3], ctx, "checksum", 0, 2**32))

    for fqn, o in _dict(doc.get("objects"), where, "objects").items():
        ctx = f"{where}: object {fqn!r:.200}"
        o = _dict(o, ctx, "object entry")
        if "raw" in o and version >= 2:
            raw_type = o.get("type")
            if raw_type not in RAW_TYPES:
                _fail(ctx, f"raw type {raw_type!r:.40} is not one of {', '.join(RAW_TYPES)}")
            md.objects[fqn] = ObjectMeta(raw=blob_ref(o["raw"], "raw", ctx), raw_type=raw_type)
        elif "pickled" in o:
            md.objects[fqn] = ObjectMeta(pickled=blob_ref(o["pickled"], "pickled", ctx))
        elif "value" in o:
            md.objects[fqn] = ObjectMeta(value=o["value"])
        else:
            _fail(ctx, "object entry has none of 'value', 'raw' (version 2) and 'pickled'")
    if "paths" in doc:
        md.paths = _paths(doc["paths"], md, where)
    return md


def _paths(value, md: Metadata, where: str) -> dict[str, tuple[str | int, ...]]:
    """The ``paths`` entry: each an fqn of ``md`` mapped to a list of
    strings and integers whose dotted join is that fqn."""
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, path in _dict(value, where, "paths").items():
        ctx = f"{where}: path of {fqn!r:.200}"
        if fqn not in md.tensors and fqn not in md.objects:
            _fail(ctx, "no tensor or object has this fqn")
        if (not isinstance(path, list) or not path
                or not all(isinstance(p, str) or type(p) is int and p >= 0 for p in path)
                or ".".join(map(str, path)) != fqn):
            _fail(ctx, "must be a list of strings and integers whose dotted join is the fqn")
        out[fqn] = tuple(path)
    return out
