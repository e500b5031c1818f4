"""Compare two checkpoints tensor by tensor (``hyperdcp diff``).

Works on anything :func:`dcp.read_metadata` reads through a storage plugin,
so a checkpoint can be compared with a safetensors folder (through
:class:`~dcp.interop.safetensors_io.SafetensorsFolder`).  Tensors are compared
whole, whatever their chunking, one pair in memory at a time; "equal" means
bitwise equal (so a NaN equals the same NaN, and ``0.0`` differs from
``-0.0``).  Non-tensor values are compared as JSON values, pickled ones by
their bytes (never unpickled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dcp.core.metadata import Metadata, ObjectMeta
from dcp.core.storage import StoragePlugin, open_storage
from dcp.interop.streaming import progress_bar, read_blob, read_tensor
from dcp.orchestration.load import read_metadata

# Same-size integer views for bitwise comparison, by item size.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorDiff:
    """How tensor ``fqn`` differs.

    ``problem`` is ``"shape"``, ``"dtype"`` (``detail`` gives both) or
    ``"values"``: then ``differing`` of ``numel`` elements differ bitwise
    and ``max_abs`` is the largest absolute difference among them (computed
    in float64; ``nan`` where one side is NaN; ``None`` for bool).
    """

    fqn: str
    problem: str
    detail: str = ""
    differing: int = 0
    numel: int = 0
    max_abs: float | None = None

    def __str__(self) -> str:
        if self.problem != "values":
            return f"{self.fqn}: {self.problem} {self.detail}"
        how = "" if self.max_abs is None else f", max |a-b| = {self.max_abs:.6g}"
        return f"{self.fqn}: {self.differing} of {self.numel} elements differ{how}"


@dataclass
class DiffReport:
    """Outcome of :func:`diff`: fqns present on one side only, tensors and
    objects that differ, and how many fqns are identical."""

    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    identical: int = 0

    @property
    def same(self) -> bool:
        """True when both sides hold the same fqns with equal values."""
        return not (self.only_in_a or self.only_in_b or self.tensors or self.objects)


def _compare_values(fqn: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff | None:
    """``None`` if ``a`` and ``b`` (same shape and dtype) are bitwise equal,
    else how their values differ."""
    bits = _BITS[a.element_size()]
    a, b = a.reshape(-1), b.reshape(-1)
    mask = a.view(bits) != b.view(bits)
    differing = int(mask.sum())
    if not differing:
        return None
    max_abs = None
    if a.dtype != torch.bool:
        wide = torch.complex128 if a.is_complex() else torch.float64
        max_abs = float((a[mask].to(wide) - b[mask].to(wide)).abs().max())
    return TensorDiff(fqn, "values", differing=differing, numel=a.numel(), max_abs=max_abs)


def _same_object(sa: StoragePlugin, a: ObjectMeta, sb: StoragePlugin, b: ObjectMeta,
                 fqn: str) -> bool:
    pa, pb = a.pickled, b.pickled
    if pa is None or pb is None:
        return pa is None and pb is None and a.value == b.value
    return read_blob(sa, fqn, pa) == read_blob(sb, fqn, pb)


def diff(a: str, b: str, *, storage_a: StoragePlugin | None = None,
         storage_b: StoragePlugin | None = None, storage_options: dict | None = None,
         progress: bool = False) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (paths or URIs).

    Args:
        a, b: the checkpoints.
        storage_a, storage_b: ready plugins instead of ``open_storage(a or
            b, **storage_options)`` (e.g. a safetensors folder).
        progress: show a progress bar (tqdm, bytes of ``a``) on stderr.

    Returns:
        A :class:`DiffReport`.

    Raises:
        NotACheckpointError / CorruptCheckpointError: a side cannot be read
            (a checksum mismatch included), naming the fqn and file.
    """
    sa = storage_a or open_storage(str(a), **(storage_options or {}))
    sb = storage_b or open_storage(str(b), **(storage_options or {}))
    ma: Metadata = read_metadata(str(a), storage=sa)
    mb: Metadata = read_metadata(str(b), storage=sb)
    report = DiffReport(
        only_in_a=[f for f in ma.fqns() if f not in mb.tensors and f not in mb.objects],
        only_in_b=[f for f in mb.fqns() if f not in ma.tensors and f not in ma.objects])
    common = [f for f in ma.tensors if f in mb.tensors]
    with progress_bar(sum(ma.tensors[f].nbytes for f in common), "diff", progress) as bar:
        for fqn in common:
            ta, tb = ma.tensors[fqn], mb.tensors[fqn]
            found: TensorDiff | None
            if ta.shape != tb.shape:
                found = TensorDiff(fqn, "shape", f"{list(ta.shape)} vs {list(tb.shape)}")
            elif ta.dtype != tb.dtype:
                found = TensorDiff(fqn, "dtype", f"{ta.dtype} vs {tb.dtype}")
            else:
                found = _compare_values(fqn, read_tensor(sa, fqn, ta), read_tensor(sb, fqn, tb))
            bar.update(ta.nbytes)
            if found is None:
                report.identical += 1
            else:
                report.tensors.append(found)
    for fqn in ma.fqns():
        oa, ob = ma.objects.get(fqn), mb.objects.get(fqn)
        if oa is not None and ob is not None:
            if _same_object(sa, oa, sb, ob, fqn):
                report.identical += 1
            else:
                report.objects.append(fqn)
        elif (oa is not None and fqn in mb.tensors) or (ob is not None and fqn in ma.tensors):
            report.objects.append(fqn)  # a tensor on one side, a value on the other
    return report
