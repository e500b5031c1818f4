"""Asynchronous save: mutate-after-return for every coordination mode at 2
and 4 ranks, plan-cache hits and invalidation, consecutive saves, torn
exchange files, a background process that raises or is killed, and
resharded loads of async-saved checkpoints.

Multi-rank scenarios run in the shared gloo groups of dist_harness (W=2 in
phase 0, W=4 in phase 1, which loads the W=2 group's checkpoint); the file
protocol's pieces are tested in this process, with threads and a forked
writer."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dcp
from dcp.asynchronous.async_save import _saver_for, async_save_counters
from dcp.coordination import wire
from dcp.coordination.file_flag import EXCHANGE_PREFIX, FileCoordinator
from dcp.core.planner import SavePlan, TensorDecl, WriteItem
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, make_dtensor, randn
from storage_plugins.posix import PosixStorage

HERE = Path(__file__).resolve().parent
MODES = ("gloo", "file", "none")
WAIT = 120  # seconds: bound on every result() of a healthy save


class FlakyStorage(PosixStorage):
    """POSIX storage (picklable, unlike helpers.FailingStorage) that sleeps
    ``delay`` seconds before writing each data file, after it waits until
    the file ``hold`` exists (if given; at most WAIT seconds), and raises on
    data file writes if ``fail``."""

    def __init__(self, checkpoint_id, *, delay: float = 0.0, hold: str = "",
                 fail: bool = False, **options):
        super().__init__(checkpoint_id, **options)
        self.delay, self.hold, self.fail = delay, hold, fail

    def write_file(self, name, buffers):
        if name.endswith(".data"):
            time.sleep(self.delay)
            if self.fail:
                raise OSError(28, "injected: no space left on device", name)
        super().write_file(name, buffers)
        deadline = time.monotonic() + WAIT
        while name.endswith(".data") and self.hold and not os.path.exists(self.hold) \
                and time.monotonic() < deadline:
            time.sleep(0.01)


def load(target, path):
    """dcp.load after a barrier: with coordination='none' each rank's
    result() covers only its own part, so the checkpoint is complete once
    every rank's result() has returned."""
    torch.distributed.barrier()
    return dcp.load(target, str(path))


# ------------------------------------------------------------ state dicts
def state(ctx, seed: int, placements="S0", mesh=None, tag: str = "") -> dict:
    """~2.5 MiB per rank: a sharded DTensor (1 MiB global), a replicated
    bf16 tensor, a non-contiguous view, 0-dim optimizer scalars and JSON
    values; deterministic in ``seed``."""
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (ctx.world_size,))
    base = randn((256, 512), seed + 2)
    return {
        "model": {
            f"w{tag}": make_dtensor(randn((512, 512), seed), mesh, placements),
            "emb": randn((1024, 256), seed + 1, torch.bfloat16),
            "cols": base[:, ::2],
        },
        "optim": {"step": torch.tensor(float(seed)), "count": torch.tensor(seed),
                  "lr": 0.01, "betas": [0.9, 0.95]},
    }


def zeros_like_state(sd) -> dict:
    def zero(v):
        if isinstance(v, DTensor):
            return make_dtensor(torch.zeros(v.shape, dtype=v.dtype), v.device_mesh,
                                list(v.placements))
        if isinstance(v, torch.Tensor):
            return torch.zeros(v.shape, dtype=v.dtype)
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return None
    return zero(sd)


def mutate(sd) -> None:
    """Change every value in place, as an optimizer step would."""
    for v in sd["model"].values():
        (v.to_local() if isinstance(v, DTensor) else v).add_(1)
    sd["optim"]["step"].add_(1)
    sd["optim"]["count"].add_(1)
    sd["optim"]["betas"].append(0.5)


def assert_state_equal(actual, expected, path="") -> None:
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, DTensor):
        assert list(actual.placements) == list(expected.placements), path
        assert_bitwise_equal(actual.to_local(), expected.to_local(), path)
    elif isinstance(expected, torch.Tensor):
        assert_bitwise_equal(actual, expected, path)
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def staged_bytes(sd) -> int:
    tensors = [v.to_local() if isinstance(v, DTensor) else v for v in sd["model"].values()]
    tensors += [sd["optim"]["step"], sd["optim"]["count"]]
    return sum(t.numel() * t.element_size() for t in tensors)


def exchange_files(path) -> list[str]:
    return [n for n in os.listdir(path) if n.startswith(EXCHANGE_PREFIX)]


