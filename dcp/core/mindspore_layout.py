"""MindSpore's distributed layouts as boxes of the global tensor.

:func:`mindspore_shard` gives the :class:`~dcp.core.tensors.TensorShard` of
one rank's slice from MindSpore's semi-auto parallel layout (device matrix
and tensor map, as ``mindspore.parallel.Layout``'s ``to_dict()`` gives
them), by the arithmetic of ``mindspore.parallel._tensor``
(``_get_tensor_slice_index``, ``_expand_layout`` for tuple entries), so a
sharded MindSpore parameter saves as chunks of its global tensor like a
DTensor does.  Pure arithmetic: MindSpore is not needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dcp.core.tensors import TensorShard
from dcp.errors import CheckpointError


def _entries(entry: int | Sequence[int]) -> tuple[int, ...]:
    """A tensor map entry's device dimensions (counted from the right),
    major first, without the ``-1`` (not split) placeholders."""
    dims = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
    return tuple(int(d) for d in dims if int(d) != -1)


def mindspore_shard(data: Any, global_shape: Sequence[int], device_matrix: Sequence[int],
                    tensor_map: Sequence[int | Sequence[int]], rank: int, *,
                    rank_list: Sequence[int] | None = None) -> TensorShard:
    """The :class:`~dcp.TensorShard` of rank ``rank``'s slice ``data`` of a
    tensor of ``global_shape`` laid out by MindSpore's semi-auto parallel
    layout, so that it saves as a chunk of the global tensor (ranks whose
    slices are the same box are replicas, saved once).

    Args:
        data: this rank's slice (a MindSpore or torch tensor), of the shape
            the layout gives it.
        global_shape: the whole tensor's shape (elements per dimension).
        device_matrix: the device arrangement, as ``Layout(device_matrix,
            alias_name)`` takes it.
        tensor_map: one entry per tensor dimension: the device matrix
            dimension it is split over, counted from the right (``0`` is the
            last), or ``-1`` (not split), or a tuple of them (split over
            several, the first major), as ``Layout(...)(...).to_dict()``
            gives it.
        rank: the global rank holding ``data``.
        rank_list: the ranks of the device matrix in row-major order
            (``Layout``'s ``rank_list``; default ``0 .. prod(device_matrix) - 1``).

    The box is MindSpore's (``mindspore.parallel._tensor``): the rank's
    coordinate in the device matrix is row-major; a dimension split ``n``
    ways (the product of its device dimensions' sizes) is cut into ``n``
    equal parts and the rank holds part ``sum(coordinate[d] * stride[d])``,
    mixed radix over the entry's device dimensions, the first most
    significant.

    Raises:
        CheckpointError: a malformed layout (a device dimension out of
            range or used twice, a map of another length than the shape),
            ``rank`` not in the layout, a dimension not divisible by its
            split (MindSpore requires even slices), or ``data`` not of the
            slice's shape; the message names the shape and the layout.
    """
    try:
        shape = tuple(int(s) for s in global_shape)
        matrix = tuple(int(d) for d in device_matrix)
        used = [d for entry in tensor_map for d in _entries(entry)]
        ranks = list(range(math.prod(matrix))) if rank_list is None else [int(r)
                                                                          for r in rank_list]
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"mindspore_shard takes integer sequences: the global shape, and the "
            f"'device_matrix', 'tensor_map' (device dimensions, not alias names) and "
            f"'rank_list' of Layout(...)(...).to_dict(); got {device_matrix!r}, "
            f"{tensor_map!r}: {e}") from None
    what = f"shape {shape} with device matrix {matrix} and tensor map {tuple(tensor_map)}"
    if not matrix or any(d < 1 for d in matrix):
        raise CheckpointError(f"{what}: device matrix sizes must be positive")
    if len(tensor_map) != len(shape):
        raise CheckpointError(f"{what}: the tensor map needs one entry per dimension")
    if any(not 0 <= d < len(matrix) for d in used) or len(set(used)) != len(used):
        raise CheckpointError(f"{what}: each entry must name a device dimension "
                              f"0..{len(matrix) - 1} (from the right) at most once, or -1")
    if len(ranks) != math.prod(matrix):
        raise CheckpointError(f"{what}: rank_list has {len(ranks)} ranks, the device matrix "
                              f"{math.prod(matrix)}")
    if rank not in ranks:
        raise CheckpointError(f"{what}: rank {rank} is not one of the layout's ranks {ranks}")
    index, coordinate = ranks.index(rank), [0] * len(matrix)
    for d in reversed(range(len(matrix))):  # row-major: the last dimension varies fastest
        index, coordinate[d] = divmod(index, matrix[d])
    offsets, sizes = [], []
    for dim, entry in zip(shape, tensor_map, strict=True):
        part, parts = 0, 1
        for d in _entries(entry):  # from the right: dimension d is matrix[-d - 1]
            part, parts = part * matrix[-d - 1] + coordinate[-d - 1], parts * matrix[-d - 1]
        if dim % parts:
            raise CheckpointError(f"{what}: dimension of size {dim} cannot be split evenly "
                                  f"{parts} ways (MindSpore requires even slices)")
        sizes.append(dim // parts)
        offsets.append(part * (dim // parts))
    if tuple(data.shape) != tuple(sizes):
        raise CheckpointError(f"{what}: rank {rank}'s slice has shape {tuple(data.shape)}, "
                              f"not the layout's {tuple(sizes)}")
    return TensorShard(data, shape, tuple(offsets))

