"""Recovery from the memory tier (issue 28, section 5), every ratio from one run.

State: ``NUM_TENSORS`` fp32 tensors of ``[ROWS, COLS]`` (512 MiB in all), on
W=4 gloo ranks on 2 simulated hosts (ranks 0-1 on ``h0``, 2-3 on ``h1``; a
host is ranks with their own ``MemoryTier(host=..., namespace=<folder>)``
under ``/dev/shm``).  Layouts: ``replicated`` (every rank holds all of it)
and ``dp2xtp2`` (tensor-parallel rows ``rank % 2``, data-parallel replicas
``r`` and ``r + 2`` on the other host), plus ``small`` (4,096 replicated
tensors of ``[64, 128]``, 128 MiB) for the host-lost row only.  One process
group per layout; per repeat:

- ``save``: ``mgr.save`` of a memory step, its block (``stall``) beside a
  ``Tensor.copy_`` of the rank's bytes into preallocated buffers
  (``memcpy``, right before), and ``sdc``: the seconds of the SDC
  comparison call (``sdc.compare``, timed around it) beside the memory
  save's time to commit;
- ``crash``: a new manager on every rank, host memory intact,
  ``load_latest`` (all bytes from the own host) beside ``memcpy``;
- ``host lost``: ``h1``'s namespace deleted, a new manager, ``load_latest``
  (``h1``'s ranks from ``h0``, every chunk checked against its CRC-32C),
  beside torch's ``PGTransport`` sending the same tensors from rank ``r``
  to ``r + 2`` (in place: ``recv_checkpoint`` into the receiver's tensors);
- ``chunks lost``: a persisted step, ``h1`` deleted and the first half of
  ``h0``'s rank-0 data file kept (the chunks past it lost everywhere):
  ``mgr.last_restore.bytes_persistent`` summed over ranks beside the bytes
  of the lost chunks (each chunk once: the persistent load reads a chunk
  that several ranks need once);
- a training loop (a gloo all-reduce of 4 MiB and a matmul loop calibrated
  to ``STEP_S``) with a memory save every step, beside the same loop with
  no checkpoint: throughput and p95 step time;
- host memory: allocated blocks of every file of each host's namespace,
  sampled every millisecond during that loop (peak) and after it (steady),
  over the host's unique bytes ``U``.

Every restore is checked element-exact against what was saved.  Times are
the slowest rank's (restores: of the ranks that received; PGTransport: its
receivers).  The bookkeeping row (find the step's sources and plan them at
10,240 simulated ranks, the approach of ``tests/test_recovery_placement.py``)
runs in this process.  The persistent tier is a local folder: its bytes
are ``RestoreReport.bytes_persistent``.  One more row puts it on S3 (moto on
127.0.0.1 behind :mod:`benchmarks.s3_load`'s request counter; a DP2xTP2
state of ``S3_SHAPE``, 16 MiB): GETs and GET bytes of a restore with ``h1``
lost, and with the chunks past the middle of ``h0``'s rank-0 file lost too
(the GET bytes, metadata included, beside the lost chunks' bytes).

``run(out_dir)`` returns the rows (also ``out_dir/recovery.json`` and
``recovery.md``); ``targets(rows)`` the issue's limits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .common import launch
from .report import Column, TargetResult, markdown_table, write_table

NUM_TENSORS, ROWS, COLS = 16, 2048, 4096
QUICK = (16, 64, 128)
SMALL, SMALL_QUICK = (4096, 64, 128), (4096, 4, 8)
#: the S3 row's state (16 MiB: moto's ranged GETs cost time in proportion to the object)
S3_SHAPE = (16, 256, 1024)
HOSTS = ("h0", "h0", "h1", "h1")
LAYOUTS = ("replicated", "dp2xtp2", "small")
STEP_S, STEP_S_QUICK, LOOP_STEPS = 0.5, 0.05, 6
#: the persistent tier's interval: steps that are multiples of it are persisted
PERSIST = 1000


def _rows(layout: str, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of every tensor that ``rank`` holds."""
    if layout == "dp2xtp2":
        half = _shape[1] // 2
        return (rank % 2) * half, (rank % 2 + 1) * half
    return 0, _shape[1]


