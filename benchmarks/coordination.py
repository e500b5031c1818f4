"""Coordination at scale: the two coordination steps of a save with many ranks.

* ``file``: the file-flag protocol (:class:`dcp.coordination.file_flag.FileCoordinator`)
  on POSIX (default options: fsync on) and on S3 (moto's server, started by
  the benchmark in a child process), 512 to 10,240 simulated ranks played in
  turn in one process (see :func:`measure_file`: one thread per rank would
  measure the GIL, not the protocol);
* ``gloo``: :class:`dcp.coordination.collectives.Coordinator` over a gloo process group
  of spawned processes running in parallel (small world sizes: one process
  per rank on this machine), and the bytes a gather moves at 10,240 ranks,
  computed from the real encoders on the scale layout (:func:`gloo_bytes`).

Both drive the steps of :meth:`dcp.orchestration.save._Save.run` with the payloads of
the 505B-class layout of :mod:`benchmarks.scale` (TP x PP x DP): step 1
(*plans*) gathers every rank's local save plan and answers each rank with
its final plan from ``DefaultSavePlanner.create_global_plan``; step 2
(*results*) gathers the write results and answers everyone with the
metadata from ``dcp.orchestration.save.build_metadata``, committed as a save
commits it (``commit_metadata``: encoded once, the answer reuses the bytes),
one shared answer.
A save whose plan is cached runs the *results* step only.  Per step: the
critical path (slowest rank from its start to its answer), the
coordinator's part, its CPU time (the process's, which a loaded machine
inflates less than wall time) and its compute (planning, metadata), and the storage
requests of the coordinator and of the other ranks.

    python -m benchmarks.coordination [--ranks 512 2048 10240] [--stores posix s3] [--gloo 2 4 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from dcp.coordination import wire
from dcp.coordination.collectives import Coordinator, CoordinatorBase, PerRank
from dcp.coordination.file_flag import FileCoordinator, answer_first_poll, poll_times
from dcp.core.metadata import METADATA_FILE
from dcp.core.planner import SavePlan
from dcp.orchestration.save import WriteResult, build_metadata, commit_metadata
from planners.save import DefaultSavePlanner
from storage_plugins.posix import PosixStorage

from .common import launch, timed
from .report import Column, markdown_table, median_range, summarize_runs, write_table
from .scale import Layout, local_plans, simulated_write_results

TIMEOUT_S = 600.0
#: Ranks whose answer read is measured (evenly spaced, first and last
#: included): every rank reads the same two ranges of one file.
ANSWER_SAMPLE = 16


def layout_for(ranks: int) -> Layout:
    """TP x PP x DP with ``ranks`` ranks (a multiple of 128 from 128 on):
    TP up to 8, then PP up to 16, then DP grows."""
    tp = min(8, ranks)
    pp = min(16, ranks // tp)
    return Layout(tp=tp, pp=pp, dp=ranks // (tp * pp))


def _payloads(ranks: int) -> tuple[list[SavePlan], list[WriteResult]]:
    plans = local_plans(layout_for(ranks))
    final = DefaultSavePlanner().create_global_plan(plans)
    return plans, simulated_write_results(plans, final)


def _detected(start: float, ready: float, first: float) -> tuple[float, int]:
    """A rank polling from ``start`` (its part written) for an answer
    published at ``ready``: the seconds it notices late, and its polls that
    miss (the poll schedule of :class:`FileCoordinator`)."""
    misses = 0
    for at in poll_times(first):
        if start + at >= ready:
            return start + at - ready, misses
        misses += 1
    raise AssertionError("poll_times is endless")


@contextlib.contextmanager
def _store(kind: str, scratch: str | None) -> Iterator:
    """A fresh storage of ``kind`` (``posix`` or ``s3``) for one run."""
    if kind == "posix":
        root = Path(tempfile.mkdtemp(prefix="coord-file-", dir=scratch))
        try:
            yield PosixStorage(str(root / "ckpt"))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    import s3fs

    from dcp.testing import local_s3_server
    from storage_plugins.s3 import S3Storage

    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    with local_s3_server() as url:
        options = {"endpoint_url": url, "key": "bench", "secret": "bench"}
        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("coord")
        yield S3Storage(f"s3://coord/{uuid.uuid4().hex[:8]}", **options)


def measure_file(ranks: int, scratch: str | None, store: str = "posix") -> dict:
    """One save's two coordination steps over exchange files, ``ranks``
    ranks played one after the other in this process.

    Per step: every other rank encodes and writes its part (``_gather``);
    the coordinator runs the whole step (:meth:`CoordinatorBase.step`:
    read the N-1 parts through its pool, plan or build the metadata,
    publish the answer); :data:`ANSWER_SAMPLE` ranks read and decode their
    part of it (``_reply``).  Played in turn, no rank waits or competes for
    the GIL, so each time is that rank's own work; the step's critical path,
    as on a cluster where ranks run in parallel, is the slowest part written
    + the coordinator + the slowest answer (its read, and how late its
    backed-off polls notice the answer, from the poll schedule).  Requests
    per rank: its write, its polls that miss (from the schedule), its reads
    and its delete.
    """
    plans, results = _payloads(ranks)
    row: dict = {"transport": f"file ({store})", "ranks": ranks}
    decls: dict = {}

    def plan_all(parts: list[SavePlan]) -> PerRank:
        for p in parts:
            decls.update(p.tensors)
        return PerRank(DefaultSavePlanner().create_global_plan(parts))

    def commit(parts: list[WriteResult]):  # as _Save.commit: build, encode once, publish
        md = build_metadata("0123456789abcdef", ranks, decls, parts)
        commit_metadata(storage, METADATA_FILE, md, overwrite=True)
        return md

    sample = sorted({1, ranks - 1, *range(1, ranks, max(1, ranks // ANSWER_SAMPLE))})
    first = answer_first_poll(ranks)
    with _store(store, scratch) as storage:
        coords = [FileCoordinator(storage, "bench", r, ranks, TIMEOUT_S) for r in range(ranks)]
        rank_requests = 0.0
        for number, (step, parts, global_fn) in enumerate(
                (("plans", plans, plan_all), ("results", results, commit))):
            before = [sum(c.requests.values()) for c in coords]
            inputs = [0.0] * ranks
            for r in range(1, ranks):
                inputs[r] = timed(coords[r]._gather, number, step, (parts[r], None))
            compute: list[float] = []

            def timed_global(values, fn=global_fn, compute=compute):
                t = time.perf_counter()
                out = fn(values)
                compute.append(time.perf_counter() - t)
                return out

            cpu = time.process_time()  # this process: the coordinator and its read pool
            coordinator = timed(coords[0].step, step, lambda parts=parts: parts[0], timed_global)
            cpu = time.process_time() - cpu
            ready = max(inputs) + coordinator
            late, misses, answers = [], [], []
            for r in sample:
                answers.append(timed(coords[r]._reply, number, step, False, None))
                wait, missed = _detected(inputs[r], ready, first)
                late.append(wait + answers[-1])
                misses.append(missed)
            made = [sum(coords[r].requests.values()) - before[r] for r in sample]
            rank_requests += max(m + x for m, x in zip(made, misses, strict=True))
            row.update({
                f"{step}_rank_part_s": max(inputs),
                f"{step}_coordinator_s": coordinator,
                f"{step}_coordinator_cpu_s": cpu,
                f"{step}_compute_s": compute[0],
                f"{step}_rank_answer_s": max(answers),
                f"{step}_critical_s": ready + max(late),
                f"{step}_coordinator_requests": sum(coords[0].requests.values()) - before[0],
            })
        row["rank_requests_per_save"] = rank_requests
        t = time.perf_counter()
        for r in range(1, ranks):  # the ranks not sampled read their answer too
            coords[r]._delete_consumed()
        coords[0].close()
        row["close_s"] = time.perf_counter() - t
    row["payload_bytes_per_rank"] = (_encoded_size(plans) + _encoded_size(results)) / ranks
    return row


def gloo_bytes(ranks: int = 10240) -> dict:
    """The bytes one save's gathers bring to the coordinator at ``ranks``
    ranks, from the real encoders on the scale layout: the payloads, what
    ``gather_object`` moves (every part padded to the largest), and, for
    comparison, the pickled objects of a plain object gather.  A cached save
    gathers only the results step, with each rank's key and token."""
    plans, results = _payloads(ranks)
    key, marks = "f" * 64, ("0" * 24, "0" * 24)
    steps = {"miss": [[(p, None) for p in plans], [(r, None) for r in results]],
             "hit": [[(("written", key, marks, r), None) for r in results]]}
    row: dict = {"transport": "gloo (computed)", "ranks": ranks}
    for kind, gathers in steps.items():
        sizes = [[len(wire.encode(v)) for v in values] for values in gathers]
        row[f"{kind}_bytes"] = sum(sum(s) for s in sizes)
        row[f"{kind}_padded_bytes"] = sum(max(s) * len(s) for s in sizes)
        row[f"{kind}_pickled_bytes"] = sum(len(pickle.dumps(v)) for values in gathers
                                           for v in values)
    return row


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


