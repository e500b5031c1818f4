"""Result records, their summary over repeats, and the JSON / Markdown output.

A :class:`Sample` is one measured call (one system, scenario, world size and
repeat) with the per-rank ``/proc/self/io`` deltas. :func:`summarize` groups
samples into :class:`Row` s: median and min/max seconds over repeats, bytes per
rank, read amplification against the bytes the load needed, and the ratios of
each system to the baseline measured in the same run.

Reads are counted twice. ``rchar`` is what each rank read through read
syscalls: what it asked of storage, which on a cluster of machines reaches
storage separately for each rank (plus page rounding and readahead there).
``read_bytes`` is what the device served after the checkpoint was evicted from
the page cache; on one machine, ranks reading the same page share one device
read (whichever rank comes first is charged), so only its sum over ranks is
meaningful.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from .systems import BASELINE

MB = 1e6


@dataclass
class Sample:
    family: str
    scenario: str
    kind: str  # "save" or "load"
    world_size: int
    system: str
    repeat: int
    seconds: float  # wall time of the call on the slowest rank
    rank_cpu_seconds: list[float]  # per-rank CPU time of the call (all threads)
    rank_io: list[dict[str, int]]  # per-rank IOCounters deltas
    needed_bytes: list[int] | None = None  # loads: per-rank bytes of the target local shards
    verified: bool | None = None  # loads: every rank's loaded values were correct


@dataclass
class Row:
    scenario: str
    kind: str
    world_size: int
    system: str
    repeats: int
    seconds_median: float
    seconds_min: float
    seconds_max: float
    cpu_seconds: float  # median over repeats of the CPU time summed over ranks
    # Medians over repeats; "per_rank" is the mean over ranks, "max_rank" the busiest rank.
    written_per_rank: float  # write_bytes
    written_max_rank: float
    read_per_rank: float  # rchar: bytes each rank read through read syscalls
    read_max_rank: float
    storage_read_total: float  # read_bytes summed over ranks: bytes fetched from the device
    read_total: float  # max(rchar, read_bytes) summed over ranks, see _read_total
    needed_per_rank: float | None
    read_amplification: float | None  # read_total / needed bytes of all ranks
    verified: bool | None
    seconds_ratio: float | None = None  # this system / baseline, medians
    bytes_ratio: float | None = None  # written (saves) or read (loads), this system / baseline


def _total(sample: Sample, counter: str) -> int:
    return sum(r[counter] for r in sample.rank_io)


def _max(sample: Sample, counter: str) -> int:
    return max(r[counter] for r in sample.rank_io)


def _read_total(sample: Sample) -> int:
    """Bytes the ranks read: logical reads, unless the device served more (reads
    that bypass read syscalls, e.g. mmap, are only seen as storage reads)."""
    return max(_total(sample, "rchar"), _total(sample, "read_bytes"))


def summarize(samples: Iterable[Sample]) -> list[Row]:
    """One row per (scenario, world size, system): scenarios and world sizes in
    first-seen order, the baseline first among the systems."""
    groups: dict[tuple[str, int, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.scenario, s.world_size, s.system), []).append(s)
    first_seen: dict[tuple[str, int], int] = {}
    for key in groups:
        first_seen.setdefault(key[:2], len(first_seen))
    groups = dict(
        sorted(groups.items(), key=lambda kv: (first_seen[kv[0][:2]], kv[0][2] != BASELINE))
    )

    med = statistics.median
    rows = []
    for (scenario, world_size, system), group in groups.items():
        w = world_size
        secs = [s.seconds for s in group]
        needed = group[0].needed_bytes
        read_total = med(_read_total(s) for s in group)
        amplification = read_total / sum(needed) if needed and sum(needed) else None
        verified = None
        if group[0].verified is not None:
            verified = all(s.verified for s in group)
        rows.append(
            Row(
                scenario=scenario,
                kind=group[0].kind,
                world_size=w,
                system=system,
                repeats=len(group),
                seconds_median=med(secs),
                seconds_min=min(secs),
                seconds_max=max(secs),
                cpu_seconds=med(sum(s.rank_cpu_seconds) for s in group),
                written_per_rank=med(_total(s, "write_bytes") for s in group) / w,
                written_max_rank=med(_max(s, "write_bytes") for s in group),
                read_per_rank=med(_total(s, "rchar") for s in group) / w,
                read_max_rank=med(_max(s, "rchar") for s in group),
                storage_read_total=med(_total(s, "read_bytes") for s in group),
                read_total=read_total,
                needed_per_rank=None if needed is None else sum(needed) / w,
                read_amplification=amplification,
                verified=verified,
            )
        )
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[Row]) -> None:
    baseline = {(r.scenario, r.world_size): r for r in rows if r.system == BASELINE}
    for r in rows:
        base = baseline.get((r.scenario, r.world_size))
        if base is None or r.system == BASELINE:
            continue
        r.seconds_ratio = r.seconds_median / base.seconds_median
        if r.kind == "save":
            mine, theirs = r.written_per_rank, base.written_per_rank
        else:
            mine, theirs = r.read_total, base.read_total
        r.bytes_ratio = mine / theirs if theirs else None


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _mb(per_rank: float, max_rank: float) -> str:
    text = f"{per_rank / MB:.0f}"
    if max_rank > 1.05 * per_rank and round(max_rank / MB) != round(per_rank / MB):
        text += f" (max {max_rank / MB:.0f})"
    return text


def markdown_table(rows: list[Row]) -> str:
    """The rows as a GitHub Markdown table (bytes in MB = 1e6 bytes, per rank)."""
    header = [
        "scenario", "W", "system", "seconds: median (min–max)", "× time", "CPU s (all ranks)",
        "written MB/rank", "read MB/rank", "storage read MB (all ranks)", "needed MB/rank",
        "read/needed", "× bytes", "correct",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [
            r.scenario,
            str(r.world_size),
            r.system,
            f"{r.seconds_median:.3f} ({r.seconds_min:.3f}–{r.seconds_max:.3f})",
            _fmt(r.seconds_ratio, ".2f"),
            f"{r.cpu_seconds:.2f}",
            _mb(r.written_per_rank, r.written_max_rank),
            _mb(r.read_per_rank, r.read_max_rank),
            f"{r.storage_read_total / MB:.0f}",
            _fmt(None if r.needed_per_rank is None else r.needed_per_rank / MB, ".0f"),
            _fmt(r.read_amplification, ".2f"),
            _fmt(r.bytes_ratio, ".2f"),
            {None: "–", True: "yes", False: "**NO**"}[r.verified],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass
class TargetResult:
    """An upper limit on a measured value (a ratio or an amplification)."""

    description: str
    measured: float | None  # None: the run did not include what the target needs
    limit: float
    timing: bool  # rests on wall times (unreliable on a busy machine)
    passed: bool | None = None  # None: not measured

    def __post_init__(self) -> None:
        if self.measured is not None:
            self.passed = self.measured <= self.limit


def markdown_targets(targets: list[TargetResult], timings_reliable: bool) -> str:
    lines = []
    for t in targets:
        verdict = {None: "not measured", True: "PASS", False: "FAIL"}[t.passed]
        if t.timing and t.passed is not None and not timings_reliable:
            verdict += " (busy machine: unreliable)"
        measured = _fmt(t.measured, ".2f")
        lines.append(f"- {verdict}: {t.description}: {measured} (limit {t.limit:g})")
    return "\n".join(lines)


def write_results(
    out_dir: Path,
    environment: dict[str, Any],
    samples: list[Sample],
    rows: list[Row],
    targets: list[TargetResult],
    notes: list[str],
    timings_reliable: bool,
    tables: dict[str, list[dict]] | None = None,
    sections: dict[str, str] | None = None,
) -> tuple[Path, Path, str]:
    """Write ``results.json`` and ``results.md`` into ``out_dir``; return their
    paths and the Markdown text.  ``tables``: the rows of the families with
    tables of their own (JSON), ``sections`` their Markdown tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    md_path = out_dir / "results.md"
    json_path.write_text(
        json.dumps(
            {
                "environment": environment,
                "summary": [asdict(r) for r in rows],
                "targets": [asdict(t) for t in targets],
                "samples": [asdict(s) for s in samples],
                "tables": tables or {},
            },
            indent=2,
        )
        + "\n"
    )
    md = "\n\n".join(
        [
            "# hyperdcp benchmarks",
            markdown_table(rows) if rows else "(no save/load scenario run)",
            *(f"## {name}\n\n{text}" for name, text in (sections or {}).items()),
            "## Targets\n\n" + (markdown_targets(targets, timings_reliable) or "(none)"),
            "## Notes\n\n" + "\n".join(f"- {n}" for n in notes),
        ]
    )
    md_path.write_text(md + "\n")
    return json_path, md_path, md
