"""Synchronous save and load, with and without resharding.

State dict (:data:`FULL`): 16 fp32 tensors of [2048, 4096] = 512 MiB in the
layouts of :mod:`benchmarks.state_dicts` (replicated, ``Shard(0)``,
``Shard(1)``, DP2xTP2).

Scenarios:

- ``save_<layout>``: save the state dict in that layout.
- ``load_<source>_to_<target>``: load the checkpoint saved in layout
  ``source`` into a state dict in layout ``target``.

For each world size one process group runs every selected scenario for every
system, ``repeat`` times; the systems' order rotates by one place between
repeats and between consecutive scenarios. Each repeat saves fresh
checkpoints (a load scenario saves its source checkpoint even when the save
scenario is not selected, without recording it); a ``sync`` precedes each
save. Before a load, the checkpoint's file pages are evicted from the page
cache (cold cache) and the target tensors are zeroed; after it, every rank
checks the loaded values element-exact.  A load's read requests per rank are
recorded where the system reports them (hyperdcp's ``LoadReport.requests``,
the floor's ``preadv`` calls).

With the floor, each load scenario also records ``memcpy``
(:data:`~benchmarks.systems.PLACEMENT`): every rank copying the bytes its
target holds once, from a warm buffer of its own, all ranks at once.  It is
no load, but the placement every load pays besides reading (the floor
places nothing): a load that reads every byte once and then places it costs
about the floor's time plus this where the ranks share too few cores to
overlap the two.

Targets of the loads: hyperdcp within 1.2x the floor's time, and at most
torch DCP's time (0.8x where hyperdcp reads fewer bytes than torch DCP).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .common import RunConfig, evict, launch, record, rotation, timed_collective
from .report import IO_COLUMNS, Row, Sample, TargetResult
from .state_dicts import StateDictSpec, is_correct, local_tensors, state_dict, zero
from .systems import FLOOR, PLACEMENT, SYSTEMS, System

FAMILY = "sync_save_load"
COLUMNS = IO_COLUMNS

FULL = StateDictSpec(num_tensors=16, rows=2048, cols=4096)
QUICK = StateDictSpec(num_tensors=4, rows=64, cols=128)
WARMUP = StateDictSpec(num_tensors=2, rows=16, cols=16)

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
#: Load targets: hyperdcp / floor seconds; hyperdcp / torch-dcp seconds, and
#: the same where hyperdcp reads at most READS_FEWER of torch DCP's bytes.
VS_FLOOR, VS_TORCH, VS_TORCH_FEWER_BYTES, READS_FEWER = 1.2, 1.0, 0.8, 0.9


def run(scenarios: list[str], config: RunConfig) -> list[Sample]:
    """Measure ``scenarios`` (names from :data:`SCENARIOS`) at every world size."""
    spec = QUICK if config.quick else FULL
    samples: list[Sample] = []
    for world_size in config.world_sizes:
        spec.check_divisible(world_size, FAMILY)
        workdir = Path(config.scratch) / f"{FAMILY}-w{world_size}"
        workdir.mkdir(parents=True)
        try:
            print(f"[{FAMILY}] W={world_size}: {', '.join(scenarios)}", file=sys.stderr)
            samples += launch(_worker, world_size, scenarios, config, spec, str(workdir))[0]
        finally:
            shutil.rmtree(workdir)
    return samples


def targets(rows: list[Row]) -> list[TargetResult]:
    """The issues' targets, checked against hyperdcp's rows."""
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
    # the checkpoint leaves the device once (ranks of one host share its page
    # cache: what they read after another rank is a memory copy, not a read)
    for scenario in ("load_shard0_to_shard1", "load_replicated_to_replicated",
                     "load_dp2tp2_to_dp2tp2"):
        row = by_key.get((scenario, 4, "hyperdcp"))
        checkpoint = by_key.get((scenario, 4, "floor"))
        results.append(TargetResult(
            f"{scenario} W=4: hyperdcp storage (device) bytes read, all ranks / the floor's",
            row.storage_read_total / checkpoint.storage_read_total
            if row and checkpoint and checkpoint.storage_read_total else None,
            limit=1.01, timing=False))
    for scenario in ("load_replicated_to_replicated", "load_dp2tp2_to_dp2tp2"):
        row = by_key.get((scenario, 4, "hyperdcp"))
        results.append(TargetResult(
            f"{scenario} W=4: hyperdcp seconds / torch-dcp seconds",
            row.seconds_ratio if row else None, limit=0.6, timing=True))
        floor = by_key.get((scenario, 4, "floor"))
        results.append(TargetResult(
            f"{scenario} W=4: floor seconds / torch-dcp seconds (reading the checkpoint once "
            f"and nothing else; above the limit, no load can meet the target on this storage)",
            floor.seconds_ratio if floor else None, limit=0.6, timing=True))
    return results + load_targets(rows)


def load_targets(rows: list[Row]) -> list[TargetResult]:
    """The loads issue's targets, for every load scenario and world size
    measured: hyperdcp's time over the floor's and over torch DCP's (the
    tighter limit where hyperdcp read at most :data:`READS_FEWER` of torch
    DCP's bytes)."""
    results = []
    for r in rows:
        if r.scenario not in LOADS or r.system != "hyperdcp":
            continue
        name = f"{r.scenario} W={r.world_size}"
        results.append(TargetResult(
            f"{name}: hyperdcp seconds / floor seconds", r.seconds_vs_floor,
            limit=VS_FLOOR, timing=True))
        fewer = r.bytes_ratio is not None and r.bytes_ratio <= READS_FEWER
        why = f"reads {r.bytes_ratio:.2f}x torch DCP's bytes" if fewer else "reads as many bytes"
        results.append(TargetResult(
            f"{name}: hyperdcp seconds / torch-dcp seconds, loads target ({why})",
            r.seconds_ratio, limit=VS_TORCH_FEWER_BYTES if fewer else VS_TORCH, timing=True))
    return results


