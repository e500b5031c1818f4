"""A compact, versioned, non-executable encoding of coordination payloads.

The file-flag protocol (:mod:`dcp.coordination.file_flag`) and the gloo
transport (:class:`dcp.coordination.collectives.Coordinator`) carry local
plans, final plans, write results, the committed metadata and failures in
this encoding.  They are never pickles: decoding one can build only plain
values, integer arrays and instances of the classes registered here, so a
crafted payload yields a :class:`~dcp.errors.CheckpointError`, never code
execution.

Envelope: ``b"DCPW"``, the format version (:data:`FORMAT_VERSION`) and a
codec byte (0: the body as is; 1: zstd-compressed, used from
:data:`COMPRESS_ABOVE` bytes on, level 1), then the body.  A decoder refuses
another magic or version, and a compressed body that would inflate beyond
:data:`MAX_PAYLOAD_BYTES`.

Body: the length of a JSON text (4 bytes, little-endian), the JSON text,
then a *section* of raw bytes that the JSON refers to by offset and length.
JSON: ``None``, booleans, integers, floats and strings as themselves; lists
as JSON arrays; every other value as a tagged object — ``{"t": [...]}`` a
tuple, ``{"d": [[key, value], ...]}`` a dict (any hashable keys),
``{"b": [offset, length]}`` bytes (in the section), ``{"c": name, "f":
...}`` an instance of a registered class (a dataclass's fields; the
metadata as the bytes of its own JSON format, validated by
:func:`dcp.core.metadata.decode`), and ``{"c": name, "j": ...}`` one with a
*columnar* codec.  Columnar codecs (:class:`~dcp.core.planner.SavePlan`
here, the save's ``WriteResult`` through :func:`write_result_codec`, and
:class:`CachedWriteResult`) write a string table and flat integer columns
instead of an object per item; a column is ``{"@": [dtype, offset,
count]}``, ``count`` little-endian integers of ``dtype`` (``i1``, ``i2``,
``i4``, ``u4`` or ``i8``: the narrowest that holds the column) in the
section.  No
integer list goes through JSON, so encoding a plan is a few array copies:
at the 505B layout of ``benchmarks/scale.py`` a local plan is about 1 KB,
and a coordinator decodes and encodes ten thousand of them per step.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from types import MappingProxyType
from typing import Any

import numpy as np
import zstandard

from dcp.core.compression import FrameIndex
from dcp.core.metadata import ChunkMeta, Metadata
from dcp.core.metadata import decode as decode_metadata
from dcp.core.metadata import encode as encode_metadata
from dcp.core.plan_columns import ColumnarSavePlan, PlanColumns, columns_of, cut_boxes
from dcp.core.planner import SavePlan, TensorDecl, WriteItem
from dcp.errors import CheckpointError

#: The version of the envelope, the body and the columnar layouts; bumped
#: on any change a reader of the previous version would misread (2: the
#: binary section, integer columns and bytes out of the JSON).
FORMAT_VERSION = 2
_MAGIC = b"DCPW"
_ENVELOPE = struct.Struct("<4sBB")  # magic, version, codec
_TEXT_LENGTH = struct.Struct("<I")
_PLAIN, _ZSTD = 0, 1
#: Bodies of at least this many bytes are compressed.
COMPRESS_ABOVE = 256
#: The most bytes a compressed body may inflate to.
MAX_PAYLOAD_BYTES = 1 << 30

#: Subclasses encoded as the class they stand for: decoded plans and write
#: results that keep their columns.
_ALIASES: dict[type, str] = {ColumnarSavePlan: "SavePlan"}

# name -> (class, to_wire, from_wire, columnar)
_CODECS: dict[str, tuple[type, Callable[..., Any], Callable[..., Any], bool]] = {}


def register(cls: type, to_wire: Callable[[Any], Any] | None = None,
             from_wire: Callable[..., Any] | None = None, *, columnar: bool = False) -> None:
    """Allow instances of ``cls`` in payloads, by class name.  A dataclass
    travels field by field by default; other classes give ``to_wire``
    (instance -> encodable value) and ``from_wire`` (its inverse, which must
    validate its input and raise ``ValueError`` or a ``CheckpointError``).
    With ``columnar``, ``to_wire`` returns plain JSON (lists, str-keyed
    dicts, numbers, strings) in which integer numpy arrays and ``bytes`` may
    stand (they go to the section), and ``from_wire(doc, section)`` gets it
    back as it is, without tags, with the :class:`Section` that its
    :meth:`Section.array` and :meth:`Section.bytes` resolve references in."""
    if to_wire is None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass: give to_wire and from_wire")
        names = {f.name for f in dataclasses.fields(cls)}

        def to_wire(value):
            return {name: getattr(value, name) for name in names}

        def from_wire(fields):
            if not isinstance(fields, dict) or set(fields) != names:
                raise ValueError(f"fields of {cls.__name__} must be {sorted(names)}")
            return cls(**fields)
    elif from_wire is None:
        raise TypeError(f"{cls!r}: give from_wire with to_wire")
    _CODECS[cls.__name__] = (cls, to_wire, from_wire, columnar)


# --- the section ----------------------------------------------------------------

_DTYPES: dict[str, np.dtype] = {code: np.dtype(f"<{code}")
                                for code in ("i1", "i2", "i4", "u4", "i8")}
# the narrow dtypes and the values they hold (u4: checksums)
_NARROW = [(code, int(np.iinfo(_DTYPES[code]).min), int(np.iinfo(_DTYPES[code]).max))
           for code in ("i1", "i2", "i4", "u4")]


class _Writer:
    """The section of one payload being encoded: its pieces and their offsets."""

    def __init__(self) -> None:
        self.pieces: list[bytes | memoryview] = []
        self.size = 0

    def add(self, data: bytes | memoryview) -> list[int]:
        at, length = self.size, len(data)
        self.pieces.append(data)
        self.size += length
        return [at, length]

    def column(self, array: np.ndarray) -> dict:
        """``{"@": [dtype, offset, count]}`` of an integer array, stored in
        the narrowest dtype that holds its values."""
        if array.dtype.kind not in "iu" or array.ndim != 1:
            raise TypeError(f"cannot encode an array of {array.dtype} {array.shape}")
        code = "i8"
        if len(array):
            low, high = int(array.min()), int(array.max())
            for name, least, most in _NARROW:
                if least <= low and high <= most:
                    code = name
                    break
        else:
            code = "i1"
        data = np.ascontiguousarray(array, dtype=_DTYPES[code])
        return {"@": [code, self.add(data.data.cast("B"))[0], len(data)]}

    def default(self, value: Any) -> Any:
        """``json.dumps``'s hook: arrays and bytes inside columnar documents."""
        if isinstance(value, np.ndarray):
            return self.column(value)
        if isinstance(value, bytes):
            return {"b": self.add(value)}
        raise TypeError(f"cannot encode a {type(value).__name__} in an exchange payload")


