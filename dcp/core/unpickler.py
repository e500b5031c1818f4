"""The restricted unpickler: every pickle read from a checkpoint goes through it.

A pickle is a program: its ``GLOBAL``/``STACK_GLOBAL``/``INST`` opcodes
import any name and ``REDUCE``/``NEWOBJ``/``OBJ`` call it, so ``pickle.loads``
of a crafted value runs ``os.system``.  Here, as in torch's ``weights_only``
loader (``torch/_weights_only_unpickler.py``), a name resolves only through
an allow-list, and the opcodes that run code are held to it:

* a global resolves only if :func:`allowed_globals` lists it; any other
  raises :class:`~dcp.errors.CheckpointError` naming it, before anything
  is called;
* ``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX`` and ``OBJ`` call only a global the
  pickle resolved, never another value (a call's result, a container);
* ``BUILD``, ``APPEND(S)``, ``SETITEM(S)`` and ``ADDITEMS`` never touch a
  resolved global (setting a function's ``__defaults__`` or a class's
  attributes would change them for the whole process); on instances
  ``BUILD`` runs their class's ``__setstate__`` — for numpy only with a
  state numpy itself writes (anything else could crash it);
* persistent ids are refused unless the caller reads them;
* a ``BYTEARRAY8`` is read before its bytes are allocated (the stdlib
  allocates the length it declares).

The allow-list (:func:`allowed_globals`): ``builtins`` containers and
scalars (``list``, ``dict``, ``set``, ``frozenset``, ``tuple``, ``int``,
``float``, ``complex``, ``str``, ``bool``, ``slice``; ``bytes`` and
``bytearray`` of bytes only), ``collections`` (``OrderedDict``, ``Counter``,
``deque``, ``defaultdict``), ``datetime`` (``date``, ``time``, ``datetime``,
``timedelta``, ``timezone``), ``decimal.Decimal``, ``fractions.Fraction``,
numpy arrays, scalars and dtypes (not of dtype ``object``, nor structured),
and the torch values of :func:`dcp.core.tensors.pickle_globals` (tensors,
parameters, dtypes, ``torch.Size``, ``torch.device``).  ``range`` is left
out: ``set(range(10**12))`` would fill memory.  A caller extends it the way
torch's ``weights_only`` loader is extended, explicitly, with
``torch.serialization.add_safe_globals([cls, ...])`` (or the
``torch.serialization.safe_globals`` context): those names are added, never
in place of the ones above.

Built on the stdlib's pure-Python unpickler (``pickle._Unpickler``), whose
opcodes can be overridden one by one (the C one's cannot).
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import struct
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Mapping
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from fractions import Fraction
from typing import Any, ClassVar, cast

import numpy as np

from dcp.core import tensors
from dcp.errors import CheckpointError, CorruptCheckpointError

#: Most dimensions of a numpy array rebuilt here (numpy's own limit).
_MAX_NDIM = 64


def _bytes(data: bytes = b"") -> bytes:
    if not isinstance(data, (bytes, bytearray)):  # bytes(10**12) would allocate it
        raise TypeError(f"bytes of a {type(data).__name__}")
    return bytes(data)


def _bytearray(data: bytes = b"") -> bytearray:
    return bytearray(_bytes(data))


class _NdarrayMark:
    """Stands for ``numpy.ndarray`` in a pickle: :func:`_np_empty` takes it,
    nothing can call it (``ndarray((10**12,))`` would allocate)."""


_NDARRAY = _NdarrayMark()


def _np_dtype(spec: str, align: bool = False, copy: bool = True) -> np.dtype:
    """``numpy.dtype`` as a pickle calls it: a new dtype (never numpy's
    shared one, which a ``BUILD`` would then change), no structured,
    sub-array or object dtype."""
    if not isinstance(spec, str):
        raise TypeError(f"numpy dtype from a {type(spec).__name__}")
    dtype = np.dtype(spec, align=bool(align), copy=True)
    if dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        raise ValueError(f"numpy dtype {spec!r} is structured or holds objects")
    return dtype


def _plain(dtype: Any) -> np.dtype:
    if not isinstance(dtype, np.dtype) or dtype.hasobject or dtype.fields is not None:
        raise ValueError(f"not a plain numpy dtype: {dtype!r:.80}")
    return dtype


def _shape(shape: Any) -> tuple[int, ...]:
    if not (isinstance(shape, tuple) and len(shape) <= _MAX_NDIM
            and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"not an array shape: {shape!r:.80}")
    return shape


def _np_empty(mark: Any, shape: Any, dtype: Any) -> np.ndarray:
    """``numpy.core.multiarray._reconstruct``: the empty array numpy's
    pickle starts from (its ``BUILD`` then gives shape and bytes)."""
    if mark is not _NDARRAY:
        raise TypeError(f"an array of {mark!r:.80}")
    return np.empty(0, dtype=np.uint8)


def _np_frombuffer(buf: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    """``numpy.core.numeric._frombuffer`` (protocol 5 pickles of arrays)."""
    dtype, shape = _plain(dtype), _shape(shape)
    if not isinstance(buf, (bytes, bytearray)) or len(buf) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"array data of {type(buf).__name__} for {dtype}{list(shape)}")
    if order not in ("C", "F"):
        raise ValueError(f"array order {order!r:.20}")
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order="F" if order == "F" else "C")


#: numpy's ``scalar()``, whatever module holds it
_np_scalar_of = cast(Callable[..., Any], np.float32(0).__reduce__()[0])


def _np_scalar(dtype: Any, data: Any) -> Any:
    """``numpy.core.multiarray.scalar``: a scalar from its bytes (without
    them numpy would allocate ``dtype.itemsize`` zeros)."""
    if not isinstance(data, bytes) or len(data) != _plain(dtype).itemsize:
        raise ValueError(f"scalar data of {type(data).__name__} for {dtype!r:.40}")
    return _np_scalar_of(dtype, data)


def _array_state_ok(state: Any) -> bool:
    """An array's ``BUILD`` state as numpy writes it: ``(1, shape, dtype,
    is_fortran, bytes)`` with the bytes of that shape (numpy's own
    ``__setstate__`` trusts a crafted one: an object array of 10**9 items
    from an empty list crashes it)."""
    try:
        version, shape, dtype, fortran, raw = state
        _plain(dtype)
        _shape(shape)
    except (TypeError, ValueError):
        return False
    return (version == 1 and type(fortran) is bool and isinstance(raw, (bytes, bytearray))
            and len(raw) == math.prod(shape) * dtype.itemsize)


def _dtype_state_ok(dtype: np.dtype, state: Any) -> bool:
    """A dtype's ``BUILD`` state as numpy writes it for this dtype: only the
    byte order may differ (and a datetime's unit); its flags, item size and
    alignment, which numpy's ``__setstate__`` takes as given, are the
    dtype's own."""
    own = dtype.__reduce__()[2]
    if not (isinstance(state, tuple) and len(state) == len(own) and state[0] == own[0]
            and state[1] in ("<", ">", "|", "=") and state[2:8] == own[2:8]):
        return False
    if len(own) == 8:
        return True
    unit = state[8]  # datetimes: (metadata, (unit, num, den, events)), numpy checks the unit
    return (dtype.kind in "Mm" and isinstance(unit, tuple) and len(unit) == 2
            and isinstance(unit[0], dict) and not unit[0] and isinstance(unit[1], tuple)
            and len(unit[1]) == 4 and isinstance(unit[1][0], bytes)
            and all(type(v) is int for v in unit[1][1:]))


@functools.cache
def _defaults() -> dict[str, Any]:
    out: dict[str, Any] = {f"builtins.{t.__name__}": t for t in (
        list, dict, set, frozenset, tuple, int, float, complex, str, bool, slice)}
    out.update({"builtins.bytes": _bytes, "builtins.bytearray": _bytearray})
    out.update({f"collections.{t.__name__}": t for t in (OrderedDict, Counter, deque, defaultdict)})
    out.update({f"datetime.{t.__name__}": t for t in (date, time, datetime, timedelta, timezone)})
    out.update({"decimal.Decimal": Decimal, "fractions.Fraction": Fraction,
                "numpy.ndarray": _NDARRAY, "numpy.dtype": _np_dtype})
    for core in ("numpy.core", "numpy._core"):  # numpy 1 and 2 write either
        out.update({f"{core}.multiarray._reconstruct": _np_empty,
                    f"{core}.multiarray.scalar": _np_scalar,
                    f"{core}.numeric._frombuffer": _np_frombuffer})
    return out


def allowed_globals() -> dict[str, Any]:
    """``"module.name"`` -> the object a pickle gets for it: the defaults
    of this module and of :func:`dcp.core.tensors.pickle_globals`, and the
    names added with ``torch.serialization.add_safe_globals`` (which never
    replace a default)."""
    torch_defaults, added = tensors.pickle_globals()
    return {**added, **_defaults(), **torch_defaults}


class RestrictedUnpickler(pickle._Unpickler):
    """Reads a pickle, resolving globals only through ``allowed`` (name ->
    object) and calling only those (see the module's rules).  ``where``
    names the pickle in errors; ``persistent_load``, if given, reads
    persistent ids (else they are refused)."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # the stdlib unpickler's, undeclared in its stubs
    metastack: list[list[Any]]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]

    def __init__(self, file, allowed: Mapping[str, Any], where: str,
                 persistent_load: Callable[[Any], Any] | None = None) -> None:
        super().__init__(file)
        self.allowed, self.where = allowed, where
        self.resolved: dict[int, str] = {}  # id of each global handed out -> its name
        self.read_persistent = persistent_load

    def persistent_load(self, pid: Any) -> Any:
        if self.read_persistent is None:
            raise pickle.UnpicklingError(f"persistent id {pid!r:.40}, which no reader here takes")
        return self.read_persistent(pid)

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise CheckpointError(
                f"{self.where}: its pickle names the global {full!r}, which the restricted "
                f"unpickler does not allow (nothing was run); if you trust the checkpoint, add "
                f"it with torch.serialization.add_safe_globals (see dcp.core.unpickler)")
        obj = self.allowed[full]
        self.resolved[id(obj)] = full
        return obj

    def _check_call(self, func: Any, opcode: str) -> None:
        if id(func) not in self.resolved:
            raise CheckpointError(
                f"{self.where}: its pickle's {opcode} calls a {type(func).__name__} value, "
                f"not an allowed global (nothing was run)")

    def load_reduce(self) -> None:
        self._check_call(self.stack[-2], "REDUCE")
        pickle._Unpickler.load_reduce(self)  # type: ignore[attr-defined]

    def load_newobj(self) -> None:
        self._check_call(self.stack[-2], "NEWOBJ")
        pickle._Unpickler.load_newobj(self)  # type: ignore[attr-defined]

    def load_newobj_ex(self) -> None:
        self._check_call(self.stack[-3], "NEWOBJ_EX")
        pickle._Unpickler.load_newobj_ex(self)  # type: ignore[attr-defined]

    def _instantiate(self, klass: Any, args: list) -> None:  # INST and OBJ
        self._check_call(klass, "INST/OBJ")
        pickle._Unpickler._instantiate(self, klass, args)  # type: ignore[attr-defined]

    def _untouched(self, target: Any, opcode: str) -> None:
        if id(target) in self.resolved:
            raise CheckpointError(
                f"{self.where}: its pickle's {opcode} changes the global "
                f"{self.resolved[id(target)]!r} (nothing was run)")

    def _container(self, opcode: str, mark: bool) -> None:
        """The container an APPEND(S), SETITEM(S) or ADDITEMS fills (they
        call its ``append``, ``extend``, ``add``, ``__setitem__``) is no
        resolved global."""
        target = self.metastack[-1][-1] if mark else self.stack[-2 if opcode == "APPEND" else -3]
        self._untouched(target, opcode)

    def load_append(self) -> None:
        self._container("APPEND", False)
        pickle._Unpickler.load_append(self)  # type: ignore[attr-defined]

    def load_appends(self) -> None:
        self._container("APPENDS", True)
        pickle._Unpickler.load_appends(self)  # type: ignore[attr-defined]

    def load_setitem(self) -> None:
        self._container("SETITEM", False)
        pickle._Unpickler.load_setitem(self)  # type: ignore[attr-defined]

    def load_setitems(self) -> None:
        self._container("SETITEMS", True)
        pickle._Unpickler.load_setitems(self)  # type: ignore[attr-defined]

    def load_additems(self) -> None:
        self._container("ADDITEMS", True)
        pickle._Unpickler.load_additems(self)  # type: ignore[attr-defined]

    def load_bytearray8(self) -> None:
        """The stdlib's allocates the declared length before reading."""
        (n,) = struct.unpack("<Q", self.read(8))
        data = self.read(n)
        if len(data) != n:
            raise pickle.UnpicklingError(f"BYTEARRAY8 of {n} bytes, {len(data)} left")
        self.append(bytearray(data))

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        self._untouched(inst, "BUILD")
        if isinstance(inst, np.ndarray | np.dtype) and not (
                _array_state_ok(state) if isinstance(inst, np.ndarray)
                else _dtype_state_ok(inst, state)):
            raise CorruptCheckpointError(
                f"{self.where}: its pickle's BUILD gives a numpy {type(inst).__name__} a state "
                f"numpy does not write ({state!r:.80})")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems


def loads(data: bytes | bytearray, where: str, allowed: Mapping[str, Any] | None = None,
          persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """The value pickled in ``data``, read by :class:`RestrictedUnpickler`
    over ``allowed`` (default: :func:`allowed_globals`).

    Raises:
        CheckpointError: the pickle names a global not allowed, or calls or
            builds what the rules refuse, naming ``where`` and the global;
            nothing it names has run.
        CorruptCheckpointError: ``data`` is no pickle, or an allowed
            constructor refused its arguments, naming ``where``.
    """
    try:
        return RestrictedUnpickler(io.BytesIO(data), allowed_globals() if allowed is None
                                   else allowed, where, persistent_load).load()
    except CheckpointError:
        raise
    except Exception as e:  # malformed: any error of the opcodes or of an allowed constructor
        raise CorruptCheckpointError(f"{where}: its pickle does not load ({type(e).__name__}: "
                                     f"{e})") from None
