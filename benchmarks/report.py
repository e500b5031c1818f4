"""Result records, their summary over repeats, and the one JSON / Markdown
table writer of the benchmarks.

Tables: :func:`markdown_table` renders any rows (dataclasses or dicts) as a
GitHub Markdown table from a list of :data:`Column` s (header, cell
function); each family names its columns and nothing else, and
:func:`write_table` writes a family's rows as ``NAME.json`` and its table as
``NAME.md``.  :func:`write_results` writes a whole run (``results.json``,
``results.md``).  Rows of repeated runs of one measurement are summarised by
:func:`summarize_runs` (dict rows) or :func:`summarize` (:class:`Sample` s),
and :func:`median_range` formats a median with its range.

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
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from .systems import BASELINE, FLOOR

MB = 1e6

#: A table column: its header and the function giving a row's cell.
Column = tuple[str, Callable[[Any], str]]


def markdown_table(rows: Iterable[Any], columns: Sequence[Column]) -> str:
    """``rows`` as a GitHub Markdown table, one line per row."""
    lines = ["| " + " | ".join(header for header, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_table(out_dir: str | os.PathLike, name: str, rows: list[Any], markdown: str) -> None:
    """``rows`` as ``out_dir/NAME.json`` and ``markdown`` (their table) as
    ``out_dir/NAME.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = [asdict(r) if is_dataclass(r) else r for r in rows]
    (out / f"{name}.json").write_text(json.dumps(records, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown + "\n")


def summarize_runs(runs: list[dict]) -> dict:
    """One row from repeated runs of one measurement: every ``*_s`` key
    becomes the median (seconds), with ``*_s_range`` = [min, max]; other
    keys come from the first run; ``repeat`` counts the runs."""
    row = dict(runs[0])
    for key in list(row):
        if key.endswith("_s"):
            values = [r[key] for r in runs]
            row[key] = statistics.median(values)
            row[f"{key}_range"] = [min(values), max(values)]
    row["repeat"] = len(runs)
    return row


def median_range(row: dict, key: str, spec: str = ".3f") -> str:
    """A :func:`summarize_runs` value as ``median (min–max)``; ``–`` if the
    row lacks it."""
    if key not in row:
        return "–"
    lo, hi = row.get(f"{key}_range", (row[key], row[key]))
    return f"{row[key]:{spec}} ({lo:{spec}}–{hi:{spec}})"


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, ``–`` for None."""
    return "–" if value is None else format(value, spec)


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
    # loads: per-rank storage requests the system reports (hyperdcp's LoadReport.requests,
    # the floors' reads); None where it reports none
    rank_requests: list[int | None] | None = None
    server: dict[str, int] | None = None  # object store: requests by method and "GET bytes"
    checkpoint_bytes: int | None = None  # bytes of the checkpoint's tensors


@dataclass
class Row:
    family: str
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
    requests_per_rank: float | None = None  # the system's reported requests, mean over ranks
    requests_max_rank: float | None = None
    get_requests: float | None = None  # object store: GET requests the server answered
    get_bytes: float | None = None  # object store: bytes of the GET responses' bodies
    server_requests: float | None = None  # object store: requests of every method
    checkpoint_bytes: int | None = None
    seconds_ratio: float | None = None  # this system / baseline, medians
    bytes_ratio: float | None = None  # written (saves) or read (loads), this system / baseline
    seconds_vs_floor: float | None = None  # this system / the floor, medians


def _total(sample: Sample, counter: str) -> int:
    return sum(r[counter] for r in sample.rank_io)


def _max(sample: Sample, counter: str) -> int:
    return max(r[counter] for r in sample.rank_io)


def _read_total(sample: Sample) -> int:
    """Bytes the ranks read: logical reads, unless the device served more (reads
    that bypass read syscalls, e.g. mmap, are only seen as storage reads)."""
    return max(_total(sample, "rchar"), _total(sample, "read_bytes"))


def _all_requests(server: dict[str, int]) -> int:
    """Requests of every method in a server's counts (its other keys count
    bytes, or requests again)."""
    return sum(n for key, n in server.items() if " " not in key)


def _median_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.median(values)


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
        first = group[0]
        needed = first.needed_bytes
        read_total = med(_read_total(s) for s in group)
        amplification = read_total / sum(needed) if needed and sum(needed) else None
        verified = None
        if first.verified is not None:
            verified = all(s.verified for s in group)
        requests = [s.rank_requests for s in group]
        known = all(r is not None and None not in r for r in requests)
        server = [s.server for s in group]
        rows.append(
            Row(
                family=first.family,
                scenario=scenario,
                kind=first.kind,
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
                requests_per_rank=med(sum(r) / w for r in requests) if known else None,
                requests_max_rank=med(max(r) for r in requests) if known else None,
                get_requests=_median_or_none([None if v is None else v.get("GET", 0)
                                              for v in server]),
                get_bytes=_median_or_none([None if v is None else v.get("GET bytes", 0)
                                           for v in server]),
                server_requests=_median_or_none([None if v is None else _all_requests(v)
                                                 for v in server]),
                checkpoint_bytes=first.checkpoint_bytes,
            )
        )
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[Row]) -> None:
    baseline = {(r.scenario, r.world_size): r for r in rows if r.system == BASELINE}
    floor = {(r.scenario, r.world_size): r for r in rows if r.system == FLOOR}
    for r in rows:
        low = floor.get((r.scenario, r.world_size))
        if low is not None and r.system != FLOOR:
            r.seconds_vs_floor = r.seconds_median / low.seconds_median
        base = baseline.get((r.scenario, r.world_size))
        if base is None or r.system == BASELINE:
            continue
        r.seconds_ratio = r.seconds_median / base.seconds_median
        if r.kind == "save":
            mine, theirs = r.written_per_rank, base.written_per_rank
        else:
            mine, theirs = r.read_total, base.read_total
        r.bytes_ratio = mine / theirs if theirs else None


def _mb(per_rank: float, max_rank: float) -> str:
    text = f"{per_rank / MB:.0f}"
    if max_rank > 1.05 * per_rank and round(max_rank / MB) != round(per_rank / MB):
        text += f" (max {max_rank / MB:.0f})"
    return text


def seconds_cell(r: Row) -> str:
    return f"{r.seconds_median:.3f} ({r.seconds_min:.3f}–{r.seconds_max:.3f})"


def requests_cell(r: Row) -> str:
    """The system's reported requests per rank (mean, busiest rank if above it)."""
    if r.requests_per_rank is None:
        return "–"
    mean = r.requests_per_rank
    text = f"{mean:.1f}" if mean != round(mean) and mean < 10 else f"{mean:.0f}"
    if r.requests_max_rank > 1.05 * mean:
        text += f" (max {r.requests_max_rank:.0f})"
    return text


