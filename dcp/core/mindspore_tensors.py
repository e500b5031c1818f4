"""The MindSpore adapter: MindSpore tensors saved and loaded as torch tensors.

MindSpore ``Tensor`` and ``Parameter`` leaves of a state dict, and
:class:`~dcp.core.tensors.TensorShard` values whose ``data`` is one, are
resolved at the API's edge, before any planning, as Stateful values are
(:mod:`dcp.core.stateful`, whose walk substitutes them): the planners, the
metadata and the storage plugins only ever see torch tensors, described by
the torch adapter (:mod:`dcp.core.tensors`).

* Save (:func:`for_save`): each MindSpore leaf becomes a torch CPU tensor
  over its host bytes, ``asnumpy()`` viewed as ``uint8`` and then as the
  torch dtype (``torch.from_numpy``, no copy on CPU, where ``asnumpy()``
  shares the tensor's memory; a device tensor's ``asnumpy()`` is its host
  copy).  bfloat16 and float8 cross as bytes, so every dtype of
  :data:`_PAIRS` is saved bit-exact.
* Load (:class:`LoadTargets`): each MindSpore target becomes a torch host
  tensor of its shape and dtype; once every read has finished, the loaded
  bytes are written into the caller's object in place with ``Tensor.copy_``
  (a ``Parameter`` keeps its identity and name; on a device the copy is the
  host-to-device transfer).  A dtype mismatch obeys ``allow_dtype_cast``
  as for torch targets: the torch target has the MindSpore target's dtype.
  A target the load does not find (``strict=False``), or a load that fails,
  leaves the MindSpore object as it was.
* Optimizers (``mindspore.nn.Optimizer``): saved and loaded as their own
  state, :func:`optimizer_state` (moments, step, learning rate), not as
  Statefuls: MindSpore's ``load_state_dict`` refuses its own ``state_dict()``.

MindSpore is never imported here: a value is MindSpore's when
``sys.modules`` already holds ``mindspore`` and the value is an instance of
its ``Tensor``; before MindSpore is imported the API's edge skips the
adapter (:func:`imported`), so a torch-only job pays nothing.

Dtypes: those of :data:`_PAIRS`, which both sides have.  A MindSpore dtype
the checkpoint format lacks (``hifloat8``, ``int4``/``qint4x2``,
``complex128``) raises :class:`~dcp.errors.UnsupportedDtypeError` naming the
fqn and the dtype before anything is written or read; so does a float8
load target, which MindSpore 2.10 cannot fill (NumPy has no float8 type to
build a tensor from bytes, and its CPU ``InplaceCopy`` kernel has no float8).

Sharded parameters: :func:`dcp.core.mindspore_layout.mindspore_shard` gives
the :class:`~dcp.core.tensors.TensorShard` of one rank's slice from
MindSpore's layout.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dcp.core.tensors import TensorShard, torch_dtype
from dcp.errors import CheckpointError, UnsupportedDtypeError

#: ``(MindSpore dtype attribute, checkpoint dtype name)`` for every dtype
#: both sides have (``mindspore.bool_`` is ``mindspore.bool``).
_PAIRS = (
    ("bool_", "bool"), ("int8", "int8"), ("int16", "int16"), ("int32", "int32"),
    ("int64", "int64"), ("uint8", "uint8"), ("uint16", "uint16"), ("uint32", "uint32"),
    ("uint64", "uint64"), ("float16", "float16"), ("float32", "float32"),
    ("float64", "float64"), ("bfloat16", "bfloat16"), ("complex64", "complex64"),
    ("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"),
)
#: Dtypes MindSpore saves but cannot load into (see the module doc).
_SAVE_ONLY = ("float8_e4m3fn", "float8_e5m2")


def _mindspore() -> Any | None:
    """The ``mindspore`` module if this process has imported it, else ``None``
    (never imports it)."""
    return sys.modules.get("mindspore")


@functools.cache
def _names(ms: Any) -> dict[Any, str]:
    """MindSpore dtype -> checkpoint dtype name, for the module ``ms``."""
    return {getattr(ms, attr): name for attr, name in _PAIRS if hasattr(ms, attr)}


def imported() -> bool:
    """Whether this process has imported MindSpore (without importing it):
    before that no value can be MindSpore's, and the API's edge skips the
    adapter."""
    return _mindspore() is not None


def is_mindspore(value: Any) -> bool:
    """Whether ``value`` is a MindSpore ``Tensor``/``Parameter``, or a
    :class:`TensorShard` holding one."""
    ms = _mindspore()
    tensor_type = getattr(ms, "Tensor", None)
    if tensor_type is None:
        return False
    if isinstance(value, TensorShard):
        value = value.data
    return isinstance(value, tensor_type)


def dtype_of(fqn: str, tensor: Any) -> str:
    """The checkpoint's dtype name of a MindSpore tensor.

    Raises :class:`UnsupportedDtypeError` naming ``fqn`` and the dtype if
    the checkpoint format has no counterpart for it.
    """
    try:
        return _names(_mindspore())[tensor.dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"{fqn!r}: MindSpore dtype {tensor.dtype} has no checkpoint counterpart "
            f"(supported: {', '.join(name for _, name in _PAIRS)})") from None


def host_tensor(fqn: str, tensor: Any) -> torch.Tensor:
    """A torch CPU tensor of a MindSpore tensor's shape, dtype and values,
    over the memory of its ``asnumpy()`` (the tensor's own on CPU)."""
    dtype = torch_dtype(dtype_of(fqn, tensor))
    array = tensor.asnumpy()
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    # reshape(-1) first: a 0-d array has no view of another item size
    flat = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return flat.view(dtype).reshape(tuple(tensor.shape))


def optimizer_state(value: Any) -> dict[str, Any] | None:
    """A MindSpore optimizer's own state, or ``None`` if ``value`` is no
    ``mindspore.nn.Optimizer``: its ``parameters_dict()`` (step, learning
    rate, moments: ``moments.<name>``, ``moment1.<name>``, ...) less the
    parameters it updates, which belong to the model's state.  An
    optimizer is saved and loaded as this dict of Parameters (loaded in
    place), not as a Stateful: MindSpore 2.10's ``Optimizer.load_state_dict``
    refuses its own ``state_dict()``, which also repeats the model's
    parameters."""
    optimizer = getattr(getattr(_mindspore(), "nn", None), "Optimizer", None)
    if optimizer is None or not isinstance(value, optimizer):
        return None
    updated = {id(p) for p in value.parameters}
    return {k: p for k, p in value.parameters_dict().items() if id(p) not in updated}


def for_save(fqn: str, value: Any) -> Any:
    """What a save plans with in place of ``value``: a MindSpore tensor's
    :func:`host_tensor`, a :class:`TensorShard` of one with its data so
    replaced, an optimizer's :func:`optimizer_state` so replaced, anything
    else as it is.  The substitute of :func:`dcp.core.stateful.resolve` for
    :func:`dcp.save` and :func:`dcp.async_save`.

    Raises :class:`UnsupportedDtypeError` naming ``fqn`` (:func:`dtype_of`).
    """
    state = optimizer_state(value)
    if state is not None:
        return {k: for_save(f"{fqn}.{k}", p) for k, p in state.items()}
    if not is_mindspore(value):
        return value
    if isinstance(value, TensorShard):
        return TensorShard(host_tensor(fqn, value.data), value.global_shape,
                           value.global_offsets)
    return host_tensor(fqn, value)


@dataclass
class LoadTargets:
    """The MindSpore targets of one load: :meth:`substitute` replaces each by
    a torch host tensor to read into, :meth:`write_back` copies the loaded
    values into the MindSpore objects afterwards.

    ``pending``: ``(fqn, MindSpore tensor, torch host tensor)`` per target.
    """

    pending: list[tuple[str, Any, torch.Tensor]] = field(default_factory=list)

    def substitute(self, fqn: str, value: Any) -> Any:
        """The target a load reads into in place of ``value`` (see
        :func:`for_save`; the torch tensor's values are uninitialized).

        Raises :class:`UnsupportedDtypeError` naming ``fqn`` and the dtype
        for a dtype the checkpoint lacks or MindSpore cannot be loaded into.
        """
        state = optimizer_state(value)
        if state is not None:
            return {k: self.substitute(f"{fqn}.{k}", p) for k, p in state.items()}
        if not is_mindspore(value):
            return value
        tensor = value.data if isinstance(value, TensorShard) else value
        name = dtype_of(fqn, tensor)
        if name in _SAVE_ONLY:
            raise UnsupportedDtypeError(
                f"{fqn!r}: MindSpore {tensor.dtype} tensors can be saved but not loaded into "
                f"(MindSpore builds no {name} tensor from bytes); load into a float16, "
                f"bfloat16 or float32 target with allow_dtype_cast=True")
        host = torch.empty(tuple(tensor.shape), dtype=torch_dtype(name))
        self.pending.append((fqn, tensor, host))
        if isinstance(value, TensorShard):
            return TensorShard(host, value.global_shape, value.global_offsets)
        return host

    def write_back(self, skip: Sequence[str] = ()) -> None:
        """Copy each loaded host tensor into its MindSpore target in place
        (``Tensor.copy_``; ``target[:] = ...`` for a non-contiguous view,
        into which MindSpore 2.10's ``copy_`` and ``target[...] = ...``
        silently write nothing),
        except the fqns of ``skip`` (the load's missing keys: nothing was
        read for them).  The bytes cross as ``uint8`` viewed as the target's
        dtype, so bfloat16 needs no NumPy type.

        Raises :class:`CheckpointError` naming the fqn if MindSpore's copy
        fails.
        """
        ms = _mindspore()
        if not self.pending or ms is None:
            return
        left_out = set(skip)
        for fqn, target, host in self.pending:
            if fqn in left_out:
                continue
            flat = ms.Tensor.from_numpy(host.reshape(-1).view(torch.uint8).numpy())
            try:
                source = flat.view(target.dtype).reshape(tuple(target.shape))
                if target.is_contiguous() or not target.ndim:
                    target.copy_(source)
                else:
                    target[:] = source
            except Exception as e:
                raise CheckpointError(
                    f"{fqn!r}: writing the loaded values into the MindSpore "
                    f"{type(target).__name__} failed: {type(e).__name__}: {e}") from e
