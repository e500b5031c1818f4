"""A compact, versioned, non-executable encoding of coordination payloads.

The file-flag protocol (:mod:`dcp.coordination.file_flag`) and the gloo
transport (:class:`dcp.coordination.collectives.Coordinator`) carry local
plans, final plans, write results, the committed metadata and failures in
this encoding.  They are never pickles: decoding one can build only plain
values and instances of the classes registered here, so a crafted payload
yields a :class:`~dcp.errors.CheckpointError`, never code execution.

Envelope: ``b"DCPW"``, the format version (:data:`FORMAT_VERSION`) and a
codec byte (0: JSON as is; 1: zstd-compressed JSON, used from
:data:`COMPRESS_ABOVE` bytes on, level 1), then the body.  A decoder refuses
another magic or version, and a compressed body that would inflate beyond
:data:`MAX_PAYLOAD_BYTES`.

JSON body: ``None``, booleans, integers, floats and strings as themselves;
lists as JSON arrays; every other value as a tagged object —
``{"t": [...]}`` a tuple, ``{"d": [[key, value], ...]}`` a dict (any
hashable keys), ``{"b": "<base64>"}`` bytes, ``{"c": name, "f": ...}`` an
instance of a registered class (a dataclass's fields; the metadata in its
own JSON format, validated by :func:`dcp.core.metadata.decode`), and
``{"c": name, "j": ...}`` one with a *columnar* codec.  Columnar codecs
(:class:`~dcp.core.planner.SavePlan` here, the save's ``WriteResult``
through :func:`write_result_codec`) write a string table and flat integer
columns instead of an object per item: at the 505B layout of
``benchmarks/scale.py`` a local plan shrinks from 40 KB of tagged JSON to
about 1 KB, and decodes about 20x faster, which is what lets one
coordinator take ten thousand of them per step.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import zstandard

from dcp.core.metadata import ChunkMeta, Metadata
from dcp.core.metadata import decode as decode_metadata
from dcp.core.metadata import encode as encode_metadata
from dcp.core.plan_columns import ColumnarSavePlan, PlanColumns, columns_of, cut_boxes
from dcp.core.planner import SavePlan, TensorDecl, WriteItem
from dcp.errors import CheckpointError

#: The version of the envelope and of the columnar layouts; bumped on any
#: change a reader of the previous version would misread.
FORMAT_VERSION = 1
_MAGIC = b"DCPW"
_ENVELOPE = struct.Struct("<4sBB")  # magic, version, codec
_PLAIN, _ZSTD = 0, 1
#: Bodies of at least this many bytes are compressed.
COMPRESS_ABOVE = 256
#: The most bytes a compressed body may inflate to.
MAX_PAYLOAD_BYTES = 1 << 30

#: Subclasses encoded as the class they stand for: decoded plans and write
#: results that keep their columns.
_ALIASES: dict[type, str] = {ColumnarSavePlan: "SavePlan"}

# name -> (class, to_wire, from_wire, columnar)
_CODECS: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any], Any], bool]] = {}


def register(cls: type, to_wire: Callable[[Any], Any] | None = None,
             from_wire: Callable[[Any], Any] | None = None, *, columnar: bool = False) -> None:
    """Allow instances of ``cls`` in payloads, by class name.  A dataclass
    travels field by field by default; other classes give ``to_wire``
    (instance -> encodable value) and ``from_wire`` (its inverse, which must
    validate its input and raise ``ValueError`` or a ``CheckpointError``).
    With ``columnar``, ``to_wire`` returns plain JSON (lists, str-keyed
    dicts, numbers, strings) that is written and handed back to
    ``from_wire`` as it is, without tags."""
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

    def __call__(self, s: str) -> int:
        return self.index.setdefault(s, len(self.index))

    def all(self, strings: Iterable[str]) -> list[int]:
        """The index of each of ``strings``."""
        index = self.index
        return [index.setdefault(s, len(index)) for s in strings]

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


def _keyed(strings: _Strings, values: dict[tuple[str, tuple[int, ...]], int]) -> dict:
    """A ``{(fqn, offsets): int}`` map as columns."""
    ndims, flat = _boxes([offsets for _, offsets in values])
    return {"f": strings.all([fqn for fqn, _ in values]), "k": ndims, "o": flat,
            "v": list(values.values())}


#: Decoded tensor tables of plans by their text: the ranks of one data
#: parallel group declare the same tensors, so a coordinator decodes each
#: distinct table once (at the scale layout, 128 tables for 10,240 plans).
_TABLES: dict[str, dict[str, TensorDecl]] = {}
_TABLES_MAX = 4096


#: During :func:`encode_many`: the text of each tensor table met, by the
#: table's id (the table is held, so its id stays its own): final plans
#: share their local plan's table.
_ENCODED_TABLES: dict[int, tuple[dict, str]] | None = None


def _table_text(tensors: dict[str, TensorDecl]) -> str:
    memo = _ENCODED_TABLES
    if memo is not None and id(tensors) in memo:
        return memo[id(tensors)][1]
    decls = list(tensors.values())
    shape_ndims, shapes = _boxes([d.shape for d in decls])
    text = json.dumps([list(tensors), [d.dtype for d in decls], shape_ndims, shapes],
                      separators=(",", ":"))
    if memo is not None:
        memo[id(tensors)] = (tensors, text)
    return text


def _plan_to_wire(plan: SavePlan) -> dict:
    table = _table_text(plan.tensors)
    c = columns_of(plan)  # a decoded or planned plan's own columns: no item objects
    used, local = np.unique(c.fqn, return_inverse=True)
    names = c.names
    return {"tensors": table, "f": local.reshape(-1).tolist(), "k": c.ndim.tolist(),
            "o": c.offsets.tolist(), "z": c.sizes.tolist(), "b": c.nbytes.tolist(),
            "names": [names[i] for i in used.tolist()]}


def _array(column: Any, what: str, length: int | None = None) -> np.ndarray:
    """``column`` (a list of integers, of ``length``) as an int64 array;
    ValueError for anything else."""
    if type(column) is not list:
        raise ValueError(f"{what}: a list of integers expected")
    if length is not None and len(column) != length:
        raise ValueError(f"{what}: {len(column)} values for {length} rows")
    if not column:
        return np.zeros(0, dtype=np.int64)
    try:
        array = np.array(column)
    except (OverflowError, ValueError):
        raise ValueError(f"{what}: a list of integers expected") from None
    if array.dtype.kind != "i" or array.ndim != 1:
        raise ValueError(f"{what}: a list of integers expected")
    return array.astype(np.int64, copy=False)


def _tensors_from_wire(table: Any) -> dict[str, TensorDecl]:
    if type(table) is not str:
        raise ValueError("SavePlan tensors: a string expected")
    known = _TABLES.get(table)
    if known is None:
        doc = json.loads(table)
        if type(doc) is not list or len(doc) != 4:
            raise ValueError("SavePlan tensors: four columns expected")
        names, dtypes = _strs(doc[0], "SavePlan tensors"), _strs(doc[1], "SavePlan dtypes")
        shapes = _unboxes(_ints(doc[2], "SavePlan shapes", len(names)),
                          _ints(doc[3], "SavePlan shapes"), "SavePlan shapes")
        known = {n: TensorDecl(s, d) for n, s, d in zip(names, shapes, dtypes, strict=True)}
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        _TABLES[table] = known
    return dict(known)


def _plan_from_wire(doc: Any) -> SavePlan:
    """A :class:`~dcp.core.plan_columns.ColumnarSavePlan`: the columns are
    checked here, its items built only if someone reads them."""
    if type(doc) is not dict:
        raise ValueError("SavePlan: columns expected")
    tensors = _tensors_from_wire(doc["tensors"])
    strings = _strs(doc["names"], "SavePlan strings")
    nbytes = _array(doc["b"], "SavePlan nbytes")
    fqns = _array(doc["f"], "SavePlan items", len(nbytes))
    if len(fqns) and (fqns.min() < 0 or fqns.max() >= len(strings)):
        raise ValueError(f"SavePlan items: index outside the table of {len(strings)}")
    ndims = _array(doc["k"], "SavePlan ranks", len(nbytes))
    total = int(ndims.sum())
    if len(ndims) and ndims.min() < 0:
        raise ValueError("SavePlan ranks: negative")
    offsets = _array(doc["o"], "offsets", total)
    sizes = _array(doc["z"], "sizes", total)
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
    doc = _result_doc(result)
    return _result_columns(doc, doc["s"])


def _result_doc(result: Any) -> dict:
    strings = _Strings()
    metas = [meta for _, meta in result.chunks]
    ndims, offsets = _boxes([m.offsets for m in metas])
    _, sizes = _boxes([m.sizes for m in metas])
    chunks = {"f": strings.all([fqn for fqn, _ in result.chunks]),
              "file": strings.all([m.file for m in metas]), "k": ndims, "o": offsets,
              "z": sizes,
              "at": [m.byte_offset for m in metas], "n": [m.nbytes for m in metas],
              "crc": [-1 if m.checksum is None else m.checksum for m in metas],
              "rank": [m.rank for m in metas]}
    return {"chunks": chunks, "prints": _keyed(strings, result.fingerprints),
            "replicas": _keyed(strings, result.replicas), "s": strings.table}


def _keyed_columns(doc: Any, strings: list[str], what: str) -> tuple:
    if type(doc) is not dict:
        raise ValueError(f"{what}: columns expected")
    values = _array(doc["v"], f"{what} values")
    fqns = _array(doc["f"], f"{what} names", len(values))
    if len(fqns) and (fqns.min() < 0 or fqns.max() >= len(strings)):
        raise ValueError(f"{what} names: index outside the table of {len(strings)}")
    ndims = _array(doc["k"], what, len(values))
    if len(ndims) and ndims.min() < 0:
        raise ValueError(f"{what}: negative ranks")
    flat = _array(doc["o"], what, int(ndims.sum()))
    return fqns, ndims, flat, values


def _result_columns(doc: dict, strings: list[str]) -> ResultColumns:
    c = doc["chunks"]
    if type(c) is not dict:
        raise ValueError("WriteResult chunks: columns expected")
    nbytes = _array(c["n"], "chunk sizes")
    count = len(nbytes)
    fqns = _array(c["f"], "chunk names", count)
    files = _array(c["file"], "chunk files", count)
    for column, what in ((fqns, "chunk names"), (files, "chunk files")):
        if count and (column.min() < 0 or column.max() >= len(strings)):
            raise ValueError(f"{what}: index outside the table of {len(strings)}")
    ndims = _array(c["k"], "chunk ranks", count)
    if count and ndims.min() < 0:
        raise ValueError("chunk ranks: negative")
    total = int(ndims.sum())
    return ResultColumns(
        strings, fqns, files, ndims, _array(c["o"], "chunk offsets", total),
        _array(c["z"], "chunk sizes", total), _array(c["at"], "chunk offsets", count), nbytes,
        _array(c["crc"], "checksums", count), _array(c["rank"], "chunk ranks", count),
        _keyed_columns(doc["prints"], strings, "fingerprints"),
        _keyed_columns(doc["replicas"], strings, "replicas"))


def write_result_codec(cls: type) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """The columnar ``to_wire`` / ``from_wire`` of the save's write results
    (``cls`` is :class:`dcp.orchestration.save.WriteResult`: ``chunks`` of
    ``(fqn, ChunkMeta)``, ``fingerprints`` and ``replicas`` keyed by
    ``(fqn, offsets)``, ``json_values``, ``pickled``).  Fqns and file names
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

    def to_wire(result: Any) -> dict:
        doc = _result_doc(result)
        doc.update(json=result.json_values,
                   pickled={k: base64.b64encode(v).decode("ascii")
                            for k, v in result.pickled.items()})
        return doc

    def from_wire(doc: Any) -> Any:
        if type(doc) is not dict:
            raise ValueError("WriteResult: columns expected")
        strings = _strs(doc["s"], "WriteResult strings")
        columns = _result_columns(doc, strings)
        json_values, pickled = doc["json"], doc["pickled"]
        if (type(json_values) is not dict or type(pickled) is not dict
                or not set(map(type, json_values.values())) <= {str}
                or not set(map(type, pickled.values())) <= {str}):
            raise ValueError("WriteResult values: maps of strings expected")
        result = Decoded(chunks=None, fingerprints=None, replicas=None, json_values=json_values,
                         pickled={k: base64.b64decode(v, validate=True)
                                  for k, v in pickled.items()})
        result.columns = columns
        return result

    return to_wire, from_wire