class Section:
    """The raw bytes after a payload's JSON text, which its columns and
    bytes refer to (offsets relative to its start)."""

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def _span(self, at: Any, length: Any, what: str) -> memoryview:
        if (type(at) is not int or type(length) is not int or at < 0 or length < 0
                or at + length > len(self.data)):
            raise ValueError(f"{what}: bytes outside the payload's section")
        return self.data[at:at + length]

    def bytes(self, ref: Any, what: str) -> bytes:
        """The bytes ``{"b": [offset, length]}`` refers to."""
        if type(ref) is not dict or set(ref) != {"b"} or type(ref["b"]) is not list \
                or len(ref["b"]) != 2:
            raise ValueError(f"{what}: a reference to bytes expected")
        at, length = ref["b"]
        return bytes(self._span(at, length, what))

    def array(self, ref: Any, what: str, length: int | None = None) -> np.ndarray:
        """The int64 column ``{"@": [dtype, offset, count]}`` refers to (of
        ``length`` values if given); ValueError for anything else."""
        if type(ref) is not dict or set(ref) != {"@"} or type(ref["@"]) is not list \
                or len(ref["@"]) != 3:
            raise ValueError(f"{what}: a column of integers expected")
        code, at, count = ref["@"]
        dtype = _DTYPES.get(code) if type(code) is str else None
        if dtype is None or type(count) is not int or count < 0:
            raise ValueError(f"{what}: a column of integers expected")
        if length is not None and count != length:
            raise ValueError(f"{what}: {count} values for {length} rows")
        data = self._span(at, count * dtype.itemsize, what)
        return np.frombuffer(data, dtype=dtype).astype(np.int64)


# --- columnar helpers ------------------------------------------------------------

_INT = {int}


def _ints(column: Any, what: str, length: int | None = None) -> list[int]:
    """``column`` if it is a list of integers (of ``length``), else ValueError."""
    if type(column) is not list or not set(map(type, column)) <= _INT:
        raise ValueError(f"{what}: a list of integers expected")
    if length is not None and len(column) != length:
        raise ValueError(f"{what}: {len(column)} values for {length} rows")
    return column


def _strs(column: Any, what: str) -> list[str]:
    if type(column) is not list or not set(map(type, column)) <= {str}:
        raise ValueError(f"{what}: a list of strings expected")
    return column


class _Strings:
    """A string table: each distinct string once, referred to by index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def all(self, strings: Iterable[str]) -> np.ndarray:
        """The index of each of ``strings``."""
        index = self.index
        return np.array([index.setdefault(s, len(index)) for s in strings], dtype=np.int64)

    @property
    def table(self) -> list[str]:
        return list(self.index)


def _boxes(boxes: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Ranks and the flat values of a column of integer tuples."""
    return list(map(len, boxes)), list(chain.from_iterable(boxes))


def _unboxes(ndims: list[int], flat: list[int], what: str) -> list[tuple[int, ...]]:
    if sum(ndims) != len(flat) or (ndims and min(ndims) < 0):
        raise ValueError(f"{what}: ranks do not add up to the values")
    return cut_boxes(ndims, flat)


