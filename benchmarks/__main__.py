"""``python -m benchmarks``: run every benchmark, write JSON + Markdown + PNG, print the tables.

    python -m benchmarks [--scenario NAME ...] [--world-sizes 2 4] [--repeat 3] [--out DIR]

Scenarios: the sync save/load family, the many-small-tensors family and
the S3 load family (hyperdcp, torch DCP and the storage's floor measured in
the same process groups, one row per system), and the families with tables
of their own — ``async_save``, ``storage``, ``convert``, ``scale``,
``coordination``, ``startup`` — each one scenario.  ``--list`` shows them
all; each runs alone with ``--scenario NAME``, and ``--scenario FAMILY``
runs a family's scenarios (e.g. ``--scenario s3_load``).  Without the bench extra
(matplotlib, s3fs, moto) ``--help`` and ``--list`` work, the families that
need it refuse to run, and no chart is drawn.
``--quick`` uses tiny inputs, to check that the harness works (its numbers
mean nothing). Timings are only worth something on an otherwise idle
machine: the CPU time that other processes took during the run is recorded,
and a busy machine is flagged.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import (
    async_save,
    convert,
    coordination,
    recovery,
    s3_load,
    scale,
    small_tensors,
    startup,
    storage,
    sync_save_load,
)
from .chart import write_chart
from .common import ForeignCpu, RunConfig, probe_eviction
from .report import markdown_table, summarize, write_results
from .systems import BASELINE, SYSTEMS, check_available

#: Scenario families: modules with FAMILY (its name), SCENARIOS (name ->
#: description), COLUMNS (of its table), run(scenarios, config) -> samples
#: and targets(rows) -> target results; NEEDS (optional): the modules it
#: imports when it runs.
FAMILIES = (sync_save_load, small_tensors, s3_load)


def _run_async(config: RunConfig, out: Path) -> list[dict]:
    return async_save.run(out, world_sizes=config.world_sizes, repeat=config.repeat,
                          quick=config.quick, scratch=config.scratch)


def _run_async_resume(config: RunConfig, out: Path) -> list[dict]:
    return async_save.run_resume(out, world_sizes=config.world_sizes, quick=config.quick,
                                 scratch=config.scratch)


def _run_storage(config: RunConfig, out: Path) -> list[dict]:
    return storage.run(out, repeat=config.repeat, quick=config.quick, scratch=config.scratch)


def _run_convert(config: RunConfig, out: Path) -> list[dict]:
    return convert.run(out, size_gib=0.05 if config.quick else 1.2, repeat=config.repeat,
                       scratch=config.scratch)


def _run_scale(config: RunConfig, out: Path) -> list[dict]:
    return scale.run(out, repeat=config.repeat, quick=config.quick)


def _run_startup(config: RunConfig, out: Path) -> list[dict]:
    return startup.run(out, repeat=2 if config.quick else max(10, config.repeat))


def _run_recovery(config: RunConfig, out: Path) -> list[dict]:
    return recovery.run(out, repeat=config.repeat, quick=config.quick, scratch=config.scratch)


def _run_coordination(config: RunConfig, out: Path) -> list[dict]:
    return coordination.run(out, repeat=config.repeat, quick=config.quick,
                            scratch=config.scratch)


#: Families with tables of their own, one scenario each: name ->
#: (description, markdown(rows) -> table, runner(config, out_dir) -> rows).
TABLES = {
    "async_save": ("async save stall, total and training loop time lost, vs torch DCP's "
                   "THREAD and PROCESS modes", async_save.markdown, _run_async),
    "async_resume": ("block time of async saves 1-5 after a resume, the background process "
                     "started cold or prestarted", async_save.markdown_resume,
                     _run_async_resume),
    "storage": ("S3 (moto) vs raw s3fs; memory://, shm://, POSIX", storage.markdown,
                _run_storage),
    "convert": ("safetensors / torch DCP conversions vs cp", convert.markdown, _run_convert),
    "scale": ("planning and metadata of a 505B-class model on 1k-16k simulated ranks",
              scale.markdown, _run_scale),
    "coordination": ("file-flag protocol with 64-512 simulated ranks; gloo with 2-8",
                     coordination.markdown, _run_coordination),
    "startup": ("hyperdcp --version/--help and import dcp, fresh processes, vs import torch",
                startup.markdown, _run_startup),
    "recovery": ("memory tier on 4 ranks, 2 simulated hosts: restore after a crash or a lost "
                 "host vs memcpy and PGTransport, save stall, loop loss, host memory, SDC, "
                 "bookkeeping at 10,240 ranks", recovery.markdown, _run_recovery),
}


def _scenarios() -> dict[str, object]:
    """Scenario name -> its family module, or the name of a family with a
    table of its own."""
    found: dict[str, object] = {name: family for family in FAMILIES for name in family.SCENARIOS}
    found.update({name: name for name in TABLES})
    return found


def _selected(names: list[str] | None) -> list[str]:
    """The scenarios named (a family's name stands for all its scenarios),
    in the order given; all of them by default."""
    if not names:
        return list(_scenarios())
    families = {family.FAMILY: list(family.SCENARIOS) for family in FAMILIES}
    return list(dict.fromkeys(n for name in names for n in families.get(name, [name])))


#: Modules the families with tables of their own import when they run.
TABLE_NEEDS = {"storage": ("s3fs", "moto", "pytest")}


def _missing(selected: list[str]) -> list[str]:
    """Why selected scenarios cannot run here: the modules they need that
    are not installed."""
    scenarios = _scenarios()
    problems = []
    for family in FAMILIES:
        if any(scenarios[n] is family for n in selected):
            problems.append((family.FAMILY, getattr(family, "NEEDS", ())))
    problems += [(name, TABLE_NEEDS.get(name, ())) for name in TABLES if name in selected]
    out = []
    for name, needs in problems:
        absent = [m for m in needs if importlib.util.find_spec(m) is None]
        if absent:
            out.append(f"{name} needs {', '.join(absent)}: pip install -e '.[bench]'"
                       + (" pytest" if "pytest" in absent else ""))
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n")[0])
    families = [family.FAMILY for family in FAMILIES]
    parser.add_argument("--scenario", nargs="+", metavar="NAME",
                        choices=sorted(_scenarios()) + families,
                        help="scenarios or families to run (default: all; see --list)")
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
            print(f"{family.FAMILY} (--scenario {family.FAMILY} runs them all):")
            for name, description in family.SCENARIOS.items():
                print(f"  {name:<34} {description}")
        print("families with their own tables:")
        for name, (description, _, _) in TABLES.items():
            print(f"  {name:<34} {description}")
        return 0

    selected = _selected(args.scenario)
    problems = [p for p in map(check_available, args.systems) if p] + _missing(selected)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2

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
            if any(scenarios[n] is family for n in selected):
                targets += family.targets([r for r in rows if r.family == family.FAMILY])
        if tables.get("scale"):
            targets += scale.targets(tables["scale"])
        if tables.get("startup"):
            targets += startup.targets(tables["startup"])
        if tables.get("recovery"):
            targets += recovery.targets(tables["recovery"])
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
    sections = {}
    for family in FAMILIES:
        mine = [r for r in rows if r.family == family.FAMILY]
        if mine:
            sections[family.FAMILY] = markdown_table(mine, family.COLUMNS)
    sections.update({name: TABLES[name][1](table)
                     for name, table in tables.items() if table})
    families = {r.family for r in rows}
    notes = _notes(eviction, args.repeat, foreign,
                   files=bool(families - {s3_load.FAMILY}), s3=s3_load.FAMILY in families)
    json_path, md_path, markdown = write_results(
        args.out, environment, samples, rows, targets, notes,
        timings_reliable=foreign <= BUSY, tables=tables, sections=sections,
    )
    chart = None
    if importlib.util.find_spec("matplotlib") is not None:
        chart = write_chart(args.out / "results.png", rows, tables)
    else:
        print("no chart: matplotlib is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
    print(markdown)
    if foreign > BUSY:
        print(f"\nwarning: other processes used {foreign:.0%} of the CPUs: timings unreliable",
              file=sys.stderr)
    print(f"\nwrote {json_path}, {md_path}" + (f" and {chart}" if chart else ""), file=sys.stderr)
    return 0


#: Share of the CPUs used by other processes above which timings are flagged.
BUSY = 0.1


def _notes(eviction: str | None, repeat: int, foreign: float, files: bool,
           s3: bool) -> list[str]:
    """The notes under the tables: the general ones, those of the families
    on files (``files``) and those of the S3 loads (``s3``)."""
    busy = (
        f"**timings unreliable**: other processes used {foreign:.0%} of the CPUs during the run"
        if foreign > BUSY
        else f"other processes used {foreign:.0%} of the CPUs during the run"
    )
    if not (files or s3):
        return [busy]
    notes = [
        busy,
        f"seconds: wall time of one save/load call on the slowest rank (fsync included), "
        f"median and range over {repeat} repeat(s); the systems' order rotates by one place "
        "between repeats and between consecutive scenarios",
        f"× time: this system / {BASELINE} from the same run (seconds); × floor: this "
        "system / `floor` from the same run (seconds)",
    ]
    if files:
        notes += _FILE_NOTES + [_storage_note(eviction)]
    if s3:
        notes += S3_NOTES
    notes.append("correct: every rank's loaded values were checked element-exact after each "
                 "load (not the floor's: it places nothing)")
    return notes


def _storage_note(eviction: str | None) -> str:
    if eviction:
        return (
            "storage read = `read_bytes` summed over ranks: bytes the device served, the "
            f"checkpoint's file pages having been evicted before each load ({eviction}); "
            "ranks reading the same page share one device read on one machine"
        )
    return (
        "storage read: not measurable here (no page-cache eviction made `read_bytes` "
        "count), so read/needed rests on `rchar` alone"
    )


_FILE_NOTES = [
    "CPU s: CPU time of the call (all threads) summed over ranks, median over repeats; "
    "less affected by other processes than seconds, but not immune",
    "bytes per rank: /proc/self/io deltas around the call, mean over ranks "
    "(busiest rank in parentheses when over 5% above the mean); MB = 1e6 bytes",
    "written = `write_bytes` (bytes dirtied for storage)",
    "read = `rchar`: bytes the rank read through read syscalls (page-cache hits included; "
    "data received from other ranks is not counted)",
    "read requests/rank: the storage reads the system reports for the load "
    "(hyperdcp's `LoadReport.requests`, where it has them; the floor's `preadv` calls), "
    "mean over ranks (busiest rank in parentheses); torch DCP reports none",
    "needed = bytes of the target state dict's local tensors on the rank",
    "read/needed = max(read, storage read) / needed, all ranks together",
    f"× bytes: this system / {BASELINE} from the same run (written for saves, "
    "max(read, storage read) for loads)",
]


S3_NOTES = [
    "s3_load: moto's S3 server on 127.0.0.1 in the benchmark's process, the ranks in "
    "spawned processes; GET requests, all requests (every method) and GET MB (bytes of "
    "the GET response bodies) are counted at the server for each load, counters reset "
    "before it; GET bytes / checkpoint: GET MB over the checkpoint's tensor bytes",
    "s3_load: reported requests/rank: hyperdcp's `LoadReport.requests` where it has them, "
    "the floor's GETs; torch DCP reports none",
]


if __name__ == "__main__":
    sys.exit(main())
