"""A non-executable encoding of coordination payloads (JSON with type tags).

The file-flag protocol (:mod:`dcp.coordination.file_flag`) stores local plans,
global plans, write results, the committed metadata and failures in exchange
files on the checkpoint's storage.  They are never pickles: decoding one can
build only plain values and instances of the classes registered here, so a
crafted exchange file yields a :class:`~dcp.errors.CheckpointError`, never
code execution.

Encoding: ``None``, booleans, integers, floats and strings as themselves;
lists as JSON arrays; every other value as a tagged object —
``{"t": [...]}`` a tuple, ``{"d": [[key, value], ...]}`` a dict (any
hashable keys), ``{"b": "<base64>"}`` bytes, ``{"c": name, "f": ...}`` an
instance of a registered class (a dataclass's fields; the metadata in its
own JSON format, validated by :func:`dcp.core.metadata.decode`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from dcp.core.metadata import ChunkMeta, Metadata
from dcp.core.metadata import decode as decode_metadata
from dcp.core.metadata import encode as encode_metadata
from dcp.core.planner import SavePlan, TensorDecl, WriteItem
from dcp.errors import CheckpointError

_CODECS: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any], Any]]] = {}


def register(cls: type, to_wire: Callable[[Any], Any] | None = None,
             from_wire: Callable[[Any], Any] | None = None) -> None:
    """Allow instances of ``cls`` in payloads, by class name.  A dataclass
    travels field by field by default; other classes give ``to_wire``
    (instance -> encodable value) and ``from_wire`` (its inverse, which must
    validate its input and raise ``ValueError`` or a ``CheckpointError``)."""
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
    _CODECS[cls.__name__] = (cls, to_wire, from_wire)


for _cls in (ChunkMeta, SavePlan, TensorDecl, WriteItem):
    register(_cls)


def _metadata_from_wire(data: Any) -> Metadata:
    if not isinstance(data, bytes):
        raise ValueError(f"metadata must be bytes, got {type(data).__name__}")
    return decode_metadata(data, "exchange payload")


register(Metadata, encode_metadata, _metadata_from_wire)


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
    name = type(value).__name__
    codec = _CODECS.get(name)
    if codec is None or codec[0] is not type(value):
        raise TypeError(f"cannot encode a {name} in an exchange payload")
    return {"c": name, "f": _pack(codec[1](value))}


def encode(value: Any) -> bytes:
    """UTF-8 JSON of ``value`` (plain values, lists, tuples, dicts, bytes and
    registered classes; ``TypeError`` for anything else)."""
    return json.dumps(_pack(value), separators=(",", ":"), allow_nan=True).encode()


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
    if tags != {"c", "f"}:
        raise ValueError(f"unexpected {type(doc).__name__} with keys {sorted(tags)}")
    codec = _CODECS.get(doc["c"]) if isinstance(doc["c"], str) else None
    if codec is None:
        raise ValueError(f"unknown class {doc['c']!r}")
    return codec[2](_unpack(doc["f"]))


def decode(data: bytes, where: str) -> Any:
    """The value :func:`encode` turned into ``data``.

    Raises :class:`CheckpointError` naming ``where`` (the exchange file) for
    anything that is not such an encoding.
    """
    try:
        return _unpack(json.loads(data))
    except (CheckpointError, ValueError, TypeError, KeyError, UnicodeDecodeError,
            RecursionError) as e:
        raise CheckpointError(f"{where}: malformed exchange payload ({e})") from None
