"""MindSpore ``.ckpt`` files <-> checkpoint, read and written without MindSpore.

The format is MindSpore's ``checkpoint.proto`` (``mindspore/train/
checkpoint_pb2.py``, written by ``mindspore.save_checkpoint``), proto2::

    message Checkpoint {
      message Value {
        required string tag = 1;
        oneof value { TensorProto tensor = 2; MapTensorProto maptensor = 3; }
      }
      repeated Value value = 1;
    }
    message TensorProto {
      repeated int64 dims = 1; required string tensor_type = 2;
      required bytes tensor_content = 3;
    }
    message MapTensorProto { repeated TensorProto tensor = 1; }

A file is serialized ``Checkpoint`` messages one after another (protobuf
merges concatenated messages), so it is a sequence of top-level field-1
records, one ``Value`` each: a parameter's tag, dims, type name
(:data:`MINDSPORE_DTYPES`) and raw little-endian row-major bytes.  A value
larger than 512 MiB is written as several consecutive records with the
same tag and the full dims, each holding the next piece of its bytes
(:data:`SLICE_BYTES`); the loader joins them.  A string (``append_dict``'s
``str`` values) is type ``"str"``, dims ``[0]``, its characters as UTF-32LE
(numpy's ``U`` dtype); ints, floats and bools of ``append_dict`` are 0-dim
tensors.  ``save_checkpoint(crc_check=True)`` ends the file with
``b"crc_num"`` and the CRC-32 (``binascii.crc32``) of every byte before it,
10 bytes big-endian; ``enc_key`` encrypts the whole file (AES-GCM, AES-CBC,
SM4-CBC: MindSpore's cipher header), which is refused here.

* :class:`MindSporeCkpt` — a ``.ckpt`` on any storage plugin as a read-only
  checkpoint.  Its records are walked on the wire format by a small reader
  of ours (varints and length-delimited fields, ``dims`` packed or not,
  unknown fields skipped), which records where each ``tensor_content`` lies
  and copies none of it: no MindSpore, no protobuf runtime, no code from the
  file.  Each tensor is one chunk of a virtual file, :data:`CONTENT_FILE`,
  the concatenation of the records' ``tensor_content`` bytes; reads of it
  go to the byte ranges of the ``.ckpt`` (a tensor split over records reads
  several), the record headers between neighbouring tensors read through
  and dropped where that is cheaper than a new request
  (:attr:`~dcp.core.read_cost.ReadCost.hole_bytes`).
* :func:`mindspore_ckpt_to_checkpoint` — the conversion, on the budgeted
  concurrent import of :func:`dcp.interop.parallel.import_checkpoint`
  (large reads, CRC-32C per tensor), strings as plain values.
* :func:`checkpoint_to_mindspore_ckpt` — the export: tensors streamed
  through :func:`dcp.interop.parallel.export_files` (read ahead within the
  budget, optionally cast, one prefix kept), each framed as MindSpore's
  writer frames it (:func:`value_header`, unpacked ``dims``, 512 MiB
  pieces), so ``mindspore.load_checkpoint`` reads the file; written under
  a temporary name and renamed, as MindSpore does, on a local path.

MindSpore's safetensors files (``save_checkpoint(format="safetensors")``,
``__metadata__`` ``{"format": "ms"}``) are plain safetensors files: see
:mod:`dcp.interop.safetensors_io`.
"""

from __future__ import annotations

import binascii
import bisect
import contextlib
import errno
import math
import struct
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from dcp.core.metadata import (
    DTYPE_ITEMSIZE,
    MAX_DIMS,
    MAX_INT,
    METADATA_FILE,
    ChunkMeta,
    Metadata,
    ObjectMeta,
    TensorMeta,
)
from dcp.core.storage import StoragePlugin, can_replace, open_storage, storage_errors
from dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from dcp.interop.parallel import (
    DEFAULT_BUDGET_BYTES,
    OutputFile,
    Ranks,
    export_files,
    import_checkpoint,
)
from dcp.interop.streaming import (
    ExportResult,
    export_selection,
    progress_bar,
    renamed,
    split_file,
)
from dcp.interop.view import ReadOnlyView
from dcp.orchestration.load import read_metadata

#: ``TensorProto.tensor_type`` -> checkpoint dtype name: the type names
#: MindSpore's loader reads (``tensor_to_ms_type`` of
#: ``mindspore/train/serialization.py``) that have a byte-sized torch dtype.
MINDSPORE_DTYPES: dict[str, str] = {
    "Int8": "int8", "UInt8": "uint8", "Int16": "int16", "UInt16": "uint16",
    "Int32": "int32", "UInt32": "uint32", "Int64": "int64", "UInt64": "uint64",
    "Float16": "float16", "Float32": "float32", "Float64": "float64",
    "BFloat16": "bfloat16", "Bool": "bool",
}
_MS_NAMES = {ours: ms for ms, ours in MINDSPORE_DTYPES.items()}
#: The type of a string value.
STR_TYPE = "str"
#: MindSpore's packed 4-bit integers (two per byte), which no torch dtype holds.
INT4_TYPE = "Int4"