def _gloo_rank(rank: int, world_size: int) -> tuple[dict[str, float], dict[str, float], dict]:
    """This rank's answer times, (the coordinator's) compute times and its
    byte counts."""
    import torch.distributed as dist

    plans, results = _payloads(world_size)
    compute: dict[str, float] = {}
    dist.barrier()
    coord = Coordinator()
    seen = _save_steps(coord, plans[rank], results[rank], compute)
    return seen, compute, coord.stats


def measure_gloo(world_size: int, scratch: str | None) -> dict:
    """One save's coordination over a gloo group of ``world_size`` processes."""
    per_rank = launch(_gloo_rank, world_size)
    stats = per_rank[0][2]
    return {"transport": "gloo", "ranks": world_size,
            **_times([seen for seen, _, _ in per_rank], per_rank[0][1]),
            "miss_bytes": stats["gathered_bytes"],
            "miss_padded_bytes": stats["gathered_padded_bytes"]}


def run(out_dir, *, ranks=(512, 2048, 10240), stores=("posix", "s3"), gloo=(2, 4, 8),
        gloo_ranks: int | None = 10240, repeat: int = 1, quick: bool = False,
        scratch: str | None = None) -> list[dict]:
    """Measure each transport and size ``repeat`` times; one row per
    (transport, ranks) with medians (``*_s``) and ranges (``*_s_range``);
    written to ``out_dir/coordination.json`` and ``coordination.md``."""
    if quick:
        ranks, stores, gloo, gloo_ranks, repeat = (128,), ("posix",), (2,), 256, 1
    rows = []
    for store in stores:
        for n in ranks:
            rows.append(summarize_runs([measure_file(n, scratch, store) for _ in range(repeat)]))
            print(markdown(rows[-1:]), flush=True)
    for n in gloo:
        rows.append(summarize_runs([measure_gloo(n, scratch) for _ in range(repeat)]))
    if gloo_ranks:
        rows.append(gloo_bytes(gloo_ranks))
    write_table(out_dir, "coordination", rows, markdown(rows))
    return rows