def _int64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)


def _index_column(section: Section, ref: Any, what: str, length: int | None,
                  bound: int) -> np.ndarray:
    """A column of indices into a table of ``bound`` entries."""
    column = section.array(ref, what, length)
    if len(column) and (column.min() < 0 or column.max() >= bound):
        raise ValueError(f"{what}: index outside the table of {bound}")
    return column


def _boxes_column(section: Section, doc: dict, what: str, rows: int,
                  keys: str = "o") -> tuple[np.ndarray, ...]:
    """The ranks (``k``) of ``rows`` boxes and their flat columns ``keys``."""
    ndims = section.array(doc["k"], f"{what} ranks", rows)
    if rows and ndims.min() < 0:
        raise ValueError(f"{what} ranks: negative")
    total = int(ndims.sum())
    return (ndims, *(section.array(doc[k], what, total) for k in keys))


#: Decoded tensor tables of plans by their text: the ranks of one data
#: parallel group declare the same tensors, so a coordinator decodes each
#: distinct table once (at the scale layout, 128 tables for 10,240 plans),
#: and every plan decoded from it shares one read-only mapping.
_TABLES: dict[bytes, Mapping[str, TensorDecl]] = {}
#: The text of each of those mappings, by its id (held in ``_TABLES``):
#: final plans share their local plan's tensors, so the coordinator
#: encodes each distinct table's text never again.
_TEXTS: dict[int, tuple[Mapping[str, TensorDecl], bytes]] = {}
_TABLES_MAX = 4096


#: During :func:`encode_many`: the text of each tensor table met, by the
#: table's id (the table is held, so its id stays its own).
_ENCODED_TABLES: dict[int, tuple[Mapping, bytes]] | None = None


def _table_text(tensors: Mapping[str, TensorDecl]) -> bytes:
    """The JSON text of a plan's tensor table (in the section: no escaping)."""
    known = _TEXTS.get(id(tensors))
    if known is not None and known[0] is tensors:
        return known[1]
    memo = _ENCODED_TABLES
    if memo is not None and id(tensors) in memo:
        return memo[id(tensors)][1]
    decls = list(tensors.values())
    shape_ndims, shapes = _boxes([d.shape for d in decls])
    text = json.dumps([list(tensors), [d.dtype for d in decls], shape_ndims, shapes],
                      separators=(",", ":")).encode()
    if memo is not None:
        memo[id(tensors)] = (tensors, text)
    return text


def _plan_to_wire(plan: SavePlan) -> dict:
    table = _table_text(plan.tensors)
    c = columns_of(plan)  # a decoded or planned plan's own columns: no item objects
    used, local = np.unique(c.fqn, return_inverse=True)
    names = c.names
    return {"tensors": table, "f": local.reshape(-1), "k": c.ndim, "o": c.offsets,
            "z": c.sizes, "b": c.nbytes, "names": [names[i] for i in used.tolist()]}


def _tensors_from_wire(table: bytes) -> Mapping[str, TensorDecl]:
    known = _TABLES.get(table)
    if known is None:
        doc = json.loads(table)
        if type(doc) is not list or len(doc) != 4:
            raise ValueError("SavePlan tensors: four columns expected")
        names, dtypes = _strs(doc[0], "SavePlan tensors"), _strs(doc[1], "SavePlan dtypes")
        shapes = _unboxes(_ints(doc[2], "SavePlan shapes", len(names)),
                          _ints(doc[3], "SavePlan shapes"), "SavePlan shapes")
        known = MappingProxyType({n: TensorDecl(s, d)
                                  for n, s, d in zip(names, shapes, dtypes, strict=True)})
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
            _TEXTS.clear()
        _TABLES[table] = known
        _TEXTS[id(known)] = (known, table)
    return known


def _plan_from_wire(doc: Any, section: Section) -> SavePlan:
    """A :class:`~dcp.core.plan_columns.ColumnarSavePlan`: the columns are
    checked here, its items built only if someone reads them."""
    if type(doc) is not dict:
        raise ValueError("SavePlan: columns expected")
    tensors = _tensors_from_wire(section.bytes(doc["tensors"], "SavePlan tensors"))
    strings = _strs(doc["names"], "SavePlan strings")
    nbytes = section.array(doc["b"], "SavePlan nbytes")
    fqns = _index_column(section, doc["f"], "SavePlan items", len(nbytes), len(strings))
    ndims, offsets, sizes = _boxes_column(section, doc, "SavePlan boxes", len(nbytes), "oz")
    return ColumnarSavePlan(tensors, PlanColumns(strings, fqns, ndims, offsets, sizes, nbytes))


