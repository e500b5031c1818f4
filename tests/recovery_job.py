"""A training job with a memory tier, launched by tests/test_recovery.py as
one process per rank so that ranks and whole hosts can be killed.

Hosts are simulated on one machine: ``--hosts`` names each rank's host, and
a host's shared memory is its own folder ``<shm>/<host>`` (the tier's
``namespace``), so losing a host is killing its processes and deleting its
folder, and a replacement host is new processes with an empty folder.

``python tests/recovery_job.py RANK WORLD PORT ROOT SHM OUT --hosts h0,h0,h1,h1
[--resume] [--steps A B] [--persist N] [--flip-at K] [--kill-in-replication K]
[--kill-in-staging K] [--kill-at-commit K] [--stall-serving HOST SECONDS]
[--restore-timeout S] [--domains h0=a,h1=a,...] [--sample-memory] [--extra NAME]``:
optionally resumes (``load_latest``; the restored state is
compared element-exact with what step S holds in an uninterrupted run: every
value is a pure function of its fqn and the step), then trains steps
``A..B`` (the state set to step S's values, then ``mgr.save``), a memory
step every step and a persistent one every ``--persist``.  ``--flip-at K``:
rank 1 flips one bit of the replicated tensor before step K's save (silent
data corruption).  ``--kill-in-replication K``: rank 1 kills itself with
SIGKILL as step K's memory step starts sending its copies to the other host
(the launcher then kills the rest, as torchrun does); every rank first waits
for the persist in flight, so step K-1 is the newest whole step.
``--kill-in-staging K``: rank 1 kills itself while it stages step K (its
tensors copied, its blobs not).  ``--kill-at-commit K``: rank 0 (its host's
leader) kills itself as it commits step K, once every other host
committed it.  ``--stall-serving HOST SECONDS``: in a restore, the ranks of
HOST send what other hosts ask of them only SECONDS later (a host that
hangs while serving).  ``--sample-memory``:
rank 0 samples the bytes its host's namespace holds (allocated blocks of
every file) every millisecond while training, and reports the peak and the
bytes once the last step committed.  Each rank writes one JSON object per event
to ``OUT.<rank>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time
import warnings
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dcp  # noqa: E402
from dcp.recovery import replicate  # noqa: E402
from dcp.recovery.host_store import COMMITTED, HostStore  # noqa: E402

SHAPES = {"rep": (256, 512), "tp": (1024, 256), "dp": (512, 256)}  # fp32: 0.5, 1, 0.5 MiB


def full(name: str, step: int) -> torch.Tensor:
    """Tensor ``name`` at ``step`` in the uninterrupted run."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + step)
    return torch.randn(SHAPES[name], generator=g)