# --- the per-rank worker -----------------------------------------------------


def _worker(
    rank: int,
    world_size: int,
    scenarios: list[str],
    config: RunConfig,
    spec: StateDictSpec,
    workdir: str,
) -> list[Sample]:
    systems: list[System] = [SYSTEMS[name]() for name in config.systems]
    mesh = init_device_mesh("cpu", (world_size,))
    loads = [s for s in scenarios if s in LOADS]
    source_layouts = list(
        dict.fromkeys([SAVES[s] for s in scenarios if s in SAVES] + [LOADS[s][0] for s in loads])
    )
    sources = {layout: state_dict(layout, spec, mesh, filled=True) for layout in source_layouts}
    destinations = {
        dst: state_dict(dst, spec, mesh, filled=False) for dst in {LOADS[s][1] for s in loads}
    }
    # the placement measurement's sources: a warm private copy of each target
    warm = {dst: [t.clone() for t in local_tensors(target)]
            for dst, target in destinations.items()} if FLOOR in config.systems else {}
    _warm_up(systems, mesh, Path(workdir) / "warmup")

    samples: list[Sample] = []
    for repeat in range(config.repeat):
        repeat_dir = Path(workdir) / f"repeat{repeat}"

        def path(system: System, layout: str, repeat_dir: Path = repeat_dir) -> str:
            return str(repeat_dir / f"{system.name}-{layout}")

        for step, layout in enumerate(source_layouts):
            for system in rotation(systems, repeat + step):
                if rank == 0:
                    os.sync()  # no earlier writeback running during the save
                m = timed_collective(system.save, sources[layout], path(system, layout))
                if f"save_{layout}" in scenarios:
                    record(samples, FAMILY, f"save_{layout}", "save", system, repeat, m)

        for step, scenario in enumerate(loads, start=len(source_layouts)):
            src, dst = LOADS[scenario]
            target = destinations[dst]
            for system in rotation(systems, repeat + step):
                zero(target)
                if rank == 0 and config.eviction:
                    evict(path(system, src), config.eviction)
                m = timed_collective(system.load, target, path(system, src))
                needed = sum(t.nbytes for t in local_tensors(target))
                floor = getattr(system, "floor", False)
                ok = None if floor else is_correct(target, dst, spec)
                record(samples, FAMILY, scenario, "load", system, repeat, m, needed, ok)
            if FLOOR in config.systems:
                m = timed_collective(_place, target, warm[dst])
                record(samples, FAMILY, scenario, "load", Placement, repeat, m,
                       sum(t.nbytes for t in local_tensors(target)), None)

        dist.barrier()
        if rank == 0:
            shutil.rmtree(repeat_dir, ignore_errors=True)
    return samples


class Placement:
    """The ``memcpy`` row's name in the samples (not a system)."""

    name = PLACEMENT


def _place(target, sources) -> None:
    """Copy ``sources`` (warm tensors shaped like the target's local ones)
    into the target's local tensors: the placement a load pays."""
    for dest, source in zip(local_tensors(target), sources, strict=True):
        dest.copy_(source)


def _warm_up(systems: list[System], mesh: DeviceMesh, workdir: Path) -> None:
    """Save and reshard-load a tiny state dict with each system (imports, lazy
    initialisation, first collectives), unmeasured."""
    for system in systems:
        for layout in ("replicated", "shard0"):
            path = str(workdir / f"{system.name}-{layout}")
            system.save(state_dict(layout, WARMUP, mesh, filled=True), path)
            system.load(state_dict("shard1", WARMUP, mesh, filled=False), path)