@dataclass
class ResultColumns:
    """A write result's chunks, fingerprints and replicas as int64 columns
    over one string table ``strings`` (fqns and file names).  Chunks:
    ``fqn``, ``file`` (indices into ``strings``), ``ndim``, flat
    ``offsets``/``sizes``, ``at`` (byte offset), ``nbytes``, ``crc`` (-1:
    none), ``rank``.  ``prints`` and ``replicas``: ``(fqn, ndim, flat
    offsets, value)``."""

    strings: list[str]
    fqn: np.ndarray
    file: np.ndarray
    ndim: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    at: np.ndarray
    nbytes: np.ndarray
    crc: np.ndarray
    rank: np.ndarray
    prints: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    replicas: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

    def chunks(self) -> list[tuple[str, ChunkMeta]]:
        s, ndims = self.strings, self.ndim.tolist()
        offsets = _unboxes(ndims, self.offsets.tolist(), "chunk offsets")
        sizes = _unboxes(ndims, self.sizes.tolist(), "chunk sizes")
        return [(s[f], ChunkMeta(o, z, s[file], at, n, None if crc < 0 else crc, r))
                for f, file, o, z, at, n, crc, r in zip(
                    self.fqn.tolist(), self.file.tolist(), offsets, sizes, self.at.tolist(),
                    self.nbytes.tolist(), self.crc.tolist(), self.rank.tolist(), strict=True)]

    def keyed(self, which: str) -> dict:
        fqn, ndim, flat, values = getattr(self, which)
        boxes = _unboxes(ndim.tolist(), flat.tolist(), which)
        s = self.strings
        return {(s[f], box): v for f, box, v in zip(fqn.tolist(), boxes, values.tolist(),
                                                      strict=True)}


def result_columns(result: Any) -> ResultColumns:
    """A write result's columns: a decoded one's own, else built from its
    objects."""
    own = getattr(result, "columns", None)
    if own is not None and result.__dict__.get("_chunks") is None and (
            result.__dict__.get("_prints") is None and result.__dict__.get("_replicas") is None):
        return own
    return _columns_of_objects(result)


def _keyed_of(strings: _Strings, values: dict[tuple[str, tuple[int, ...]], int]) -> tuple:
    ndims, flat = _boxes([offsets for _, offsets in values])
    return (strings.all([fqn for fqn, _ in values]), _int64(ndims), _int64(flat),
            _int64(list(values.values())))


def _columns_of_objects(result: Any) -> ResultColumns:
    strings = _Strings()
    metas = [meta for _, meta in result.chunks]
    ndims, offsets = _boxes([m.offsets for m in metas])
    _, sizes = _boxes([m.sizes for m in metas])
    fqn = strings.all([fqn for fqn, _ in result.chunks])
    file = strings.all([m.file for m in metas])
    prints, replicas = _keyed_of(strings, result.fingerprints), _keyed_of(strings,
                                                                           result.replicas)
    return ResultColumns(
        strings.table, fqn, file, _int64(ndims), _int64(offsets), _int64(sizes),
        _int64([m.byte_offset for m in metas]), _int64([m.nbytes for m in metas]),
        _int64([-1 if m.checksum is None else m.checksum for m in metas]),
        _int64([m.rank for m in metas]), prints, replicas)


def _keyed_doc(keyed: tuple) -> dict:
    fqn, ndim, flat, values = keyed
    return {"f": fqn, "k": ndim, "o": flat, "v": values}


def _keyed_columns(doc: Any, section: Section, strings: list[str], what: str) -> tuple:
    if type(doc) is not dict:
        raise ValueError(f"{what}: columns expected")
    values = section.array(doc["v"], f"{what} values")
    fqns = _index_column(section, doc["f"], f"{what} names", len(values), len(strings))
    ndims, flat = _boxes_column(section, doc, what, len(values))
    return fqns, ndims, flat, values


def _result_doc(c: ResultColumns) -> dict:
    return {"s": c.strings, "chunks": {"f": c.fqn, "file": c.file, "k": c.ndim, "o": c.offsets,
                                       "z": c.sizes, "at": c.at, "n": c.nbytes, "crc": c.crc,
                                       "rank": c.rank},
            "prints": _keyed_doc(c.prints), "replicas": _keyed_doc(c.replicas)}


def _result_columns(doc: dict, section: Section, strings: list[str]) -> ResultColumns:
    c = doc["chunks"]
    if type(c) is not dict:
        raise ValueError("WriteResult chunks: columns expected")
    nbytes = section.array(c["n"], "chunk sizes")
    count = len(nbytes)
    fqns = _index_column(section, c["f"], "chunk names", count, len(strings))
    files = _index_column(section, c["file"], "chunk files", count, len(strings))
    ndims, offsets, sizes = _boxes_column(section, c, "chunk boxes", count, "oz")
    return ResultColumns(
        strings, fqns, files, ndims, offsets, sizes,
        section.array(c["at"], "chunk offsets", count), nbytes,
        section.array(c["crc"], "checksums", count), section.array(c["rank"], "chunk ranks",
                                                                   count),
        _keyed_columns(doc["prints"], section, strings, "fingerprints"),
        _keyed_columns(doc["replicas"], section, strings, "replicas"))


Frames = dict[tuple[str, tuple[int, ...]], FrameIndex]


