"""The crash matrix (issue #8.1): kill -9 the process running a save — a
non-coordinator rank, the coordinator, or the background process of either
for ``dcp.async_save`` — at each phase of the save (tests/crash_points.py),
for sync and async saves, on the POSIX and S3 plugins.

In every cell:

* the previous checkpoint (saved just before, in the same root) loads
  bit-exact;
* the interrupted checkpoint is either committed and loads bit-exact (and
  verifies), or is refused as incomplete (``NotACheckpointError``) — which
  one is fixed per cell, by :func:`expected`, and documented in
  docs/reliability.md (checked below);
* every surviving rank raises a ``CheckpointError`` within the timeout, or,
  only in a cell whose checkpoint got committed, returns.

Sync cells run in 3-rank groups forked from a forkserver that has torch and
dcp imported (a killed rank ends its group, so each cell needs a fresh one;
forking costs milliseconds where spawning costs seconds), several cells at
once.  Async cells run one after the other in the shared 2-rank harness
group: the trainers survive, and each killed background process is replaced
at the next save.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dcp
import s3_server
from crash_points import PHASES, Crash, CrashingPlanner, CrashingStorage
from dcp.asynchronous.async_save import _saver_for
from dcp.tools.verify import verify
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, random_tensor

#: Seconds: the timeout of the saves' coordination (the gloo group's timeout
#: for dcp.save, ``timeout=`` of dcp.async_save).
TIMEOUT_S = 30.0
#: Seconds a survivor may take beyond TIMEOUT_S (a loaded 2-core machine).
SLACK_S = 15.0
SYNC_WORLD = 3
ASYNC_WORLD = 2
VICTIMS = ("non-coordinator", "coordinator")
STORAGES = ("posix", "s3")
PARALLEL_CELLS = 10
DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"


def victim_rank(victim: str) -> int:
    return 0 if victim == "coordinator" else 1


def expected(victim: str, phase: str) -> str:
    """``committed`` or ``refused``: what becomes of the interrupted
    checkpoint.  The coordinator commits once every rank reported its writes,
    so a non-coordinator killed while waiting for the commit leaves a
    complete checkpoint."""
    if phase == "after commit" or (phase == "before commit" and victim == "non-coordinator"):
        return "committed"
    return "refused"


def table() -> str:
    """The matrix as the Markdown table of docs/reliability.md."""
    rows = ["| save | process killed | " + " | ".join(PHASES) + " |",
            "|---|---|" + "---|" * len(PHASES)]
    for mode, who in (("sync", "rank {r} ({v})"),
                      ("async", "background process of rank {r} ({v})")):
        for victim in VICTIMS:
            label = who.format(r=victim_rank(victim), v=victim)
            rows.append(f"| {mode} | {label} | "
                        + " | ".join(expected(victim, p) for p in PHASES) + " |")
    return "\n".join(rows)


def test_the_documented_table_is_the_tested_one():
    assert table() in DOC.read_text(), f"docs/reliability.md must hold the matrix:\n{table()}"


# ------------------------------------------------------------- state
ROWS = 16


def state(rank: int, world: int, seed: int) -> dict:
    """A rank's part: row shards of a float32 matrix, a replicated bf16
    tensor, a JSON value (~20 KiB per rank)."""
    full = random_tensor((world * ROWS, 256), torch.float32, seed)
    return {"model": {"w": dcp.TensorShard(full[rank * ROWS:(rank + 1) * ROWS].clone(),
                                           tuple(full.shape), (rank * ROWS, 0)),
                      "b": random_tensor((64, 64), torch.bfloat16, seed + 1)},
            "step": seed}


def whole(world: int, seed: int) -> dict:
    """What a load of ``state``'s checkpoint into plain tensors must give."""
    return {"model": {"w": random_tensor((world * ROWS, 256), torch.float32, seed),
                      "b": random_tensor((64, 64), torch.bfloat16, seed + 1)},
            "step": seed}


def zeros(world: int) -> dict:
    return {"model": {"w": torch.zeros(world * ROWS, 256),
                      "b": torch.zeros(64, 64, dtype=torch.bfloat16)},
            "step": 0}