SUFFIX = ".ckpt"
#: The virtual file a :class:`MindSporeCkpt`'s chunks lie in: every
#: ``tensor_content`` of the ``.ckpt``, in file order, back to back.
CONTENT_FILE = "tensor_content"
#: Bytes of ``tensor_content`` per record in an export; larger tensors are
#: split into several records, as ``mindspore.save_checkpoint`` does
#: (``1024 * SLICE_SIZE``).
SLICE_BYTES = 512 << 20
#: ``b"crc_num"`` then the CRC-32 of the records, 10 bytes big-endian.
CRC_MARK = b"crc_num"
CRC_TRAILER_BYTES = len(CRC_MARK) + 10
#: The first bytes of a file MindSpore encrypted (``enc_key``), by mode.
_CIPHER_MAGICS = {b"\xd8\x5e\x3a\x7f": "AES-GCM", b"\xd9\x5e\x3a\x7f": "AES-CBC",
                  b"\xda\x5e\x3a\x7f": "SM4-CBC"}
#: Largest tag, type name or string value read into memory (bytes).
MAX_FIELD_BYTES = 64 << 20
_BLOCK = 64 << 10  # bytes the reader fetches at once (a header, and small tensors with it)
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5  # protobuf wire types


# ---- reading the wire format ------------------------------------------------

class _Reader:
    """Sequential reads of bytes ``[0, end)`` of file ``name``, in blocks of
    :data:`_BLOCK`.  With ``crc_end``, every byte is read once, in order
    (skipped ones included), and :attr:`crc` is the CRC-32 of those before
    ``crc_end``; without, skipped bytes are not read."""

    def __init__(self, storage: StoragePlugin, name: str, where: str, end: int,
                 crc_end: int | None) -> None:
        self.storage, self.name, self.where, self.end = storage, name, where, end
        self.crc: int | None = None if crc_end is None else 0
        self.crc_end = crc_end
        self.pos = 0
        self._buf = b""
        self._buf_start = 0

    def fail(self, what: str, at: int | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: {what} at byte {self.pos if at is None else at}: not a MindSpore "
            f"checkpoint, or a damaged one")

    def _fill(self, need: int) -> None:
        """Make the buffer hold bytes ``[pos, pos + need)``: what it holds
        from ``pos`` on is kept and the next bytes are read after it (so,
        with ``crc``, every byte is read once, in order)."""
        if self.pos + need > self.end:
            raise self.fail(f"the file ends (byte {self.end}) within a field of {need} bytes")
        buf_end = self._buf_start + len(self._buf)
        if self._buf_start <= self.pos and self.pos + need <= buf_end:
            return
        keep, start = (self._buf[self.pos - self._buf_start:], buf_end) \
            if self.pos <= buf_end else (b"", self.pos)
        size = min(max(_BLOCK, need - len(keep)), self.end - start)
        block = memoryview(bytearray(size))
        self._read(start, block)
        self._buf, self._buf_start = keep + bytes(block), self.pos

    def take(self, n: int) -> bytes:
        self._fill(n)
        i = self.pos - self._buf_start
        self.pos += n
        return self._buf[i:i + n]

    def skip(self, n: int) -> None:
        """Move past ``n`` bytes; with ``crc``, those not yet read are read
        through a scratch buffer (16 MiB at most) and only checksummed."""
        if self.pos + n > self.end:
            raise self.fail(f"a field of {n} bytes runs past the end of the file (byte "
                            f"{self.end})")
        buffered = max(0, min(n, self._buf_start + len(self._buf) - self.pos))
        self.pos, n = self.pos + buffered, n - buffered
        if self.crc is None or not n:
            self.pos += n
            return
        scratch = memoryview(bytearray(min(n, 16 << 20)))
        while n:
            piece = scratch[:min(n, len(scratch))]
            self._read(self.pos, piece)
            self.pos, n = self.pos + len(piece), n - len(piece)

    def _read(self, start: int, out: memoryview) -> None:
        try:
            self.storage.read_ranges(self.name, [(start, out)])
        except Exception as e:
            raise CorruptCheckpointError(f"{self.where}: reading bytes {start}..{start + len(out)} "
                                         f"failed: {e}") from e
        if self.crc is not None and self.crc_end is not None:
            self.crc = binascii.crc32(out[:max(0, self.crc_end - start)], self.crc)

    def varint(self) -> int:
        start, value = self.pos, 0
        for shift in range(0, 70, 7):
            if self.pos >= self.end:
                raise self.fail("the file ends within a varint", start)
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if value >= 1 << 64:
                    raise self.fail("a varint longer than 64 bits", start)
                return value
        raise self.fail("a varint longer than 10 bytes", start)

    def key(self) -> tuple[int, int]:
        """A field's number and wire type."""
        start = self.pos
        key = self.varint()
        number, wire = key >> 3, key & 7
        if number == 0 or wire not in (_VARINT, _I64, _LEN, _I32):
            raise self.fail(f"field key {key} (field {number}, wire type {wire})", start)
        return number, wire

    def length(self, limit: int) -> int:
        """A length prefix, checked against the enclosing message's end."""
        start = self.pos
        n = self.varint()
        if self.pos + n > limit:
            raise self.fail(f"a length of {n} bytes runs past its message (byte {limit})", start)
        return n

    def skip_field(self, wire: int, limit: int) -> None:
        if wire == _VARINT:
            self.varint()
        else:
            n = {_I64: 8, _I32: 4}.get(wire) or self.length(limit)
            if self.pos + n > limit:
                raise self.fail(f"a field of {n} bytes runs past its message (byte {limit})")
            self.skip(n)

    def text(self, n: int, what: str) -> str:
        if n > MAX_FIELD_BYTES:
            raise self.fail(f"{what} of {n} bytes (more than {MAX_FIELD_BYTES})")
        start = self.pos
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} that is not UTF-8", start) from None