def _frames_to_wire(frames: Frames) -> list:
    """A result's frame indexes: ``[fqn, offsets, frame_bytes, stored,
    kinds, crcs]`` per compressed chunk."""
    return [[fqn, list(offsets), f.frame_bytes, list(f.stored), list(f.kinds), list(f.crcs)]
            for (fqn, offsets), f in frames.items()]


def _frames_from_wire(rows: Any) -> Frames:
    if type(rows) is not list:
        raise ValueError("WriteResult frames: a list expected")
    out: Frames = {}
    for row in rows:
        if (type(row) is not list or len(row) != 6 or type(row[0]) is not str
                or type(row[2]) is not int
                or not all(type(c) is list and set(map(type, c)) <= {int}
                           for c in (row[1], row[3], row[4], row[5]))):
            raise ValueError("WriteResult frames: [fqn, offsets, frame_bytes, stored, kinds, "
                             "crcs] rows expected")
        out[(row[0], tuple(row[1]))] = FrameIndex(row[2], tuple(row[3]), tuple(row[4]),
                                                  tuple(row[5]))
    return out


def _values_from_wire(doc: dict, section: Section) -> tuple[dict[str, str], dict[str, bytes],
                                                             dict[str, list[str | int]], Frames]:
    """A result's JSON values, blobs, paths and frame indexes."""
    json_values, pickled, paths = doc["json"], doc["pickled"], doc["paths"]
    if (type(json_values) is not dict or type(pickled) is not dict
            or not set(map(type, json_values.values())) <= {str}):
        raise ValueError("WriteResult values: a map of strings expected")
    if type(paths) is not dict or not all(
            type(p) is list and set(map(type, p)) <= {str, int} for p in paths.values()):
        raise ValueError("WriteResult paths: a map of lists of keys expected")
    return (json_values, {k: section.bytes(v, f"blob {k!r}") for k, v in pickled.items()},
            paths, _frames_from_wire(doc["frames"]))


#: The class of decoded write results (:func:`write_result_codec`).
_DECODED: list[type] = []


def _decoded_result(columns: ResultColumns, json_values: dict[str, str],
                    pickled: dict[str, bytes], paths: dict[str, list[str | int]],
                    frames: Frames) -> Any:
    result = _DECODED[0](chunks=None, fingerprints=None, replicas=None,
                         json_values=json_values, pickled=pickled, paths=paths, frames=frames)
    result.columns = columns
    return result


def write_result_codec(cls: type) -> tuple[Callable[[Any], Any], Callable[..., Any]]:
    """The columnar ``to_wire`` / ``from_wire`` of the save's write results
    (``cls`` is :class:`dcp.orchestration.save.WriteResult`: ``chunks`` of
    ``(fqn, ChunkMeta)``, ``fingerprints`` and ``replicas`` keyed by
    ``(fqn, offsets)``, ``json_values``, ``pickled``, ``paths``).  Fqns and file names
    go into one string table; a chunk is eight integers and its box.

    A decoded result keeps its columns (:class:`ResultColumns`, its
    ``columns``; what :func:`result_columns` returns) and builds ``chunks``,
    ``fingerprints`` and ``replicas`` as objects only when they are read:
    the coordinator builds the metadata from the columns."""

    names = [f.name for f in dataclasses.fields(cls)]

    def lazy(field: str, build: Callable[[ResultColumns], Any]) -> property:
        slot = f"_{field}"

        def get(self):
            value = self.__dict__.get(slot)
            if value is None:
                value = self.__dict__[slot] = build(self.columns)
            return value

        def put(self, value):
            self.__dict__[slot] = value

        return property(get, put)

    class Decoded(cls):  # type: ignore[valid-type, misc]
        chunks = lazy("chunks", ResultColumns.chunks)
        fingerprints = lazy("prints", lambda c: c.keyed("prints"))
        replicas = lazy("replicas", lambda c: c.keyed("replicas"))

        def __eq__(self, other):
            if not isinstance(other, cls):
                return NotImplemented
            return all(getattr(self, n) == getattr(other, n) for n in names)

        __hash__ = None  # type: ignore[assignment]

        def __reduce__(self):
            return cls, tuple(getattr(self, n) for n in names)

    Decoded.__qualname__ = f"{cls.__qualname__}.Decoded"
    _ALIASES[Decoded] = cls.__name__
    _DECODED[:] = [Decoded]

    def to_wire(result: Any) -> dict:
        doc = _result_doc(result_columns(result))
        doc.update(json=result.json_values, pickled=result.pickled, paths=result.paths,
                   frames=_frames_to_wire(result.frames))
        return doc

    def from_wire(doc: Any, section: Section) -> Any:
        if type(doc) is not dict:
            raise ValueError("WriteResult: columns expected")
        strings = _strs(doc["s"], "WriteResult strings")
        return _decoded_result(_result_columns(doc, section, strings),
                               *_values_from_wire(doc, section))

    return to_wire, from_wire


