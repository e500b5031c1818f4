"""Save plans as flat columns, for a coordinator of thousands of ranks.

A local plan of the 505B layout (:mod:`benchmarks.scale`) holds about 150
items; ten thousand of them are 1.5 million :class:`WriteItem` objects,
seconds of a coordinator's step just to build and walk.  A
:class:`ColumnarSavePlan` is a :class:`SavePlan` whose items live in numpy
columns (a names table, and per item the name's index, the box's rank, its
offsets and sizes flattened, its bytes) and are built as objects only when
``items`` is first read.  :mod:`dcp.coordination.wire` decodes plans into
it and encodes it straight from its columns; the default save planner reads
and makes columns (:func:`columns_of`), so on the coordinator a plan's
items never become objects.  It compares equal to a plain plan of the same
items, and pickles as its columns (as a plain plan once its items are built).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, cast

import numpy as np

from dcp.core.planner import SavePlan, TensorDecl, WriteItem


@dataclass
class PlanColumns:
    """The items of one plan: ``names`` (distinct fqns), and per item
    ``fqn`` (index into ``names``), ``ndim``, ``nbytes``; ``offsets`` and
    ``sizes`` flattened (``ndim`` values per item, in item order).  Integer
    columns are int64 arrays."""

    names: list[str]
    fqn: np.ndarray
    ndim: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    def items(self) -> list[WriteItem]:
        """The items as objects."""
        names, ndims = self.names, self.ndim.tolist()
        offsets = cut_boxes(ndims, self.offsets.tolist())
        sizes = cut_boxes(ndims, self.sizes.tolist())
        return [WriteItem(names[f], o, z, b) for f, o, z, b in zip(
            self.fqn.tolist(), offsets, sizes, self.nbytes.tolist(), strict=True)]


def cut_boxes(ndims: list[int], flat: list[int]) -> list[tuple[int, ...]]:
    """``flat`` cut into consecutive tuples of the lengths ``ndims``."""
    if ndims and ndims.count(ndims[0]) == len(ndims) and ndims[0]:  # one rank: cut in C
        return list(zip(*[iter(flat)] * ndims[0], strict=True))
    out, p = [], 0
    for k in ndims:
        out.append(tuple(flat[p:p + k]))
        p += k
    return out


_FQN, _OFFSETS, _SIZES, _NBYTES = (attrgetter(a) for a in ("fqn", "offsets", "sizes", "nbytes"))


def columns_of(plan: SavePlan) -> PlanColumns:
    """``plan``'s items as columns (a :class:`ColumnarSavePlan`'s own, without
    building its items)."""
    if isinstance(plan, ColumnarSavePlan) and plan._items is None:
        return plan.columns
    items = plan.items
    fqns = list(map(_FQN, items))
    names = list(dict.fromkeys(fqns))
    index = {n: i for i, n in enumerate(names)}
    offs, sizes = list(map(_OFFSETS, items)), list(map(_SIZES, items))
    ndims = list(map(len, offs))
    if ndims != list(map(len, sizes)):
        raise ValueError("an item's offsets and sizes differ in length")
    total = sum(ndims)
    return PlanColumns(
        names, np.fromiter(map(index.__getitem__, fqns), np.int64, len(items)),
        np.array(ndims, dtype=np.int64),
        np.fromiter(itertools.chain.from_iterable(offs), np.int64, total),
        np.fromiter(itertools.chain.from_iterable(sizes), np.int64, total),
        np.fromiter(map(_NBYTES, items), np.int64, len(items)))


class ColumnarSavePlan(SavePlan):
    """A :class:`SavePlan` holding its items as :class:`PlanColumns` until
    ``items`` is first read (then as objects, which later changes go to).
    ``tensors`` may be a read-only mapping shared by many plans (decoded
    plans of one tensor table share one); it pickles as a dict, one for the
    plans of one table pickled together."""

    def __init__(self, tensors: Mapping[str, TensorDecl], columns: PlanColumns) -> None:
        self.tensors = cast(dict, tensors)
        self.columns = columns
        self._items: list[WriteItem] | None = None

    @property  # type: ignore[override]
    def items(self) -> list[WriteItem]:
        if self._items is None:
            self._items = self.columns.items()
        return self._items

    @items.setter
    def items(self, value: list[WriteItem]) -> None:
        self._items = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SavePlan):
            return NotImplemented
        return self.tensors == other.tensors and self.items == other.items

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ColumnarSavePlan(tensors={len(self.tensors)}, items={len(self.columns)})"

    def __reduce__(self) -> tuple[Any, ...]:
        if self._items is None:  # still columns: a few arrays, not an object per item
            return ColumnarSavePlan, (_plain(self.tensors), self.columns)
        return SavePlan, (dict(self.tensors), self.items)


#: A dict copy of each shared read-only tensor table pickled, by the
#: table's id (the table is held): plans of one table pickled together
#: share the copy, so the table is written once (a coordinator's cached
#: plans at 10,240 ranks: 128 tables, not 20,480).
_PLAIN: dict[int, tuple[Mapping[str, TensorDecl], dict[str, TensorDecl]]] = {}


def _plain(tensors: Mapping[str, TensorDecl]) -> dict[str, TensorDecl]:
    if isinstance(tensors, dict):
        return tensors
    known = _PLAIN.get(id(tensors))
    if known is None or known[0] is not tensors:
        if len(_PLAIN) >= 4096:
            _PLAIN.clear()
        known = _PLAIN[id(tensors)] = (tensors, dict(tensors))
    return known[1]