def boxes(name: str, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``name`` rank ``rank`` holds: ``rep`` on every
    rank, ``tp`` one block per rank, ``dp`` one block per tensor-parallel
    rank (``rank % 2``): replicas on ranks ``r`` and ``r + 2``."""
    rows = SHAPES[name][0]
    if name == "rep":
        return 0, rows
    parts, index = (world, rank) if name == "tp" else (min(2, world), rank % 2)
    return rows * index // parts, rows * (index + 1) // parts


def make_state(rank: int, world: int, step: int | None) -> dict:
    model = {}
    for name in SHAPES:
        lo, hi = boxes(name, rank, world)
        data = full(name, step)[lo:hi].clone() if step is not None else torch.zeros(
            hi - lo, SHAPES[name][1])
        model[name] = data if name == "rep" else dcp.TensorShard(data, SHAPES[name], (lo, 0))
    return {"model": model, "meta": {"step": -1 if step is None else step}}


def set_step(state: dict, rank: int, world: int, step: int) -> None:
    for name in SHAPES:
        lo, hi = boxes(name, rank, world)
        t = state["model"][name]
        (t if name == "rep" else t.data).copy_(full(name, step)[lo:hi])
    state["meta"]["step"] = step


def mismatches(state: dict, rank: int, world: int, step: int) -> list[str]:
    bad = []
    for name in SHAPES:
        lo, hi = boxes(name, rank, world)
        t = state["model"][name]
        t = t if name == "rep" else t.data
        if not torch.equal(t.view(torch.int32), full(name, step)[lo:hi].view(torch.int32)):
            bad.append(name)
    if state["meta"]["step"] != step:
        bad.append(f"meta.step={state['meta']['step']}")
    return bad


def namespace_bytes(folder: str) -> int:
    """Allocated bytes of every file under ``folder`` (a host's namespace)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # dropped while walking
    return total


class Sampler(threading.Thread):
    """The peak of :func:`namespace_bytes`, sampled every millisecond."""

    def __init__(self, folder: str) -> None:
        super().__init__(daemon=True)
        self.folder, self.peak, self.stop = folder, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, namespace_bytes(self.folder))
            time.sleep(0.001)


def kill_in_replication(step: int, emit, mgr) -> None:
    """SIGKILL this process as memory step ``step`` sends its copies."""
    exchange = replicate.exchange

    def dying(sends, recvs, group, **options) -> None:
        if threading.current_thread().name == f"dcp-memory-step-{step}":
            emit(event="killing", step=step, memory=mgr.memory_steps())
            os.kill(os.getpid(), signal.SIGKILL)
        exchange(sends, recvs, group, **options)

    replicate.exchange = dying


def kill_in_staging(step: int, emit, mgr) -> None:
    """SIGKILL this process while it stages memory step ``step``: its
    tensors are in its data file, its blobs not yet."""
    stage = HostStore.stage

    def dying(store, at, name, nbytes):
        if at == step and name.endswith("-blobs.data"):
            emit(event="killing", step=step, memory=mgr.memory_steps())
            os.kill(os.getpid(), signal.SIGKILL)
        return stage(store, at, name, nbytes)

    HostStore.stage = dying  # type: ignore[method-assign]


def kill_at_commit(step: int, emit, mgr, others: list[str]) -> None:
    """SIGKILL this process (a host's leader) as it commits memory step
    ``step``: its metadata written, its ``COMMITTED`` not, once every host
    of ``others`` (their step folders) committed the step."""
    commit = HostStore.commit

    def dying(store, at):
        if at == step:
            deadline = time.monotonic() + 60
            while not all(os.path.exists(os.path.join(o, COMMITTED)) for o in others):
                assert time.monotonic() < deadline, f"the other hosts never committed {step}"
                time.sleep(0.01)
            emit(event="killing", step=step, memory=mgr.memory_steps())
            os.kill(os.getpid(), signal.SIGKILL)
        commit(store, at)

    HostStore.commit = dying  # type: ignore[method-assign]


def stall_serving(seconds: float, emit) -> None:
    """The chunks this rank serves other hosts in a restore leave only
    ``seconds`` after they are asked for (a host that hangs while it serves;
    its own restore and the job's agreement go on)."""
    send = replicate.send

    def stalled(sends, group, *args, **options) -> None:
        if threading.current_thread().name.startswith("dcp-restore-serve") and any(
                len(v) for views in sends.values() for v in views):
            emit(event="stalling", seconds=seconds)
            time.sleep(seconds)
        send(sends, group, *args, **options)

    replicate.send = stalled


def main() -> None:
    p = argparse.ArgumentParser()
    for a in ("rank", "world", "port"):
        p.add_argument(a, type=int)
    p.add_argument("root")
    p.add_argument("shm")
    p.add_argument("out")
    p.add_argument("--hosts", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--steps", type=int, nargs=2)
    p.add_argument("--persist", type=int, default=4)
    p.add_argument("--flip-at", type=int)
    p.add_argument("--kill-in-replication", type=int)
    p.add_argument("--kill-in-staging", type=int)
    p.add_argument("--kill-at-commit", type=int)
    p.add_argument("--stall-serving", nargs=2, metavar=("HOST", "SECONDS"))
    p.add_argument("--restore-timeout", type=float, default=10.0)
    p.add_argument("--domains")
    p.add_argument("--sample-memory", action="store_true")
    p.add_argument("--extra")
    args = p.parse_args()
    rank, world = args.rank, args.world
    host = args.hosts.split(",")[rank]
    out = open(f"{args.out}.{rank}", "a")

    def emit(**record) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    domains = dict(d.split("=") for d in args.domains.split(",")) if args.domains else None
    tier = dcp.MemoryTier(host=host, namespace=os.path.join(args.shm, host), run_id="job",
                          timeout=60, restore_timeout=args.restore_timeout, domains=domains)
    if args.stall_serving is not None and args.stall_serving[0] == host:
        stall_serving(float(args.stall_serving[1]), emit)
    mgr = dcp.CheckpointManager(args.root, interval=args.persist, keep_latest=0,
                                save_rng=False, memory=tier)
    state = make_state(rank, world, None)
    if args.resume:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = mgr.load_latest(state)
        r = mgr.last_restore
        emit(event="resume", step=step, bad=mismatches(state, rank, world, step),
             warnings=[str(w.message) for w in caught],
             source=None if r is None else {
                 "own": r.bytes_own_host, "peer": r.bytes_other_hosts,
                 "persistent": r.bytes_persistent, "refetched": r.chunks_refetched,
                 "seconds": r.seconds, "late": sorted(set(r.late_holders))})
    if args.kill_in_replication is not None and rank == 1:
        kill_in_replication(args.kill_in_replication, emit, mgr)
    if args.kill_in_staging is not None and rank == 1:
        kill_in_staging(args.kill_in_staging, emit, mgr)
    hosts = args.hosts.split(",")
    if args.kill_at_commit is not None and rank == 0:  # the leader of its host
        kill_at_commit(args.kill_at_commit, emit, mgr, [
            os.path.join(args.shm, h, "job", f"step-{args.kill_at_commit}")
            for h in dict.fromkeys(hosts) if h != host])
    if args.steps:
        sampler = Sampler(os.path.join(args.shm, host)) if args.sample_memory and rank == 0 \
            else None
        if sampler is not None:
            sampler.start()
        for step in range(args.steps[0], args.steps[1] + 1):
            set_step(state, rank, world, step)
            if step in (args.kill_in_replication, args.kill_in_staging, args.kill_at_commit):
                mgr.wait()  # the persist in flight ended: the kill leaves the previous step whole
            if args.flip_at == step and rank == 1:
                state["model"]["rep"].view(torch.int32)[7, 3] ^= 1 << 5
            try:
                mgr.save(step, state)
            except dcp.SilentDataCorruptionError as e:
                emit(event="sdc", step=step, error=str(e),
                     mismatches=[[m[0], list(m[1]), sorted(m[2]), m[3]] for m in e.mismatches])
        try:
            mgr.wait()
        except dcp.SilentDataCorruptionError as e:
            emit(event="sdc", step=args.steps[1], error=str(e))
        if args.sample_memory:
            dist.barrier()  # every rank's last step committed
        if sampler is not None:
            sampler.stop.set()
            sampler.join()
            emit(event="memory", peak=sampler.peak, steady=namespace_bytes(sampler.folder))
        ms = mgr.last_memory_save
        emit(event="trained", memory=mgr.memory_steps(), persistent=mgr.persistent_steps(),
             errors=[str(e) for e in mgr.errors],
             stall=None if ms is None else ms.stall_s)
    if args.extra == "newer-persistent":
        # a persistent step newer than every memory step wins (a job without the tier)
        plain = dcp.CheckpointManager(args.root, interval=1, keep_latest=0, save_rng=False,
                                      async_save=False, save_on_preemption=False)
        set_step(state, rank, world, 13)
        plain.save(13, state)
        plain.close()
        fresh = make_state(rank, world, None)
        step = mgr.load_latest(fresh)
        emit(event="newer-persistent", step=step, bad=mismatches(fresh, rank, world, 13),
             from_memory=mgr.last_restore is not None)
        # row 10: SIGTERM to one rank: every rank persists this step at once
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        set_step(fresh, rank, world, 14)
        saved = mgr.save(14, fresh)
        again = make_state(rank, world, None)
        plain = dcp.CheckpointManager(args.root, save_rng=False, save_on_preemption=False)
        emit(event="sigterm", saved=saved, preempted=mgr.preempted,
             persistent=mgr.persistent_steps(), step=plain.load_latest(again),
             bad=mismatches(again, rank, world, 14))
        plain.close()
        small = dcp.CheckpointManager(args.root + "-small", interval=100, save_rng=False,
                                      memory=dcp.MemoryTier(host=host, namespace=os.path.join(
                                          args.shm, host), run_id="small", host_bytes=4096))
        small.save(1, state)
        small.wait()
        emit(event="refused", errors=[str(e) for e in small.errors],
             memory=small.memory_steps())
        small.close()
        # a memory step no source can restore (step 15, not persisted: every
        # host's data files damaged) fails once per load_latest; the second
        # failure marks it bad; each time the next older step (persistent 14)
        # is loaded whole
        again = dcp.CheckpointManager(args.root, interval=4, keep_latest=0, save_rng=False,
                                      memory=tier)
        set_step(fresh, rank, world, 15)
        again.save(15, fresh)
        again.wait()
        saved = again.memory_steps()
        dist.barrier()
        folder = os.path.join(args.shm, host, "job", "step-15")
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.endswith(".data") and os.path.getsize(path):
                with open(path, "r+b") as f:
                    first = f.read(1)
                    f.seek(0)
                    f.write(bytes([first[0] ^ 0xFF]))
        dist.barrier()
        loads = []
        for _ in range(2):
            target = make_state(rank, world, None)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step = again.load_latest(target)
            with open(os.path.join(folder, "failures")) as f:
                count = int(f.read().split()[0])
            loads.append({"step": step, "bad": mismatches(target, rank, world, step),
                          "from_memory": again.last_restore is not None, "failures": count,
                          "memory": again.memory_steps(),
                          "warned": any("memory step 15 cannot be restored" in str(w.message)
                                        for w in caught)})
        emit(event="unrestorable", saved=saved, loads=loads)
        again.close()
    mgr.close()
    emit(event="done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