def assert_exchange_files_removed(path) -> None:
    """The coordinator's worker removes the last exchange files right after
    the commit, once every rank has read the outcome."""
    deadline = time.monotonic() + 30
    while exchange_files(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not exchange_files(path), f"exchange files left after commit: {exchange_files(path)}"


def wait_for(event: threading.Event, what: str) -> None:
    assert event.wait(30), f"{what} did not happen within 30 s"


# ============================================================ W=2, phase 0
@dist_scenario(world_size=2, phase=0)
def test_mutate_after_return_every_mode_w2(ctx):
    """CPU tensors, 0-dim tensors, a non-contiguous view and DTensor shards
    changed in place right after async_save returns: the checkpoint holds the
    values at the call, in every coordination mode."""
    for i, mode in enumerate(MODES):
        path = ctx.dir / mode
        sd = state(ctx, 10 + i)
        called = threading.Event()
        response = dcp.async_save(sd, str(path), coordination=mode,
                                  callback=lambda r, called=called: called.set())
        assert response.staged.done()
        mutate(sd)
        md = response.result(WAIT)
        assert response.done() and isinstance(md, dcp.Metadata)
        wait_for(called, f"{mode}: the completion callback")
        assert response.stats.staged_bytes == staged_bytes(sd), response.stats
        target = zeros_like_state(sd)
        load(target, path)
        assert_state_equal(target, state(ctx, 10 + i))
        assert_exchange_files_removed(path)
        names = set(os.listdir(path))
        if mode == "none":
            assert "metadata.json" not in names
            assert {"metadata.rank00000.json", "metadata.rank00001.json"} <= names
        else:
            assert "metadata.json" in names and md.world_size == 2
    sd = state(ctx, 20)
    dcp.async_save(sd, str(ctx.shared / "async_w2_shard0"), coordination="gloo").result(WAIT)


@dist_scenario(world_size=2, phase=0)
def test_plan_cache_hit_then_invalidated_by_resharding_w2(ctx):
    """Same structure twice: one plan exchange.  Shard(0) -> Shard(1): a new
    exchange and a correct checkpoint.  A structure change on rank 1 only
    (rank 0 hits, writes speculatively, and must replan): a correct
    checkpoint with no stray files."""
    for mode in ("gloo", "file"):
        # save() runs only within this iteration: its late read of mode is safe (B023)
        def save(seed, placements, extra=False):
            sd = state(ctx, seed, placements, tag=mode)  # noqa: B023
            if extra and ctx.rank == 1:
                sd["extra"] = dcp.TensorShard(randn((64, 64), 99), (64, 64), (0, 0))
            path = ctx.dir / f"{mode}{seed}"  # noqa: B023
            response = dcp.async_save(sd, str(path), coordination=mode)  # noqa: B023
            md = response.result(WAIT)
            return response, md, path

        start = async_save_counters().plan_exchanges
        r1, _, _ = save(1, "S0")
        r2, _, p2 = save(2, "S0")
        assert (r1.stats.plan_exchanged, r2.stats.plan_exchanged) == (True, False)
        assert async_save_counters().plan_exchanges == start + 1
        r3, _, p3 = save(3, "S1")
        assert r3.stats.plan_exchanged and async_save_counters().plan_exchanges == start + 2
        r4, md4, p4 = save(4, "S1", extra=True)
        assert r4.stats.plan_exchanged and async_save_counters().plan_exchanges == start + 3
        r5, _, _ = save(5, "S1", extra=True)
        assert not r5.stats.plan_exchanged and async_save_counters().plan_exchanges == start + 3

        for seed, placements, path in ((2, "S0", p2), (3, "S1", p3)):
            target = zeros_like_state(state(ctx, 0, placements, tag=mode))
            load(target, path)
            assert_state_equal(target, state(ctx, seed, placements, tag=mode))
        target = zeros_like_state(state(ctx, 0, "S1", tag=mode))
        target["extra"] = torch.zeros(64, 64)
        load(target, p4)
        expected = state(ctx, 4, "S1", tag=mode)
        expected["extra"] = randn((64, 64), 99)
        assert_state_equal(target, expected)
        stray = set(os.listdir(p4)) - md4.files() - {"metadata.json"}
        assert not stray, f"{mode}: files not in the metadata: {stray}"


@dist_scenario(world_size=2, phase=0)
def test_consecutive_async_saves_reuse_buffers_and_load_bit_exact_w2(ctx):
    """A second async_save called while the first is in flight waits for it;
    both load bit-exact.  The staging buffer is allocated once, and what
    goes to the worker is small messages (the tensors travel by shared
    memory, never pickled)."""
    from dcp.asynchronous import worker as worker_module

    sizes = []
    submit = worker_module.WorkerHandle.submit

    def measuring_submit(handle, job):
        sizes.append(len(multiprocessing.reduction.ForkingPickler.dumps(job)))
        return submit(handle, job)

    worker_module.WorkerHandle.submit = measuring_submit
    try:
        sd = state(ctx, 30, tag="c")
        before = async_save_counters()
        first = dcp.async_save(sd, str(ctx.dir / "first"))
        mutate(sd)
        second = dcp.async_save(sd, str(ctx.dir / "second"), blocking_staging=False)
        assert first.done(), "a second async_save did not wait for the one in flight"
        second.staged.result(WAIT)
        mutate(sd)
        second.result(WAIT)
        third = dcp.async_save(sd, str(ctx.dir / "third"))
        third.result(WAIT)
    finally:
        worker_module.WorkerHandle.submit = submit
    after = async_save_counters()
    assert after.staging_allocations == before.staging_allocations + 1, (before, after)
    assert after.bytes_staged - before.bytes_staged == 3 * staged_bytes(sd)
    assert max(sizes) < 64 * 1024 < staged_bytes(sd), f"messages to the worker: {sizes} bytes"

    expected = state(ctx, 30, tag="c")
    for name in ("first", "second", "third"):
        target = zeros_like_state(sd)
        load(target, ctx.dir / name)
        assert_state_equal(target, expected)
        mutate(expected)


@dist_scenario(world_size=2, phase=0)
def test_load_of_a_save_in_flight_refuses_or_waits_w2(ctx):
    """dcp.load of a checkpoint this process is still saving waits for the
    save; a reader that is not the saving process (here: the metadata read
    straight from storage) finds no checkpoint until the commit."""
    path = ctx.dir / "ckpt"
    sd = state(ctx, 40)
    response = dcp.async_save(sd, str(path), storage=FlakyStorage(str(path), delay=1.5))
    with pytest.raises(dcp.NotACheckpointError):
        dcp.read_metadata(str(path))
    assert not response.done()
    target = zeros_like_state(sd)
    dcp.load(target, str(path))  # waits for this process's save in flight
    assert response.done()
    assert_state_equal(target, state(ctx, 40))


@dist_scenario(world_size=2, phase=0, last=True)
def test_background_failure_fails_every_rank_and_the_next_save_works_w2(ctx):
    """A write error in rank 1's worker: result() raises on both ranks
    (coordinated modes) naming rank 1; the previous checkpoint at the same
    path (overwrite=True) stays loadable; the next save works.  With
    coordination='none' only rank 1 knows, and the checkpoint is refused as
    incomplete."""
    failures = async_save_counters().failures
    for i, mode in enumerate(MODES):
        path = ctx.dir / mode
        dcp.async_save(state(ctx, 50 + i), str(path), coordination=mode).result(WAIT)
        target = path if mode != "none" else ctx.dir / f"{mode}-failed"
        bad = FlakyStorage(str(target), fail=ctx.rank == 1)
        response = dcp.async_save(state(ctx, 60 + i), str(target), coordination=mode,
                                  storage=bad, overwrite=True)
        if mode != "none" or ctx.rank == 1:
            with pytest.raises(dcp.CheckpointError) as ei:
                response.result(WAIT)
            assert "rank 1" in str(ei.value) and "no space left" in str(ei.value), str(ei.value)
        else:
            response.result(WAIT)
        sd = zeros_like_state(state(ctx, 0))
        load(sd, path)
        assert_state_equal(sd, state(ctx, 50 + i))
        if mode == "none":
            with pytest.raises(dcp.NotACheckpointError, match="rank.* 1 of 2 never committed"):
                load(zeros_like_state(state(ctx, 0)), target)
        dcp.async_save(state(ctx, 70 + i), str(ctx.dir / f"{mode}-next"),
                       coordination=mode).result(WAIT)
        load(sd, ctx.dir / f"{mode}-next")
        assert_state_equal(sd, state(ctx, 70 + i))
    assert async_save_counters().failures - failures == (3 if ctx.rank == 1 else 2)


@dist_scenario(world_size=2, phase=0, last=True)
def test_killed_background_process_fails_every_rank_and_the_next_save_works_w2(ctx):
    """kill -9 of rank 1's worker mid-save: result() raises on every rank
    (with coordination='none' on rank 1 only), the previous checkpoint stays
    loadable, the partial one is refused as incomplete, and the next
    async_save (a new worker, a new gloo group) works."""
    for i, mode in enumerate(MODES):
        previous, partial = ctx.dir / f"{mode}-previous", ctx.dir / f"{mode}-partial"
        dcp.async_save(state(ctx, 80 + i), str(previous), coordination=mode).result(WAIT)
        worker_started()
        response = dcp.async_save(state(ctx, 90 + i), str(partial), coordination=mode, timeout=3,
                                  storage=FlakyStorage(str(partial), delay=2.0))
        if ctx.rank == 1:
            workers = [p for p in multiprocessing.active_children() if p.name == "dcp-async-save"]
            assert len(workers) == 1, workers
            os.kill(workers[0].pid, signal.SIGKILL)
        if mode != "none" or ctx.rank == 1:
            with pytest.raises(dcp.CheckpointError) as ei:
                response.result(WAIT)
            if ctx.rank == 1:
                assert "died" in str(ei.value), str(ei.value)
        else:
            response.result(WAIT)
        sd = zeros_like_state(state(ctx, 0))
        load(sd, previous)
        assert_state_equal(sd, state(ctx, 80 + i))
        with pytest.raises(dcp.NotACheckpointError):
            load(zeros_like_state(state(ctx, 0)), partial)
        dcp.async_save(state(ctx, 100 + i), str(ctx.dir / f"{mode}-next"),
                       coordination=mode).result(WAIT)
        load(sd, ctx.dir / f"{mode}-next")
        assert_state_equal(sd, state(ctx, 100 + i))


def kill_worker() -> int:
    """SIGKILL this rank's background save process, as the OOM killer does,
    and wait until it is gone; returns its pid."""
    workers = [p for p in multiprocessing.active_children() if p.name == "dcp-async-save"]
    assert len(workers) == 1, workers
    if sys.platform.startswith("linux"):  # found by `pgrep dcp-async-save`
        assert Path(f"/proc/{workers[0].pid}/comm").read_text().strip() == "dcp-async-save"
    os.kill(workers[0].pid, signal.SIGKILL)
    workers[0].join(WAIT)
    return workers[0].pid


def worker_started() -> None:
    """Wait until this rank's background process is up: until then a save
    runs in the trainer, and a test of what befalls the process needs it."""
    _saver_for(None).ensure_worker().wait_started(WAIT)


def worker_pids() -> list[int]:
    return [p.pid for p in multiprocessing.active_children() if p.name == "dcp-async-save"]


@dist_scenario(world_size=2, phase=0, last=True)
def test_killed_idle_worker_is_replaced_and_the_save_goes_on_w2(ctx):
    """The OOM killer takes a rank's idle background process (the
    coordinator's, then the other's): that rank's next async_save starts a
    new one and the save succeeds on every rank, loading bit-exact."""
    for i, (mode, victim) in enumerate([("gloo", 0), ("gloo", 1), ("file", 0)]):
        first, second = ctx.dir / f"{mode}{victim}-first", ctx.dir / f"{mode}{victim}-second"
        dcp.async_save(state(ctx, 110 + i), str(first), coordination=mode).result(WAIT)
        if ctx.rank == victim:
            killed = kill_worker()
        ctx.barrier()
        dcp.async_save(state(ctx, 120 + i), str(second), coordination=mode,
                       timeout=60).result(WAIT)
        if ctx.rank == victim:
            assert killed not in worker_pids()
        for path, seed in ((first, 110 + i), (second, 120 + i)):
            sd = zeros_like_state(state(ctx, 0))
            load(sd, path)
            assert_state_equal(sd, state(ctx, seed))


@dist_scenario(world_size=2, phase=0, last=True)
def test_worker_killed_mid_save_fails_every_rank_within_seconds_w2(ctx):
    """A rank's background process killed while every worker is held in
    its writes (30 s each, timeout=60): every rank's result() raises within
    10 s of the call, naming the rank at fault; the previous checkpoint
    loads bit-exact, the failed one is refused as incomplete, and the next
    save (new background processes) loads bit-exact."""
    for i, (mode, victim) in enumerate([("gloo", 1), ("gloo", 0), ("file", 1)]):
        previous = ctx.dir / f"{mode}{victim}-previous"
        failed, after = ctx.dir / f"{mode}{victim}-failed", ctx.dir / f"{mode}{victim}-after"
        dcp.async_save(state(ctx, 130 + i), str(previous), coordination=mode).result(WAIT)
        worker_started()
        start = time.monotonic()
        response = dcp.async_save(state(ctx, 140 + i), str(failed), coordination=mode,
                                  timeout=60, storage=FlakyStorage(str(failed), delay=30.0))
        if ctx.rank == victim:
            time.sleep(1.0)  # the save is in flight: meeting, planning or the held write
            kill_worker()
        with pytest.raises(dcp.CheckpointError) as ei:
            response.result(WAIT)
        stall = time.monotonic() - start
        assert stall < 10, f"{mode}: rank {ctx.rank} learned of the failure after {stall:.1f} s"
        assert f"rank {victim}" in str(ei.value), str(ei.value)
        sd = zeros_like_state(state(ctx, 0))
        load(sd, previous)
        assert_state_equal(sd, state(ctx, 130 + i))
        with pytest.raises(dcp.NotACheckpointError):
            load(zeros_like_state(state(ctx, 0)), failed)
        dcp.async_save(state(ctx, 150 + i), str(after), coordination=mode,
                       timeout=60).result(WAIT)
        load(sd, after)
        assert_state_equal(sd, state(ctx, 150 + i))


@dist_scenario(world_size=2, phase=0, last=True)
def test_manager_goes_on_after_its_background_processes_die_w2(ctx):
    """CheckpointManager(async_save=True): rank 1's idle background process
    killed, the next step saves on every rank; rank 0's killed during a
    held save (faulty://: every data file write waits 3 s once), the
    failure is warned about on every rank within seconds, the loop goes on
    (the next step saves), and load_latest gives the newest complete step,
    bit-exact."""
    root = f"faulty://{ctx.dir / 'run'}"
    hold = {"methods": ["write_file"], "faults": ["timeout"], "rate": 1.0,
            "max_consecutive": 1, "delay_s": 3.0}
    mgr = dcp.CheckpointManager(root, interval=1, keep_latest=0, timeout=60,
                                storage_options=hold, save_rng=False)
    saved: dict[int, int] = {}

    def save(step: int) -> None:
        saved[step] = 160 + step
        assert mgr.save(step, {"state": state(ctx, saved[step])})

    save(1)
    mgr.wait()
    if ctx.rank == 1:
        kill_worker()
    ctx.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(2)
        mgr.wait()
        assert not caught, [str(w.message) for w in caught]
        worker_started()
        save(3)
        if ctx.rank == 0:
            time.sleep(1.0)
            kill_worker()
        start = time.monotonic()
        mgr.wait()
        stall = time.monotonic() - start
        assert stall < 10, f"rank {ctx.rank} waited {stall:.1f} s for the failed step"
        messages = [str(w.message) for w in caught if issubclass(w.category, dcp.CheckpointWarning)]
        assert len(messages) == 1 and "step 3" in messages[0] and "rank 0" in messages[0], messages
        save(4)
        mgr.wait()
        assert len(caught) == 1, [str(w.message) for w in caught]
    mgr.close()
    for newest in (4, 2):
        with dcp.CheckpointManager(ctx.dir / "run", interval=1, save_rng=False) as fresh:
            sd = {"state": zeros_like_state(state(ctx, 0))}
            assert fresh.load_latest(sd) == newest
            assert_state_equal(sd["state"], state(ctx, saved[newest]))
        if ctx.rank == 0 and newest == 4:  # step 3 failed: the newest complete is then 2
            shutil.rmtree(ctx.dir / "run" / "step-4")
        ctx.barrier()


@dist_scenario(world_size=2, phase=0, last=True)
def test_peer_worker_killed_while_a_save_runs_in_the_trainer_w2(ctx):
    """Rank 0's background process is killed while idle, so its next save
    runs in its trainer (the replacement is still starting) and that save's
    steps go over the job's store; rank 1's process, up and held in its
    write (30 s, timeout=60), is killed once rank 0 has written (so rank 0
    waits for it in a step over the store): every rank's result() raises
    within 10 s, naming rank 1; the previous checkpoint loads
    bit-exact, the failed one is refused, and the next save loads
    bit-exact."""
    previous, failed, after = (ctx.dir / f"trainer-{n}" for n in ("previous", "failed", "after"))
    dcp.async_save(state(ctx, 170), str(previous)).result(WAIT)
    worker_started()
    if ctx.rank == 0:
        kill_worker()
    ctx.barrier()
    start = time.monotonic()
    response = dcp.async_save(state(ctx, 171), str(failed), timeout=60,
                              storage=FlakyStorage(str(failed), delay=30.0 * ctx.rank))
    if ctx.rank == 1:  # once rank 0 has written, it waits for rank 1 in a step over the store
        deadline = time.monotonic() + 30
        while not (failed.is_dir() and any(p.suffix == ".data" for p in failed.iterdir())):
            assert time.monotonic() < deadline, "rank 0 wrote no data file"
            time.sleep(0.02)
        kill_worker()
    with pytest.raises(dcp.CheckpointError) as ei:
        response.result(WAIT)
    stall = time.monotonic() - start
    assert stall < 10, f"rank {ctx.rank} learned of the failure after {stall:.1f} s"
    assert "rank 1" in str(ei.value), str(ei.value)
    assert response.stats is not None and response.stats.in_trainer == (ctx.rank == 0)
    sd = zeros_like_state(state(ctx, 0))
    load(sd, previous)
    assert_state_equal(sd, state(ctx, 170))
    with pytest.raises(dcp.NotACheckpointError):
        load(zeros_like_state(state(ctx, 0)), failed)
    dcp.async_save(state(ctx, 172), str(after), timeout=60).result(WAIT)
    load(sd, after)
    assert_state_equal(sd, state(ctx, 172))


# ============================================================ W=4, phase 1
def _mesh_2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


@dist_scenario(world_size=4, phase=1)
def test_mutate_after_return_every_mode_w4_with_replicas(ctx):
    """2-D mesh, DTensors replicated over dp and sharded over tp: each chunk
    is held by two ranks and written once in every mode (by the coordinator's
    dedup, or by the owner rule of coordination='none')."""
    mesh = _mesh_2d()
    for i, mode in enumerate(MODES):
        path = ctx.dir / mode
        sd = state(ctx, 110 + i, "R,S0", mesh)
        response = dcp.async_save(sd, str(path), coordination=mode)
        mutate(sd)
        response.result(WAIT)
        target = zeros_like_state(sd)
        load(target, path)
        assert_state_equal(target, state(ctx, 110 + i, "R,S0", mesh))
        md = dcp.read_metadata(str(path))
        assert md.stored_bytes == md.unique_bytes, (mode, md.stored_bytes, md.unique_bytes)
        assert_exchange_files_removed(path)


@dist_scenario(world_size=4, phase=1)
def test_resharded_load_of_a_w2_async_checkpoint_w4(ctx):
    """The W=2 Shard(0) checkpoint of the phase-0 group, loaded by 4 ranks
    as Shard(1) and as a 2-D (Shard(1), Shard(0)) layout."""
    path = ctx.shared / "async_w2_shard0"
    for placements, mesh in (("S1", None), ("S1,S0", _mesh_2d())):
        target = zeros_like_state(state(ctx, 0, placements, mesh))
        dcp.load(target, str(path))
        assert_state_equal(target, state(ctx, 20, placements, mesh))


# ============================================================ one process
def test_single_process_async_save_mutate_after_return(tmp_path):
    sd = {"w": randn((256, 1024), 1), "view": randn((64, 64), 2).t(),
          "step": torch.tensor(3), "flag": torch.tensor(True), "note": "x"}
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    response = dcp.async_save(sd, str(tmp_path / "a"))
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            v.logical_not_() if v.dtype == torch.bool else v.add_(1)
    response.result(WAIT)
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
              for k, v in sd.items()}
    dcp.load(target, str(tmp_path / "a"))
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert_bitwise_equal(target[k], v, k)
        else:
            assert target[k] == v
    with pytest.raises(dcp.CheckpointError, match="coordination must be one of"):
        dcp.async_save(sd, str(tmp_path / "b"), coordination="nccl")