@dataclass
class Record:
    """One ``Value``: its tag, and of its tensor the dims, type and where
    the ``tensor_content`` bytes lie in the file."""

    tag: str
    at: int  # file offset of the record
    dims: list[int] = field(default_factory=list)
    type: str | None = None
    content: tuple[int, int] | None = None  # (file offset, bytes)
    maptensor: bool = False


def _tensor(reader: _Reader, end: int, record: Record) -> None:
    """Parse a ``TensorProto`` ending at ``end`` into ``record`` (a second
    one merges into it, as protobuf does)."""
    while reader.pos < end:
        number, wire = reader.key()
        if number == 1 and wire == _VARINT:
            record.dims.append(reader.varint())
        elif number == 1 and wire == _LEN:  # packed
            n = reader.length(end)
            if n > MAX_DIMS * 10:  # a varint is at most 10 bytes
                raise reader.fail(f"tensor {record.tag!r}: packed dims of {n} bytes (more than "
                                  f"{MAX_DIMS} dims)")
            stop = n + reader.pos  # pos after the length
            while reader.pos < stop:
                if len(record.dims) == MAX_DIMS:
                    raise reader.fail(f"tensor {record.tag!r} with more than {MAX_DIMS} dims")
                record.dims.append(reader.varint())
            if reader.pos != stop:
                raise reader.fail("packed dims that overrun their field")
        elif number == 2 and wire == _LEN:
            record.type = reader.text(reader.length(end), "a tensor_type")
        elif number == 3 and wire == _LEN:
            n = reader.length(end)
            record.content = (reader.pos, n)
            reader.skip(n)
        else:
            reader.skip_field(wire, end)
        if len(record.dims) > MAX_DIMS:
            raise reader.fail(f"tensor {record.tag!r} with more than {MAX_DIMS} dims")


def _value(reader: _Reader, end: int) -> Record:
    """Parse one ``Checkpoint.Value`` ending at ``end``."""
    record = Record("", reader.pos)
    tag: str | None = None
    while reader.pos < end:
        number, wire = reader.key()
        if number == 1 and wire == _LEN:
            tag = reader.text(reader.length(end), "a tag")
            record.tag = tag
        elif number == 2 and wire == _LEN:
            stop = reader.length(end) + reader.pos  # pos after the length
            record.maptensor = False
            _tensor(reader, stop, record)
        elif number == 3 and wire == _LEN:
            record.maptensor = True
            reader.skip(reader.length(end))
        else:
            reader.skip_field(wire, end)
    if tag is None:
        raise reader.fail("a value without its required tag", record.at)
    if not record.maptensor and (record.type is None or record.content is None):
        raise reader.fail(f"value {tag!r} without a tensor (tensor_type and tensor_content "
                          f"are required)", record.at)
    return record


def records(storage: StoragePlugin, name: str, size: int, where: str) -> list[Record]:
    """Every ``Value`` of the ``.ckpt`` file ``name`` (``size`` bytes) in
    ``storage``, in file order; ``where`` names the file in errors.  A
    ``crc_num`` trailer is checked (the file is then read whole, once).

    Raises:
        CheckpointError: an encrypted file.
        CorruptCheckpointError: malformed records (naming the byte offset),
            a wrong CRC-32, a failed read.
    """
    head = bytearray(min(size, CRC_TRAILER_BYTES))
    tail = bytearray(min(size, CRC_TRAILER_BYTES))
    try:
        storage.read_ranges(name, [(0, memoryview(head)), (size - len(tail), memoryview(tail))])
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: cannot read it: {e}") from e
    if bytes(head[:4]) in _CIPHER_MAGICS:
        raise CheckpointError(
            f"{where} is encrypted ({_CIPHER_MAGICS[bytes(head[:4])]}: saved with enc_key); "
            f"decrypt it with MindSpore first (mindspore.load_checkpoint(..., dec_key=...) and "
            f"save_checkpoint without enc_key)")
    # b"crc_num" is a trailer only where the records end: its b"c" (field 12,
    # wire type 3) cannot start a record, so the same bytes inside the last
    # record are that record's
    trailer, expected = None, None
    if size >= CRC_TRAILER_BYTES and bytes(tail[:len(CRC_MARK)]) == CRC_MARK:
        trailer = size - CRC_TRAILER_BYTES
        expected = int.from_bytes(tail[len(CRC_MARK):], "big")
    if not size or trailer == 0:
        raise NotACheckpointError(f"{where} holds no MindSpore values (an empty file)")
    reader = _Reader(storage, name, where, size, crc_end=trailer)
    out: list[Record] = []
    while reader.pos < size and reader.pos != trailer:
        number, wire = reader.key()
        if number == 1 and wire == _LEN:
            stop = reader.length(size) + reader.pos  # pos after the length
            out.append(_value(reader, stop))
        else:
            reader.skip_field(wire, size)
    if reader.pos == trailer and reader.crc != expected:
        raise CorruptCheckpointError(
            f"{where}: CRC-32 of bytes 0..{trailer} is {reader.crc:#010x}, its crc_num trailer "
            f"says {expected:#010x}: the file is damaged")
    return out


