"""Coordination at scale: the two coordination steps of a save with many ranks.

* ``file``: the file-flag protocol (:class:`dcp.coordination.file_flag.FileCoordinator`)
  over the POSIX plugin (default options: fsync on), real exchange files in
  one checkpoint directory, 64 to 512 simulated ranks played in turn in one
  process (see :func:`measure_file`: one thread per rank would measure the
  GIL, not the protocol);
* ``gloo``: :class:`dcp.coordination.collectives.Coordinator` over a gloo process group
  of spawned processes running in parallel (small world sizes: one process
  per rank on this machine).

Both drive the steps of :meth:`dcp.orchestration.save._Save.run` with the payloads of
the 505B-class layout of :mod:`benchmarks.scale` (TP x PP x DP): step 1
(*plans*) gathers every rank's local save plan and answers each rank with
its final plan from ``DefaultSavePlanner.create_global_plan``; step 2
(*results*) gathers the write results and answers everyone with the
metadata from ``dcp.orchestration.save.build_metadata`` (one shared answer).  Per step:
the critical path (slowest rank from its start to its answer), the
coordinator's part and its compute (planning, metadata).  For ``file``, the
exchange files read whole per step show that the coordinator reads N and
every other rank one.

    python -m benchmarks.coordination [--ranks 64 128 256 512] [--gloo 2 4 8]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from dcp.coordination import wire
from dcp.coordination.collectives import Coordinator, CoordinatorBase, PerRank
from dcp.coordination.file_flag import FileCoordinator
from dcp.core.planner import SavePlan
from dcp.orchestration.save import WriteResult, build_metadata
from planners.save import DefaultSavePlanner
from storage_plugins.posix import PosixStorage

from .common import launch, timed
from .report import Column, markdown_table, median_range, summarize_runs, write_table
from .scale import Layout, local_plans, simulated_write_results

TIMEOUT_S = 600.0


def layout_for(ranks: int) -> Layout:
    """TP x PP x DP with ``ranks`` ranks (a power of two): TP up to 8, then
    PP up to 16, then DP grows."""
    tp = min(8, ranks)
    pp = min(16, ranks // tp)
    return Layout(tp=tp, pp=pp, dp=ranks // (tp * pp))


class _CountingStorage(PosixStorage):
    """The POSIX plugin, counting the exchange files each rank read whole
    (``reads``, keyed by the rank set in ``rank``) and the polls that found
    none (``misses``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank = 0
        self.reads: Counter = Counter()
        self.misses: Counter = Counter()

    def read_exchange(self, name: str):
        payload = super().read_exchange(name)
        (self.reads if payload is not None else self.misses)[self.rank] += 1
        return payload


def _payloads(ranks: int) -> tuple[list[SavePlan], list[WriteResult]]:
    plans = local_plans(layout_for(ranks))
    final = DefaultSavePlanner().create_global_plan(plans)
    return plans, simulated_write_results(plans, final)


def measure_file(ranks: int, scratch: str | None) -> dict:
    """One save's two coordination steps over exchange files, ``ranks``
    ranks played one after the other in this process.

    Per step: every other rank encodes and writes its part (``_gather``);
    the coordinator runs the whole step (:meth:`CoordinatorBase.step`:
    read the N parts, plan or build the metadata, write the answers); every
    other rank reads and decodes its answer (``_reply``).  Played in turn,
    no rank waits or competes for the GIL, so each time is that rank's own
    work; the step's critical path, as on a cluster where ranks run in
    parallel, is the slowest part written + the coordinator + the slowest
    answer read.
    """
    plans, results = _payloads(ranks)
    root = Path(tempfile.mkdtemp(prefix=f"coord-file-{ranks}-", dir=scratch))
    storage = _CountingStorage(str(root / "ckpt"))
    coords = [FileCoordinator(storage, "bench", r, ranks, TIMEOUT_S) for r in range(ranks)]
    decls: dict = {}

    def plan_all(parts: list[SavePlan]) -> PerRank:
        for p in parts:
            decls.update(p.tensors)
        return PerRank(DefaultSavePlanner().create_global_plan(parts))

    def commit(parts: list[WriteResult]):
        return build_metadata("0123456789abcdef", ranks, decls, parts)

    row = {"transport": "file", "ranks": ranks}
    try:
        for number, (step, parts, global_fn) in enumerate(
                (("plans", plans, plan_all), ("results", results, commit))):
            inputs = []
            for r in range(1, ranks):
                storage.rank = r
                inputs.append(timed(coords[r]._gather, number, step, (parts[r], None)))
            storage.rank = 0
            compute: list[float] = []

            def timed_global(values, fn=global_fn, compute=compute):
                t = time.perf_counter()
                out = fn(values)
                compute.append(time.perf_counter() - t)
                return out

            coordinator = timed(coords[0].step, step, lambda parts=parts: parts[0], timed_global)
            answers = []
            for r in range(1, ranks):
                storage.rank = r
                answers.append(timed(coords[r]._reply, number, step, False, None))
            row.update({
                f"{step}_rank_part_s": max(inputs),
                f"{step}_coordinator_s": coordinator,
                f"{step}_compute_s": compute[0],
                f"{step}_rank_answer_s": max(answers),
                f"{step}_critical_s": max(inputs) + coordinator + max(answers),
            })
        coords[0].close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    others = [storage.reads[r] / 2 for r in range(1, ranks)]
    return {**row, "coordinator_reads_per_step": storage.reads[0] / 2,
            "rank_reads_per_step_max": max(others),
            "polls_missed": sum(storage.misses.values()),
            "payload_bytes_per_rank": (_encoded_size(plans) + _encoded_size(results)) / ranks}


def _save_steps(coord: CoordinatorBase, plan: SavePlan, result: WriteResult,
                compute: dict[str, float]) -> dict[str, float]:
    """The coordination steps of one save on one rank (as in
    :meth:`dcp.orchestration.save._Save.run`); returns when this rank got each answer,
    seconds after its start.  The coordinator records its compute time per
    step in ``compute``."""
    start = time.perf_counter()
    seen: dict[str, float] = {}
    decls: dict = {}

    def plan_all(plans: list[SavePlan]) -> list[SavePlan]:
        t = time.perf_counter()
        final = DefaultSavePlanner().create_global_plan(plans)
        for p in plans:
            decls.update(p.tensors)
        compute["plans"] = time.perf_counter() - t
        return final

    def commit(results: list[WriteResult]):
        t = time.perf_counter()
        md = build_metadata("0123456789abcdef", coord.world_size, decls, results)
        compute["results"] = time.perf_counter() - t
        return md

    coord.gather_scatter("save planning", lambda: plan, plan_all)
    seen["plans"] = time.perf_counter() - start
    coord.gather_broadcast("save writing/commit", lambda: result, commit)
    seen["results"] = time.perf_counter() - start
    return seen


def _encoded_size(values) -> int:
    return sum(len(wire.encode(v)) for v in values)


def _times(seen: list[dict], compute: dict[str, float]) -> dict:
    """Per step: the slowest rank's time to its answer (``critical``: ranks
    run in parallel) and the coordinator's compute."""
    out, previous = {}, 0.0
    for step in ("plans", "results"):
        wall = max(s[step] for s in seen)
        out[f"{step}_critical_s"] = wall - previous
        out[f"{step}_compute_s"] = compute[step]
        previous = wall
    return out


def _gloo_rank(rank: int, world_size: int) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's answer times and (the coordinator's) compute times."""
    import torch.distributed as dist

    plans, results = _payloads(world_size)
    compute: dict[str, float] = {}
    dist.barrier()
    seen = _save_steps(Coordinator(), plans[rank], results[rank], compute)
    return seen, compute


def measure_gloo(world_size: int, scratch: str | None) -> dict:
    """One save's coordination over a gloo group of ``world_size`` processes."""
    per_rank = launch(_gloo_rank, world_size)
    return {"transport": "gloo", "ranks": world_size,
            **_times([seen for seen, _ in per_rank], per_rank[0][1])}


