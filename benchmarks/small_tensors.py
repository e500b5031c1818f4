"""Many small tensors: per-tensor overhead of save and load.

State dict: :data:`COUNT` plain fp32 tensors of 256 elements (1 KiB each,
4,000 x 1 KiB = 4 MiB), replicated on every rank, as the many small
parameters and optimizer entries of a real model.  For each world size one
process group saves it with each system and loads it back into zeroed
tensors, ``repeat`` times, the systems' order rotating between repeats;
every load is checked element-exact.  Target: hyperdcp <= 0.25x torch DCP's
time, for save and for load.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from .common import RunConfig, launch, record, rotation, timed_collective
from .report import IO_COLUMNS, Row, Sample, TargetResult
from .systems import SYSTEMS

FAMILY = "small_tensors"
COLUMNS = IO_COLUMNS
COUNT, ELEMENTS = 4000, 256
QUICK_COUNT = 200
TARGET = 0.25
SCENARIOS = {
    "save_small_tensors": f"save {COUNT} x 1 KiB replicated tensors",
    "load_small_tensors": f"load {COUNT} x 1 KiB replicated tensors",
}


def _state(count: int, filled: bool) -> dict[str, torch.Tensor]:
    return {f"params.{i:05d}": (torch.full((ELEMENTS,), float(i)) if filled
                                else torch.zeros(ELEMENTS)) for i in range(count)}


def run(scenarios: list[str], config: RunConfig) -> list[Sample]:
    """Measure ``scenarios`` (both are measured together; the ones not asked
    for are dropped) at every world size."""
    count = QUICK_COUNT if config.quick else COUNT
    samples: list[Sample] = []
    for world_size in config.world_sizes:
        workdir = Path(config.scratch) / f"{FAMILY}-w{world_size}"
        workdir.mkdir(parents=True)
        try:
            print(f"[{FAMILY}] W={world_size}", file=sys.stderr)
            measured = launch(_worker, world_size, config, count, str(workdir))[0]
            samples += [s for s in measured if s.scenario in scenarios]
        finally:
            shutil.rmtree(workdir)
    return samples


def targets(rows: list[Row]) -> list[TargetResult]:
    """hyperdcp / torch-dcp seconds, per scenario and world size."""
    return [TargetResult(f"{r.scenario} W={r.world_size}: hyperdcp seconds / torch-dcp seconds",
                         r.seconds_ratio, limit=TARGET, timing=True)
            for r in rows if r.scenario in SCENARIOS and r.system == "hyperdcp"]


def _worker(rank: int, world_size: int, config: RunConfig, count: int,
            workdir: str) -> list[Sample]:
    systems = [SYSTEMS[name]() for name in config.systems
               if not getattr(SYSTEMS[name], "floor", False)]
    source, target = _state(count, True), _state(count, False)
    for system in systems:  # imports and first collectives, unmeasured
        system.save(_state(4, True), f"{workdir}/warmup-{system.name}")
        system.load(_state(4, False), f"{workdir}/warmup-{system.name}")
    samples: list[Sample] = []
    needed = count * ELEMENTS * 4
    for repeat in range(config.repeat):
        for system in rotation(systems, repeat):
            path = f"{workdir}/r{repeat}-{system.name}"
            save = timed_collective(system.save, source, path)
            for t in target.values():
                t.zero_()
            load = timed_collective(system.load, target, path)
            ok = all(torch.equal(target[k], v) for k, v in source.items())
            record(samples, FAMILY, "save_small_tensors", "save", system, repeat, save)
            record(samples, FAMILY, "load_small_tensors", "load", system, repeat, load, needed, ok)
    return samples