def _opt(key: str, fmt: str = ".3f", scale: float = 1.0):
    def cell(r: dict) -> str:
        if key not in r:
            return "–"
        return f"{r[key] / scale:{fmt}}" if not key.endswith("_s") else median_range(r, key)
    return cell


def _mb(key: str):
    return lambda r: f"{r[key] / 1e6:.1f}" if key in r else "–"


COLUMNS: list[Column] = [
    ("transport", lambda r: r["transport"]),
    ("ranks", lambda r: f"{r['ranks']:,}"),
    ("plans: critical path s", _opt("plans_critical_s")),
    ("plans: coordinator s", _opt("plans_coordinator_s")),
    ("planning s", _opt("plans_compute_s")),
    ("plans: coordinator CPU s", _opt("plans_coordinator_cpu_s")),
    ("results: critical path s", _opt("results_critical_s")),
    ("results: coordinator s", _opt("results_coordinator_s")),
    ("metadata s", _opt("results_compute_s")),
    ("results: coordinator CPU s", _opt("results_coordinator_cpu_s")),
    ("coordinator requests per step", lambda r: (
        f"{r['plans_coordinator_requests']:.0f} / {r['results_coordinator_requests']:.0f}"
        if "plans_coordinator_requests" in r else "–")),
    ("requests per other rank per save", _opt("rank_requests_per_save", ".0f")),
    ("payload KB per rank", _opt("payload_bytes_per_rank", ".1f", 1e3)),
    ("gathered MB: miss (padded)", lambda r: (
        f"{r['miss_bytes'] / 1e6:.2f} ({r['miss_padded_bytes'] / 1e6:.2f})"
        if "miss_bytes" in r else "–")),
    ("gathered MB: cache hit (padded)", lambda r: (
        f"{r['hit_bytes'] / 1e6:.2f} ({r['hit_padded_bytes'] / 1e6:.2f})"
        if "hit_bytes" in r else "–")),
    ("pickled objects MB: miss / hit", lambda r: (
        f"{r['miss_pickled_bytes'] / 1e6:.1f} / {r['hit_pickled_bytes'] / 1e6:.1f}"
        if "miss_pickled_bytes" in r else "–")),
]


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    return markdown_table(rows, COLUMNS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coordination",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", nargs="*", type=int, default=[512, 2048, 10240],
                        help="simulated ranks of the file-flag protocol")
    parser.add_argument("--stores", nargs="+", choices=("posix", "s3"), default=["posix", "s3"])
    parser.add_argument("--gloo", nargs="*", type=int, default=[2, 4, 8],
                        help="world sizes of the gloo runs (processes)")
    parser.add_argument("--gloo-ranks", type=int, default=10240,
                        help="ranks of the computed gloo bytes (0: none)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--scratch", default=None)
    args = parser.parse_args(argv)
    print(markdown(run(args.out, ranks=args.ranks, stores=args.stores, gloo=args.gloo,
                       gloo_ranks=args.gloo_ranks, repeat=args.repeat, scratch=args.scratch)))


if __name__ == "__main__":
    main()