def run(out_dir, *, ranks=(64, 128, 256, 512), gloo=(2, 4, 8), repeat: int = 3,
        quick: bool = False, scratch: str | None = None) -> list[dict]:
    """Measure each transport and size ``repeat`` times; one row per
    (transport, ranks) with medians (``*_s``) and ranges (``*_s_range``);
    written to ``out_dir/coordination.json`` and ``coordination.md``."""
    if quick:
        ranks, gloo, repeat = (16, 32), (2,), 1
    rows = []
    for sizes, fn in ((ranks, measure_file), (gloo, measure_gloo)):
        for n in sizes:
            rows.append(summarize_runs([fn(n, scratch) for _ in range(repeat)]))
    write_table(out_dir, "coordination", rows, markdown(rows))
    return rows


def _reads(r: dict) -> str:
    if "coordinator_reads_per_step" not in r:
        return "–"
    return f"{r['coordinator_reads_per_step']:.0f} / {r['rank_reads_per_step_max']:.0f}"


COLUMNS: list[Column] = [
    ("transport", lambda r: r["transport"]),
    ("ranks", lambda r: str(r["ranks"])),
    ("plans: critical path s", lambda r: median_range(r, "plans_critical_s")),
    ("plans: coordinator s", lambda r: median_range(r, "plans_coordinator_s")),
    ("planning s", lambda r: f"{r['plans_compute_s']:.3f}"),
    ("results: critical path s", lambda r: median_range(r, "results_critical_s")),
    ("results: coordinator s", lambda r: median_range(r, "results_coordinator_s")),
    ("metadata s", lambda r: f"{r['results_compute_s']:.3f}"),
    ("files read per step: coordinator / other rank", _reads),
    ("payload KB per rank", lambda r: f"{r['payload_bytes_per_rank'] / 1e3:.0f}"
     if "payload_bytes_per_rank" in r else "–"),
]


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    return markdown_table(rows, COLUMNS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coordination",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[64, 128, 256, 512],
                        help="simulated ranks of the file-flag protocol")
    parser.add_argument("--gloo", nargs="+", type=int, default=[2, 4, 8],
                        help="world sizes of the gloo runs (processes)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--scratch", default=None)
    args = parser.parse_args(argv)
    print(markdown(run(args.out, ranks=args.ranks, gloo=args.gloo, repeat=args.repeat,
                       scratch=args.scratch)))


if __name__ == "__main__":
    main()