def test_interrupted_async_save_leaves_no_folder(tmp_path):
    """Ctrl-C reaches the background process too (a terminal sends SIGINT
    to the whole job): mid-write, it deletes what it wrote and the folder
    the save made; result() raises; the next save works.  The process is
    up before the save (else the save runs in the trainer), and its write
    is held after the data file until the SIGINT is sent: a loaded machine
    cannot miss the window."""
    path, release = tmp_path / "run" / "step-1", tmp_path / "release"
    sd = {"w": randn((256, 256), 1)}
    worker_started()
    response = dcp.async_save(sd, str(path), storage=FlakyStorage(str(path), hold=str(release)))
    deadline = time.monotonic() + WAIT
    while not (path.is_dir() and any(p.suffix == ".data" for p in path.iterdir())):
        assert time.monotonic() < deadline and not response.done(), "no data file was written"
        time.sleep(0.02)
    (worker,) = [p for p in multiprocessing.active_children() if p.name == "dcp-async-save"]
    os.kill(worker.pid, signal.SIGINT)  # pending there before the write returns
    # the worker's main thread takes the signal at its next bytecode, while
    # a writer thread holds: give it that moment on a loaded machine (CI once
    # saw the held write released and the save finished first)
    time.sleep(1.0)
    release.touch()
    with pytest.raises(dcp.CheckpointError, match="died"):
        response.result(WAIT)
    worker.join(WAIT)
    assert not path.exists(), sorted(p.name for p in path.iterdir())
    dcp.async_save(sd, str(path)).result(WAIT)
    target = {"w": torch.zeros(256, 256)}
    dcp.load(target, str(path))
    assert_bitwise_equal(target["w"], sd["w"], "w")


