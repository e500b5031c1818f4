"""The checkpoint's metadata (the "seating chart") and its encoding.

Metadata is the contract between save and load.  For every tensor it records
the global shape and dtype, and for every saved chunk its global offsets and
sizes, the data file and byte range holding it (row-major, C order), the
writing rank and a CRC-32 checksum of its bytes.  Non-tensor values are stored
inline as JSON, or (only when the caller opted in) as pickled bytes in a data
file.

The encoding is versioned JSON: decoding it can never execute code (contrast
PyTorch DCP's pickled ``.metadata``).  :func:`decode` validates every field and
raises :class:`~dcp.errors.CorruptCheckpointError` for anything malformed, so
a crafted file yields a clean error, never another exception.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

from dcp.errors import CorruptCheckpointError

FORMAT = "hyperdcp"
VERSION = 1
METADATA_FILE = "metadata.json"
CHECKSUM = "crc32"

# Item sizes in bytes of the dtypes a checkpoint may hold (the safetensors set).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "bool": 1, "complex64": 8,
}


def checksum(buffer, value: int = 0) -> int:
    """CRC-32 of ``buffer`` (any buffer-protocol object), continuing ``value``.

    zlib releases the GIL on large buffers, so writer threads hash in parallel.
    """
    return zlib.crc32(buffer, value)


@dataclass(frozen=True)
class ChunkMeta:
    """One saved chunk: a box of the global tensor.

    ``offsets``/``sizes`` are in elements, global coordinates; the bytes
    ``[byte_offset, byte_offset + nbytes)`` of ``file`` hold it in row-major
    order; ``checksum`` is their CRC-32; ``rank`` wrote it.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    byte_offset: int
    nbytes: int
    checksum: int
    rank: int


@dataclass
class TensorMeta:
    """Global ``shape`` and ``dtype`` name of one tensor and its saved chunks."""

    shape: tuple[int, ...]
    dtype: str
    chunks: list[ChunkMeta] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unique) tensor."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class BlobRef:
    """Bytes of a pickled non-tensor value inside a data file."""

    file: str
    byte_offset: int
    nbytes: int
    checksum: int


@dataclass
class ObjectMeta:
    """A non-tensor value: inline JSON ``value``, or a ``pickled`` blob."""

    value: Any = None
    pickled: BlobRef | None = None


@dataclass
class Metadata:
    """Everything a load needs to find the bytes of every fqn.

    Returned by :func:`dcp.save` and :func:`dcp.read_metadata`.
    """

    save_id: str
    world_size: int
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    objects: dict[str, ObjectMeta] = field(default_factory=dict)
    version: int = VERSION

    def files(self) -> set[str]:
        """Names (relative to the checkpoint root) of every data file used."""
        names = {c.file for t in self.tensors.values() for c in t.chunks}
        names.update(o.pickled.file for o in self.objects.values() if o.pickled)
        return names

    def fqns(self) -> list[str]:
        """Every fqn in the checkpoint, tensors and objects."""
        return [*self.tensors, *self.objects]

    @property
    def stored_bytes(self) -> int:
        """Bytes of tensor data stored (each distinct chunk once)."""
        return sum(c.nbytes for t in self.tensors.values() for c in t.chunks)

    @property
    def unique_bytes(self) -> int:
        """Bytes of the global tensors: the state's size without replicas."""
        return sum(t.nbytes for t in self.tensors.values())


# ---------------------------------------------------------------- encoding