def _string(data: bytes, where: str) -> str:
    """A ``"str"`` value's UTF-32LE characters, trailing NULs dropped (as
    numpy reads a ``U`` array)."""
    if len(data) % 4:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes are not UTF-32 characters")
    try:
        return data.decode("utf-32-le").rstrip("\0")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where}: not UTF-32 characters ({e})") from None


def file_size(storage: StoragePlugin, name: str) -> int:
    """Bytes of file ``name``: the length of its mapping where the plugin
    maps files, else what its listing says.  Raises
    :class:`NotACheckpointError` for a missing file, :class:`CheckpointError`
    where the plugin tells no size."""
    try:
        with storage.mapped(name) as view:
            if view is not None:
                return len(view)
    except FileNotFoundError:
        raise NotACheckpointError(f"{storage.checkpoint_id}/{name}: no such file") from None
    except OSError as e:  # a folder: EISDIR, or ENODEV from mmap
        if isinstance(e, IsADirectoryError) or e.errno == errno.ENODEV:
            raise CheckpointError(f"{storage.checkpoint_id}/{name} is a folder, not a MindSpore "
                                  f"{SUFFIX} file") from None
        raise CheckpointError(f"{storage.checkpoint_id}/{name}: cannot open it: {e}") from None
    size = storage.file_stats().get(name, (None, None))[0]
    if size is None:
        if not storage.exists(name):
            raise NotACheckpointError(f"{storage.checkpoint_id}/{name}: no such file")
        raise CheckpointError(f"{storage.checkpoint_id}/{name}: its storage plugin does not "
                              f"tell the file's size")
    return size


