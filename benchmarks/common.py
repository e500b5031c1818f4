"""Machinery shared by the scenario families.

- :func:`launch` is the one way to run a worker in a process group: it spawns
  ``world_size`` ranks joined in a gloo group (free TCP port on 127.0.0.1,
  ``OMP_NUM_THREADS=1``) and returns each rank's return value to the caller.
- :class:`IOCounters` snapshots ``/proc/self/io``. The kernel sums the counters
  of all threads of the process, so I/O done by a library's worker threads is
  counted; I/O done by child processes is not.
- :func:`probe_eviction` / :func:`evict` drop a checkpoint's file pages from the
  page cache so that the next load's ``read_bytes`` counts storage reads
  instead of 0 (a load served from the page cache reads nothing from storage).
- :func:`timed_collective` measures one collective call on every rank: wall
  time, CPU time (which contention from other processes barely changes), I/O
  and the call's return value; :func:`timed` one call in one process.
- :func:`record` gathers one measured call of every rank to rank 0 as a
  :class:`~benchmarks.report.Sample`.
- :func:`rotation` orders the systems of a repeat.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .report import Sample
from .systems import requests_of

T = TypeVar("T")


@dataclass(frozen=True)
class RunConfig:
    """What every scenario family needs to know about the run."""

    systems: tuple[str, ...]  # names from benchmarks.systems.SYSTEMS
    world_sizes: tuple[int, ...]
    repeat: int
    scratch: str  # directory for checkpoints (removed afterwards)
    eviction: str | None  # from probe_eviction(); None: storage reads unmeasurable
    quick: bool  # tiny state dicts: checks the harness, numbers are meaningless


#: The ways :func:`evict` can drop cached file pages, tried in this order.
EVICTION_METHODS = ("fadvise", "drop_caches")


@dataclass(frozen=True)
class IOCounters:
    """The byte counters of ``/proc/self/io``.

    ``rchar``/``wchar``: bytes passed to read/write-like syscalls (logical I/O,
    page cache hits included, mmap access excluded). ``read_bytes``: bytes the
    process caused to be fetched from storage (readahead included).
    ``write_bytes``: bytes the process dirtied in the page cache for writing to
    storage. ``syscr``/``syscw``: numbers of read/write-like syscalls.
    """

    rchar: int
    wchar: int
    syscr: int
    syscw: int
    read_bytes: int
    write_bytes: int

    @classmethod
    def snapshot(cls) -> IOCounters:
        wanted = {f.name for f in fields(cls)}
        values = {}
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in wanted:
                    values[key] = int(value)
        return cls(**values)

    def __sub__(self, other: IOCounters) -> IOCounters:
        return IOCounters(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ForeignCpu:
    """Measures how busy the machine was with work that is not ours.

    Created at the start of a run; :meth:`fraction` at the end gives the CPU
    time that other processes (and the hypervisor, as steal time) took, as a
    fraction of all CPUs over the elapsed time. Our own CPU time counts this
    process and its reaped children (the spawned ranks, once joined).
    """

    def __init__(self) -> None:
        self._start = (self._machine_busy(), self._own(), time.monotonic())

    @staticmethod
    def _machine_busy() -> float:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def fraction(self) -> float:
        busy0, own0, wall0 = self._start
        busy = self._machine_busy() - busy0
        own = self._own() - own0
        wall = time.monotonic() - wall0
        return max(0.0, busy - own) / (wall * os.cpu_count())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``worker(rank, world_size, *args)`` on ``world_size`` spawned
    ranks; return what each rank's call returned, in rank order.

    Each rank joins a gloo default process group (rendezvous on a free TCP
    port of 127.0.0.1) and uses one intra-op thread; the return values
    (picklable) are gathered to rank 0, which hands them to this process,
    and the group is destroyed.  ``worker`` must be a module-level function
    (it is pickled to the children).  An exception on any rank is re-raised
    here after the other ranks are terminated.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="hyperdcp-bench-launch-") as tmp:
        out = Path(tmp) / "results.pickle"
        mp.spawn(_rank_main, args=(world_size, free_port(), worker, args, str(out)),
                 nprocs=world_size)
        return pickle.loads(out.read_bytes())


def _rank_main(rank: int, world_size: int, port: int, worker: Callable[..., Any], args: tuple,
               out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        results = gather_to_rank0(worker(rank, world_size, *args))
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Measurement:
    """One rank's view of one call."""

    seconds: float  # wall time
    cpu_seconds: float  # CPU time of this process, all threads
    io: IOCounters  # /proc/self/io delta
    value: Any = None  # what the call returned (a load's report, ...)


