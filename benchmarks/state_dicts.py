"""The state dicts of the save/load families, in every layout, and their
element-exact check.

A state dict is ``num_tensors`` fp32 tensors of ``[rows, cols]``, each
either a plain tensor (``replicated``: every rank holds all of it), a
DTensor on a 1-D mesh over all ranks, ``Shard(0)`` or ``Shard(1)``, or
(``dp2tp2``) a DTensor on a 2-D mesh (W/2 data-parallel x 2
tensor-parallel) with ``[Replicate(), Shard(0)]``: every TP shard held by
W/2 DP replicas.  Element (i, j) of tensor k is ``i * cols + j + k``,
computed element-wise, so any box of the same element gives the same value
and a loaded target can be checked element-exact in any layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass(frozen=True)
class StateDictSpec:
    num_tensors: int
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        """Bytes of the whole state dict (one replica)."""
        return self.num_tensors * self.rows * self.cols * 4

    def check_divisible(self, world_size: int, family: str) -> None:
        """Raise unless every layout splits the tensors evenly over ``world_size`` ranks."""
        for dim, size in (("rows", self.rows), ("cols", self.cols)):
            if size % world_size:
                raise ValueError(f"{family}: {dim}={size} is not divisible by W={world_size}")


# Layout -> sharded dimension (None: replicated plain tensor).
LAYOUTS: dict[str, int | None] = {"replicated": None, "shard0": 0, "shard1": 1, "dp2tp2": 0}
TP = 2  # tensor-parallel size of the dp2tp2 layout


def local_box(layout: str, spec: StateDictSpec, rank: int,
              world_size: int) -> tuple[int, int, int, int]:
    """(row offset, rows, col offset, cols) of this rank's part of each tensor."""
    dim = LAYOUTS[layout]
    if layout == "dp2tp2":
        rows = spec.rows // TP
        return rank % TP * rows, rows, 0, spec.cols
    if dim == 0:
        rows = spec.rows // world_size
        return rank * rows, rows, 0, spec.cols
    if dim == 1:
        cols = spec.cols // world_size
        return 0, spec.rows, rank * cols, cols
    return 0, spec.rows, 0, spec.cols


def pattern(index: int, box: tuple[int, int, int, int], spec: StateDictSpec) -> torch.Tensor:
    """Values of tensor ``index`` in ``box``: element (i, j) is ``i * cols + j + index``."""
    row0, rows, col0, cols = box
    r = torch.arange(row0, row0 + rows, dtype=torch.float32).unsqueeze(1) * spec.cols
    c = torch.arange(col0, col0 + cols, dtype=torch.float32).unsqueeze(0) + index
    return r + c


def state_dict(layout: str, spec: StateDictSpec, mesh: DeviceMesh,
               filled: bool) -> dict[str, torch.Tensor]:
    """This rank's state dict in ``layout``: the pattern, or zeros (a load target)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    box = local_box(layout, spec, rank, world_size)
    dim = LAYOUTS[layout]
    placements = [Shard(dim)] if dim is not None else None
    if layout == "dp2tp2":
        mesh = init_device_mesh("cpu", (world_size // TP, TP), mesh_dim_names=("dp", "tp"))
        placements = [Replicate(), Shard(0)]
    out = {}
    for i in range(spec.num_tensors):
        local = pattern(i, box, spec) if filled else torch.zeros(box[1], box[3])
        if dim is not None:
            local = DTensor.from_local(
                local,
                mesh,
                placements,
                run_check=False,
                shape=torch.Size((spec.rows, spec.cols)),
                stride=(spec.cols, 1),
            )
        out[f"layers.{i}.weight"] = local
    return out


def local_tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    """The local tensors of a state dict (DTensors' local shards)."""
    return [v.to_local() if isinstance(v, DTensor) else v for v in sd.values()]


def zero(sd: dict[str, Any]) -> None:
    """Zero every local tensor of ``sd`` (before a load)."""
    for t in local_tensors(sd):
        t.zero_()


def is_correct(sd: dict[str, Any], layout: str, spec: StateDictSpec) -> bool:
    """Whether this rank's part of ``sd`` holds the pattern, element-exact."""
    box = local_box(layout, spec, dist.get_rank(), dist.get_world_size())
    return all(torch.equal(t, pattern(i, box, spec)) for i, t in enumerate(local_tensors(sd)))