@dataclass
class CachedWriteResult:
    """A write result by a cached final plan, carrying only what the
    metadata needs beyond that plan: per chunk written, in the order of
    ``chunks`` (row ``item`` of the plan's items: fqn, box and bytes), its
    ``file`` (index into ``files``), byte offset ``at`` and checksum
    ``crc`` (-1: none); the fingerprints ``prints`` by row of the final
    plan and ``replicas`` by row of the rank's local plan, as ``(rows,
    values)``; the non-tensor values, the fqns' paths and the frame
    indexes of compressed chunks.  All integer columns are int64 arrays.
    Made by :func:`relative_result`, made whole again by
    :func:`absolute_result`."""

    files: list[str]
    item: np.ndarray
    file: np.ndarray
    at: np.ndarray
    crc: np.ndarray
    prints: tuple[np.ndarray, np.ndarray]
    replicas: tuple[np.ndarray, np.ndarray]
    json_values: dict[str, str]
    pickled: dict[str, bytes]
    paths: dict[str, list[str | int]]
    frames: Frames


def _rows_of(plan: SavePlan) -> tuple[dict[tuple[str, tuple[int, ...]], int],
                                       list[tuple[int, ...]], list[int]]:
    """Each item's row by ``(fqn, offsets)``, and each row's sizes and bytes."""
    c = columns_of(plan)
    names, ndims = c.names, c.ndim.tolist()
    rows = {(names[f], o): row for row, (f, o) in enumerate(zip(
        c.fqn.tolist(), cut_boxes(ndims, c.offsets.tolist()), strict=True))}
    return rows, cut_boxes(ndims, c.sizes.tolist()), c.nbytes.tolist()


def relative_result(result: Any, plan: SavePlan, local: SavePlan,
                    rank: int) -> CachedWriteResult | None:
    """``result``, written by ``rank`` by its final ``plan`` (made from its
    ``local`` plan), as a :class:`CachedWriteResult`; ``None`` if it holds
    anything those plans do not give (a chunk not in ``plan`` as it is, of
    another rank, or a replica not in ``local``)."""
    rows, sizes, nbytes = _rows_of(plan)
    held = _rows_of(local)[0]
    items, at, crc = [], [], []
    for fqn, meta in result.chunks:
        row = rows.get((fqn, meta.offsets))
        if row is None or meta.rank != rank or meta.nbytes != nbytes[row] or \
                meta.sizes != sizes[row]:
            return None
        items.append(row)
        at.append(meta.byte_offset)
        crc.append(-1 if meta.checksum is None else meta.checksum)
    files = _Strings()
    file = files.all([meta.file for _, meta in result.chunks])
    try:
        prints = [rows[key] for key in result.fingerprints]
        replicas = [held[key] for key in result.replicas]
    except KeyError:
        return None
    return CachedWriteResult(files.table, _int64(items), file, _int64(at), _int64(crc),
                             (_int64(prints), _int64(list(result.fingerprints.values()))),
                             (_int64(replicas), _int64(list(result.replicas.values()))),
                             result.json_values, result.pickled, result.paths, result.frames)


