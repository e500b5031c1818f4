"""Startup: how long the ``hyperdcp`` command and ``import dcp`` take.

Each command runs ``repeat`` times, every time in a fresh process of this
run's interpreter (its environment passed on, ``PYTHONPATH`` included), the
commands interleaved so that a busy spell touches them all alike.  Per
command: the wall time of the process from start to exit and its CPU time
(user + system, which other processes on the machine inflate less), median
and range; and, from one more run under ``python -X importtime``, how many
modules it imports and whether torch is one of them.

Two floors from the same run: ``python -c pass``, the interpreter's own
start, and ``python -c "import torch"``, what any command that touches a
tensor pays.  ``hyperdcp`` is the console script installed beside the
interpreter (``setup.cfg``'s entry point), else ``python -m dcp``.  The
issue's target: ``hyperdcp --version`` and ``--help`` in at most 0.3 s.

    python -m benchmarks.startup [--repeat 10]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from .report import Column, TargetResult, markdown_table, median_range, summarize_runs, write_table

#: The issue's limit on ``hyperdcp --version`` and ``hyperdcp --help`` (s).
TARGET_S = 0.3


def commands() -> dict[str, list[str]]:
    """Each measured command line, by the name its row shows."""
    script = shutil.which("hyperdcp", path=sysconfig.get_path("scripts"))
    hyperdcp = [sys.executable, script] if script else [sys.executable, "-m", "dcp"]
    python = [sys.executable, "-c"]
    return {
        "hyperdcp --version": [*hyperdcp, "--version"],
        "hyperdcp --help": [*hyperdcp, "--help"],
        "hyperdcp list --help": [*hyperdcp, "list", "--help"],
        'python -c "import dcp"': [*python, "import dcp"],
        'python -c "import dcp; dcp.save"': [*python, "import dcp; dcp.save"],
        'python -c "import torch" (floor)': [*python, "import torch"],
        "python -c pass (floor)": [*python, "pass"],
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(argv: list[str]) -> dict:
    """One fresh process: its wall and CPU seconds."""
    cpu, start = _children_cpu(), time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr[-2000:]}")
    return {"wall_s": wall, "cpu_s": _children_cpu() - cpu}


def imported(argv: list[str]) -> list[str]:
    """The modules ``argv`` (a Python command line) imports, in the order
    ``-X importtime`` reports them."""
    done = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=True)
    return [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:") and not line.endswith("| imported package")]


def run(out_dir, *, repeat: int = 10) -> list[dict]:
    """Measure every command ``repeat`` times; one row per command with the
    medians of ``wall_s`` and ``cpu_s`` and their ranges, ``modules`` and
    ``torch``.  Written to ``out_dir/startup.json`` and ``startup.md``."""
    lines = commands()
    runs: dict[str, list[dict]] = {name: [] for name in lines}
    for _ in range(repeat):
        for name, argv in lines.items():
            runs[name].append(_timed(argv))
    rows = []
    for name, argv in lines.items():
        modules = imported(argv)
        rows.append(summarize_runs([{"command": name, **r, "modules": len(modules),
                                     "torch": "torch" in modules} for r in runs[name]]))
    write_table(out_dir, "startup", rows, markdown(rows))
    return rows


COLUMNS: list[Column] = [
    ("command", lambda r: f"`{r['command']}`"),
    ("wall s", lambda r: median_range(r, "wall_s")),
    ("CPU s", lambda r: median_range(r, "cpu_s")),
    ("modules imported", lambda r: str(r["modules"])),
    ("torch imported", lambda r: "yes" if r["torch"] else "no"),
]


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (seconds: median (min–max))."""
    return markdown_table(rows, COLUMNS)


def targets(rows: list[dict]) -> list[TargetResult]:
    """The issue's limit on ``hyperdcp --version`` and ``--help``."""
    by_name = {r["command"]: r for r in rows}
    return [TargetResult(f"startup: `{name}` s", by_name[name]["wall_s"] if name in by_name
                         else None, TARGET_S, timing=True)
            for name in ("hyperdcp --version", "hyperdcp --help")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="runs per command (default 10)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    print(markdown(run(args.out, repeat=args.repeat)))


if __name__ == "__main__":
    main()