def verified_cell(r: Row) -> str:
    return {None: "–", True: "yes", False: "**NO**"}[r.verified]


#: The columns of the save/load tables on files (bytes in MB = 1e6 bytes, per rank).
IO_COLUMNS: list[Column] = [
    ("scenario", lambda r: r.scenario),
    ("W", lambda r: str(r.world_size)),
    ("system", lambda r: r.system),
    ("seconds: median (min–max)", seconds_cell),
    ("× time", lambda r: fmt(r.seconds_ratio, ".2f")),
    ("× floor", lambda r: fmt(r.seconds_vs_floor, ".2f")),
    ("CPU s (all ranks)", lambda r: f"{r.cpu_seconds:.2f}"),
    ("written MB/rank", lambda r: _mb(r.written_per_rank, r.written_max_rank)),
    ("read MB/rank", lambda r: _mb(r.read_per_rank, r.read_max_rank)),
    ("read requests/rank", requests_cell),
    ("storage read MB (all ranks)", lambda r: f"{r.storage_read_total / MB:.0f}"),
    ("needed MB/rank",
     lambda r: fmt(None if r.needed_per_rank is None else r.needed_per_rank / MB, ".0f")),
    ("read/needed", lambda r: fmt(r.read_amplification, ".2f")),
    ("× bytes", lambda r: fmt(r.bytes_ratio, ".2f")),
    ("correct", verified_cell),
]


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
        measured = fmt(t.measured, ".2f")
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
    tables of their own (JSON); ``sections``: every Markdown table of the
    run, by title."""
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
            *(f"## {name}\n\n{text}" for name, text in (sections or {}).items()),
            "## Targets\n\n" + (markdown_targets(targets, timings_reliable) or "(none)"),
            "## Notes\n\n" + "\n".join(f"- {n}" for n in notes),
        ]
    )
    md_path.write_text(md + "\n")
    return json_path, md_path, md