def _rows(c: PlanColumns, rows: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """The flat values (offsets or sizes) of ``rows`` of ``c``."""
    starts = np.cumsum(c.ndim) - c.ndim
    k = c.ndim[rows]
    at = np.repeat(starts[rows] - (np.cumsum(k) - k), k) + np.arange(int(k.sum()))
    return flat[at]


def absolute_result(cached: CachedWriteResult, plan: SavePlan, local: SavePlan,
                    rank: int) -> Any:
    """The write result ``cached`` stands for (a decoded ``WriteResult``
    with columns), by ``rank``'s final ``plan`` and ``local`` plan.  Raises
    :class:`CheckpointError` naming the rank if it does not fit them."""
    c, held = columns_of(plan), columns_of(local)
    for rows, table, what in ((cached.item, c, "chunk"), (cached.prints[0], c, "fingerprint"),
                              (cached.replicas[0], held, "replica")):
        if len(rows) and (rows.min() < 0 or rows.max() >= len(table)):
            raise CheckpointError(f"rank {rank}'s write result names a {what} outside its "
                                  f"cached plan of {len(table)} items")
    if len(cached.file) and (cached.file.min() < 0 or cached.file.max() >= len(cached.files)):
        raise CheckpointError(f"rank {rank}'s write result names a file outside its table")
    item, (prow, pval), (rrow, rval) = cached.item, cached.prints, cached.replicas
    # one string table of the names used (a planner's final plans share the
    # table of every name in the world), then the files
    used, index = np.unique(np.concatenate([c.fqn[item], c.fqn[prow]]), return_inverse=True)
    held_used, held_index = np.unique(held.fqn[rrow], return_inverse=True)
    strings = [*(c.names[i] for i in used.tolist()),
               *(held.names[i] for i in held_used.tolist()), *cached.files]
    index = index.reshape(-1)
    fqn, print_fqn = index[:len(item)], index[len(item):]
    replica_fqn = held_index.reshape(-1) + len(used)
    columns = ResultColumns(
        strings, fqn, cached.file + len(used) + len(held_used), c.ndim[item],
        _rows(c, item, c.offsets), _rows(c, item, c.sizes), cached.at, c.nbytes[item],
        cached.crc, np.full(len(item), rank, dtype=np.int64),
        (print_fqn, c.ndim[prow], _rows(c, prow, c.offsets), pval),
        (replica_fqn, held.ndim[rrow], _rows(held, rrow, held.offsets), rval))
    return _decoded_result(columns, cached.json_values, cached.pickled, cached.paths,
                           cached.frames)


def _cached_to_wire(r: CachedWriteResult) -> dict:
    return {"files": r.files, "item": r.item, "file": r.file, "at": r.at, "crc": r.crc,
            "prints": list(r.prints), "replicas": list(r.replicas), "json": r.json_values,
            "pickled": r.pickled, "paths": r.paths, "frames": _frames_to_wire(r.frames)}


def _cached_from_wire(doc: Any, section: Section) -> CachedWriteResult:
    if type(doc) is not dict:
        raise ValueError("CachedWriteResult: columns expected")
    files = _strs(doc["files"], "CachedWriteResult files")
    item = section.array(doc["item"], "chunk rows")
    count = len(item)
    keyed = []
    for name in ("prints", "replicas"):
        pair = doc[name]
        if type(pair) is not list or len(pair) != 2:
            raise ValueError(f"CachedWriteResult {name}: two columns expected")
        values = section.array(pair[1], f"{name} values")
        keyed.append((section.array(pair[0], f"{name} rows", len(values)), values))
    return CachedWriteResult(
        files, item, _index_column(section, doc["file"], "chunk files", count, len(files)),
        section.array(doc["at"], "chunk offsets", count),
        section.array(doc["crc"], "checksums", count), keyed[0], keyed[1],
        *_values_from_wire(doc, section))


for _cls in (ChunkMeta, TensorDecl, WriteItem):
    register(_cls)
register(SavePlan, _plan_to_wire, _plan_from_wire, columnar=True)
register(CachedWriteResult, _cached_to_wire, _cached_from_wire, columnar=True)


def _metadata_from_wire(data: Any) -> Metadata:
    if not isinstance(data, bytes):
        raise ValueError(f"metadata must be bytes, got {type(data).__name__}")
    return decode_metadata(data, "exchange payload")


#: The metadata last committed and its bytes: the answer that carries it to
#: every rank reuses them (:func:`remember_metadata`) instead of encoding it again.
_COMMITTED: list[tuple[Metadata, bytes]] = []


def remember_metadata(md: Metadata, data: bytes) -> None:
    """``data`` is ``md`` encoded (and ``md`` does not change any more):
    an answer carrying ``md`` reuses these bytes."""
    _COMMITTED[:] = [(md, data)]


def _metadata_to_wire(md: Metadata) -> bytes:
    for known, data in _COMMITTED:
        if known is md:
            return data
    return encode_metadata(md)


register(Metadata, _metadata_to_wire, _metadata_from_wire)


def _pack(value: Any, section: _Writer) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_pack(v, section) for v in value]
    if isinstance(value, tuple):
        return {"t": [_pack(v, section) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_pack(k, section), _pack(v, section)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"b": section.add(value)}
    name = _ALIASES.get(type(value)) or type(value).__name__
    codec = _CODECS.get(name)
    if codec is None or not (codec[0] is type(value) or type(value) in _ALIASES):
        raise TypeError(f"cannot encode a {name} in an exchange payload")
    if codec[3]:
        return {"c": name, "j": codec[1](value)}
    return {"c": name, "f": _pack(codec[1](value), section)}


def encode(value: Any) -> bytes:
    """The envelope of ``value`` (plain values, lists, tuples, dicts, bytes
    and registered classes; ``TypeError`` for anything else)."""
    section = _Writer()
    text = json.dumps(_pack(value, section), separators=(",", ":"), allow_nan=True,
                      default=section.default).encode()
    body = b"".join([_TEXT_LENGTH.pack(len(text)), text, *section.pieces])
    if len(body) < COMPRESS_ABOVE:
        return _ENVELOPE.pack(_MAGIC, FORMAT_VERSION, _PLAIN) + body
    return _ENVELOPE.pack(_MAGIC, FORMAT_VERSION, _ZSTD) + zstandard.compress(body, 1)


def encode_many(values: list[Any]) -> list[bytes]:
    """``[encode(v) for v in values]``, each distinct tensor table of the
    plans among them encoded once (the values must not change meanwhile)."""
    global _ENCODED_TABLES
    _ENCODED_TABLES = {}
    try:
        return [encode(v) for v in values]
    finally:
        _ENCODED_TABLES = None


def _unpack(doc: Any, section: Section) -> Any:
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [_unpack(v, section) for v in doc]
    tags = set(doc) if isinstance(doc, dict) else set()
    if tags == {"t"}:
        return tuple(_unpack(v, section) for v in doc["t"])
    if tags == {"d"}:
        return {_unpack(k, section): _unpack(v, section) for k, v in doc["d"]}
    if tags == {"b"}:
        return section.bytes(doc, "bytes")
    if tags not in ({"c", "f"}, {"c", "j"}):
        raise ValueError(f"unexpected {type(doc).__name__} with keys {sorted(tags)}")
    codec = _CODECS.get(doc["c"]) if isinstance(doc["c"], str) else None
    if codec is None or codec[3] != ("j" in tags):
        raise ValueError(f"unknown class {doc['c']!r}")
    return codec[2](doc["j"], section) if codec[3] else codec[2](_unpack(doc["f"], section))


def _split(data: bytes) -> tuple[memoryview, memoryview]:
    """The JSON text and the section inside the envelope ``data``;
    ``ValueError`` if it is not one of this version."""
    if len(data) < _ENVELOPE.size:
        raise ValueError(f"{len(data)} bytes: shorter than the envelope")
    magic, version, codec = _ENVELOPE.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("not a hyperdcp exchange payload (bad magic)")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}; this reader knows {FORMAT_VERSION}")
    rest = memoryview(data)[_ENVELOPE.size:]
    if codec == _ZSTD:
        size = zstandard.frame_content_size(rest)
        if size < 0 or size > MAX_PAYLOAD_BYTES:
            raise ValueError(f"compressed body of unknown or excessive size ({size})")
        rest = memoryview(zstandard.ZstdDecompressor().decompress(rest, max_output_size=size))
    elif codec != _PLAIN:
        raise ValueError(f"unknown codec {codec}")
    if len(rest) < _TEXT_LENGTH.size:
        raise ValueError("body shorter than its JSON text's length")
    (length,) = _TEXT_LENGTH.unpack_from(rest)
    end = _TEXT_LENGTH.size + length
    if end > len(rest):
        raise ValueError(f"JSON text of {length} bytes in a body of {len(rest)}")
    return rest[_TEXT_LENGTH.size:end], rest[end:]