def encode(md: Metadata) -> bytes:
    """Encode ``md`` as UTF-8 JSON.

    Chunks are stored as compact arrays
    ``[offsets, sizes, file_index, byte_offset, nbytes, checksum, rank]``
    against one table of file names.
    """
    files = sorted(md.files())
    index = {name: i for i, name in enumerate(files)}
    tensors = {
        fqn: {
            "shape": list(t.shape),
            "dtype": t.dtype,
            "chunks": [
                [list(c.offsets), list(c.sizes), index[c.file], c.byte_offset,
                 c.nbytes, c.checksum, c.rank]
                for c in t.chunks
            ],
        }
        for fqn, t in md.tensors.items()
    }
    objects = {}
    for fqn, o in md.objects.items():
        if o.pickled is not None:
            b = o.pickled
            objects[fqn] = {"pickled": [index[b.file], b.byte_offset, b.nbytes, b.checksum]}
        else:
            objects[fqn] = {"value": o.value}
    doc = {
        "format": FORMAT,
        "version": md.version,
        "checksum": CHECKSUM,
        "save_id": md.save_id,
        "world_size": md.world_size,
        "files": files,
        "tensors": tensors,
        "objects": objects,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


def _fail(where: str, problem: str):
    raise CorruptCheckpointError(f"{where}: invalid metadata: {problem}")


def _int(value, where: str, what: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        _fail(where, f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _ints(value, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        _fail(where, f"{what} must be a list of integers, got {type(value).__name__}")
    return tuple(_int(v, where, what) for v in value)


def _dict(value, where: str, what: str) -> dict:
    if not isinstance(value, dict):
        _fail(where, f"{what} must be an object, got {type(value).__name__}")
    return value


def check_relative_path(name, where: str) -> str:
    """Refuse file names that could escape the checkpoint root."""
    if (not isinstance(name, str) or not name or name.startswith(("/", "\\"))
            or "\\" in name or ":" in name
            or any(part in ("", ".", "..") for part in name.split("/"))):
        _fail(where, f"file name {name!r} is not a plain relative path")
    return name


def decode(data: bytes, where: str = METADATA_FILE) -> Metadata:
    """Decode and validate metadata bytes.

    Raises :class:`~dcp.errors.CorruptCheckpointError` naming ``where`` and
    the problem for anything that is not a well-formed version-1 document.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        _fail(where, f"not JSON ({e})")
    doc = _dict(doc, where, "document")
    if doc.get("format") != FORMAT:
        _fail(where, f"format is {doc.get('format')!r}, expected {FORMAT!r}")
    version = doc.get("version")
    if version != VERSION:
        _fail(where, f"unsupported version {version!r} (this build reads {VERSION})")
    if doc.get("checksum") != CHECKSUM:
        _fail(where, f"unsupported checksum {doc.get('checksum')!r}")
    save_id = doc.get("save_id")
    if not isinstance(save_id, str):
        _fail(where, "save_id must be a string")
    world_size = _int(doc.get("world_size"), where, "world_size", 1)
    files = doc.get("files")
    if not isinstance(files, list):
        _fail(where, "files must be a list")
    files = [check_relative_path(f, where) for f in files]

    def file_at(i, ctx):
        _int(i, ctx, "file index")
        if i >= len(files):
            _fail(ctx, f"file index {i} out of range ({len(files)} files)")
        return files[i]

    md = Metadata(save_id=save_id, world_size=world_size, version=version)
    for fqn, t in _dict(doc.get("tensors"), where, "tensors").items():
        ctx = f"{where}: tensor {fqn!r}"
        t = _dict(t, ctx, "tensor entry")
        shape = _ints(t.get("shape"), ctx, "shape")
        dtype = t.get("dtype")
        if dtype not in DTYPE_ITEMSIZE:
            _fail(ctx, f"unknown dtype {dtype!r}")
        itemsize = DTYPE_ITEMSIZE[dtype]
        chunks = t.get("chunks")
        if not isinstance(chunks, list):
            _fail(ctx, "chunks must be a list")
        meta = TensorMeta(shape=shape, dtype=dtype)
        for c in chunks:
            if not isinstance(c, list) or len(c) != 7:
                _fail(ctx, f"chunk must be a list of 7 fields, got {c!r:.80}")
            offsets, sizes = _ints(c[0], ctx, "chunk offsets"), _ints(c[1], ctx, "chunk sizes")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                _fail(ctx, f"chunk rank {len(offsets)}/{len(sizes)} != tensor rank {len(shape)}")
            if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
                _fail(ctx, f"chunk at {list(offsets)} of sizes {list(sizes)} exceeds shape {list(shape)}")
            nbytes = _int(c[4], ctx, "chunk nbytes")
            if nbytes != math.prod(sizes) * itemsize:
                _fail(ctx, f"chunk at {list(offsets)}: nbytes {nbytes} != sizes x itemsize")
            meta.chunks.append(ChunkMeta(
                offsets=offsets, sizes=sizes, file=file_at(c[2], ctx),
                byte_offset=_int(c[3], ctx, "byte offset"), nbytes=nbytes,
                checksum=_int(c[5], ctx, "checksum"), rank=_int(c[6], ctx, "rank")))
        md.tensors[fqn] = meta
    for fqn, o in _dict(doc.get("objects"), where, "objects").items():
        ctx = f"{where}: object {fqn!r}"
        o = _dict(o, ctx, "object entry")
        if "pickled" in o:
            p = o["pickled"]
            if not isinstance(p, list) or len(p) != 4:
                _fail(ctx, "pickled must be [file_index, byte_offset, nbytes, checksum]")
            md.objects[fqn] = ObjectMeta(pickled=BlobRef(
                file=file_at(p[0], ctx), byte_offset=_int(p[1], ctx, "byte offset"),
                nbytes=_int(p[2], ctx, "nbytes"), checksum=_int(p[3], ctx, "checksum")))
        elif "value" in o:
            md.objects[fqn] = ObjectMeta(value=o["value"])
        else:
            _fail(ctx, "object entry has neither 'value' nor 'pickled'")
    return md
