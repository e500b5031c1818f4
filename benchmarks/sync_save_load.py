"""Synchronous save and load, with and without resharding.

State dict (:data:`FULL`): 16 fp32 tensors of [2048, 4096] = 512 MiB, each either a plain tensor (replicated: every rank holds all of it),
a DTensor on a 1-D mesh over all ranks, ``Shard(0)`` or ``Shard(1)``, or
(``dp2tp2``) a DTensor on a 2-D mesh (W/2 data-parallel x 2 tensor-parallel)
with ``[Replicate(), Shard(0)]``: every TP shard held by W/2 DP replicas.

Scenarios:

- ``save_<layout>``: save the state dict in that layout.
- ``load_<source>_to_<target>``: load the checkpoint saved in layout
  ``source`` into a state dict in layout ``target``.

For each world size one process group runs every selected scenario for every
system, ``repeat`` times; the systems' order rotates by one place between
repeats and between consecutive scenarios. Each repeat saves fresh
checkpoints (a load scenario saves its source checkpoint even when the save
scenario is not selected, without recording it); a ``sync`` precedes each
save. Before a load,
the checkpoint's file pages are evicted from the page cache and the target
tensors are zeroed; after it, every rank checks the loaded values.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .common import Measurement, RunConfig, evict, gather_to_rank0, launch, timed_collective
from .report import Row, Sample, TargetResult
from .systems import SYSTEMS, System

FAMILY = "sync_save_load"


@dataclass(frozen=True)
class StateDictSpec:
    num_tensors: int
    rows: int
    cols: int


FULL = StateDictSpec(num_tensors=16, rows=2048, cols=4096)
QUICK = StateDictSpec(num_tensors=4, rows=64, cols=128)
WARMUP = StateDictSpec(num_tensors=2, rows=16, cols=16)

# Layout -> sharded dimension (None: replicated plain tensor).
LAYOUTS: dict[str, int | None] = {"replicated": None, "shard0": 0, "shard1": 1, "dp2tp2": 0}
TP = 2  # tensor-parallel size of the dp2tp2 layout

SAVES: dict[str, str] = {
    "save_replicated": "replicated",
    "save_shard0": "shard0",
}
LOADS: dict[str, tuple[str, str]] = {
    **{f"load_{src}_to_{dst}": (src, dst)
       for src in ("replicated", "shard0")
       for dst in ("shard0", "shard1")},
    # read once per replica group, broadcast to the rest
    "load_replicated_to_replicated": ("replicated", "replicated"),
    "load_dp2tp2_to_dp2tp2": ("dp2tp2", "dp2tp2"),
}
SCENARIOS: dict[str, str] = {
    **{name: f"save, {layout}" for name, layout in SAVES.items()},
    **{name: f"load a {src} checkpoint into {dst}" for name, (src, dst) in LOADS.items()},
}


def run(scenarios: list[str], config: RunConfig) -> list[Sample]:
    """Measure ``scenarios`` (names from :data:`SCENARIOS`) at every world size."""
    spec = QUICK if config.quick else FULL
    samples: list[Sample] = []
    for world_size in config.world_sizes:
        for dim, size in (("rows", spec.rows), ("cols", spec.cols)):
            if size % world_size:
                raise ValueError(f"{FAMILY}: {dim}={size} is not divisible by W={world_size}")
        workdir = Path(config.scratch) / f"{FAMILY}-w{world_size}"
        workdir.mkdir(parents=True)
        result_path = workdir / "samples.json"
        try:
            print(f"[{FAMILY}] W={world_size}: {', '.join(scenarios)}", file=sys.stderr)
            launch(_worker, world_size, scenarios, config, spec, str(workdir), str(result_path))
            samples += [Sample(**s) for s in json.loads(result_path.read_text())]
        finally:
            shutil.rmtree(workdir)
    return samples


def targets(rows: list[Row]) -> list[TargetResult]:
    """The issue's targets, checked against hyperdcp's rows."""
    by_key = {(r.scenario, r.world_size, r.system): r for r in rows}
    results = []
    world_sizes = sorted({r.world_size for r in rows if r.scenario in SAVES})
    for scenario in SAVES:
        for w in world_sizes:
            row = by_key.get((scenario, w, "hyperdcp"))
            results.append(TargetResult(
                f"{scenario} W={w}: hyperdcp seconds / torch-dcp seconds",
                row.seconds_ratio if row else None, limit=0.8, timing=True))
            floor = by_key.get((scenario, w, "floor"))
            results.append(TargetResult(
                f"{scenario} W={w}: floor seconds / torch-dcp seconds (writing each distinct "
                f"byte once and nothing else; above the limit, no save can meet the target on "
                f"this storage)", floor.seconds_ratio if floor else None, limit=0.8, timing=True))
    row = by_key.get(("load_shard0_to_shard1", 4, "hyperdcp"))
    results.append(TargetResult(
        "load_shard0_to_shard1 W=4: hyperdcp bytes read / bytes needed",
        row.read_amplification if row else None, limit=1.05, timing=False))
    # each rank needs the whole checkpoint (replicated) or one TP shard of it
    for scenario, shards in (("load_replicated_to_replicated", 1), ("load_dp2tp2_to_dp2tp2", TP)):
        row = by_key.get((scenario, 4, "hyperdcp"))
        results.append(TargetResult(
            f"{scenario} W=4: hyperdcp bytes read, all ranks / checkpoint bytes",
            row.read_total / (row.needed_per_rank * shards) if row else None,
            limit=1.01, timing=False))
        results.append(TargetResult(
            f"{scenario} W=4: hyperdcp seconds / torch-dcp seconds",
            row.seconds_ratio if row else None, limit=0.6, timing=True))
        floor = by_key.get((scenario, 4, "floor"))
        results.append(TargetResult(
            f"{scenario} W=4: floor seconds / torch-dcp seconds (reading the checkpoint once "
            f"and nothing else; above the limit, no load can meet the target on this storage)",
            floor.seconds_ratio if floor else None, limit=0.6, timing=True))
    return results


# --- state dicts -------------------------------------------------------------


def _local_box(layout: str, spec: StateDictSpec, rank: int, world_size: int) -> tuple[int, int, int, int]:
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


def _pattern(index: int, box: tuple[int, int, int, int], spec: StateDictSpec) -> torch.Tensor:
    """Values of tensor ``index`` in ``box``: element (i, j) is ``i * cols + j + index``,
    computed element-wise so any box of the same element gives the same value."""
    row0, rows, col0, cols = box
    r = torch.arange(row0, row0 + rows, dtype=torch.float32).unsqueeze(1) * spec.cols
    c = torch.arange(col0, col0 + cols, dtype=torch.float32).unsqueeze(0) + index
    return r + c


def _state_dict(
    layout: str, spec: StateDictSpec, mesh: DeviceMesh, filled: bool
) -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    box = _local_box(layout, spec, rank, world_size)
    dim = LAYOUTS[layout]
    placements = [Shard(dim)] if dim is not None else None
    if layout == "dp2tp2":
        mesh = init_device_mesh("cpu", (world_size // TP, TP), mesh_dim_names=("dp", "tp"))
        placements = [Replicate(), Shard(0)]
    state_dict = {}
    for i in range(spec.num_tensors):
        local = _pattern(i, box, spec) if filled else torch.zeros(box[1], box[3])
        if dim is not None:
            local = DTensor.from_local(
                local,
                mesh,
                placements,
                run_check=False,
                shape=torch.Size((spec.rows, spec.cols)),
                stride=(spec.cols, 1),
            )
        state_dict[f"layers.{i}.weight"] = local
    return state_dict


def _locals(state_dict: dict[str, Any]) -> list[torch.Tensor]:
    return [v.to_local() if isinstance(v, DTensor) else v for v in state_dict.values()]


def _is_correct(state_dict: dict[str, Any], layout: str, spec: StateDictSpec) -> bool:
    box = _local_box(layout, spec, dist.get_rank(), dist.get_world_size())
    return all(torch.equal(t, _pattern(i, box, spec)) for i, t in enumerate(_locals(state_dict)))


# --- the per-rank worker -----------------------------------------------------


def _worker(
    rank: int,
    world_size: int,
    scenarios: list[str],
    config: RunConfig,
    spec: StateDictSpec,
    workdir: str,
    result_path: str,
) -> None:
    systems: list[System] = [SYSTEMS[name]() for name in config.systems]
    mesh = init_device_mesh("cpu", (world_size,))
    loads = [s for s in scenarios if s in LOADS]
    source_layouts = list(
        dict.fromkeys([SAVES[s] for s in scenarios if s in SAVES] + [LOADS[s][0] for s in loads])
    )
    sources = {layout: _state_dict(layout, spec, mesh, filled=True) for layout in source_layouts}
    destinations = {
        dst: _state_dict(dst, spec, mesh, filled=False) for dst in {LOADS[s][1] for s in loads}
    }
    _warm_up(systems, mesh, Path(workdir) / "warmup")

    samples: list[Sample] = []

    def record(scenario: str, system: System, repeat: int, m: Measurement, needed=None, ok=None):
        kind = "save" if scenario in SAVES else "load"
        per_rank = gather_to_rank0((m.seconds, m.cpu_seconds, m.io.as_dict(), needed, ok))
        if rank != 0:
            return
        sample = Sample(
            family=FAMILY,
            scenario=scenario,
            kind=kind,
            world_size=world_size,
            system=system.name,
            repeat=repeat,
            seconds=max(p[0] for p in per_rank),
            rank_cpu_seconds=[p[1] for p in per_rank],
            rank_io=[p[2] for p in per_rank],
            needed_bytes=None if kind == "save" else [p[3] for p in per_rank],
            verified=None if kind == "save" or per_rank[0][4] is None else all(p[4] for p in per_rank),
        )
        samples.append(sample)
        print(
            f"  W={world_size} r={repeat} {scenario:<26} {system.name:<9} {sample.seconds:.3f} s",
            file=sys.stderr,
        )

    for repeat in range(config.repeat):
        repeat_dir = Path(workdir) / f"repeat{repeat}"

        def path(system: System, layout: str) -> str:
            return str(repeat_dir / f"{system.name}-{layout}")

        def order(step: int) -> list[System]:
            """Systems in the order to run them, rotated by one place from one
            repeat or step to the next: over as many repeats as systems, each
            system runs in every position once.  (The disk is slower after
            another system's writes, so a fixed position would favour or
            handicap one system throughout.)"""
            k = (repeat + step) % len(systems)
            return systems[k:] + systems[:k]

        for step, layout in enumerate(source_layouts):
            for system in order(step):
                if rank == 0:
                    os.sync()  # no earlier writeback running during the save
                m = timed_collective(lambda: system.save(sources[layout], path(system, layout)))
                if f"save_{layout}" in scenarios:
                    record(f"save_{layout}", system, repeat, m)

        for step, scenario in enumerate(loads, start=len(source_layouts)):
            src, dst = LOADS[scenario]
            for system in order(step):
                for t in _locals(destinations[dst]):
                    t.zero_()
                if rank == 0 and config.eviction:
                    evict(path(system, src), config.eviction)
                m = timed_collective(lambda: system.load(destinations[dst], path(system, src)))
                needed = sum(t.nbytes for t in _locals(destinations[dst]))
                ok = None if getattr(system, "floor", False) else _is_correct(destinations[dst], dst, spec)
                record(scenario, system, repeat, m, needed, ok)

        dist.barrier()
        if rank == 0:
            shutil.rmtree(repeat_dir, ignore_errors=True)

    if rank == 0:
        Path(result_path).write_text(json.dumps([asdict(s) for s in samples]))


def _warm_up(systems: list[System], mesh: DeviceMesh, workdir: Path) -> None:
    """Save and reshard-load a tiny state dict with each system (imports, lazy
    initialisation, first collectives), unmeasured."""
    for system in systems:
        for layout in ("replicated", "shard0"):
            path = str(workdir / f"{system.name}-{layout}")
            system.save(_state_dict(layout, WARMUP, mesh, filled=True), path)
            system.load(_state_dict("shard1", WARMUP, mesh, filled=False), path)