_BUNDLE = 2  # codec of a bundle: zstd over several payloads' bodies
_COUNT = struct.Struct("<I")


def bundle(payloads: list[bytes]) -> bytes:
    """Several payloads as one, their bodies compressed together: the ranks
    of one host send plans and results that share most of their names and
    columns, so at the scale layout a host's bundle of 8 is 3-6x smaller
    than its payloads apart.  A payload that is not a valid envelope goes
    in as it is (decoding it names it, after :func:`unbundle`)."""
    entries = []
    for payload in payloads:
        try:
            text, section = _split(payload)
        except (ValueError, zstandard.ZstdError):
            entries.append(payload)
            continue
        entries.append(b"".join([_ENVELOPE.pack(_MAGIC, FORMAT_VERSION, _PLAIN),
                                 _TEXT_LENGTH.pack(len(text)), text, section]))
    table = struct.pack(f"<I{len(entries)}Q", len(entries), *map(len, entries))
    return _ENVELOPE.pack(_MAGIC, FORMAT_VERSION, _BUNDLE) + zstandard.compress(
        b"".join([table, *entries]), 1)


def unbundle(data: bytes, where: str) -> list[bytes]:
    """The payloads :func:`bundle` put into ``data``, each one to
    :func:`decode`.  Raises :class:`CheckpointError` naming ``where`` if
    ``data`` is not a bundle of this version."""
    try:
        if len(data) < _ENVELOPE.size:
            raise ValueError(f"{len(data)} bytes: shorter than the envelope")
        magic, version, codec = _ENVELOPE.unpack_from(data)
        if magic != _MAGIC or version != FORMAT_VERSION or codec != _BUNDLE:
            raise ValueError("not a bundle of this version")
        rest = memoryview(data)[_ENVELOPE.size:]
        size = zstandard.frame_content_size(rest)
        if size < 0 or size > MAX_PAYLOAD_BYTES:
            raise ValueError(f"compressed bundle of unknown or excessive size ({size})")
        whole = zstandard.ZstdDecompressor().decompress(rest, max_output_size=size)
        (count,) = _COUNT.unpack_from(whole)
        lengths = struct.unpack_from(f"<{count}Q", whole, _COUNT.size)
        at = _COUNT.size + 8 * count
        if at + sum(lengths) != len(whole):
            raise ValueError("bundle lengths do not add up")
    except (ValueError, struct.error, zstandard.ZstdError) as e:
        raise CheckpointError(f"{where}: malformed bundle ({e})") from None
    out = []
    for length in lengths:
        out.append(whole[at:at + length])
        at += length
    return out


def body(data: bytes) -> bytes:
    """The JSON text inside the envelope ``data`` (the section after it
    holds the columns and bytes it refers to); ``ValueError`` if it is not
    one of this version."""
    return bytes(_split(data)[0])


def decode(data: bytes, where: str) -> Any:
    """The value :func:`encode` turned into ``data``.

    Raises :class:`CheckpointError` naming ``where`` (the exchange file) for
    anything that is not such an encoding.
    """
    try:
        text, section = _split(data)
        return _unpack(json.loads(bytes(text)), Section(section))
    except (CheckpointError, ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError,
            RecursionError, zstandard.ZstdError) as e:
        raise CheckpointError(f"{where}: malformed exchange payload ({e})") from None