class MindSporeCkpt(ReadOnlyView):
    """A MindSpore ``.ckpt`` file presented as a read-only checkpoint.

    ``source`` is the file, a path or URI of any storage plugin (``options``
    go to the plugin of its folder); ``rename`` maps tags to fqns (unlisted
    tags are kept).  The records are walked on first use of
    :attr:`metadata`; every tensor is one chunk (no checksum: the format
    records none per tensor) in :data:`CONTENT_FILE`, every ``"str"`` value
    a plain value of the metadata.  Reads of tensor bytes go to the
    ``.ckpt`` through the folder's plugin; writing raises.
    """

    def __init__(self, source: str, *, rename: dict[str, str] | None = None, **options) -> None:
        root, self.name = split_file(source)
        super().__init__(str(source), open_storage(root, **options), "MindSpore checkpoint")
        self.rename = rename
        self._metadata: Metadata | None = None
        self._virtual: list[int] = []  # where each segment starts in CONTENT_FILE
        self._segments: list[tuple[int, int]] = []  # (file offset, bytes), nonempty only

    @property
    def metadata(self) -> Metadata:
        """Every tensor as one chunk of :data:`CONTENT_FILE`, its shape and
        dtype as recorded (``dims`` ``[0]`` with one element's bytes is a
        0-dim tensor, as MindSpore's loader reads it); every ``"str"`` value
        in ``objects``.

        Raises:
            NotACheckpointError: no file at the source.
            CheckpointError: an encrypted file; a maptensor value, a type
                with no torch dtype (``Int4``) or an unknown one, naming the
                tag; a bad rename map.
            CorruptCheckpointError: malformed records, a wrong ``crc_num``,
                a tensor whose bytes do not match its dims, a tag repeated
                after others, naming the byte offset and tag.
        """
        if self._metadata is None:
            self._metadata = self._read()
        return self._metadata

    def _where(self) -> str:
        return repr(str(self.checkpoint_id))

    def _read(self) -> Metadata:
        where = self._where()
        found = records(self.inner, self.name, file_size(self.inner, self.name), where)
        groups: dict[str, list[Record]] = {}
        for i, r in enumerate(found):
            if r.tag in groups and found[i - 1].tag != r.tag:
                raise CorruptCheckpointError(
                    f"{where}: tag {r.tag!r} again at byte {r.at}, after other tags (a split "
                    f"value's records are consecutive)")
            groups.setdefault(r.tag, []).append(r)
        tensors: dict[str, TensorMeta] = {}
        strings: dict[str, str] = {}
        position = 0
        for tag, parts in groups.items():
            first = parts[0]
            at = f"{where}: value {tag!r} (byte {first.at})"
            if any(p.maptensor for p in parts):
                raise CheckpointError(f"{at} is a maptensor (a MindSpore MapParameter), which no "
                                      f"checkpoint tensor holds")
            if any((p.type, p.dims) != (first.type, first.dims) for p in parts):
                raise CorruptCheckpointError(f"{at}: its records disagree on type or dims")
            contents = [p.content for p in parts if p.content is not None]  # all: not maptensors
            nbytes = sum(n for _, n in contents)
            if first.type == STR_TYPE:
                if nbytes > MAX_FIELD_BYTES:
                    raise CheckpointError(f"{at}: a string of {nbytes} bytes (more than "
                                          f"{MAX_FIELD_BYTES})")
                data = bytearray(nbytes)
                self._read_segments(contents, memoryview(data))
                strings[tag] = _string(bytes(data), at)
                continue
            tensors[tag] = self._tensor_meta(at, first, nbytes, position)
            for offset, n in contents:
                if n:
                    self._virtual.append(position)
                    self._segments.append((offset, n))
                    position += n
        names = renamed([*tensors, *strings], self.rename, where)
        md = Metadata(save_id="mindspore", world_size=1)
        for tag, meta in tensors.items():
            md.tensors[names[tag]] = meta
        for tag, text in strings.items():
            md.objects[names[tag]] = ObjectMeta(value=text)
        return md

    @staticmethod
    def _tensor_meta(at: str, record: Record, nbytes: int, position: int) -> TensorMeta:
        if record.type == INT4_TYPE:
            raise CheckpointError(f"{at}: type Int4 packs two elements per byte; no torch dtype a "
                                  f"checkpoint can hold matches it")
        if record.type not in MINDSPORE_DTYPES:
            raise CheckpointError(f"{at}: unknown tensor_type {record.type!r} (known: "
                                  f"{', '.join(MINDSPORE_DTYPES)}, str)")
        dtype = MINDSPORE_DTYPES[record.type]
        if any(d >= 1 << 63 for d in record.dims):
            raise CorruptCheckpointError(f"{at}: negative dims {record.dims}")
        if any(d >= MAX_INT for d in record.dims):  # beyond what a checkpoint's metadata holds
            raise CorruptCheckpointError(f"{at}: dims {record.dims} beyond 2**62")
        shape = tuple(record.dims)
        if shape == (0,) and nbytes == DTYPE_ITEMSIZE[dtype]:
            shape = ()  # MindSpore's loader reads dims [0] as a scalar
        needed = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        if needed != nbytes:
            raise CorruptCheckpointError(f"{at}: {record.type}{list(shape)} needs {needed} bytes, "
                                         f"its tensor_content holds {nbytes}")
        meta = TensorMeta(shape, dtype)
        if nbytes:
            meta.chunks.append(ChunkMeta((0,) * len(shape), shape, CONTENT_FILE, position, nbytes,
                                         None, 0))
        return meta

    def _read_segments(self, pieces: list[tuple[int, int]], out: memoryview) -> None:
        ranges, pos = [], 0
        for offset, n in pieces:
            ranges.append((offset, out[pos:pos + n]))
            pos += n
        self.inner.read_ranges(self.name, [(o, v) for o, v in ranges if len(v)])

    # ---- reads of CONTENT_FILE, as reads of the .ckpt ----------------------

    def _file_requests(self, requests) -> list[tuple[int, list[memoryview]]]:
        """``requests`` of :data:`CONTENT_FILE` as requests of the ``.ckpt``:
        each view cut at the records' boundaries, runs of the file that
        follow each other joined, gaps up to ``hole_bytes`` read into
        scratch and dropped, a request no larger than ``max_request_bytes``
        once it holds a view."""
        hole, largest = self.inner.read_cost.hole_bytes, self.inner.read_cost.max_request_bytes
        out: list[tuple[int, list[memoryview]]] = []
        end = size = -1  # file offset after the last request, its size
        for offset, views in requests:
            pos = offset
            for view in views:
                view = memoryview(view).cast("B")
                while len(view):
                    k = bisect.bisect_right(self._virtual, pos) - 1
                    if k < 0 or pos >= self._virtual[k] + self._segments[k][1]:
                        raise CorruptCheckpointError(
                            f"{self._where()}: byte {pos} of {CONTENT_FILE} is no tensor's")
                    file_at, n = self._segments[k]
                    file_at += pos - self._virtual[k]
                    n = min(len(view), self._virtual[k] + n - pos)
                    piece, view = view[:n], view[n:]
                    gap = file_at - end
                    if out and 0 <= gap <= hole and size + gap + n <= largest:
                        if gap:
                            out[-1][1].append(memoryview(bytearray(gap)))
                        out[-1][1].append(piece)
                        size += gap + n
                    else:
                        out.append((file_at, [piece]))
                        size = n
                    end = file_at + n
                    pos += n
        return out

    def _check_name(self, name: str) -> None:
        if name != CONTENT_FILE:
            raise FileNotFoundError(f"{self.checkpoint_id!r} has no file {name!r} (only "
                                    f"{CONTENT_FILE!r})")

    def read_ranges(self, name, ranges) -> None:
        self.read_requests(name, [(offset, [buf]) for offset, buf in ranges])

    def read_requests(self, name, requests) -> None:
        self._check_name(name)
        _ = self.metadata
        self.inner.read_requests(self.name, self._file_requests(requests))

    def read_file(self, name: str) -> bytes:
        if name == METADATA_FILE:
            return super().read_file(name)
        self._check_name(name)
        _ = self.metadata
        out = bytearray(sum(n for _, n in self._segments))
        self.read_ranges(name, [(0, memoryview(out))])
        return bytes(out)

    @contextlib.contextmanager
    def mapped(self, name: str) -> Iterator[memoryview | None]:
        self._check_name(name)
        yield None  # no file holds the content contiguously

    def exists(self, name: str) -> bool:
        return name in (METADATA_FILE, CONTENT_FILE)

    def list_files(self) -> list[str]:
        return [CONTENT_FILE]


