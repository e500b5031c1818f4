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
from dcp.coordination.collectives import Coordinator, PerRank
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


def _payloads(ranks: int) -> tuple[list[SavePlan], list[WriteResult], list[SavePlan]]:
    """Every rank's local plan, write result and final plan."""
    plans = local_plans(layout_for(ranks))
    final = DefaultSavePlanner().create_global_plan(plans)
    return plans, simulated_write_results(plans, final), final


_KEY, _MARKS = "f" * 64, ("0" * 24, "0" * 24)
_WHERE = "s3://bucket/runs/llm-505b/step-1000"  # each part's checkpoint id


def _kept(plans: list[SavePlan]) -> tuple[list[SavePlan], list[SavePlan]]:
    """The local and final plans as the coordinator keeps them in its plan
    cache: decoded local plans, and the final plans the planner made of
    them (columns sharing one table of every name)."""
    local = [wire.decode(wire.encode(p), "plan") for p in plans]
    return local, DefaultSavePlanner().create_global_plan(local)


def _cached_parts(plans: list[SavePlan], final: list[SavePlan],
                  results: list[WriteResult]) -> list[tuple]:
    """What each rank of a cached save sends: ``("written", key, marks,
    result, location)``, its write result relative to its cached plans (``local``
    ``plans`` and ``final`` ones), as ``PlanCache`` sends it."""
    return [("written", _KEY, _MARKS, wire.relative_result(r, f, p, rank), _WHERE)
            for rank, (r, f, p) in enumerate(zip(results, final, plans, strict=True))]


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
    plans, results, final = _payloads(ranks)
    cached = _cached_parts(plans, final, results)
    kept_plans, kept_final = _kept(plans)
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

    def commit_cached(parts: list[tuple]):  # as PlanCache: results made whole, then commit
        return commit([wire.absolute_result(p[3], kept_final[r], kept_plans[r], r)
                       for r, p in enumerate(parts)])

    sample = sorted({1, ranks - 1, *range(1, ranks, max(1, ranks // ANSWER_SAMPLE))})
    first = answer_first_poll(ranks)
    with _store(store, scratch) as storage:
        coords = [FileCoordinator(storage, "bench", r, ranks, TIMEOUT_S) for r in range(ranks)]
        rank_requests = {"plans": 0.0, "results": 0.0, "hit": 0.0}
        for number, (step, parts, global_fn) in enumerate(
                (("plans", plans, plan_all), ("results", results, commit),
                 ("hit", cached, commit_cached))):
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
            rank_requests[step] = max(m + x for m, x in zip(made, misses, strict=True))
            row.update({
                f"{step}_rank_part_s": max(inputs),
                f"{step}_coordinator_s": coordinator,
                f"{step}_coordinator_cpu_s": cpu,
                f"{step}_compute_s": compute[0],
                f"{step}_rank_answer_s": max(answers),
                f"{step}_critical_s": ready + max(late),
                f"{step}_coordinator_requests": sum(coords[0].requests.values()) - before[0],
            })
        row["rank_requests_per_save"] = rank_requests["plans"] + rank_requests["results"]
        row["rank_requests_per_cached_save"] = rank_requests["hit"]
        t = time.perf_counter()
        for r in range(1, ranks):  # the ranks not sampled read their answer too
            coords[r]._delete_consumed()
        coords[0].close()
        row["close_s"] = time.perf_counter() - t
    row["payload_bytes_per_rank"] = (_encoded_size(plans) + _encoded_size(results)) / ranks
    row["results_bytes_per_rank"] = _encoded_size(
        [("written", _KEY, _MARKS, r, _WHERE) for r in results]) / ranks
    row["hit_bytes_per_rank"] = _encoded_size(cached) / ranks
    return row


#: Ranks per host in the computed two-level gather (one TP group of the layout).
RANKS_PER_HOST = 8


def gloo_bytes(ranks: int = 10240) -> dict:
    """The bytes one save's gathers bring to the coordinator at ``ranks``
    ranks, from the real encoders on the scale layout: the payloads, what
    ``gather_object`` moves (every part padded to the largest), with one
    gather and with the two-level gather through one leader per host of
    :data:`RANKS_PER_HOST` ranks (the coordinator's host's payloads and the
    other leaders' bundles), and, for comparison, the pickled objects of a
    plain object gather.  A cached save gathers only the results step, each
    rank's key, token and its write result relative to the cached plans."""
    plans, results, final = _payloads(ranks)
    steps = {"miss": [[(p, None) for p in plans], [(r, None) for r in results]],
             "hit": [[(part, None) for part in _cached_parts(plans, final, results)]],
             "hit_full": [[(("written", _KEY, _MARKS, r, _WHERE), None) for r in results]]}
    row: dict = {"transport": "gloo (computed)", "ranks": ranks}
    for kind, gathers in steps.items():
        encoded = [[wire.encode(v) for v in values] for values in gathers]
        sizes = [list(map(len, e)) for e in encoded]
        row[f"{kind}_bytes"] = sum(sum(s) for s in sizes)
        row[f"{kind}_padded_bytes"] = sum(max(s) * len(s) for s in sizes)
        two_level = padded = 0
        for e in encoded:
            hosts = [e[h:h + RANKS_PER_HOST] for h in range(0, len(e), RANKS_PER_HOST)]
            bundles = [len(wire.bundle(h)) for h in hosts[1:]]
            two_level += sum(map(len, hosts[0])) + sum(bundles)
            padded += max(map(len, hosts[0])) * len(hosts[0]) + max(bundles) * len(bundles)
        row[f"{kind}_two_level_bytes"], row[f"{kind}_two_level_padded_bytes"] = two_level, padded
        if kind != "hit_full":
            row[f"{kind}_pickled_bytes"] = sum(len(pickle.dumps(v)) for values in gathers
                                               for v in values)
    return row


def _save_steps(coord: Coordinator, rank: int, payloads: tuple, compute: dict[str, float],
                stats: list[dict]) -> dict[str, float]:
    """The coordination steps of one save on one rank (as in
    :meth:`dcp.orchestration.save._Save.run`), then the one step of a save
    by the cached plans (as in :class:`PlanCache`); returns when this rank
    got each answer, seconds after its start.  The coordinator records its
    compute time per step in ``compute``, and every rank its byte counters
    after each step in ``stats``."""
    plans, results, final = payloads
    cached = _cached_parts(plans, final, results)
    kept_plans, kept_final = _kept(plans)
    start = time.perf_counter()
    seen: dict[str, float] = {}
    decls: dict = {}

    def plan_all(parts: list[SavePlan]) -> list[SavePlan]:
        t = time.perf_counter()
        out = DefaultSavePlanner().create_global_plan(parts)
        for p in parts:
            decls.update(p.tensors)
        compute["plans"] = time.perf_counter() - t
        return out

    def commit(step: str, parts: list[WriteResult]):
        t = time.perf_counter()
        md = build_metadata("0123456789abcdef", coord.world_size, decls, parts)
        compute[step] = time.perf_counter() - t
        return md

    coord.gather_scatter("save planning", lambda: plans[rank], plan_all)
    seen["plans"] = time.perf_counter() - start
    stats.append(dict(coord.stats))
    coord.gather_broadcast("save writing/commit", lambda: results[rank],
                           lambda parts: commit("results", parts))
    seen["results"] = time.perf_counter() - start
    stats.append(dict(coord.stats))
    coord.gather_broadcast(
        "save (planning or cached writing)", lambda: cached[rank],
        lambda parts: commit("hit", [wire.absolute_result(p[3], kept_final[r], kept_plans[r], r)
                                     for r, p in enumerate(parts)]))
    seen["hit"] = time.perf_counter() - start
    stats.append(dict(coord.stats))
    return seen


def _encoded_size(values) -> int:
    return sum(len(wire.encode(v)) for v in values)


def _times(seen: list[dict], compute: dict[str, float]) -> dict:
    """Per step: the slowest rank's time to its answer (``critical``: ranks
    run in parallel) and the coordinator's compute."""
    out, previous = {}, 0.0
    for step in ("plans", "results", "hit"):
        wall = max(s[step] for s in seen)
        out[f"{step}_critical_s"] = wall - previous
        out[f"{step}_compute_s"] = compute[step]
        previous = wall
    return out


def _gloo_rank(rank: int, world_size: int, hosts: int
               ) -> tuple[dict[str, float], dict[str, float], list[dict]]:
    """This rank's answer times, (the coordinator's) compute times and its
    byte counts per step; ``hosts`` > 1 simulates that many hosts (ranks
    split evenly, in order) and gathers through their leaders."""
    import torch.distributed as dist

    payloads = _payloads(world_size)
    compute: dict[str, float] = {}
    if hosts > 1:
        coord = Coordinator(host=f"host-{rank * hosts // world_size}", two_level_from=2)
    else:
        coord = Coordinator()
    # connections of new groups are made on their first use: once per job, not timed
    coord.gather_broadcast("warm-up", lambda: b"", lambda parts: None)
    coord.stats = dict.fromkeys(coord.stats, 0)
    dist.barrier()
    stats: list[dict] = []
    seen = _save_steps(coord, rank, payloads, compute, stats)
    return seen, compute, stats


def measure_gloo(world_size: int, scratch: str | None, hosts: int = 1) -> dict:
    """One save's coordination over a gloo group of ``world_size``
    processes, then one by the cached plans; with ``hosts`` > 1, simulated
    hosts and the two-level gather."""
    per_rank = launch(_gloo_rank, world_size, hosts)
    plans, results, hit = per_rank[0][2]  # the counters after each step

    def delta(key: str, after: dict, before: dict) -> int:
        return after[key] - before.get(key, 0)

    return {"transport": "gloo" if hosts == 1 else f"gloo ({hosts} hosts)", "ranks": world_size,
            **_times([seen for seen, _, _ in per_rank], per_rank[0][1]),
            "miss_bytes": results["gathered_bytes"],
            "miss_padded_bytes": results["gathered_padded_bytes"],
            "hit_bytes": delta("gathered_bytes", hit, results),
            "hit_padded_bytes": delta("gathered_padded_bytes", hit, results)}


def run(out_dir, *, ranks=(512, 2048, 10240), stores=("posix", "s3"), gloo=(2, 4, 8),
        gloo_hosts=(1, 2), gloo_ranks: int | None = 10240, repeat: int = 1,
        quick: bool = False, scratch: str | None = None) -> list[dict]:
    """Measure each transport and size ``repeat`` times (gloo with each
    count of ``gloo_hosts`` simulated hosts that leaves a host several
    ranks); one row per (transport, ranks) with medians (``*_s``) and
    ranges (``*_s_range``); written to ``out_dir/coordination.json`` and
    ``coordination.md``."""
    if quick:
        ranks, stores, gloo, gloo_ranks, repeat = (128,), ("posix",), (2, 4), 256, 1
    rows = []
    for store in stores:
        for n in ranks:
            rows.append(summarize_runs([measure_file(n, scratch, store) for _ in range(repeat)]))
            print(markdown(rows[-1:]), flush=True)
    for hosts in gloo_hosts:
        for n in gloo:
            if hosts == 1 or 1 < hosts < n:
                rows.append(summarize_runs([measure_gloo(n, scratch, hosts)
                                            for _ in range(repeat)]))
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


def _pair(a: str, b: str, scale: float, fmt: str, form: str = "{} / {}"):
    def cell(r: dict) -> str:
        if a not in r:
            return "–"
        return form.format(f"{r[a] / scale:{fmt}}", f"{r[b] / scale:{fmt}}" if b in r else "–")
    return cell


FILE_COLUMNS: list[Column] = [
    ("transport", lambda r: r["transport"]),
    ("ranks", lambda r: f"{r['ranks']:,}"),
    ("plans: critical path s", _opt("plans_critical_s")),
    ("plans: coordinator s", _opt("plans_coordinator_s")),
    ("plans: coordinator CPU s", _opt("plans_coordinator_cpu_s")),
    ("planning s", _opt("plans_compute_s")),
    ("results: critical path s", _opt("results_critical_s")),
    ("results: coordinator s", _opt("results_coordinator_s")),
    ("results: coordinator CPU s", _opt("results_coordinator_cpu_s")),
    ("metadata s", _opt("results_compute_s")),
    ("cache hit: critical path s", _opt("hit_critical_s")),
    ("cache hit: coordinator CPU s", _opt("hit_coordinator_cpu_s")),
    ("coordinator requests per step", lambda r: (
        f"{r['plans_coordinator_requests']:.0f} / {r['results_coordinator_requests']:.0f}")),
    ("requests per other rank per save (cached save)", _pair(
        "rank_requests_per_save", "rank_requests_per_cached_save", 1, ".0f", "{} ({})")),
    ("payload KB per rank", _opt("payload_bytes_per_rank", ".1f", 1e3)),
    ("write result KB per rank: full / cache hit", _pair(
        "results_bytes_per_rank", "hit_bytes_per_rank", 1e3, ".2f")),
]

GLOO_COLUMNS: list[Column] = [
    ("transport", lambda r: r["transport"]),
    ("ranks", lambda r: f"{r['ranks']:,}"),
    ("plans: critical path s", _opt("plans_critical_s")),
    ("planning s", _opt("plans_compute_s")),
    ("results: critical path s", _opt("results_critical_s")),
    ("metadata s", _opt("results_compute_s")),
    ("cache hit: critical path s", _opt("hit_critical_s")),
    ("gathered MB per save: miss (padded)", _pair("miss_bytes", "miss_padded_bytes", 1e6,
                                                   ".3f", "{} ({})")),
    ("cache hit (padded)", _pair("hit_bytes", "hit_padded_bytes", 1e6, ".3f", "{} ({})")),
    ("cache hit, full results (padded)", _pair("hit_full_bytes", "hit_full_padded_bytes", 1e6,
                                                ".2f", "{} ({})")),
    ("two-level MB: miss / hit", lambda r: (
        f"{r['miss_two_level_bytes'] / 1e6:.2f} / {r['hit_two_level_bytes'] / 1e6:.2f}"
        if "miss_two_level_bytes" in r else "–")),
    ("pickled objects MB: miss / hit", _pair("miss_pickled_bytes", "hit_pickled_bytes", 1e6,
                                             ".1f")),
]


def markdown(rows: list[dict]) -> str:
    """The rows as Markdown tables: the file protocol's, then gloo's."""
    files = [r for r in rows if r["transport"].startswith("file")]
    gloo = [r for r in rows if not r["transport"].startswith("file")]
    return "\n\n".join(markdown_table(part, columns) for part, columns in
                        ((files, FILE_COLUMNS), (gloo, GLOO_COLUMNS)) if part)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coordination",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", nargs="*", type=int, default=[512, 2048, 10240],
                        help="simulated ranks of the file-flag protocol")
    parser.add_argument("--stores", nargs="+", choices=("posix", "s3"), default=["posix", "s3"])
    parser.add_argument("--gloo", nargs="*", type=int, default=[2, 4, 8],
                        help="world sizes of the gloo runs (processes)")
    parser.add_argument("--gloo-hosts", nargs="*", type=int, default=[1, 2],
                        help="simulated hosts of the gloo runs (1: the real host; more: "
                             "the two-level gather through their leaders)")
    parser.add_argument("--gloo-ranks", type=int, default=10240,
                        help="ranks of the computed gloo bytes (0: none)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--scratch", default=None)
    args = parser.parse_args(argv)
    print(markdown(run(args.out, ranks=args.ranks, stores=args.stores, gloo=args.gloo,
                       gloo_hosts=args.gloo_hosts, gloo_ranks=args.gloo_ranks,
                       repeat=args.repeat, scratch=args.scratch)))


if __name__ == "__main__":
    main()