def timed_collective(call: Callable[..., Any], *args: Any) -> Measurement:
    """Run ``call(*args)`` on this rank after a barrier and measure it."""
    dist.barrier()
    io = IOCounters.snapshot()
    cpu = time.process_time()
    start = time.perf_counter()
    value = call(*args)
    seconds = time.perf_counter() - start
    return Measurement(seconds, time.process_time() - cpu, IOCounters.snapshot() - io, value)


def timed(call: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Wall seconds of ``call(*args, **kwargs)`` in this process (no collective)."""
    start = time.perf_counter()
    call(*args, **kwargs)
    return time.perf_counter() - start


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Collect one picklable object per rank; rank 0 gets the list, others None."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def record(samples: list[Sample], family: str, scenario: str, kind: str, system: Any,
           repeat: int, m: Measurement, needed: int | None = None, ok: bool | None = None,
           **extra) -> None:
    """Gather one call's per-rank measurements to rank 0 and add them to
    ``samples`` there as one :class:`Sample` (``extra``: its other fields,
    as rank 0 knows them)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = (m.seconds, m.cpu_seconds, m.io.as_dict(), needed, ok, requests_of(m.value))
    per_rank = gather_to_rank0(mine)
    if rank != 0:
        return
    load = kind == "load"
    sample = Sample(
        family=family,
        scenario=scenario,
        kind=kind,
        world_size=world_size,
        system=system.name,
        repeat=repeat,
        seconds=max(p[0] for p in per_rank),
        rank_cpu_seconds=[p[1] for p in per_rank],
        rank_io=[p[2] for p in per_rank],
        needed_bytes=[p[3] for p in per_rank] if load else None,
        verified=all(p[4] for p in per_rank) if load and per_rank[0][4] is not None else None,
        rank_requests=[p[5] for p in per_rank] if load else None,
        **extra,
    )
    samples.append(sample)
    print(f"  W={world_size} r={repeat} {scenario:<26} {system.name:<9} {sample.seconds:.3f} s",
          file=sys.stderr)


def rotation(items: Sequence[T], k: int) -> list[T]:
    """``items`` rotated left by ``k`` places.  Run the systems of repeat
    (or step) ``k`` in this order, and over ``len(items)`` consecutive
    values of ``k`` each system runs in every position once: storage is
    slower right after another system's writes, so a fixed position would
    favour or handicap one system throughout."""
    k %= len(items)
    return [*items[k:], *items[:k]]


def _files(path: Path) -> list[Path]:
    return [p for p in sorted(Path(path).rglob("*")) if p.is_file()]


def evict(path: str | os.PathLike, method: str) -> None:
    """Flush and drop the cached pages of every file under ``path``.

    ``fadvise``: fsync, then ``POSIX_FADV_DONTNEED`` on each file.
    ``drop_caches``: ``sync``, then ``echo 1 > /proc/sys/vm/drop_caches``
    (the whole machine's clean page cache; needs root).
    """
    if method == "fadvise":
        for file in _files(Path(path)):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    elif method == "drop_caches":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    else:
        raise ValueError(f"unknown eviction method {method!r}")


def probe_eviction(scratch: str | os.PathLike, size: int = 16 << 20) -> str | None:
    """The first of :data:`EVICTION_METHODS` after which re-reading a file
    counts at least 90% of its size in ``read_bytes``; None if none does (then
    only logical reads, ``rchar``, are measurable)."""
    probe_dir = Path(tempfile.mkdtemp(prefix="eviction-probe-", dir=scratch))
    probe = probe_dir / "probe.bin"
    try:
        with open(probe, "wb") as f:
            f.write(os.urandom(size))
        for method in EVICTION_METHODS:
            probe.read_bytes()  # make sure the pages are cached
            try:
                evict(probe_dir, method)
            except OSError:
                continue
            before = IOCounters.snapshot()
            probe.read_bytes()
            if (IOCounters.snapshot() - before).read_bytes >= 0.9 * size:
                return method
        return None
    finally:
        shutil.rmtree(probe_dir)