def _head_varint(head: bytes, i: int) -> tuple[int, int] | None:
    """The varint at ``head[i:]`` and the index after it; ``None`` where
    ``head`` ends within it."""
    value = 0
    for shift in range(0, 64, 7):
        if i >= len(head):
            return None
        value |= (head[i] & 0x7F) << shift
        i += 1
        if not head[i - 1] & 0x80:
            return value, i
    return None


#: Bytes :func:`is_mindspore_ckpt` wants of a file (a first record's tag
#: and the key after it, for tags up to about 4000 bytes).
HEAD_BYTES = 4096


def is_mindspore_ckpt(head: bytes) -> bool:
    """Whether ``head``, a file's first bytes (:data:`HEAD_BYTES`, or the
    whole file if shorter), start like a MindSpore ``.ckpt``: MindSpore's
    cipher header, or a plausible first record — a field-1 ``Value`` whose
    first field is its tag (UTF-8, within the record) followed by the key
    of its ``tensor`` or ``maptensor`` field."""
    if head[:4] in _CIPHER_MAGICS:
        return True
    if not head or head[0] != 1 << 3 | _LEN:
        return False
    record = _head_varint(head, 1)
    if record is None:
        return False
    length, i = record
    if i >= len(head) or head[i] != 1 << 3 | _LEN:  # the tag's key
        return False
    tag = _head_varint(head, i + 1)
    if tag is None:
        return False
    end = tag[1] + tag[0]  # after the tag, where the tensor's key is
    if end >= min(len(head), i + length):
        return False
    try:
        head[tag[1]:end].decode("utf-8")
    except UnicodeDecodeError:
        return False
    return head[end] in (2 << 3 | _LEN, 3 << 3 | _LEN)


def mindspore_ckpt_to_checkpoint(source: str, checkpoint_id: str, *,
                                 rename: dict[str, str] | None = None, overwrite: bool = False,
                                 buffer_bytes: int = DEFAULT_BUDGET_BYTES,
                                 source_options: dict | None = None,
                                 storage_options: dict | None = None,
                                 progress: bool = False, process_group=None) -> Metadata:
    """Convert a MindSpore ``.ckpt`` file into a checkpoint, streaming,
    without MindSpore.

    Every tensor becomes one chunk with its CRC-32C, shape and dtype as in
    the file (:data:`MINDSPORE_DTYPES`), its bytes copied unchanged, read
    straight into the buffer that is written, several data files at once
    (:func:`dcp.interop.parallel.import_checkpoint`); ``"str"`` values
    become plain (JSON) values.  With a ``process_group`` each rank of it
    converts a share of the files and rank 0 commits once.

    Args:
        source: the ``.ckpt`` file, path or URI; ``source_options`` go to
            the storage plugin of its folder.
        checkpoint_id: destination path or URI; ``storage_options`` go to
            its plugin.
        rename: tag -> fqn.
        overwrite: replace a committed checkpoint at ``checkpoint_id``.
        buffer_bytes: memory budget per process (bytes in flight; at least
            the largest tensor is let through).
        progress: show a progress bar (tqdm, bytes) on stderr.
        process_group: share the conversion over this group's ranks
            (collective); ``None``: this process alone.

    Returns:
        The committed :class:`dcp.Metadata` (on every rank).

    Raises:
        CheckpointError: as :attr:`MindSporeCkpt.metadata` (encrypted or
            malformed files, maptensors, Int4), or a failed read or write
            naming the tensor and file; nothing is committed.
    """
    view = MindSporeCkpt(source, rename=rename, **(source_options or {}))
    md = view.metadata
    dest = open_storage(str(checkpoint_id), **(storage_options or {}))
    with progress_bar(md.stored_bytes, "import", progress) as bar:
        return import_checkpoint(view, md, dest, overwrite=overwrite, buffer_bytes=buffer_bytes,
                                 process_group=process_group, on_bytes=bar.update,
                                 objects={f: o.value for f, o in md.objects.items()})


# ---- writing -------------------------------------------------------------

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


def value_header(tag: str, dims: Sequence[int], tensor_type: str, content_bytes: int) -> bytes:
    """The bytes of one record up to its ``tensor_content``: the top-level
    ``value`` field, the ``Value``'s tag, its ``tensor`` field, the dims
    (unpacked, as MindSpore's protobuf writes proto2 ``repeated int64``),
    the type name and the content's key and length — what
    ``Checkpoint.SerializeToString()`` writes before the content bytes."""
    dims_bytes = b"".join(_varint(1 << 3 | _VARINT) + _varint(d) for d in dims)
    head = dims_bytes + _field(2, tensor_type.encode()) + _varint(3 << 3 | _LEN) \
        + _varint(content_bytes)
    tensor_bytes = len(head) + content_bytes
    value = _field(1, tag.encode()) + _varint(2 << 3 | _LEN) + _varint(tensor_bytes) + head
    return _varint(1 << 3 | _LEN) + _varint(len(value) + content_bytes) + value