_shape: tuple[int, int, int] = QUICK


def _values(i: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i * 7919 + step)
    return torch.rand(_shape[1:], generator=g)


def _state(layout: str, rank: int, step: int) -> dict:
    import dcp

    lo, hi = _rows(layout, rank)
    model = {}
    for i in range(_shape[0]):
        data = _values(i, step)[lo:hi].clone()
        model[f"t{i}"] = data if layout != "dp2xtp2" else dcp.TensorShard(
            data, _shape[1:], (lo, 0))
    return {"model": model}


def _locals(state: dict) -> list[torch.Tensor]:
    return [t if isinstance(t, torch.Tensor) else t.data for t in state["model"].values()]


def _set(state: dict, ref: list[torch.Tensor]) -> None:
    for t, r in zip(_locals(state), ref, strict=True):
        t.copy_(r)


def _zero(state: dict) -> None:
    for t in _locals(state):
        t.zero_()


def _exact(state: dict, ref: list[torch.Tensor]) -> bool:
    return all(torch.equal(t.view(torch.int32), r.view(torch.int32))
               for t, r in zip(_locals(state), ref, strict=True))


def _namespace_bytes(folder: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class _Sampler(threading.Thread):
    def __init__(self, folder: str) -> None:
        super().__init__(daemon=True)
        self.folder, self.peak, self.stop = folder, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _namespace_bytes(self.folder))
            time.sleep(0.001)


class _Work:
    """A training step: an all-reduce of 4 MiB and a matmul loop, ``step_s`` alone."""

    def __init__(self, step_s: float) -> None:
        self.grad = torch.ones(1 << 20)
        self.a = torch.rand(256, 256)
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.2:
            self.a @ self.a
            n += 1
        self.n = max(1, int(n * step_s / (time.perf_counter() - start) * 0.9))

    def step(self) -> None:
        dist.all_reduce(self.grad)
        for _ in range(self.n):
            self.a @ self.a


def _timed_compare(times: list[float]):
    """Wraps ``sdc.compare`` (as the snapshotter calls it) to time each call."""
    from dcp.recovery import sdc

    compare = sdc.compare

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return compare(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)
    sdc.compare = timed
    return compare


