"""The torch adapter: the module of the core that describes torch tensors.

(The MindSpore adapter, :mod:`dcp.core.mindspore_tensors`, knows torch too:
it hands MindSpore tensors to this one as torch tensors, before planning.)
It turns each tensor-like leaf of a state dict into the framework-agnostic
description the planners and the metadata work with — global shape, dtype
name, and the box ``(offsets, sizes)`` this rank holds — and moves bytes
between tensors and host buffers.

Three kinds of leaves are understood:

* ``torch.Tensor``: the whole tensor, held by every rank (replicated).
* ``DTensor`` with ``Shard``, ``Replicate`` and strided-shard placements on any
  device mesh: the local shard's box comes from torch's own placement
  arithmetic (``compute_local_shape_and_global_offset``), uneven and empty
  shards included.  A DTensor built with ``DTensor.from_local(..., shape=,
  stride=)`` over local shards the placements do not give (7 rows as 5 and
  2) has its real local shape, at offsets only the other ranks' local
  shapes tell (:func:`placed_box`, :func:`uneven_offsets`; agreed
  by :mod:`dcp.coordination.dtensor_offsets`).
* :class:`TensorShard`: a Megatron-style description (local tensor + global
  shape + global offsets) for frameworks without DTensor.
* ``ShardedTensor`` (FSDP1's ``SHARDED_STATE_DICT``, torchrec): each local
  shard is a chunk at its ``shard_offsets``, uneven and empty shards
  included; a rank may hold several (:func:`describe_chunks`), or one at
  most to be loaded into (:func:`describe`).

A DTensor on a mesh that does not contain the calling rank is skipped on
that rank, as PyTorch DCP does: it offers nothing to save, and its load
target is an empty box.  A tensor on the ``meta`` device holds no values:
it is refused on save, and on load it is replaced by a real tensor of the
saved dtype (:func:`materialize`), on the device the load names (by default
the current accelerator, else the host).

Accelerator tensors (CUDA, Ascend NPU through ``torch_npu``, ...) move
through generic torch calls (``Tensor.to``, ``Tensor.copy_``), so no device
type is hard-coded; where the copies run and into which host memory is
:mod:`dcp.core.devices`'.
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from dcp.core import devices
from dcp.core.metadata import DTYPE_ITEMSIZE
from dcp.errors import CheckpointError, UnsupportedDtypeError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor, without importing DTensor's package
    (about 600 modules, 0.6 s): before ``torch.distributed.tensor`` is
    imported no DTensor can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(value, cls)

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


@dataclass
class TensorShard:
    """One rank's piece of a global tensor, described without DTensor.

    ``data`` holds the box starting at ``global_offsets`` (elements, one per
    dimension) of a tensor of ``global_shape``; its own shape gives the box's
    sizes.  Ranks holding the same ``(fqn, global_offsets)`` hold replicas of
    one chunk; save writes it once.  This is the shape of Megatron-LM's
    ``ShardedTensor`` (key, data, global shape, global offset).
    """

    data: torch.Tensor
    global_shape: Sequence[int]
    global_offsets: Sequence[int]


@dataclass
class LocalChunk:
    """What this rank holds of one tensor: a box and the tensor holding it."""

    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor


def is_tensor(value: Any) -> bool:
    """True for leaves this adapter describes (tensors, DTensors, shards)."""
    return isinstance(value, (torch.Tensor, TensorShard))


def init_optimizer_state(value: Any) -> None:
    """Give a ``torch.optim.Optimizer`` whose ``state`` is empty (a fresh
    one, about to be loaded into) its state tensors, so that its
    ``state_dict()`` holds shaped targets (DTensors under FSDP2): PyTorch
    DCP's own initialisation (``get_optimizer_state_dict``), a step on zero
    gradients at learning rate 0 that leaves the parameters as they are.
    Anything else, and an optimizer with state or gradients, is left as it is."""
    if isinstance(value, torch.optim.Optimizer) and not value.state:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(value)


def dtype_name(dtype: torch.dtype, fqn: str) -> str:
    """The checkpoint's name for a torch dtype (``torch.float32`` -> ``"float32"``);
    raises :class:`UnsupportedDtypeError` naming ``fqn`` for a dtype it lacks."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"{fqn!r}: dtype {dtype} is not supported (supported: {', '.join(_DTYPES)})") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a checkpoint dtype name."""
    return _DTYPES[name]