def check_checkpoints(cell: str, prev: str, new: str, world: int, outcome: str, options: dict,
                      process_group=None) -> list[str]:
    """Problems with the previous (seed 1) and the interrupted (seed 2)
    checkpoint of a cell."""
    problems = []
    target = zeros(world)
    dcp.load(target, prev, storage_options=options, process_group=process_group)
    for key in ("w", "b"):
        assert_bitwise_equal(target["model"][key], whole(world, 1)["model"][key],
                             f"{cell}: previous {key}")
    assert target["step"] == 1
    target = zeros(world)
    if outcome == "committed":
        dcp.load(target, new, storage_options=options, process_group=process_group)
        for key in ("w", "b"):
            assert_bitwise_equal(target["model"][key], whole(world, 2)["model"][key],
                                 f"{cell}: new {key}")
        assert target["step"] == 2
        report = verify(new, storage_options=options)
        if not report.ok or report.checked != world + 1:
            problems.append(f"{cell}: committed checkpoint does not verify: {report}")
    else:
        try:
            dcp.load(target, new, storage_options=options, process_group=process_group)
            problems.append(f"{cell}: the interrupted checkpoint loaded; expected it refused")
        except dcp.NotACheckpointError:
            pass
    return problems


def check_survivor(cell: str, rank: int, record: dict | None, outcome: str) -> list[str]:
    if record is None:
        return [f"{cell}: surviving rank {rank} recorded nothing (hung or died)"]
    problems = []
    if record["result"] == "returned" and outcome != "committed":
        problems.append(f"{cell}: rank {rank}'s save returned though nothing was committed")
    if record["result"] == "raised" and not record["checkpoint_error"]:
        problems.append(f"{cell}: rank {rank} raised something other than CheckpointError: "
                        f"{record['error']}")
    if record["secs"] > TIMEOUT_S + SLACK_S:
        problems.append(f"{cell}: rank {rank} took {record['secs']:.1f} s (timeout {TIMEOUT_S} s)")
    return problems