def _object_record(tag: str, value) -> bytes | None:
    """A value of our checkpoint as a record, as ``save_checkpoint``'s
    ``append_dict`` stores it: a string as ``"str"`` (``""`` as one NUL
    character, as numpy holds it), a bool, an int (in int64) or a float (as
    Float64, exact) as a 0-dim tensor; ``None`` for anything else."""
    if isinstance(value, str):
        # numpy's bytes of np.array(value), as MindSpore writes them: "" is a
        # <U1 array, one NUL character (no bytes fail its loader on the file)
        content = value.encode("utf-32-le") or bytes(4)
        return value_header(tag, [0], STR_TYPE, len(content)) + content
    if isinstance(value, bool):
        content = bytes([value])
        return value_header(tag, [], "Bool", 1) + content
    if isinstance(value, int) and -(1 << 63) <= value < 1 << 63:
        return value_header(tag, [], "Int64", 8) + value.to_bytes(8, "little", signed=True)
    if isinstance(value, float):
        return value_header(tag, [], "Float64", 8) + struct.pack("<d", value)
    return None


class _Framed(Sequence):
    """The buffers of an export's :class:`OutputFile` (its read-ahead:
    header, then one buffer per tensor) with each tensor's record headers
    around pieces of it, then ``tail``; the read-ahead is asked for each of
    its buffers once, in order, as a writer asks.  With ``crc``, the
    CRC-32 of every byte handed out goes into a final ``crc_num``
    trailer."""

    def __init__(self, inner: Sequence, pieces: list[list[tuple[bytes, int, int]]],
                 tail: list[bytes], crc: bool) -> None:
        self.inner = inner
        self.ops: list[tuple[int, int, int] | bytes] = [(0, 0, -1)]  # inner item, [start, end)
        for t, tensor_pieces in enumerate(pieces):
            for header, start, end in tensor_pieces:
                self.ops += [header, (t + 1, start, end)]
        self.ops += tail
        self.crc: int | None = 0 if crc else None
        if crc:
            self.ops.append(b"")  # the trailer, made when asked for
        self._item, self._view = -1, None

    def __len__(self) -> int:
        return len(self.ops)

    def __getitem__(self, k: int):  # type: ignore[override]  # read by index only, in order
        if not 0 <= k < len(self.ops):
            raise IndexError(k)
        op = self.ops[k]
        if self.crc is not None and k == len(self.ops) - 1:
            return CRC_MARK + self.crc.to_bytes(10, "big")
        if isinstance(op, bytes):
            out = op
        else:
            item, start, end = op
            if item != self._item:
                self._view = None  # before asking on: the read-ahead frees what nobody holds
                self._view, self._item = self.inner[item], item
            out = self._view[start:] if end < 0 else self._view[start:end]  # type: ignore[index]
        if self.crc is not None:
            self.crc = binascii.crc32(out, self.crc)
        return out