def _storage_from_bytes(data: bytes) -> torch.storage.TypedStorage:
    """``torch.storage._load_from_bytes``, which ``pickle.dumps`` of a tensor
    names for its storage: the ``torch.save`` bytes read by torch's
    ``weights_only`` loader (torch's runs its full unpickler)."""
    if not isinstance(data, bytes):
        raise TypeError(f"a storage from a {type(data).__name__}")
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage):
        raise TypeError(f"a storage pickle holding a {type(storage).__name__}")
    return storage


def _tensor_from_storage(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                         hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` with its view checked to lie
    inside the storage (torch's ``set_`` grows the storage to fit any view:
    memory without bound), non-negative strides, and no backward hooks."""
    if not (isinstance(storage, torch.storage.TypedStorage) and type(offset) is int
            and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) <= 64
            and all(type(v) is int and v >= 0 for v in (offset, *size, *stride))
            and type(requires_grad) is bool and not hooks
            and (metadata is None or isinstance(metadata, dict))):
        raise TypeError(f"a tensor rebuilt from ({type(storage).__name__}, {offset!r:.20}, "
                        f"{size!r:.40}, {stride!r:.40}, ...)")
    end = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1 \
        if all(size) else offset
    elements = storage._untyped_storage.nbytes() // storage.dtype.itemsize  # no deprecation warning
    if end > elements:
        raise ValueError(f"a view {list(size)}, strides {list(stride)}, offset {offset} of a "
                         f"storage of {elements} elements")
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
                                           OrderedDict(), metadata)


def _parameter(data: Any, requires_grad: Any, hooks: Any) -> torch.nn.Parameter:
    """``torch._utils._rebuild_parameter``, without backward hooks."""
    if not isinstance(data, torch.Tensor) or type(requires_grad) is not bool or hooks:
        raise TypeError(f"a parameter of a {type(data).__name__}")
    return torch.nn.Parameter(data, requires_grad)


@functools.cache
def _pickle_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {f"torch.{name}": v for name, v in vars(torch).items()
                           if isinstance(v, torch.dtype)}
    out.update({"torch.Size": torch.Size, "torch.device": torch.device,
                "torch.storage._load_from_bytes": _storage_from_bytes,
                "torch._utils._rebuild_tensor_v2": _tensor_from_storage,
                "torch._utils._rebuild_parameter": _parameter})
    return out


def pickle_globals() -> tuple[dict[str, Any], dict[str, Any]]:
    """The torch part of :func:`dcp.core.unpickler.allowed_globals`, by the
    names ``pickle.dumps`` writes, and the names a user added to torch's
    own ``weights_only`` allow-list (``torch.serialization.add_safe_globals``).

    Ours: every ``torch.<dtype>``, ``torch.Size``, ``torch.device``, and a
    tensor or parameter as ``pickle.dumps`` writes it (torch's rebuild
    functions, checked: :func:`_tensor_from_storage`), its storage read by
    ``torch.load(weights_only=True)``.  Torch's ``weights_only`` loader
    allows the same and more (sparse, quantized, nested tensors, subclasses:
    add them if needed)."""
    added: dict[str, Any] = {}
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (
            entry, f"{entry.__module__}.{entry.__qualname__}")
        added[name] = obj
    return _pickle_defaults(), added


def describe(fqn: str, value: Any) -> LocalChunk:
    """Describe a tensor-like leaf held as one box on this rank.

    Raises :class:`CheckpointError` naming ``fqn`` for an unsupported dtype,
    a :class:`TensorShard` or DTensor whose box lies outside its global
    shape, or a leaf this rank holds several boxes of (a ``ShardedTensor``
    with several local shards, a checkpointable tensor: see
    :func:`load_chunks`).
    """
    chunks = load_chunks(fqn, value)
    if len(chunks) != 1:
        raise CheckpointError(f"{fqn!r}: this rank holds {len(chunks)} boxes of it, not one")
    return chunks[0]


def load_chunks(fqn: str, value: Any,
                offsets: tuple[int, ...] | None = None) -> list[LocalChunk]:
    """Every box this rank holds of a tensor-like leaf, as load targets
    filled in place: one for most leaves, one per local shard of a
    ``ShardedTensor`` or of a checkpointable tensor (:func:`_checkpointable`),
    an empty box for a DTensor whose mesh does not contain this rank (or a
    leaf with no local shard here).  ``offsets`` (elements, one per
    dimension) place a DTensor's local shard where its placements do not
    (:func:`uneven_offsets`); ``None``: where they do.

    Raises :class:`CheckpointError` naming ``fqn`` for an unsupported dtype
    or a box outside the global shape.
    """
    if isinstance(value, ShardedTensor):
        return _sharded_chunks(fqn, value)
    if is_dtensor(value) and not _on_mesh(value):
        return [_empty_chunk(fqn, value)]
    if _is_checkpointable(value):
        return _checkpointable(fqn, value, save=False) or [_empty_chunk(fqn, value)]
    return [_one_chunk(fqn, value, offsets)]


def _placement_box(value: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sizes, offsets)`` of this rank's shard as its placements give them
    (torch's own arithmetic)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements)
    return tuple(sizes), tuple(offsets)


def _one_chunk(fqn: str, value: Any, offsets: tuple[int, ...] | None = None) -> LocalChunk:
    """The one box of a tensor, DTensor or :class:`TensorShard`; a
    DTensor's local shard at ``offsets`` if given, else at its placements'."""
    if is_dtensor(value):
        local = value._local_tensor
        global_shape = tuple(value.shape)
        # the local tensor's real shape; the placements' offsets unless the
        # ranks agreed on others (uneven_offsets); the save's coverage check
        # refuses boxes that then do not tile the global shape
        sizes = tuple(local.shape)
        if offsets is None:
            offsets = _placement_box(value)[1]
        if 0 in sizes:  # an empty shard: its offsets may lie past the end
            offsets = (0,) * len(sizes)
        _check_box(fqn, "DTensor", sizes, offsets, global_shape)
        return LocalChunk(global_shape, dtype_name(local.dtype, fqn), offsets, sizes, local)
    if isinstance(value, TensorShard):
        data = value.data
        global_shape = tuple(int(d) for d in value.global_shape)
        offsets = tuple(int(o) for o in value.global_offsets)
        sizes = tuple(data.shape)
        _check_box(fqn, "TensorShard", sizes, offsets, global_shape)
        return LocalChunk(global_shape, dtype_name(data.dtype, fqn), offsets, sizes, data)
    shape = tuple(value.shape)
    return LocalChunk(shape, dtype_name(value.dtype, fqn), (0,) * len(shape), shape, value)


def _check_box(fqn: str, kind: str, sizes: tuple[int, ...], offsets: tuple[int, ...],
               global_shape: tuple[int, ...]) -> None:
    if not (len(global_shape) == len(offsets) == len(sizes)) or any(
            o < 0 or o + s > g for o, s, g in zip(offsets, sizes, global_shape, strict=True)):
        raise CheckpointError(
            f"{fqn!r}: {kind} of shape {sizes} at offsets {offsets} does not fit "
            f"global shape {global_shape}")


def _empty_chunk(fqn: str, value: Any) -> LocalChunk:
    """An empty box of a leaf's global shape (a scratch scalar for a 0-d
    one): what a rank holding none of it asks a load for."""
    shape = tuple(value.shape)
    sizes = (0, *shape[1:]) if shape else ()
    return LocalChunk(shape, dtype_name(value.dtype, fqn), (0,) * len(shape), sizes,
                      torch.empty(sizes, dtype=value.dtype))


def describe_chunks(fqn: str, value: Any,
                    offsets: tuple[int, ...] | None = None) -> list[LocalChunk]:
    """Every box this rank holds of a tensor-like leaf, to be saved: one for
    most leaves, one per local shard of a ``ShardedTensor`` or of a
    checkpointable tensor, none for a DTensor whose mesh does not contain
    this rank; ``offsets`` as :func:`load_chunks`'.

    Raises :class:`CheckpointError` naming ``fqn`` for a tensor on the meta
    device (it holds no values), besides :func:`load_chunks`' errors.
    """
    if is_meta(value):
        raise CheckpointError(f"{fqn!r} is on the meta device: it holds no values to save")
    if isinstance(value, ShardedTensor):
        return _sharded_chunks(fqn, value)
    if is_dtensor(value) and not _on_mesh(value):
        return []
    if _is_checkpointable(value):
        return _checkpointable(fqn, value, save=True)
    return [_one_chunk(fqn, value, offsets)]


def dtensors_possible() -> bool:
    """Whether a DTensor can exist in this process (``torch.distributed.tensor``
    is imported), without importing it."""
    return "torch.distributed.tensor" in sys.modules


def placed_box(value: Any) -> tuple[tuple[int, ...], tuple[int, ...], bool] | None:
    """For a DTensor that :func:`uneven_offsets` can place (on a mesh holding
    this rank, described by its placements, not a checkpointable one): its
    local shape, the offsets its placements give, and whether its local
    shard is not empty and of another shape than they give
    (``DTensor.from_local(..., shape=, stride=)`` over other sizes; an empty
    one needs no offsets).  ``None`` for any other leaf."""
    if not is_dtensor(value) or not _on_mesh(value) or _is_checkpointable(value):
        return None
    local = tuple(value._local_tensor.shape)
    sizes, offsets = _placement_box(value)
    return local, offsets, 0 not in local and local != sizes


def uneven_offsets(fqn: str, value: DTensor,
                   shape_of: Callable[[int], tuple[int, ...] | None]) -> tuple[int, ...]:
    """This rank's offsets (elements, one per dimension) in a DTensor
    whose ranks hold local shards of any sizes, from every mesh rank's local
    shape (``shape_of(global rank)``, ``None`` where it is unknown).

    Along a tensor dimension, the offset is the sum of the sizes of the
    shards before this rank's: those of the mesh ranks that share its
    coordinates on every mesh dimension not sharding that tensor dimension
    (``Replicate`` ones hold replicas) and come before it in the order of
    the sharding mesh dimensions (several shard one tensor dimension in
    placement order: the first splits it, the next each part, as torch's
    ``Shard`` does).  Unsharded dimensions start at 0.

    Raises :class:`CheckpointError` naming ``fqn`` for strided-shard
    placements (``_StridedShard``: their order is not the mesh's) and for a
    mesh rank whose shape is unknown.
    """
    mesh = value.device_mesh
    mine = tuple(mesh.get_coordinate() or ())
    ranks = mesh.mesh.tolist()
    placements = tuple(value.placements)
    if any(getattr(p, "split_factor", None) is not None for p in placements):
        raise CheckpointError(
            f"{fqn!r}: a DTensor with strided-shard placements {placements} whose local shards "
            f"are uneven in a way the placements do not give cannot be placed")
    ndim = len(value.shape)

    def rank_at(coordinate: tuple[int, ...]) -> int:
        at: Any = ranks
        for c in coordinate:
            at = at[c]
        return int(at)

    offsets = []
    for d in range(ndim):
        sharding = [m for m, p in enumerate(placements) if p.is_shard() and
                    getattr(p, "dim", 0) % ndim == d]
        total = 0
        for before in itertools.product(*(range(mesh.size(m)) for m in sharding)):
            if before >= tuple(mine[m] for m in sharding):
                break
            coordinate = list(mine)
            for m, c in zip(sharding, before, strict=True):
                coordinate[m] = c
            rank = rank_at(tuple(coordinate))
            shape = shape_of(rank)
            if shape is None or len(shape) != ndim:
                raise CheckpointError(
                    f"{fqn!r}: the local shape of this DTensor on rank {rank} of its mesh is "
                    f"unknown (that rank is not in the group saving or loading it)")
            total += shape[d]
        offsets.append(total)
    return tuple(offsets)


#: torch DCP's protocol of tensors that describe their own chunks
#: (``torch/distributed/checkpoint/planner_helpers.py``, ``utils.py``).
_PROTOCOL = ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")


def _is_checkpointable(value: Any) -> bool:
    """Whether a leaf describes its own chunks through torch's protocol: a
    tensor subclass implementing it (torch's test type
    ``CheckpointableDistTensor``), or a DTensor whose local tensor does
    (``LocalShardsWrapper``: TorchRec's sharded embedding tables, several
    shards on a rank).  A plain DTensor has the methods too, over its
    placements: it is described by them here instead."""
    holder = value._local_tensor if is_dtensor(value) else value
    return any(hasattr(holder, name) for name in _PROTOCOL) and not is_dtensor(holder)


def _checkpointable(fqn: str, value: Any, save: bool) -> list[LocalChunk]:
    """The boxes of a checkpointable leaf: on save those its
    ``__create_write_items__`` names, on load those its
    ``__create_chunk_list__`` names, each one's tensor from
    ``__get_tensor_shard__`` (filled in place on load).

    Raises :class:`CheckpointError` naming ``fqn`` and the protocol for a
    leaf that implements it in part, raises inside it, or returns boxes
    that are no tensor shards or do not fit (before any I/O).
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItemType

    holder: Any = value._local_tensor if is_dtensor(value) else value
    what = (f"{fqn!r}: {type(holder).__name__} implements torch DCP's checkpointable protocol "
            f"({', '.join(_PROTOCOL)})")
    absent = [name for name in _PROTOCOL if not hasattr(holder, name)]
    if absent:
        raise CheckpointError(f"{what} only in part: it lacks {', '.join(absent)}")
    global_shape = tuple(value.shape)
    chunks = []
    try:
        if save:
            boxes = []
            for item in holder.__create_write_items__(fqn, holder):
                if item.type not in (WriteItemType.SHARD, WriteItemType.TENSOR) or (
                        item.tensor_data is None):
                    raise CheckpointError(f"{what}, and gives a {item.type.name} write item: "
                                          f"only tensor shards are supported")
                boxes.append((item.tensor_data.chunk, item.index))
        else:
            boxes = [(c, MetadataIndex(fqn, c.offsets, i))
                     for i, c in enumerate(holder.__create_chunk_list__())]
        for chunk, index in boxes:
            data = holder.__get_tensor_shard__(index)
            offsets = tuple(int(o) for o in chunk.offsets)
            sizes = tuple(int(s) for s in chunk.sizes)
            if not isinstance(data, torch.Tensor) or tuple(data.shape) != sizes:
                raise CheckpointError(
                    f"{what}, and its shard at offsets {offsets} is a "
                    f"{type(data).__name__} of shape {tuple(getattr(data, 'shape', ()))}, "
                    f"not a tensor of its chunk's sizes {sizes}")
            if 0 in sizes:
                offsets = (0,) * len(sizes)
            _check_box(fqn, "a checkpointable shard", sizes, offsets, global_shape)
            chunks.append(LocalChunk(global_shape, dtype_name(data.dtype, fqn), offsets, sizes,
                                     data))
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{what}, which raised {type(e).__name__}: {e}") from e
    return chunks


def _on_mesh(value: DTensor) -> bool:
    return value.device_mesh.get_coordinate() is not None


def _sharded_chunks(fqn: str, value: ShardedTensor) -> list[LocalChunk]:
    """The local shards of a ShardedTensor as chunks (an empty box if it
    has none here); raises :class:`CheckpointError` naming ``fqn`` for a
    shard that does not fit the global shape or its own metadata."""
    global_shape = tuple(value.size())
    chunks = []
    for shard in value.local_shards():
        sizes = tuple(int(s) for s in shard.metadata.shard_sizes)
        offsets = tuple(int(o) for o in shard.metadata.shard_offsets)
        if tuple(shard.tensor.shape) != sizes or len(offsets) != len(global_shape) or any(
                o < 0 or o + s > g for o, s, g in zip(offsets, sizes, global_shape, strict=True)):
            raise CheckpointError(
                f"{fqn!r}: ShardedTensor shard of shape {tuple(shard.tensor.shape)} at offsets "
                f"{offsets} (sizes {sizes}) does not fit global shape {global_shape}")
        if 0 in sizes:
            offsets = (0,) * len(sizes)
        chunks.append(LocalChunk(global_shape, dtype_name(shard.tensor.dtype, fqn), offsets,
                                 sizes, shard.tensor))
    return chunks or [_empty_chunk(fqn, value)]


def is_meta(value: Any) -> bool:
    """Whether a tensor-like leaf's values live on the meta device (none)."""
    if isinstance(value, TensorShard):
        value = value.data
    if isinstance(value, ShardedTensor):
        return any(s.tensor.is_meta for s in value.local_shards())
    if is_dtensor(value):
        return value._local_tensor.is_meta
    return isinstance(value, torch.Tensor) and value.is_meta


def _materialize_device(value: Any, device: Any) -> torch.device:
    """``device`` if given, else the current accelerator with its index
    (:func:`dcp.core.devices.current_device`) — for a DTensor, if its mesh
    is on that accelerator's type — else the host."""
    if device is not None:
        return torch.device(device)
    current = devices.current_device()
    if current is None or (is_dtensor(value)
                           and value.device_mesh.device_type != current.type):
        return torch.device("cpu")
    return current


def materialize(value: Any, dtype: str, device: Any = None) -> Any:
    """A tensor-like leaf laid out like ``value`` (same kind, shape,
    placements) whose values are uninitialized, of checkpoint dtype
    ``dtype``: the target that replaces a meta-device one.  It lives on
    ``device`` (a ``torch.device`` or its name), by default on the current
    accelerator with its index, else on the host (as torch DCP puts it on
    its group's device; a DTensor of a host mesh stays on the host)."""
    dt = _DTYPES[dtype]
    device = _materialize_device(value, device)
    if isinstance(value, TensorShard):
        return TensorShard(torch.empty(tuple(value.data.shape), dtype=dt, device=device),
                           value.global_shape, value.global_offsets)
    if isinstance(value, ShardedTensor):
        from torch.distributed import _remote_device
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard

        def placed(m: ShardMetadata) -> ShardMetadata:
            rank = m.placement.rank() if m.placement is not None else None
            return ShardMetadata(m.shard_offsets, m.shard_sizes,
                                 _remote_device(f"rank:{rank}/{device}"))

        shards = [Shard(torch.empty(tuple(s.tensor.shape), dtype=dt, device=device),
                        placed(s.metadata)) for s in value.local_shards()]
        metadata = copy.deepcopy(value.metadata())
        metadata.shards_metadata = [placed(m) for m in metadata.shards_metadata]
        metadata.tensor_properties.dtype = dt
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, metadata, process_group=value._process_group)
    if is_dtensor(value):
        local = torch.empty(tuple(value._local_tensor.shape), dtype=dt, device=device)
        return type(value).from_local(local, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return torch.empty(tuple(value.shape), dtype=dt, device=device)


def replica_slot(value: Any, rank: int, world_size: int) -> tuple[int, int]:
    """``(index, count)``: this rank is replica number ``index`` of the
    ``count`` ranks holding the same chunk of a tensor-like leaf, computed
    without communication.  A plain tensor is held by every rank of the group
    (``(rank, world_size)``); a DTensor by the ranks that differ only in
    their coordinates on ``Replicate`` mesh dimensions; a :class:`TensorShard`
    counts as held by this rank alone (its replicas are not knowable), as
    does a ``ShardedTensor``'s shard (shards are disjoint)."""
    if isinstance(value, (TensorShard, ShardedTensor)) or (
            _is_checkpointable(value) and not is_dtensor(value)):
        return 0, 1
    if is_dtensor(value):
        mesh = value.device_mesh
        coordinate: Sequence[int] = mesh.get_coordinate() or ()
        index, count = 0, 1
        for dim, placement in enumerate(value.placements):
            if placement.is_replicate():
                index = index * mesh.size(dim) + coordinate[dim]
                count *= mesh.size(dim)
        return index, count
    return rank, world_size


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor with ``t``'s values (``t`` itself if it is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without copying (writable)."""
    # ndarray has the buffer protocol; numpy's stubs declare it for Python 3.12+ only
    array = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def empty_host(sizes: Sequence[int], dtype: str) -> torch.Tensor:
    """An uninitialized contiguous host tensor to read into."""
    return torch.empty(tuple(sizes), dtype=_DTYPES[dtype])


def region(data: torch.Tensor, rel_offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``data`` covering the box at ``rel_offsets`` of ``sizes``."""
    return data[tuple(slice(o, o + s) for o, s in zip(rel_offsets, sizes, strict=True))]


def is_direct_target(view: torch.Tensor, dtype: str) -> bool:
    """Whether bytes of ``dtype`` can be read straight into ``view``."""
    return view.device.type == "cpu" and view.is_contiguous() and view.dtype == _DTYPES[dtype]


def copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dest`` in place (casting dtype, moving device).
    Into an accelerator tensor the copy is queued on the current stream
    (``non_blocking``): work queued there later sees its values; host
    memory ``src`` in pageable memory may be reused at once (the runtime
    stages it), page-locked ``src`` only once the stream has passed the
    copy (:meth:`dcp.core.devices.CallerStreams.record`)."""
    with torch.no_grad():
        dest.copy_(src, non_blocking=devices.is_accelerator(dest.device))


def flat_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of contiguous host tensors, concatenated into one flat uint8
    host tensor (no copy for a single part)."""
    flat = [p.reshape(-1).view(torch.uint8) for p in parts]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def bytes_of(view: memoryview) -> torch.Tensor:
    """A flat uint8 host tensor over the writable bytes ``view`` (no copy)."""
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(
        0, dtype=torch.uint8)


def readonly_view(view: memoryview, dtype: str, sizes: Sequence[int]) -> torch.Tensor:
    """``view``'s bytes (possibly read-only memory, such as a mapping of
    another process's shared memory) as a tensor of ``dtype`` and shape
    ``sizes``, without copying; the caller only reads from it."""
    if not len(view):
        return torch.empty(tuple(sizes), dtype=_DTYPES[dtype])
    with warnings.catch_warnings():  # torch warns that it cannot mark the tensor read-only
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view, dtype=torch.uint8)
    return from_bytes(flat, dtype, sizes)


def empty_bytes(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """An uninitialized flat uint8 host tensor of ``nbytes``, page-locked
    (from torch's cached pinned allocator) if ``pinned``."""
    if pinned:
        return devices.pinned_empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)


def contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (never a view of its memory)."""
    return t.clone(memory_format=torch.contiguous_format)


def zeros_bytes(nbytes: int) -> torch.Tensor:
    """A flat uint8 host tensor of ``nbytes`` zeros."""
    return torch.zeros(nbytes, dtype=torch.uint8)


def from_bytes(flat: torch.Tensor, dtype: str, sizes: Sequence[int]) -> torch.Tensor:
    """View flat uint8 bytes as a tensor of ``dtype`` and shape ``sizes``
    (copied first if their offset is not aligned to the item size)."""
    if flat.storage_offset() % DTYPE_ITEMSIZE[dtype]:
        flat = flat.clone()
    return flat.view(_DTYPES[dtype]).reshape(tuple(sizes))