def _measure(rank: int, world_size: int, layout: str, shape, repeat: int, quick: bool,
             shm: str, root: str) -> dict:
    """This rank's samples (module doc)."""
    from torch.distributed.checkpoint._pg_transport import PGTransport

    import dcp
    from dcp.recovery import sdc

    global _shape
    _shape = shape
    host = HOSTS[rank]
    namespace = os.path.join(shm, host)
    leader = rank in (0, 2)

    def manager():
        tier = dcp.MemoryTier(host=host, namespace=namespace, run_id="bench", timeout=300)
        return dcp.CheckpointManager(root, interval=PERSIST, keep_latest=0, save_rng=False,
                                     memory=tier)

    state = _state(layout, rank, 0)
    floor = [torch.empty_like(t) for t in _locals(state)]

    def memcpy() -> float:
        dist.barrier()
        t = time.perf_counter()
        for dst, src in zip(floor, _locals(state), strict=True):
            dst.copy_(src)
        return time.perf_counter() - t

    def restore(name: str, ref: list[torch.Tensor]) -> dict:
        _zero(state)
        dist.barrier()
        mgr = manager()
        t = time.perf_counter()
        step = mgr.load_latest(state)
        seconds = time.perf_counter() - t
        r = mgr.last_restore
        out = dict(kind=name, seconds=seconds, step=step, exact=_exact(state, ref),
                   own=r.bytes_own_host if r else 0, peer=r.bytes_other_hosts if r else 0,
                   persistent=r.bytes_persistent if r else 0)
        mgr.close()
        return out

    def wipe_h1() -> None:
        dist.barrier()
        if rank == 2:
            shutil.rmtree(namespace, ignore_errors=True)
        dist.barrier()

    compare_s: list[float] = []
    original = _timed_compare(compare_s)
    samples: list[dict] = []
    nbytes = sum(t.nbytes for t in _locals(state))
    try:
        mgr = manager()
        step = 1
        for i in range(repeat + 1):  # the first save also builds the layout
            ref = [_values(k, step)[slice(*_rows(layout, rank))] for k in range(shape[0])]
            _set(state, ref)
            floor_s = memcpy()
            dist.barrier()
            before = len(compare_s)
            t = time.perf_counter()
            mgr.save(step, state)
            stall = time.perf_counter() - t
            mgr.wait()
            ms = mgr.last_memory_save
            if i:
                samples.append(dict(kind="save", stall=stall, memcpy=floor_s,
                                    commit=ms.seconds, sdc=sum(compare_s[before:])))
            step += 1
        mgr.close()
        last = step - 1
        for _ in range(repeat):
            floor_s = memcpy()
            samples.append(dict(restore("crash", ref), memcpy=floor_s))
        for i in range(repeat):
            wipe_h1()
            samples.append(restore("host_lost", ref))
            # PGTransport: rank r sends the same tensors to r + 2, received in place
            pg = dist.distributed_c10d._get_default_group()
            transport = PGTransport(pg, datetime.timedelta(seconds=300), torch.device("cpu"),
                                    state_dict=lambda: {"model": dict(zip(
                                        state["model"], _locals(state), strict=True))})
            payload = {"model": dict(zip(state["model"], _locals(state), strict=True))}
            if rank >= 2:
                _zero(state)
            dist.barrier()
            t = time.perf_counter()
            if rank < 2:
                transport.send_checkpoint([rank + 2], payload)
            else:
                transport.recv_checkpoint(rank - 2)
            seconds = time.perf_counter() - t
            samples.append(dict(kind="pg_transport", seconds=seconds,
                                exact=rank < 2 or _exact(state, ref)))
            # h1 holds nothing now: save the step again for the next repeat
            mgr = manager()
            _set(state, ref)
            mgr.save(last + i + 1, state)
            mgr.wait()
            mgr.close()
        last += repeat
        if layout == "small":
            return dict(rank=rank, nbytes=nbytes, samples=samples)
        # the training loop, without and with a memory step every step
        work = _Work(STEP_S_QUICK if quick else STEP_S)
        mgr = manager()
        sampler = _Sampler(namespace) if leader else None
        for _ in range(repeat):
            for kind in ("none", "memory"):
                if kind == "memory" and sampler is not None and not sampler.is_alive():
                    sampler.start()
                dist.barrier()
                times = []
                for _ in range(LOOP_STEPS):
                    t = time.perf_counter()
                    work.step()
                    if kind == "memory":
                        last += 1
                        mgr.save(last, state)
                    times.append(time.perf_counter() - t)
                mgr.wait()
                samples.append(dict(kind=f"loop_{kind}", times=times))
        dist.barrier()
        if sampler is not None:
            sampler.stop.set()
            sampler.join()
            samples.append(dict(kind="memory", peak=sampler.peak,
                                steady=_namespace_bytes(namespace)))
        # a persisted step; then h1 lost and the chunks past the middle of
        # h0's rank-0 data file lost: those from the persistent tier
        persisted = (last // PERSIST + 1) * PERSIST
        mgr.save(persisted, state)
        mgr.wait()
        mgr.close()
        wipe_h1()
        lost = _cut_rank0(rank, namespace, persisted, nbytes // shape[0])
        r = restore("chunks_lost", ref)
        samples.append(dict(r, lost=lost))
    finally:
        sdc.compare = original
    return dict(rank=rank, nbytes=nbytes, samples=samples)


def _median(values: list[float]) -> dict:
    return dict(median=statistics.median(values), lo=min(values), hi=max(values),
                n=len(values))


def _cut_rank0(rank: int, namespace: str, step: int, chunk: int) -> int:
    """Keep the first half of rank 0's data file of memory step ``step``
    (on rank 0's host; chunks of ``chunk`` bytes): the chunks past it are
    lost on every host (the other host wiped).  Collective; returns the lost
    chunks' bytes on every rank."""
    lost = 0
    if rank == 0:
        step_dir = Path(namespace) / "bench" / f"step-{step}"
        data = step_dir / "r00000.data"
        cut = data.stat().st_size // 2
        held = json.loads((step_dir / "held.r00000.json").read_bytes())
        for file, _, offsets in held["files"]:
            if file == "r00000.data":
                lost = sum(chunk for o in offsets if o + chunk > cut)
        os.truncate(data, cut)
    lost_t = torch.tensor([lost], dtype=torch.int64)
    dist.broadcast(lost_t, 0)
    return int(lost_t)


def _measure_s3(rank: int, world_size: int, shape, shm: str, endpoint: str) -> dict:
    """The persistent tier on S3 (moto, behind the request counter of
    :mod:`benchmarks.s3_load`), DP2xTP2: a persisted memory step restored
    with ``h1`` lost (every chunk still in ``h0``'s memory), then with the
    chunks past the middle of ``h0``'s rank-0 data file lost too; the
    server's GETs and GET bytes during each restore."""
    import dcp

    from .s3_load import BUCKET, _credentials, server_counts

    global _shape
    _shape = shape
    host = HOSTS[rank]
    namespace = os.path.join(shm, host)
    options = _credentials(endpoint)
    root = f"s3://{BUCKET}/recovery"

    def manager():
        tier = dcp.MemoryTier(host=host, namespace=namespace, run_id="bench", timeout=300)
        return dcp.CheckpointManager(root, interval=PERSIST, keep_latest=0, save_rng=False,
                                     memory=tier, storage_options=options)

    state = _state("dp2xtp2", rank, PERSIST)
    ref = [t.clone() for t in _locals(state)]
    nbytes = sum(t.nbytes for t in ref)
    samples = []
    for i, kind in enumerate(("s3_host_lost", "s3_chunks_lost")):
        step = PERSIST * (i + 1)
        _set(state, ref)
        mgr = manager()
        mgr.save(step, state)  # a memory step, persisted
        mgr.wait()
        mgr.close()
        dist.barrier()
        if rank == 2:
            shutil.rmtree(namespace, ignore_errors=True)
        lost = _cut_rank0(rank, namespace, step, nbytes // shape[0]) if i else 0
        _zero(state)
        mgr = manager()
        dist.barrier()
        if rank == 0:
            server_counts(endpoint, reset=True)
        dist.barrier()
        got = mgr.load_latest(state)
        dist.barrier()
        counts = server_counts(endpoint) if rank == 0 else {}
        r = mgr.last_restore
        samples.append(dict(kind=kind, step=got, exact=got == step and _exact(state, ref),
                            persistent=r.bytes_persistent if r else 0, lost=lost,
                            gets=counts.get("GET", 0), get_bytes=counts.get("GET bytes", 0)))
        mgr.close()
    return dict(rank=rank, nbytes=nbytes, samples=samples)


def _summarize_s3(ranks: list[dict]) -> dict:
    row: dict = dict(layout="dp2xtp2, persistent tier on S3", rank_bytes=ranks[0]["nbytes"],
                     exact=all(s["exact"] for r in ranks for s in r["samples"]))
    for kind in ("s3_host_lost", "s3_chunks_lost"):
        per = [s for r in ranks for s in r["samples"] if s["kind"] == kind]
        row[f"{kind}_persistent_bytes"] = sum(s["persistent"] for s in per)
        row[f"{kind}_gets"] = sum(s["gets"] for s in per)
        row[f"{kind}_get_bytes"] = sum(s["get_bytes"] for s in per)
        row[f"{kind}_lost"] = per[0]["lost"]
    row["s3_lost_x_needed"] = row["s3_chunks_lost_get_bytes"] / max(1, row["s3_chunks_lost_lost"])
    return row


def _summarize(layout: str, ranks: list[dict], shape) -> dict:
    """One row: medians (and ranges) over repeats of the slowest rank's numbers."""
    by_kind: dict[str, list[list[dict]]] = {}
    for r in ranks:
        for s in r["samples"]:
            by_kind.setdefault(s["kind"], [[] for _ in ranks])[r["rank"]].append(s)

    def per_repeat(kind: str, who=range(4)) -> list[list[dict]]:
        return [list(x) for x in zip(*(by_kind[kind][k] for k in who), strict=True)]

    row: dict = dict(layout=layout, rank_bytes=ranks[0]["nbytes"],
                     tensors=shape[0], exact=True)
    for kind in by_kind:
        for per in by_kind[kind]:
            row["exact"] &= all(s.get("exact", True) for s in per)
    hl = [max(s["seconds"] for s in rep[2:]) for rep in per_repeat("host_lost")]
    pg = [max(s["seconds"] for s in rep[2:]) for rep in per_repeat("pg_transport")]
    row["host_lost_s"], row["pg_transport_s"] = _median(hl), _median(pg)
    row["host_lost_x_pg"] = _median([a / b for a, b in zip(hl, pg, strict=True)])
    row["host_lost_persistent_bytes"] = max(
        sum(s["persistent"] for s in rep) for rep in per_repeat("host_lost"))
    crash = per_repeat("crash")
    c = [max(s["seconds"] for s in rep) for rep in crash]
    m = [max(s["memcpy"] for s in rep) for rep in crash]
    row["crash_s"], row["crash_memcpy_s"] = _median(c), _median(m)
    row["crash_x_memcpy"] = _median([a / b for a, b in zip(c, m, strict=True)])
    row["crash_own_bytes"] = min(sum(s["own"] for s in rep) for rep in crash)
    saves = per_repeat("save")
    st = [max(s["stall"] for s in rep) for rep in saves]
    mc = [max(s["memcpy"] for s in rep) for rep in saves]
    commit = [max(s["commit"] for s in rep) for rep in saves]
    sdc_s = [max(s["sdc"] for s in rep) for rep in saves]
    row["stall_s"], row["stall_memcpy_s"] = _median(st), _median(mc)
    row["stall_x_memcpy"] = _median([a / b for a, b in zip(st, mc, strict=True)])
    row["commit_s"], row["sdc_s"] = _median(commit), _median(sdc_s)
    row["sdc_share"] = _median([a / b for a, b in zip(sdc_s, commit, strict=True)])
    if "loop_none" not in by_kind:
        return row
    loss, p95 = [], []
    for none, mem in zip(per_repeat("loop_none"), per_repeat("loop_memory"), strict=True):
        tn = max(sum(s["times"]) for s in none)
        tm = max(sum(s["times"]) for s in mem)
        loss.append(1 - tn / tm)
        q = [float(np.percentile([max(x) for x in zip(*(s["times"] for s in rep),
                                                     strict=True)], 95))
             for rep in (none, mem)]
        p95.append(q[1] / q[0] - 1)
    row["loop_loss"], row["loop_p95_added"] = _median(loss), _median(p95)
    row["step_s"] = _median([statistics.median(
        max(x) for x in zip(*(s["times"] for s in rep), strict=True))
        for rep in per_repeat("loop_none")])
    mem = [s for r in ranks for s in r["samples"] if s["kind"] == "memory"]
    unique = (shape[0] * shape[1] * shape[2] * 4)  # each host holds the whole state once
    row["host_unique_bytes"] = unique
    row["steady_x_unique"] = max(s["steady"] for s in mem) / unique
    row["peak_x_unique"] = max(s["peak"] for s in mem) / unique
    cl = [s for r in ranks for s in r["samples"] if s["kind"] == "chunks_lost"]
    # each lost chunk is read once from the persistent tier, whichever ranks need it
    row["lost_bytes_needed"] = cl[0]["lost"]
    row["lost_persistent_bytes"] = sum(s["persistent"] for s in cl)
    row["lost_x_needed"] = row["lost_persistent_bytes"] / max(1, row["lost_bytes_needed"])
    return row


def bookkeeping(world: int = 10240, per_host: int = 8, repeat: int = 3) -> dict:
    """Seconds of placement and a restore's source plan at ``world`` ranks,
    one host lost (the layout of ``tests/test_recovery_placement.py``):
    median and range over ``repeat``."""
    from dcp.recovery import placement

    rank = np.arange(world)
    rank_host = rank // per_host
    hosts = world // per_host
    groups = world // 8
    shared_c = (rank[:, None] % groups) * 64 + np.arange(64)[None, :]
    private_c = groups * 64 + rank[:, None] * 8 + np.arange(8)[None, :]
    hc = np.concatenate([shared_c.ravel(), private_c.ravel()])
    hr = np.concatenate([np.repeat(rank, 64), np.repeat(rank, 8)])
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        p = placement.place(hc, hr, rank_host, np.arange(hosts) // 4, replicas=1)
        held_host = np.concatenate([p.own_host, p.copy_host])
        held_chunk = np.concatenate([p.own_chunk, p.copy_chunk])
        alive = held_host != 7
        held = placement.holdings(held_host[alive], held_chunk[alive], int(hc.max()) + 1)
        kind, _ = placement.sources(hr, hc, np.zeros(len(hc), np.int64), rank_host, held)
        times.append(time.perf_counter() - t0)
        assert not (kind == placement.PERSISTENT).any()
    return dict(layout=f"bookkeeping {world:,} ranks", bookkeeping_s=_median(times))


def run(out_dir: str | Path, *, repeat: int = 3, quick: bool = False,
        scratch: str | None = None) -> list[dict]:
    """Every layout in its own process group, then the bookkeeping row;
    rows also written to ``out_dir/recovery.json`` and ``recovery.md``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout in LAYOUTS:
        shape = (SMALL_QUICK if quick else SMALL) if layout == "small" else (
            QUICK if quick else (NUM_TENSORS, ROWS, COLS))
        shm = tempfile.mkdtemp(prefix="hyperdcp-bench-recovery-", dir="/dev/shm")
        root = tempfile.mkdtemp(prefix="hyperdcp-bench-recovery-", dir=scratch)
        try:
            ranks = launch(_measure, 4, layout, shape, repeat, quick, shm, root)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
        rows.append(_summarize(layout, ranks, shape))
    from .s3_load import counting_server

    shm = tempfile.mkdtemp(prefix="hyperdcp-bench-recovery-", dir="/dev/shm")
    try:
        with counting_server() as endpoint:
            ranks = launch(_measure_s3, 4, QUICK if quick else S3_SHAPE, shm, endpoint)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    rows.append(_summarize_s3(ranks))
    rows.append(bookkeeping(repeat=repeat))
    write_table(out_dir, "recovery", rows, markdown(rows))
    return rows


def _m(row: dict, key: str, spec: str = ".3f") -> str:
    if key not in row:
        return "–"
    v = row[key]
    return f"{v['median']:{spec}} ({v['lo']:{spec}}–{v['hi']:{spec}})"


COLUMNS: list[Column] = [
    ("layout", lambda r: r["layout"]),
    ("MiB/rank", lambda r: f"{r['rank_bytes'] / 2**20:.0f}" if "rank_bytes" in r else "–"),
    ("crash s / memcpy s", lambda r: f"{_m(r, 'crash_s')} / {_m(r, 'crash_memcpy_s')}"
     if "crash_s" in r else "–"),
    ("crash × memcpy", lambda r: _m(r, "crash_x_memcpy", ".2f")),
    ("host lost s / PGTransport s",
     lambda r: f"{_m(r, 'host_lost_s')} / {_m(r, 'pg_transport_s')}" if "crash_s" in r else "–"),
    ("host lost × PGTransport", lambda r: _m(r, "host_lost_x_pg", ".2f")),
    ("persistent bytes: host lost / chunks lost (× lost)",
     lambda r: (f"{r['host_lost_persistent_bytes']:,} / " + (
         f"{r['lost_persistent_bytes']:,} ({r['lost_x_needed']:.3f}×)"
         if "lost_x_needed" in r else "–")) if "crash_s" in r else "–"),
    ("S3: GETs (GET bytes), host lost / chunks lost (× lost)",
     lambda r: f"{r['s3_host_lost_gets']} ({r['s3_host_lost_get_bytes']:,}) / "
               f"{r['s3_chunks_lost_gets']} ({r['s3_chunks_lost_get_bytes']:,}; "
               f"{r['s3_lost_x_needed']:.3f}×)" if "s3_lost_x_needed" in r else "–"),
    ("stall s (× memcpy)", lambda r: f"{_m(r, 'stall_s')} ({_m(r, 'stall_x_memcpy', '.2f')})"
     if "stall_s" in r else "–"),
    ("loop: step s, throughput lost, p95 added",
     lambda r: f"{_m(r, 'step_s', '.2f')}, {_m(r, 'loop_loss', '.1%')}, "
               f"{_m(r, 'loop_p95_added', '.1%')}" if "loop_loss" in r else "–"),
    ("host memory × U: steady / peak",
     lambda r: f"{r['steady_x_unique']:.2f} / {r['peak_x_unique']:.2f}"
     if "peak_x_unique" in r else "–"),
    ("SDC s / commit s (share)",
     lambda r: f"{_m(r, 'sdc_s', '.4f')} / {_m(r, 'commit_s', '.2f')} "
               f"({_m(r, 'sdc_share', '.2%')})" if "sdc_s" in r else "–"),
    ("bookkeeping s", lambda r: _m(r, "bookkeeping_s")),
    ("exact", lambda r: ("yes" if r["exact"] else "NO") if "exact" in r else "–"),
]


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    return markdown_table(rows, COLUMNS)


def targets(rows: list[dict]) -> list[TargetResult]:
    """The issue's limits, one per layout where it applies."""
    out = []
    for r in rows:
        name = r["layout"]
        if "bookkeeping_s" in r:
            out.append(TargetResult(f"recovery {name}: find + plan s",
                                    r["bookkeeping_s"]["median"], 1.0, timing=True))
            continue
        if "s3_lost_x_needed" in r:
            out += [TargetResult(f"recovery {name}: persistent bytes, host lost",
                                 r["s3_host_lost_persistent_bytes"], 0, timing=False),
                    TargetResult(f"recovery {name}: GET bytes × lost chunks' bytes",
                                 r["s3_lost_x_needed"], 1.05, timing=False)]
            continue
        pg_limit = 0.5 if name == "small" else 1.0
        out.append(TargetResult(f"recovery {name}: host lost × PGTransport",
                                r["host_lost_x_pg"]["median"], pg_limit, timing=True))
        out.append(TargetResult(f"recovery {name}: persistent bytes, host lost",
                                r["host_lost_persistent_bytes"], 0, timing=False))
        if name == "small":
            continue
        out += [
            TargetResult(f"recovery {name}: crash × memcpy", r["crash_x_memcpy"]["median"],
                         1.5, timing=True),
            TargetResult(f"recovery {name}: persistent bytes × lost chunks' bytes",
                         r["lost_x_needed"], 1.05, timing=False),
            TargetResult(f"recovery {name}: stall × memcpy", r["stall_x_memcpy"]["median"],
                         1.2, timing=True),
            TargetResult(f"recovery {name}: loop throughput lost", r["loop_loss"]["median"],
                         0.05, timing=True),
            TargetResult(f"recovery {name}: loop p95 step time added",
                         r["loop_p95_added"]["median"], 0.10, timing=True),
            TargetResult(f"recovery {name}: host memory steady × U", r["steady_x_unique"],
                         2.0, timing=False),
            TargetResult(f"recovery {name}: host memory peak × U", r["peak_x_unique"],
                         3.0, timing=False),
            TargetResult(f"recovery {name}: SDC comparison / memory save time",
                         r["sdc_share"]["median"], 0.05, timing=True),
        ]
    return out


def print_targets(results: list[TargetResult]) -> None:
    for t in results:
        verdict = "pass" if t.passed else "FAIL"
        print(f"{verdict}: {t.description}: {t.measured:.4g} (limit {t.limit:g})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recovery",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny tensors: a harness check")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--scratch", default=None)
    args = parser.parse_args()
    found = run(args.out, repeat=args.repeat, quick=args.quick, scratch=args.scratch)
    print(markdown(found))
    print_targets(targets(found))