# ------------------------------------------------------------- sync cells
def _sync_rank(rank: int, world: int, cell: dict) -> None:
    """One rank of a sync cell: save the previous checkpoint, then the
    interrupted one; record what the save did (unless killed)."""
    torch.set_num_threads(1)
    store = dist.FileStore(cell["store"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    options = cell["options"]
    dcp.save(state(rank, world, 1), cell["prev"], storage_options=options)
    crash = Crash(cell["phase"], cell["victim"], rank, cell["pid_dir"])
    start = time.monotonic()
    try:
        dcp.save(state(rank, world, 2), cell["new"], planner=CrashingPlanner(crash),
                 storage=CrashingStorage(cell["new"], crash, options))
        record = {"result": "returned"}
    except Exception as e:  # recorded and judged by the test
        record = {"result": "raised", "checkpoint_error": isinstance(e, dcp.CheckpointError),
                  "error": f"{type(e).__name__}: {e}"}
    record["secs"] = time.monotonic() - start
    Path(cell["pid_dir"], f"record{rank}.json").write_text(json.dumps(record))
    import os
    os._exit(0)  # no teardown: a peer may be dead


def _location(kind: str, tmp_path: Path, label: str) -> tuple[str, dict]:
    if kind == "posix":
        return str(tmp_path / label), {"thread_count": 2}
    return s3_server.fresh_url(label), s3_server.options(s3_server.endpoint(), thread_count=2)


@pytest.mark.parametrize("kind", STORAGES)
def test_crash_matrix_sync(kind, tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dcp", "storage_plugins.posix",
                                "storage_plugins.s3", "test_crash_matrix"])
    cells = []
    for victim in VICTIMS:
        for phase in PHASES:
            name = f"sync/{kind}/{victim}/{phase}"
            root, options = _location(kind, tmp_path, f"{victim}-{phase}".replace(" ", "-"))
            pid_dir = tmp_path / name.replace("/", "_").replace(" ", "-")
            pid_dir.mkdir()
            cells.append(dict(name=name, victim=victim_rank(victim), phase=phase, options=options,
                              prev=f"{root}/prev", new=f"{root}/new", pid_dir=str(pid_dir),
                              store=str(pid_dir / "store"), outcome=expected(victim, phase)))
    problems = []
    for first in range(0, len(cells), PARALLEL_CELLS):
        wave = cells[first:first + PARALLEL_CELLS]
        procs = {(c["name"], r): ctx.Process(target=_sync_rank, args=(r, SYNC_WORLD, c))
                 for c in wave for r in range(SYNC_WORLD)}
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + 60 + 2 * (TIMEOUT_S + SLACK_S)
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for (name, rank), p in procs.items():
            if p.is_alive():
                p.kill()
                p.join()
                problems.append(f"{name}: rank {rank} still running at the deadline: killed")
        for c in wave:
            victim = c["victim"]
            if procs[(c["name"], victim)].exitcode != -signal.SIGKILL:
                problems.append(f"{c['name']}: the victim (rank {victim}) exited with "
                                f"{procs[(c['name'], victim)].exitcode}, not by SIGKILL")
            for rank in set(range(SYNC_WORLD)) - {victim}:
                path = Path(c["pid_dir"], f"record{rank}.json")
                record = json.loads(path.read_text()) if path.exists() else None
                problems += check_survivor(c["name"], rank, record, c["outcome"])
            try:
                problems += check_checkpoints(c["name"], c["prev"], c["new"], SYNC_WORLD,
                                              c["outcome"], c["options"])
            except (AssertionError, dcp.CheckpointError) as e:
                problems.append(f"{c['name']}: {e}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------ async cells
def _shared(value_on_rank0):
    box = [value_on_rank0() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dist_scenario(world_size=ASYNC_WORLD, phase=0, last=True)
def test_crash_matrix_async(ctx):
    endpoint = _shared(s3_server.endpoint)
    problems = []
    for kind in STORAGES:
        for victim in VICTIMS:
            for phase in PHASES:
                name = f"async/{kind}/{victim}/{phase}"
                label = f"async-{kind}-{victim}-{phase}".replace(" ", "-")
                if kind == "posix":
                    root, options = str(ctx.dir / label), {"thread_count": 2}
                else:
                    root = _shared(lambda: s3_server.fresh_url(label))  # noqa: B023 (called right here)
                    options = s3_server.options(endpoint, thread_count=2)
                prev, new = f"{root}/prev", f"{root}/new"
                pid_dir = ctx.dir / f"pids-{label}"
                pid_dir.mkdir(exist_ok=True)
                dcp.save(state(ctx.rank, ctx.world_size, 1), prev, storage_options=options)
                crash = Crash(phase, victim_rank(victim), ctx.rank, str(pid_dir))
                # the kill is for the background process: a save before it is up (the
                # first, or after the last kill) would run, and be killed, in the trainer
                _saver_for(None).ensure_worker().wait_started(3 * TIMEOUT_S + SLACK_S)
                start = time.monotonic()
                response = dcp.async_save(state(ctx.rank, ctx.world_size, 2), new,
                                          planner=CrashingPlanner(crash), timeout=TIMEOUT_S,
                                          storage=CrashingStorage(new, crash, options))
                try:
                    response.result(3 * TIMEOUT_S + SLACK_S)
                    record = {"result": "returned"}
                except dcp.CheckpointError as e:
                    record = {"result": "raised", "checkpoint_error": True, "error": str(e)}
                record["secs"] = time.monotonic() - start
                records = [None] * ctx.world_size
                dist.all_gather_object(records, record)
                outcome = expected(victim, phase)
                dead = victim_rank(victim)
                if records[dead]["result"] != "raised" or "died" not in records[dead]["error"]:
                    problems.append(f"{name}: rank {dead}, whose background process was killed, "
                                    f"got {records[dead]}")
                for rank in set(range(ctx.world_size)) - {dead}:
                    problems += check_survivor(name, rank, records[rank], outcome)
                try:
                    problems += check_checkpoints(name, prev, new, ctx.world_size, outcome, options)
                except (AssertionError, dcp.CheckpointError) as e:
                    problems.append(f"{name}: {e} (the ranks' saves: {records})")
    # ranks saw some saves end differently (a victim killed after the commit
    # raised, its peer returned): the next save still meets in one group
    after = str(ctx.dir / "after-the-matrix")
    start = time.monotonic()
    dcp.async_save(state(ctx.rank, ctx.world_size, 3), after).result(TIMEOUT_S + SLACK_S)
    assert time.monotonic() - start < TIMEOUT_S, "the save after the matrix waited out a timeout"
    want = whole(ctx.world_size, 3)
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0}
    dcp.load(target, after)
    assert target["step"] == 3
    for k, v in want["model"].items():
        assert_bitwise_equal(target["model"][k], v, f"after the matrix: {k}")
    assert not problems, "\n".join(problems)