def checkpoint_to_mindspore_ckpt(checkpoint_id: str, dest_ckpt: str, *,
                                 rename: dict[str, str] | None = None, overwrite: bool = False,
                                 dtype: str | torch.dtype | None = None, model_only: bool = False,
                                 prefix: str | None = None, crc_check: bool = False,
                                 slice_bytes: int = SLICE_BYTES,
                                 buffer_bytes: int = DEFAULT_BUDGET_BYTES,
                                 storage_options: dict | None = None,
                                 dest_options: dict | None = None,
                                 progress: bool = False, process_group=None) -> ExportResult:
    """Export a checkpoint as one MindSpore ``.ckpt`` file, streaming, without
    MindSpore; ``mindspore.load_checkpoint(dest_ckpt)`` reads it.

    Each tensor is consolidated from its chunks (checksums verified) by
    reader threads ahead of the writer within ``buffer_bytes``
    (:func:`dcp.interop.parallel.export_files`) and written as one record
    (:func:`value_header`: tag, dims, type from :data:`MINDSPORE_DTYPES`,
    raw bytes), or as consecutive records of ``slice_bytes`` each when
    larger, as MindSpore splits them.  The checkpoint's values follow as
    ``append_dict`` stores them (strings as ``"str"``, ints as Int64, floats
    as Float64, bools as Bool, 0-dim); other values are skipped, and so are
    tensors of shape ``(0,)`` (MindSpore's loader reads dims ``[0]`` as a
    0-dim tensor; other empty shapes are written).  Where the storage
    plugin replaces files atomically (:meth:`~dcp.core.storage.StoragePlugin.replace`:
    paths, ``shm://``) the file is written as ``<name>.tmp-<id>`` and renamed
    over ``dest_ckpt``, as MindSpore does (a failed or killed export leaves
    no partial ``.ckpt`` and the previous file as it was); elsewhere it is
    written under its name, which must not exist yet, and removed if the
    export fails.  With a ``process_group`` the call is collective (rank 0
    writes the file).

    Args:
        checkpoint_id: the checkpoint, path or URI; ``storage_options`` go
            to its plugin.
        dest_ckpt: the file to write, a path or URI ending in ``.ckpt``;
            ``dest_options`` go to the plugin of its folder.
        rename: fqn -> tag (names after ``prefix`` stripping).
        overwrite: replace an existing ``dest_ckpt``.
        dtype: cast floating-point tensors to this dtype (a name such as
            ``"bfloat16"``, or a ``torch.dtype``); integer and bool tensors
            are kept.
        model_only: export only the tensors under ``model.`` (the prefix
            stripped), as ``prefix="model."``.
        prefix: export only the tensors (and values) whose fqn starts with
            it, named without it.
        crc_check: end the file with MindSpore's ``crc_num`` trailer (the
            CRC-32 of the records), which ``load_checkpoint(...,
            crc_check=True)`` verifies.
        slice_bytes: the most ``tensor_content`` bytes per record.
        buffer_bytes: memory budget per process.
        progress: show a progress bar (tqdm, bytes) on stderr.

    Returns:
        An :class:`~dcp.interop.streaming.ExportResult`; ``skipped`` lists
        the values (and ``(0,)`` tensors) a ``.ckpt`` cannot hold.

    Raises:
        NotACheckpointError / CorruptCheckpointError: as :func:`dcp.load`.
        CheckpointError: ``dest_ckpt`` exists without ``overwrite``, or
            exists on a storage that cannot replace it atomically, or does
            not end in ``.ckpt``; a dtype with no MindSpore type
            (:data:`MINDSPORE_DTYPES`) naming the tensor, a bad prefix,
            rename map or ``dtype``; a failed write (nothing is left at
            ``dest_ckpt``).
    """
    where = repr(str(checkpoint_id))
    root, name = split_file(str(dest_ckpt))
    if not name.endswith(SUFFIX):
        raise CheckpointError(f"{str(dest_ckpt)!r}: a MindSpore checkpoint's name ends in "
                              f"{SUFFIX} (mindspore.load_checkpoint requires it)")
    if slice_bytes < 1:
        raise CheckpointError(f"slice_bytes must be at least 1, not {slice_bytes}")
    storage = open_storage(str(checkpoint_id), **(storage_options or {}))
    md = read_metadata(str(checkpoint_id), storage=storage)
    strip = "model." if model_only and not prefix else prefix
    stripped, casts = export_selection(md, strip, dtype, where)
    kept = [f for f in md.objects if not strip or f.startswith(strip)]
    values = {f: md.objects[f].value for f in kept
              if md.objects[f].pickled is None and md.objects[f].blob is None}
    tags = renamed([*stripped.values(), *(f[len(strip or ""):] for f in values)], rename, where)
    dest = open_storage(root, **(dest_options or {}))
    atomic = can_replace(dest)
    ranks = Ranks.of(process_group)
    exists = None
    if ranks.rank == 0:  # rank 0 looks, before any rank writes: every rank refuses alike
        with storage_errors(f"reading {str(dest_ckpt)!r}"):
            exists = dest.exists(name)
    if ranks.broadcast(exists):
        if not overwrite:
            raise CheckpointError(f"{str(dest_ckpt)!r} exists; pass overwrite=True to replace it")
        if not atomic:
            raise CheckpointError(f"{str(dest_ckpt)!r} exists, and its storage "
                                  f"({type(dest).__name__}) cannot replace a file atomically; "
                                  f"delete it first")
    result = ExportResult(skipped=[f for f in kept if f not in values])
    pieces: list[list[tuple[bytes, int, int]]] = []
    entries = []
    for fqn, short in stripped.items():
        meta = md.tensors[fqn]
        if meta.shape == (0,):  # dims [0]: MindSpore's loader would make a 0-dim tensor of it
            result.skipped.append(fqn)
            continue
        out_dtype = casts[fqn] or meta.dtype
        if out_dtype not in _MS_NAMES:
            raise CheckpointError(f"{fqn!r}: dtype {out_dtype} has no MindSpore .ckpt type (they "
                                  f"are {', '.join(_MS_NAMES)}); cast it with dtype=...")
        nbytes = math.prod(meta.shape) * DTYPE_ITEMSIZE[out_dtype]
        bounds = list(range(0, nbytes, slice_bytes)) or [0]
        pieces.append([(value_header(tags[short], meta.shape, _MS_NAMES[out_dtype],
                                     min(slice_bytes, nbytes - start)), start,
                        min(start + slice_bytes, nbytes)) for start in bounds])
        entries.append((fqn, meta, casts[fqn]))
        result.tensors += 1
        result.nbytes += nbytes
    tail = []
    for fqn, value in values.items():
        record = _object_record(tags[fqn[len(strip or ""):]], value)
        if record is None:
            result.skipped.append(fqn)
        else:
            tail.append(record)
    temp = f"{name}.tmp-{uuid.uuid4().hex[:8]}" if atomic else name
    output = OutputFile(temp, b"", entries, frame=lambda ahead: _Framed(ahead, pieces, tail,
                                                                         crc_check))

    def publish() -> list[str]:
        if atomic:
            dest.replace(temp, name)
        return []

    with progress_bar(result.nbytes, "export", progress) as bar:
        export_files(storage, [output], dest, buffer_bytes=buffer_bytes,
                     process_group=process_group, finish=publish, on_bytes=bar.update)
    result.files = [name]
    return result
