"""``python -m benchmarks``: run every benchmark, write JSON + Markdown + PNG, print the tables.

    python -m benchmarks [--scenario NAME ...] [--world-sizes 2 4] [--repeat 3] [--out DIR]

Scenarios: the sync save/load family and the many-small-tensors family
(hyperdcp and torch DCP measured in the same process groups, one row per
system), and the families with tables of their own — ``async_save``,
``storage``, ``convert``, ``scale``, ``coordination`` — each one scenario.
``--list`` shows them all; each runs alone with ``--scenario NAME``.
``--quick`` uses tiny inputs, to check that the harness works (its numbers
mean nothing). Timings are only worth something on an otherwise idle
machine: the CPU time that other processes took during the run is recorded,
and a busy machine is flagged.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import async_save, convert, coordination, scale, small_tensors, storage, sync_save_load
from .chart import write_chart
from .common import ForeignCpu, RunConfig, probe_eviction
from .report import summarize, write_results
from .systems import BASELINE, SYSTEMS, check_available

#: Scenario families: modules with SCENARIOS (name -> description),
#: run(scenarios, config) -> samples and targets(rows) -> target results.
FAMILIES = (sync_save_load, small_tensors)


def _run_async(config: RunConfig, out: Path) -> list[dict]:
    return async_save.run(out, world_sizes=config.world_sizes, repeat=config.repeat,
                          quick=config.quick, scratch=config.scratch)


def _run_storage(config: RunConfig, out: Path) -> list[dict]:
    return storage.run(out, repeat=config.repeat, quick=config.quick, scratch=config.scratch)


def _run_convert(config: RunConfig, out: Path) -> list[dict]:
    return convert.run(out, size_gib=0.05 if config.quick else 1.2, repeat=config.repeat,
                       scratch=config.scratch)


def _run_scale(config: RunConfig, out: Path) -> list[dict]:
    return scale.run(out, repeat=config.repeat, quick=config.quick)


def _run_coordination(config: RunConfig, out: Path) -> list[dict]:
    return coordination.run(out, repeat=config.repeat, quick=config.quick,
                            scratch=config.scratch)


#: Families with tables of their own, one scenario each: name ->
#: (description, module with markdown(rows), runner(config, out_dir) -> rows).
TABLES = {
    "async_save": ("async save stall, total and training loop time lost, vs torch DCP's "
                   "THREAD and PROCESS modes", async_save, _run_async),
    "storage": ("S3 (moto) vs raw s3fs; memory://, shm://, POSIX", storage, _run_storage),
    "convert": ("safetensors / torch DCP conversions vs cp", convert, _run_convert),
    "scale": ("planning and metadata of a 505B-class model on 1k-16k simulated ranks",
              scale, _run_scale),
    "coordination": ("file-flag protocol with 64-512 simulated ranks; gloo with 2-8",
                     coordination, _run_coordination),
}


def _scenarios() -> dict[str, object]:
    found: dict[str, object] = {name: family for family in FAMILIES for name in family.SCENARIOS}
    found.update({name: name for name in TABLES})
    return found


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", nargs="+", metavar="NAME", choices=sorted(_scenarios()),
                        help="scenarios to run (default: all; see --list)")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4], metavar="W")
    parser.add_argument("--repeat", type=int, default=3, help="repeats per measurement (default 3)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS),
                        help=f"systems to compare (default: all; ratios are to {BASELINE})")
    parser.add_argument("--scratch", default=tempfile.gettempdir(),
                        help="where checkpoints are written (a fresh subdirectory, removed after)")
    parser.add_argument("--quick", action="store_true", help="tiny state dicts: a harness check")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.repeat < 1 or min(args.world_sizes) < 1:
        parser.error("--repeat and --world-sizes must be positive")
    return args


def _git_version() -> str | None:
    """The checked-out commit, ``-dirty`` if the work tree has changes."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"],
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    scenarios = _scenarios()
    if args.list:
        for family in FAMILIES:
            print(f"{family.FAMILY}:")
            for name, description in family.SCENARIOS.items():
                print(f"  {name:<28} {description}")
        print("families with their own tables:")
        for name, (description, _, _) in TABLES.items():
            print(f"  {name:<28} {description}")
        return 0

    problems = [p for p in map(check_available, args.systems) if p]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2

    selected = args.scenario or list(scenarios)
    foreign_cpu = ForeignCpu()
    scratch = Path(tempfile.mkdtemp(prefix="hyperdcp-bench-", dir=args.scratch))
    try:
        eviction = probe_eviction(scratch)
        config = RunConfig(
            systems=tuple(args.systems),
            world_sizes=tuple(args.world_sizes),
            repeat=args.repeat,
            scratch=str(scratch),
            eviction=eviction,
            quick=args.quick,
        )
        samples, targets, tables = [], [], {}
        for family in FAMILIES:
            names = [n for n in selected if scenarios[n] is family]
            if names:
                samples += family.run(names, config)
        for name, (_, _, runner) in TABLES.items():
            if name in selected:
                print(f"[{name}]", file=sys.stderr)
                tables[name] = runner(config, args.out / name)
        rows = summarize(samples)
        for family in FAMILIES:
            targets += family.targets(rows)
        if tables.get("scale"):
            targets += scale.targets(tables["scale"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    foreign = foreign_cpu.fraction()

    environment = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "git": _git_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "page_cache_eviction": eviction,
        "foreign_cpu_fraction": round(foreign, 3),
        "quick": args.quick,
    }
    sections = {name: TABLES[name][1].markdown(table) for name, table in tables.items() if table}
    json_path, md_path, markdown = write_results(
        args.out, environment, samples, rows, targets, _notes(eviction, args.repeat, foreign),
        timings_reliable=foreign <= BUSY, tables=tables, sections=sections,
    )
    chart = write_chart(args.out / "results.png", rows, tables)
    print(markdown)
    if foreign > BUSY:
        print(f"\nwarning: other processes used {foreign:.0%} of the CPUs: timings unreliable",
              file=sys.stderr)
    print(f"\nwrote {json_path}, {md_path}" + (f" and {chart}" if chart else ""), file=sys.stderr)
    return 0


#: Share of the CPUs used by other processes above which timings are flagged.
BUSY = 0.1


def _notes(eviction: str | None, repeat: int, foreign: float) -> list[str]:
    if eviction:
        storage = (
            "storage read = `read_bytes` summed over ranks: bytes the device served, the "
            f"checkpoint's file pages having been evicted before each load ({eviction}); "
            "ranks reading the same page share one device read on one machine"
        )
    else:
        storage = (
            "storage read: not measurable here (no page-cache eviction made `read_bytes` "
            "count), so read/needed rests on `rchar` alone"
        )
    busy = (
        f"**timings unreliable**: other processes used {foreign:.0%} of the CPUs during the run"
        if foreign > BUSY
        else f"other processes used {foreign:.0%} of the CPUs during the run"
    )
    return [
        busy,
        f"seconds: wall time of one save/load call on the slowest rank (fsync included), "
        f"median and range over {repeat} repeat(s); the systems' order rotates by one place "
        "between repeats and between consecutive scenarios (small tensors: alternates)",
        "CPU s: CPU time of the call (all threads) summed over ranks, median over repeats; "
        "less affected by other processes than seconds, but not immune",
        "bytes per rank: /proc/self/io deltas around the call, mean over ranks "
        "(busiest rank in parentheses when over 5% above the mean); MB = 1e6 bytes",
        "written = `write_bytes` (bytes dirtied for storage)",
        "read = `rchar`: bytes the rank read through read syscalls (page-cache hits included; "
        "data received from other ranks is not counted)",
        storage,
        "needed = bytes of the target state dict's local tensors on the rank",
        "read/needed = max(read, storage read) / needed, all ranks together",
        f"× time, × bytes: this system / {BASELINE} from the same run "
        "(bytes: written for saves, max(read, storage read) for loads)",
        "correct: every rank's loaded values were checked after each load",
    ]


if __name__ == "__main__":
    sys.exit(main())
