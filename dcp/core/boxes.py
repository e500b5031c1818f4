"""Resharding arithmetic on N-dimensional half-open boxes.

A box is ``(offsets, sizes)`` in global element coordinates and covers
``[offsets[d], offsets[d] + sizes[d])`` along every dimension ``d``.  A saved
chunk is stored row-major, so a box inside it is a set of contiguous byte
runs; :func:`byte_runs` lists them, which is what lets a resharded load read
exactly the bytes it needs instead of whole chunks (PyTorch DCP reads whole
chunks and narrows them afterwards).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np


def intersect_many(offsets: np.ndarray, sizes: np.ndarray, box_offsets: Sequence[int],
                   box_sizes: Sequence[int]) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Intersect one box with many (int64 arrays ``[n, ndim]``) at once.

    Returns the row numbers of the boxes that share elements with it, and
    the intersections' offsets and sizes, as lists.
    """
    lo = np.maximum(offsets, np.asarray(box_offsets, dtype=np.int64))
    hi = np.minimum(offsets + sizes, np.asarray(box_offsets, dtype=np.int64)
                    + np.asarray(box_sizes, dtype=np.int64))
    rows = np.flatnonzero(np.all(hi > lo, axis=1))
    return rows.tolist(), lo[rows].tolist(), (hi - lo)[rows].tolist()


def volume(sizes: Sequence[int]) -> int:
    """Number of elements in a box (1 for a 0-dim box)."""
    return math.prod(sizes)


def _runs_layout(chunk_sizes: Sequence[int], rel_offsets: Sequence[int],
                 sizes: Sequence[int], itemsize: int) -> tuple[list[int], int, int, int]:
    """How a sub-box's bytes lie in its row-major chunk (``ndim >= 1``):
    the chunk's byte strides, ``k`` — the outermost dimension a run spans
    (the dimensions after it are covered fully) —, the run length and the
    first run's start."""
    ndim = len(chunk_sizes)
    strides = [itemsize] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * chunk_sizes[d + 1]
    k = ndim - 1
    while k > 0 and rel_offsets[k] == 0 and sizes[k] == chunk_sizes[k]:
        k -= 1
    base = sum(o * s for o, s in zip(rel_offsets, strides, strict=True))
    return strides, k, sizes[k] * strides[k], base


def byte_runs(chunk_sizes: Sequence[int], rel_offsets: Sequence[int],
              sizes: Sequence[int], itemsize: int) -> Iterator[tuple[int, int]]:
    """Contiguous byte runs ``(start, length)`` of a sub-box inside a chunk.

    ``rel_offsets``/``sizes`` give the sub-box relative to the chunk, whose
    bytes are row-major with dimensions ``chunk_sizes``.  Runs come in
    row-major order of the sub-box, so concatenated they are the sub-box's own
    row-major bytes.  Trailing dimensions the sub-box covers fully are merged
    into one run.
    """
    if not chunk_sizes:
        yield 0, itemsize
        return
    strides, k, run, base = _runs_layout(chunk_sizes, rel_offsets, sizes, itemsize)
    if k == 0:
        yield base, run
        return
    outer = [range(n) for n in sizes[:k]]
    for idx in itertools.product(*outer):
        yield base + sum(i * s for i, s in zip(idx, strides, strict=False)), run


def run_extent(chunk_sizes: Sequence[int], rel_offsets: Sequence[int], sizes: Sequence[int],
               itemsize: int) -> tuple[int, int, int] | None:
    """Where the byte runs of a sub-box lie inside its chunk, without listing
    them: ``(start, end, gap)`` — the first byte, the byte after the last,
    and the longest gap between two consecutive runs (bytes, chunk-relative;
    arguments as for :func:`byte_runs`).  ``None`` for an empty sub-box."""
    if not chunk_sizes:
        return 0, itemsize, 0
    if not volume(sizes):
        return None
    strides, k, run, base = _runs_layout(chunk_sizes, rel_offsets, sizes, itemsize)
    last = base + sum((sizes[d] - 1) * strides[d] for d in range(k))
    gap = 0
    wrapped = 0  # bytes that the dimensions inside d travel before wrapping to 0
    for d in range(k - 1, -1, -1):
        if sizes[d] > 1:
            gap = max(gap, strides[d] - wrapped - run)
        wrapped += (sizes[d] - 1) * strides[d]
    return base, last + run, gap