def _python(script: str, *args: str, stdin: bool = False) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter (fed on standard input with
    ``stdin``, else from a file next to it), with hyperdcp and tests/ on the
    path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    if stdin:
        return subprocess.run([sys.executable, "-", *args], input=script, text=True, env=env,
                              capture_output=True, timeout=300)
    path = Path(args[0]) / "job.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path), *args], text=True, env=env,
                          capture_output=True, timeout=300)


STDIN_JOB = """
import sys, torch, dcp
root = sys.argv[1]
sd = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "note": "stdin"}
dcp.async_save(sd, root + "/a").result(120)
target = {"w": torch.zeros(64, 64), "note": None}
dcp.load(target, root + "/a")
assert torch.equal(target["w"], sd["w"]) and target["note"] == "stdin", target

class Mine(dcp.CheckpointError):  # a class of the script itself cannot reach the worker
    pass

def before_commit(metadata):
    raise Mine("never called")

try:
    dcp.async_save(sd, root + "/b", before_commit=before_commit).result(120)
except dcp.CheckpointError as e:
    assert "standard input" in str(e) and "define it in a module" in str(e), e
else:
    raise AssertionError("a function of a script on stdin reached the worker")
dcp.async_save(sd, root + "/c").result(120)
with dcp.CheckpointManager(root + "/run", interval=1) as mgr:
    mgr.save(1, {"sd": sd})
print("ok")
"""