for _cls in (ChunkMeta, TensorDecl, WriteItem):
    register(_cls)
register(SavePlan, _plan_to_wire, _plan_from_wire, columnar=True)


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


def _pack(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_pack(v) for v in value]
    if isinstance(value, tuple):
        return {"t": [_pack(v) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_pack(k), _pack(v)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode("ascii")}
    name = _ALIASES.get(type(value)) or type(value).__name__
    codec = _CODECS.get(name)
    if codec is None or not (codec[0] is type(value) or type(value) in _ALIASES):
        raise TypeError(f"cannot encode a {name} in an exchange payload")
    if codec[3]:
        return {"c": name, "j": codec[1](value)}
    return {"c": name, "f": _pack(codec[1](value))}


def encode(value: Any) -> bytes:
    """The envelope of ``value`` (plain values, lists, tuples, dicts, bytes
    and registered classes; ``TypeError`` for anything else)."""
    body = json.dumps(_pack(value), separators=(",", ":"), allow_nan=True).encode()
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


def _unpack(doc: Any) -> Any:
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [_unpack(v) for v in doc]
    tags = set(doc) if isinstance(doc, dict) else set()
    if tags == {"t"}:
        return tuple(_unpack(v) for v in doc["t"])
    if tags == {"d"}:
        return {_unpack(k): _unpack(v) for k, v in doc["d"]}
    if tags == {"b"}:
        return base64.b64decode(doc["b"], validate=True)
    if tags not in ({"c", "f"}, {"c", "j"}):
        raise ValueError(f"unexpected {type(doc).__name__} with keys {sorted(tags)}")
    codec = _CODECS.get(doc["c"]) if isinstance(doc["c"], str) else None
    if codec is None or codec[3] != ("j" in tags):
        raise ValueError(f"unknown class {doc['c']!r}")
    return codec[2](doc["j"]) if codec[3] else codec[2](_unpack(doc["f"]))


def body(data: bytes) -> bytes:
    """The JSON text inside the envelope ``data``; ``ValueError`` if it is
    not one of this version."""
    if len(data) < _ENVELOPE.size:
        raise ValueError(f"{len(data)} bytes: shorter than the envelope")
    magic, version, codec = _ENVELOPE.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("not a hyperdcp exchange payload (bad magic)")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}; this reader knows {FORMAT_VERSION}")
    rest = memoryview(data)[_ENVELOPE.size:]
    if codec == _PLAIN:
        return bytes(rest)
    if codec != _ZSTD:
        raise ValueError(f"unknown codec {codec}")
    size = zstandard.frame_content_size(rest)
    if size < 0 or size > MAX_PAYLOAD_BYTES:
        raise ValueError(f"compressed body of unknown or excessive size ({size})")
    return zstandard.ZstdDecompressor().decompress(rest, max_output_size=size)


def decode(data: bytes, where: str) -> Any:
    """The value :func:`encode` turned into ``data``.

    Raises :class:`CheckpointError` naming ``where`` (the exchange file) for
    anything that is not such an encoding.
    """
    try:
        return _unpack(json.loads(body(data)))
    except (CheckpointError, ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError,
            RecursionError, zstandard.ZstdError) as e:
        raise CheckpointError(f"{where}: malformed exchange payload ({e})") from None