def test_async_save_from_a_script_fed_on_stdin(tmp_path):
    """``python - <<EOF``: the main module is ``<stdin>``, which a spawned
    process cannot re-import; the background process starts without it, the
    save commits and loads back exact, a function of the script passed as
    before_commit fails the save saying why, and the next save works."""
    done = _python(STDIN_JOB, str(tmp_path), stdin=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    assert dcp.read_metadata(str(tmp_path / "run" / "step-1")).tensors["sd.w"].shape == (64, 64)


PRESTART_JOB = """
import sys, time, torch, dcp
from dcp.asynchronous.async_save import _saver_for

if __name__ == "__main__":
    root = sys.argv[1]
    sd = {"w": torch.randn(256, 1024)}
    start = time.monotonic()
    mgr = dcp.CheckpointManager(root + "/run", interval=1, keep_latest=0, save_rng=False)
    assert mgr.load_latest(sd) is None  # the resume: nothing there yet
    worker = _saver_for(None).worker
    called, starting, blocks, values = [], [], [], {}
    for step in range(1, 5):
        if step == 4:  # after the start: the save goes to the process
            worker.wait_started(120)
        time.sleep(0.25)  # a training step, shorter than the worker's start
        sd["w"].add_(1)
        values[step] = sd["w"].clone()
        starting.append(not worker.ready())
        called.append(time.monotonic() - start)
        t = time.monotonic()
        mgr.save(step, sd)
        blocks.append(time.monotonic() - t)
    mgr.close()
    for step, value in values.items():
        target = {"w": torch.zeros(256, 1024)}
        dcp.load(target, f"{root}/run/step-{step}")
        assert torch.equal(target["w"], value), step
    print(*called, *starting, *blocks)
"""


def test_no_save_blocks_on_the_background_process_start(tmp_path):
    """CheckpointManager(async_save=True) after a short resume, 0.25 s
    training steps, the background process still starting at save 2 (it
    takes seconds: Python and import torch): save 2 blocks for less than
    0.25x the time since the manager was made (a lower bound of the start)
    and under 0.5 s, since saves 1-2 run in the trainer instead of waiting
    for the process; save 4, once the process is up, goes to it; every step
    loads exact."""
    done = _python(PRESTART_JOB, str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.split()
    called, starting, blocks = [float(x) for x in out[:4]], out[4:8], [float(x) for x in out[8:]]
    assert starting[:2] == ["True", "True"] and starting[3] == "False", (starting, called)
    assert blocks[1] < min(0.5, 0.25 * called[1]), (blocks, called)


def test_exchange_payloads_are_json_and_never_unpickled():
    plan = SavePlan({"w": TensorDecl((4, 2), "float32")}, [WriteItem("w", (0, 0), (4, 2), 32)])
    value = ((plan, None), {("w", (0, 0)): 7}, b"\x00\xff", [1.5, None, "s"])
    data = wire.encode(value)
    json.loads(wire.body(data))  # JSON inside the versioned envelope
    assert wire.decode(data, "f") == value
    for crafted in (pickle.dumps(plan), b'{"c":"os.system","f":"true"}', b'{"t":[1],"d":[]}',
                    b'{"c":"SavePlan","f":{"d":[["tensors",{"d":[]}]]}}'):
        with pytest.raises(dcp.CheckpointError, match="crafted: malformed exchange payload"):
            wire.decode(crafted, "crafted")


def test_torn_exchange_files_are_never_read_as_complete(tmp_path):
    storage = PosixStorage(str(tmp_path))
    payload = wire.encode({"plan": list(range(40))})
    storage.write_exchange("x", payload)
    complete = (tmp_path / "x").read_bytes()
    assert storage.read_exchange("x") == payload
    for cut in range(len(complete)):
        (tmp_path / "x").write_bytes(complete[:cut])
        assert storage.read_exchange("x") is None, f"a file torn at byte {cut} was accepted"
    flipped = bytearray(complete)
    flipped[3] ^= 0x10
    for damaged in (bytes(flipped), complete + b"\x00", payload):
        (tmp_path / "x").write_bytes(damaged)
        assert storage.read_exchange("x") is None


class _StallingStorage(PosixStorage):
    """Writes each buffer separately and stalls before the last one (the
    completion trailer of an exchange file)."""

    def write_file(self, name, buffers):
        with open(self._path(name), "wb") as f:
            for i, buf in enumerate(buffers):
                if i == len(buffers) - 1:
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(60)
                f.write(buf)


def test_writer_killed_mid_write_leaves_a_file_the_coordinator_refuses(tmp_path):
    """A rank's worker killed (SIGKILL) while writing its exchange file: the
    coordinator never accepts the torn file and times out naming the rank."""
    key = "k"
    coordinator = FileCoordinator(PosixStorage(str(tmp_path)), key, 0, 2, timeout=0.5)
    torn = tmp_path / f"{EXCHANGE_PREFIX}{key}.000.in.r00001"
    pid = os.fork()
    if pid == 0:  # the writer: rank 1's part of step 0
        try:
            _StallingStorage(str(tmp_path)).write_exchange(torn.name, wire.encode(((1, 2), None)))
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while not (torn.exists() and torn.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert torn.stat().st_size > 0
    with pytest.raises(dcp.CheckpointError) as ei:
        coordinator.gather_broadcast("save planning", lambda: (0, 1), lambda parts: parts)
    assert "rank 1 never arrived" in str(ei.value) and torn.name in str(ei.value), str(ei.value)


class _CountingStorage(PosixStorage):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = 0

    def read_exchange(self, name):
        self.reads += 1
        return super().read_exchange(name)


def test_file_protocol_steps_failures_timeouts_and_cleanup(tmp_path):
    """Three ranks on threads: per-rank and shared answers, a failure on
    rank 2 reaching everyone, a rank that never arrives, a coordinator that
    never answers (each rank reads only its own answer, and polls with
    backoff), and no exchange file left after close()."""
    world = 3

    def run_ranks(key, body, ranks=range(world), timeout=10.0):
        results, storages = {}, {}

        def one(rank):
            storages[rank] = _CountingStorage(str(tmp_path))
            coord = FileCoordinator(storages[rank], key, rank, world, timeout)
            try:
                results[rank] = body(coord)
            except dcp.CheckpointError as e:
                results[rank] = e
            coord.close()

        threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return results, storages

    def body(coord):
        mine = coord.gather_scatter("planning", lambda: coord.rank * 10,
                                    lambda parts: [p + 1 for p in parts])
        total = coord.gather_broadcast("commit", lambda: mine, sum)
        return mine, total

    results, storages = run_ranks("ok", body)
    assert results == {0: (1, 33), 1: (11, 33), 2: (21, 33)}
    assert not exchange_files(tmp_path)

    def failing(coord):
        def local():
            if coord.rank == 2:
                raise OSError("disk on fire")
            return coord.rank
        return coord.run_all("writing", local)

    results, _ = run_ranks("fail", failing)
    for rank in range(world):
        assert isinstance(results[rank], dcp.CheckpointError), results
        assert ("writing failed on rank 2" in str(results[rank])
                and "disk on fire" in str(results[rank]))
    assert not exchange_files(tmp_path)

    results, storages = run_ranks("missing", body, ranks=(0, 1), timeout=0.6)
    for rank in (0, 1):
        assert "rank 2 never arrived" in str(results[rank]), results[rank]
    assert storages[0].reads < 3 * 30, f"{storages[0].reads} reads in 0.6 s: a busy loop"

    results, storages = run_ranks("no-coordinator", body, ranks=(1,), timeout=0.6)
    assert "no answer from the coordinator (rank 0)" in str(results[1]), results[1]
    assert storages[1].reads < 2 * 40, f"{storages[1].reads} reads in 1.2 s: a busy loop"
