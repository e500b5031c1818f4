"""The chaos soak of :class:`dcp.CheckpointManager` (issue #26, section 2).

    python -m benchmarks.soak --storage posix|shm|s3 [...] --cycles N --seed S --out FILE
    python -m benchmarks.soak --report FILE [FILE ...]     # the Markdown table of results

Each cycle trains a small model (``Linear(16, 32) -> Tanh -> Linear(32, 8)``
with AdamW, on 2-4 gloo ranks, sharded by FSDP2 ``fully_shard`` or
replicated with an all-reduce of the gradients, a per-rank loader position
``PerRank({"samples", "batches"}, on_resize=SumOf("samples"))`` and every
rank's RNG streams in the state) through ``CheckpointManager(interval=2,
keep_latest=2, async_save=True, timeout=...)`` on a fresh root: job A
trains steps 1-8 and one fault is injected at a random moment (after a
random step or save started, plus a random delay of 0-200 ms); job B, a new
job, sometimes at another world size or layout, resumes with
``load_latest`` and trains 4 more steps.  The faults (:data:`FAULTS`):

* ``kill_all``: SIGKILL of the whole job, trainers and background save
  processes (one process group, as torchrun's);
* ``kill_trainers``: SIGKILL of every trainer; their background processes
  live on (and may commit the step in flight);
* ``kill_worker``: SIGKILL of one rank's background save process, mid-save
  or idle between saves;
* ``sigterm``: SIGTERM to one rank: "last words", every rank saves that step;
* ``storage_transient``: ``faulty://`` faults (``ENOSPC``/``EIO`` on a path,
  503/``SlowDown`` on S3) on data-file writes, or on those and the commits
  (metadata, pointer), each failing call failing 1-3 times in a row before
  it goes through: retried, every save commits;
* ``storage_persistent``: from a random step on, every data-file write or
  every commit (metadata, pointer) fails: those saves fail on every rank and
  leave no file; training goes on.

Checked after each cycle, against an uninterrupted reference run of the
same seeds and layout (trained once per (seed, layout, world size) and
cached): the resumed step is the newest complete one (a raw listing of the
root, not the library's); job A's states at every step equal the
reference's (saving perturbs nothing); the restored model and optimizer
tensors (full, gathered, compared by SHA-256 of their bytes), each rank's
loader position and its next random numbers (Python, NumPy, torch) are
exact, and, on the same layout, every later step's state too; after a
resize the loader positions follow ``SumOf`` and the generators
``DeriveRNG`` over the reference's states; no step whose save reported
success is lost; retention holds after job B's commits (at most
``keep_latest`` complete steps, no incomplete step older than the newest);
``hyperdcp verify`` passes on every complete step; after ``hyperdcp prune
--min-age 0`` no file is left that no committed metadata names.  Every job
runs under a hard wall limit and every blocking manager call is timed: a
job over the limit, or a call (or an orphaned background process) waiting
longer than the configured ``timeout``, counts as a hang.  For
``kill_worker``, a stall longer than the job's first worker start (a
replacement starts) plus :data:`WORKER_STALL` of the timeout counts as a
hang (issue #32, point 2: a dead worker stalls its peers for ``timeout``).

Cost: a long-lived driver imports torch once and forks every rank (before
any thread or process group exists in it); the driver itself never touches
storage or tensors (forked children do), so it stays single-threaded and
safe to fork from.  What is left per job is the library's own background
save processes, which are spawned (``import torch`` each): that dominates a
cycle (measured: docs/benchmarks.md, "Chaos soak").

Results: one JSON file per run (``--out``, rewritten after every cycle),
holding each cycle's record; ``--report`` sums any number of them into the
table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import hashlib
import io
import json
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: the faults, drawn in turn (each block of len(FAULTS) cycles in a seeded order)
FAULTS = ("kill_all", "kill_trainers", "kill_worker", "sigterm", "storage_transient",
          "storage_persistent")
LAYOUTS = ("fsdp", "replicate")
WORLDS = (2, 3, 4)
#: job A's world sizes, drawn with these weights: each of its ranks spawns a
#: background save process (``import torch``), the cost of a cycle
WORLD_WEIGHTS = (2, 1, 1)
STORAGES = ("posix", "shm", "s3")
#: the faults ``faulty://`` raises on each: a filesystem's, an object store's
STORAGE_FAULTS = {"posix": ["ENOSPC", "EIO"], "shm": ["ENOSPC", "EIO"],
                  "s3": ["503", "slowdown"]}
STEPS = 8  # job A trains steps 1..STEPS
AFTER = 4  # job B trains this many steps past its resume
INTERVAL, KEEP = 2, 2
REF_STEPS = STEPS + AFTER
MODEL_SEEDS = 3  # references are cached per (model seed, layout, world size)
#: the stall after a background process's SIGKILL that counts as a hang:
#: longer than the job's first worker start (a replacement is started) plus
#: this fraction of the timeout (issue #32, point 2: a stall of ``timeout``)
WORKER_STALL = 0.25
#: seconds a blocking call may take beyond the timeout (a loaded machine)
SLACK_S = 10.0


# ----------------------------------------------------------------- plans
def draw_plan(seed: int, index: int, quick: bool = False) -> dict:
    """The random decisions of cycle ``index`` of a run seeded ``seed``:
    reproducible, one fault kind per cycle in a seeded order of each block
    of ``len(FAULTS)`` cycles.  ``quick`` (CI): job A on 2 ranks, job B's
    saves synchronous (no background process to start), one model seed
    (fewer reference runs)."""
    rng = random.Random(f"hyperdcp-soak/{seed}/{index}")
    block = list(FAULTS)
    random.Random(f"hyperdcp-soak/{seed}/block/{index // len(FAULTS)}").shuffle(block)
    fault = block[index % len(FAULTS)]
    world_a = 2 if quick else rng.choices(WORLDS, WORLD_WEIGHTS)[0]
    layout_a = rng.choice(LAYOUTS)
    if rng.random() < 0.5:
        world_b, layout_b = world_a, layout_a
    else:
        world_b, layout_b = rng.choice([(w, lay) for w in WORLDS for lay in LAYOUTS
                                        if (w, lay) != (world_a, layout_a)])
    plan: dict[str, Any] = {
        "index": index, "fault": fault, "mseed": rng.randrange(MODEL_SEEDS) * (not quick),
        "world_a": world_a, "layout_a": layout_a, "world_b": world_b, "layout_b": layout_b,
        "delay_s": rng.choice([0.0, 0.005, 0.02, 0.05, 0.2]) * rng.random(),
        "target": rng.randrange(world_a), "b_async": not quick and rng.random() < 0.5}
    if fault in ("kill_all", "kill_trainers", "sigterm"):
        plan["event"] = rng.choice(["trained", "save"])
        plan["step"] = rng.randint(1, STEPS)
    elif fault == "kill_worker":  # mid-save, or idle between saves (issue #32's case)
        plan["event"] = rng.choice(["trained", "save"])
        plan["step"] = rng.randint(INTERVAL + 1, STEPS - 1)
    elif fault == "storage_transient":
        plan["rate"] = rng.choice([0.3, 0.6, 1.0])
        plan["max_consecutive"] = rng.randint(1, 3)
        plan["fault_seed"] = rng.randrange(1 << 30)
        plan["methods"] = rng.choice([["write_file"], ["write_file", "commit_file"]])
    else:
        plan["faulty_from"] = rng.randint(INTERVAL, STEPS)
        plan["methods"] = rng.choice([["write_file"], ["commit_file"],
                                      ["write_file", "commit_file"]])
    return plan


# ------------------------------------------------------------ rank code
class _AppState:
    """Model and optimizer as one Stateful, through torch's get_state_dict /
    set_state_dict (FSDP2's DTensors; an optimizer without state yet gets
    its targets)."""

    def __init__(self, model, optim) -> None:
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])


def _build(layout: str, world: int, mseed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(mseed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 8))
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _seed_rank(mseed: int, rank: int) -> None:
    import numpy as np

    random.seed(f"soak/{mseed}/{rank}")
    np.random.seed(1000 * mseed + rank)
    torch.manual_seed(7919 * mseed + rank + 1)


def _train_step(model, optim, loader: dict, layout: str, world: int) -> None:
    import numpy as np
    import torch.distributed as dist

    x, y = torch.randn(4, 16), torch.randn(4, 8)  # this rank's data
    noise = random.random() + float(np.random.rand())  # every stream counts
    loss = ((model(x) - y) ** 2).mean() * (1 + 0.1 * noise)
    optim.zero_grad()
    loss.backward()
    if layout == "replicate":  # data parallel by hand (FSDP2 reduce-scatters itself)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    optim.step()
    loader["samples"] += 4
    loader["batches"] += 1


def _local_bytes(t: torch.Tensor) -> bytes:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _digest(model, optim, loader: dict) -> str:
    """SHA-256 of this rank's shards of every parameter and optimizer state,
    the loader position and every generator's state."""
    import numpy as np

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(_local_bytes(p))
        for key, value in sorted(optim.state.get(p, {}).items()):
            h.update(key.encode())
            h.update(_local_bytes(value) if isinstance(value, torch.Tensor)
                     else repr(value).encode())
    h.update(json.dumps(loader, sort_keys=True).encode())
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()[1].tolist()).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def _full_hashes(model, optim) -> dict[str, str]:
    """SHA-256 of every full (gathered) model and optimizer tensor, by
    fqn.  Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": hashlib.sha256(_local_bytes(v)).hexdigest() for k, v in msd.items()}
    for fqn, entry in osd["state"].items():
        for key, value in entry.items():
            data = _local_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode()
            out[f"optim.{fqn}.{key}"] = hashlib.sha256(data).hexdigest()
    return out


def _peek() -> list[str]:
    """The next random numbers of Python's, NumPy's and torch's generators,
    which are left as they were."""
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        return [random.random().hex(), float(np.random.rand()).hex(),
                *(float(v).hex() for v in torch.rand(3).tolist())]
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def _peek_of(state: dict) -> list[str]:
    """What :func:`_peek` returns after restoring the RNG ``state``
    (``dcp.manager.rng`` format); this rank's generators left as they were."""
    from dcp.manager import rng

    mine = rng.capture()
    try:
        rng.restore(state, "soak")
        return _peek()
    finally:
        rng.restore(mine, "soak")


def _manager(spec: dict, faulty: dict | None, asynchronous: bool = True):
    import dcp

    root, options = spec["root"], dict(spec["options"])
    if faulty is not None:
        root, options = f"faulty://{root}", {**faulty, "options": options}
    return dcp.CheckpointManager(root, interval=INTERVAL, keep_latest=KEEP,
                                 storage_options=options, async_save=asynchronous,
                                 timeout=spec["timeout"], rng_on_resize=dcp.DeriveRNG())


def _rank_main(spec: dict, rank: int, port: int) -> None:
    """One rank of a job (``spec["role"]``: ``ref``, ``a`` or ``b``),
    logging one JSON line per event to ``<dir>/rank<r>.jsonl``."""
    import torch.distributed as dist

    from dcp.manager import rng

    torch.set_num_threads(1)
    world, layout = spec["world"], spec["layout"]
    out = Path(spec["dir"])
    err = os.open(out / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 1)
    os.dup2(err, 2)
    log = open(out / f"rank{rank}.jsonl", "a", buffering=1)

    def emit(**event) -> None:
        event["t"] = time.time()
        log.write(json.dumps(event) + "\n")

    emit(ev="start", pid=os.getpid())
    try:
        timeout = datetime.timedelta(seconds=spec["pg_timeout"])
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        model, optim = _build(layout, world, spec["mseed"])
        _seed_rank(spec["mseed"], rank)
        loader = {"samples": 0, "batches": 0}
        if spec["role"] == "ref":
            for step in range(1, spec["last"] + 1):
                _train_step(model, optim, loader, layout, world)
                full = _full_hashes(model, optim)
                emit(ev="trained", step=step, digest=_digest(model, optim, loader),
                     peek=_peek(), rng=rng.capture(), loader=dict(loader),
                     **({"full": full} if rank == 0 else {}))
        else:
            _managed(spec, rank, model, optim, loader, emit)
        dist.destroy_process_group()
        emit(ev="exit")
    except BaseException:
        emit(ev="error", tb=traceback.format_exc())
        raise


def _managed(spec: dict, rank: int, model, optim, loader: dict,
             emit: Callable[..., None]) -> None:
    """Jobs A and B: resume, train through the manager, close."""
    import warnings

    import dcp

    mgr = _manager(spec, spec.get("faulty"), spec.get("asynchronous", True))
    state = {"app": _AppState(model, optim),
             "loader": dcp.PerRank(loader, on_resize=dcp.SumOf("samples"))}
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = mgr.load_latest(state) or 0
    event: dict[str, Any] = {"ev": "resumed", "step": resumed,
                             "blocked_s": time.monotonic() - start,
                             "warnings": [str(w.message) for w in caught],
                             "digest": _digest(model, optim, loader), "peek": _peek(),
                             "loader": dict(loader)}
    if spec["role"] == "b":
        full = _full_hashes(model, optim)
        if rank == 0:
            event["full"] = full
        derive = spec.get("derive_from")
        if derive is not None:  # the expected streams after a resize
            event["expected_peek"] = _peek_of(dcp.DeriveRNG()(derive, rank, spec["world"]))
    emit(**event)
    saved: list[int] = []
    for step in range(resumed + 1, spec["last"] + 1):
        if step == spec.get("faulty_from"):  # the storage starts failing
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mgr.close()
            emit(ev="closed", saved_steps=saved, errors=[str(e) for e in mgr.errors])
            mgr = _manager(spec, spec["persistent"])
        emit(ev="step", step=step)
        _train_step(model, optim, loader, spec["layout"], spec["world"])
        emit(ev="trained", step=step, digest=_digest(model, optim, loader))
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # failures are read from mgr.errors
            did = mgr.save(step, state)
        if did:
            saved.append(step)
        emit(ev="save", step=step, saved=did, blocked_s=time.monotonic() - start,
             saved_steps=saved, errors=[str(e) for e in mgr.errors])
        if mgr.preempted:
            emit(ev="preempted", step=step)
            break
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.close()
    emit(ev="done", blocked_s=time.monotonic() - start, saved_steps=saved,
         errors=[str(e) for e in mgr.errors])


# ------------------------------------------------------------- processes
def _fork(fn: Callable[..., Any], *args: Any, pgid: int | None = None) -> int:
    """Run ``fn(*args)`` in a forked child (in process group ``pgid``: 0 a
    new one); exits 0 when it returns, 1 when it raises."""
    pid = os.fork()
    if pid:
        if pgid is not None:
            with contextlib.suppress(OSError):  # the child may have set it already
                os.setpgid(pid, pgid or pid)
        return pid
    code = 1
    try:
        if pgid is not None:
            os.setpgid(0, pgid)
        fn(*args)
        code = 0
    except BaseException:  # noqa: BLE001  # a child never returns into the driver
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # the library's workers stop as at a normal exit
        os._exit(code)


def in_child(fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Any:
    """``fn(*args)`` run in a forked child, its JSON result returned (its
    exception re-raised as ``RuntimeError`` with the traceback)."""
    r, w = os.pipe()

    def child() -> None:
        os.close(r)
        try:
            payload = {"ok": fn(*args)}
        except BaseException:  # noqa: BLE001  # reported to the parent
            payload = {"error": traceback.format_exc()}
        with os.fdopen(w, "w") as f:
            json.dump(payload, f)

    pid = _fork(child)
    os.close(w)
    data, deadline = b"", time.monotonic() + timeout
    with os.fdopen(r, "rb") as f:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([f], [], [], 1.0)
            if ready:
                chunk = os.read(f.fileno(), 1 << 20)
                if not chunk:
                    break
                data += chunk
    if time.monotonic() >= deadline:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}: the child gave no answer "
                           f"(timed out or died)")
    payload = json.loads(data)
    if "error" in payload:
        raise RuntimeError(payload["error"])
    return payload["ok"]


def _serve_store(world: int, w: int, driver: int) -> None:
    """The job's rendezvous store (as torchrun's agent serves it, outliving
    the trainers), until the driver kills it or dies."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    os.write(w, f"{store.port}\n".encode())
    os.close(w)
    while os.getppid() == driver:
        time.sleep(0.5)


def _processes_in_group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def _workers_of(pid: int) -> list[int]:
    """The background save processes a trainer spawned."""
    import psutil

    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return []
    out = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(child.cmdline())
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                out.append(child.pid)
    return out


class _Logs:
    """The ranks' JSON lines, read as they are written."""

    def __init__(self, folder: Path, world: int) -> None:
        self.paths = [folder / f"rank{r}.jsonl" for r in range(world)]
        self.files: list[Any] = [None] * world
        self.partial = [b""] * world
        self.events: list[list[dict]] = [[] for _ in range(world)]

    def poll(self) -> list[tuple[int, dict]]:
        new = []
        for r, path in enumerate(self.paths):
            if self.files[r] is None:
                try:
                    self.files[r] = open(path, "rb")  # noqa: SIM115  # closed by close()
                except FileNotFoundError:
                    continue
            data = self.partial[r] + self.files[r].read()
            end = data.rfind(b"\n") + 1
            self.partial[r] = data[end:]
            for line in data[:end].splitlines():
                event = json.loads(line)
                self.events[r].append(event)
                new.append((r, event))
        return new

    def close(self) -> None:
        for f in self.files:
            if f is not None:
                f.close()


def run_job(spec: dict, limit_s: float, inject: dict | None = None,
            orphan_limit_s: float = 0.0) -> dict:
    """Run one job (``spec["world"]`` forked ranks in a process group of
    their own, the store served by another process), inject ``inject``'s
    fault when its event is logged, wait for the ranks and then for every
    process left in their group (at most ``orphan_limit_s``).  Returns the
    ranks' events, exit codes, what was injected and whether it hung."""
    world = spec["world"]
    folder = Path(spec["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    r, w = os.pipe()
    store_pid = _fork(_serve_store, world, w, os.getpid())
    os.close(w)
    with os.fdopen(r) as f:
        port = int(f.readline())
    start = time.monotonic()
    pids: list[int] = []
    pgid = 0
    for rank in range(world):
        pids.append(_fork(_rank_main, spec, rank, port, pgid=pgid))
        pgid = pgid or pids[0]
    logs = _Logs(folder, world)
    codes: dict[int, int] = {}
    result: dict[str, Any] = {"hang": None, "injected": None}
    fire_at: float | None = None
    while len(codes) < world:
        for rank_of, event in logs.poll():
            if (inject is not None and fire_at is None and result["injected"] is None
                    and rank_of == inject["watch"] and event.get("ev") == inject["event"]
                    and event.get("step") == inject["step"]):
                fire_at = time.monotonic() + inject["delay_s"]
        if fire_at is not None and time.monotonic() >= fire_at:
            result["injected"] = _inject(inject, pids, pgid, logs)
            fire_at = None
        for i, pid in enumerate(pids):
            if i not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        if time.monotonic() - start > limit_s:
            result["hang"] = f"the job ran past its limit of {limit_s:.0f} s"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            for i, pid in enumerate(pids):
                if i not in codes:
                    codes[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            break
        time.sleep(0.003)
    result["ranks_s"] = time.monotonic() - start
    deadline = time.monotonic() + orphan_limit_s
    left = _processes_in_group(pgid)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = _processes_in_group(pgid)
    if left:
        if result["hang"] is None:
            result["hang"] = (f"{len(left)} process(es) of the job still ran "
                              f"{orphan_limit_s:.0f} s after its trainers ended")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    result["wall_s"] = time.monotonic() - start
    os.kill(store_pid, signal.SIGKILL)
    os.waitpid(store_pid, 0)
    logs.poll()
    logs.close()
    result["events"] = logs.events
    result["codes"] = [codes[i] for i in range(world)]
    return result


def _inject(inject: dict, pids: list[int], pgid: int, logs: _Logs) -> dict:
    """Do the fault; what was done, and the last step each rank logged."""
    kind = inject["kind"]
    done: dict[str, Any] = {"kind": kind, "t": time.time()}
    try:
        if kind == "kill_all":
            os.killpg(pgid, signal.SIGKILL)
        elif kind == "kill_trainers":
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        elif kind == "kill_worker":
            workers = _workers_of(pids[inject["target"]])
            done["workers"] = workers
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            if not workers:
                done["missed"] = "no background process to kill"
        elif kind == "sigterm":
            os.kill(pids[inject["target"]], signal.SIGTERM)
    except ProcessLookupError:
        done["missed"] = "the process had exited"
    logs.poll()
    done["last_step"] = [max((e.get("step", 0) for e in ev if e.get("ev") == "trained"),
                             default=0) for ev in logs.events]
    return done


# -------------------------------------------------------------- storages
class Storage:
    """A storage's roots and raw (library-free) views, used from forked
    children only."""

    def __init__(self, kind: str, scratch: Path, endpoint: str | None) -> None:
        self.kind, self.scratch, self.endpoint = kind, scratch, endpoint
        self.tag = f"soak-{uuid.uuid4().hex[:8]}"

    def root(self, cycle: int) -> str:
        if self.kind == "posix":
            return str(self.scratch / "roots" / f"cycle-{cycle}")
        if self.kind == "shm":
            return f"shm://{self.tag}/cycle-{cycle}"
        return f"s3://hyperdcp-soak/{self.tag}/cycle-{cycle}"

    @property
    def options(self) -> dict:
        if self.kind != "s3":
            return {}
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def cli_options(self) -> list[str]:
        return [a for k, v in self.options.items() for a in ("-o", f"{k}={v}")]

    def _s3(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                                 **self.options)

    def _local(self, root: str) -> Path:
        if self.kind == "shm":
            from storage_plugins.shm import DEFAULT_ROOT

            return Path(DEFAULT_ROOT) / root.removeprefix("shm://")
        return Path(root)

    def files(self, root: str) -> list[str]:
        """Every file under ``root``, relative to it (a raw listing)."""
        if self.kind == "s3":
            prefix = root.removeprefix("s3://").rstrip("/") + "/"
            return sorted(p[len(prefix):] for p in self._s3().find(prefix))
        base = self._local(root)
        return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())

    def remove(self, root: str) -> None:
        if self.kind == "s3":
            fs = self._s3()
            prefix = root.removeprefix("s3://").rstrip("/")
            if fs.find(prefix):
                fs.rm(prefix, recursive=True)
        else:
            shutil.rmtree(self._local(root), ignore_errors=True)

    def make_bucket(self) -> None:
        self._s3().mkdir("hyperdcp-soak")

    def remove_all(self) -> None:
        if self.kind == "shm":
            shutil.rmtree(self._local(f"shm://{self.tag}"), ignore_errors=True)
        elif self.kind == "s3":
            self.remove(f"s3://hyperdcp-soak/{self.tag}")


def _steps_of(files: list[str]) -> tuple[list[int], dict[int, int]]:
    """The complete steps (a committed ``metadata.json``) and the file count
    of each step folder without one."""
    complete, folders = set(), Counter()
    for name in files:
        head, _, rest = name.partition("/")
        if head.startswith("step-") and head[5:].isdigit():
            folders[int(head[5:])] += 1
            if rest == "metadata.json":
                complete.add(int(head[5:]))
    return sorted(complete), {s: n for s, n in folders.items() if s not in complete}


def _failed_steps(errors: list[str]) -> set[int]:
    """The steps of the manager's errors ``"step N: ..."``."""
    return {int(e.split(":")[0].split()[1]) for e in errors if e.startswith("step ")}


def check_storage(storage: Storage, root: str, prune: bool = True,
                  remove: bool = False) -> dict:
    """In a child: the ``files`` under ``root``, ``hyperdcp verify`` of
    every complete step and (with ``prune``) ``hyperdcp prune --min-age 0``
    of the root, after which every file left must be named by a committed
    metadata (or be the pointer); with ``remove``, the root is deleted if
    all of it passed."""
    from dcp import read_metadata
    from dcp.tools import cli

    def run(argv: list[str]) -> tuple[int, str]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = cli.main(argv)
        return code, buf.getvalue()

    out: dict[str, Any] = {"files": storage.files(root), "verify_failed": {}, "orphans": []}
    complete, _ = _steps_of(out["files"])
    for step in complete:
        code, text = run(["verify", f"{root}/step-{step}", "-q", *storage.cli_options()])
        if code != 0:
            out["verify_failed"][step] = text[-2000:]
    if not prune:
        return out
    code, text = run(["prune", root, "--min-age", "0", *storage.cli_options()])
    if code != 0:
        out["prune_failed"] = text[-2000:]
    files = storage.files(root)
    complete, _ = _steps_of(files)
    named = {"latest.json"}
    for step in complete:
        md = read_metadata(f"{root}/step-{step}", storage_options=storage.options)
        named |= {f"step-{step}/{n}" for n in (*md.files(), "metadata.json")}
    out["orphans"] = [n for n in files if n not in named]
    if remove and not out["orphans"] and not out["verify_failed"] and "prune_failed" not in out:
        storage.remove(root)
    return out


# ----------------------------------------------------------------- cycles
class Soak:
    """One driver: its storage, scratch space, cached references and
    configuration."""

    def __init__(self, storage: Storage, timeout: float, cache: Path) -> None:
        self.storage, self.timeout, self.cache = storage, timeout, cache
        self.refs: dict[tuple, dict] = {}
        self.limit_s = 3 * timeout + 60

    def reference(self, mseed: int, layout: str, world: int) -> dict:
        """Per step and rank: digest, next draws, RNG states, loader (and,
        rank 0, the full tensors' hashes) of the uninterrupted run."""
        key = (mseed, layout, world)
        if key in self.refs:
            return self.refs[key]
        path = self.cache / f"ref-{mseed}-{layout}-{world}-{REF_STEPS}-{torch.__version__}.json"
        if path.exists():
            self.refs[key] = json.loads(path.read_text())
            return self.refs[key]
        folder = Path(tempfile.mkdtemp(prefix="ref-", dir=self.storage.scratch))
        spec = self._spec("ref", world, layout, mseed, REF_STEPS, folder)
        job = run_job(spec, self.limit_s)
        if job["hang"] or any(job["codes"]):
            raise RuntimeError(f"reference {key} failed: {job['hang']} {job['codes']}; "
                               f"logs in {folder}")
        ref = {str(e["step"]): [next(x for x in job["events"][r] if x.get("step") == e["step"]
                                     and x["ev"] == "trained") for r in range(world)]
               for e in job["events"][0] if e.get("ev") == "trained"}
        shutil.rmtree(folder, ignore_errors=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(ref))
        os.replace(tmp, path)
        self.refs[key] = ref
        return ref

    def _spec(self, role: str, world: int, layout: str, mseed: int, last: int, folder: Path,
              **extra: Any) -> dict[str, Any]:
        """What a job's ranks do: train steps up to ``last`` (``ref``: no
        manager; ``a``, ``b``: through one on ``extra["root"]``).  Their own
        collectives wait up to the job's limit: only the manager's waits are
        bounded by the timeout."""
        return {"role": role, "world": world, "layout": layout, "mseed": mseed, "last": last,
                "dir": str(folder), "timeout": self.timeout, "pg_timeout": self.limit_s,
                **extra}

    def cycle(self, plan: dict, label: int) -> dict:
        """Run and check one cycle; its record (``failures`` empty if it passed)."""
        t0, cpu0 = time.monotonic(), os.times()
        storage, kind = self.storage, plan["fault"]
        root = storage.root(label)
        folder = storage.scratch / f"cycle-{label}"
        ref_a = self.reference(plan["mseed"], plan["layout_a"], plan["world_a"])
        failures: list[str] = []
        rec: dict[str, Any] = {"cycle": label, "storage": storage.kind, "plan": plan,
                               "failures": failures, "hangs": []}
        spec_a = self._spec("a", plan["world_a"], plan["layout_a"], plan["mseed"], STEPS,
                            folder / "a", root=root, options=storage.options)
        inject = None
        if kind == "storage_transient":
            spec_a["faulty"] = {"faults": STORAGE_FAULTS[storage.kind],
                                "rate": plan["rate"],
                                "max_consecutive": plan["max_consecutive"],
                                "seed": plan["fault_seed"], "methods": plan["methods"]}
        elif kind == "storage_persistent":
            spec_a["faulty_from"] = plan["faulty_from"]
            spec_a["persistent"] = {"faults": STORAGE_FAULTS[storage.kind], "rate": 1.0,
                                    "methods": plan["methods"]}
        else:
            watch = plan["target"] if kind == "sigterm" else 0
            inject = {"kind": kind, "watch": watch, "event": plan["event"],
                      "step": plan["step"], "delay_s": plan["delay_s"],
                      "target": plan["target"]}
        orphans = self.timeout + SLACK_S if kind == "kill_trainers" else SLACK_S
        job_a = run_job(spec_a, self.limit_s, inject, orphan_limit_s=orphans)
        rec["a_s"] = round(job_a["wall_s"], 3)
        rec["injected"] = job_a["injected"]
        self._check_a(plan, job_a, ref_a, rec)

        seen = in_child(check_storage, storage, root, False)
        complete, incomplete = _steps_of(seen["files"])
        newest = complete[-1] if complete else 0
        rec["complete_after_a"], rec["newest"] = complete, newest
        trained = [max((e["step"] for e in ev if e.get("ev") == "trained"), default=0)
                   for ev in job_a["events"]]
        rec["lost_steps"] = max(trained) - newest
        for step, text in seen["verify_failed"].items():
            failures.append(f"corrupt: hyperdcp verify of step {step} after job A failed: "
                            f"{text}")
        self._check_known_commits(job_a, newest, rec)
        if kind == "storage_persistent":
            left = {s: n for s, n in incomplete.items() if s >= plan["faulty_from"]}
            if left:
                failures.append(f"failed saves left files: {left}")

        spec_b = self._spec("b", plan["world_b"], plan["layout_b"], plan["mseed"],
                            newest + AFTER, folder / "b", root=root, options=storage.options,
                            asynchronous=plan["b_async"])
        resized = plan["world_b"] != plan["world_a"]
        if newest and resized:
            spec_b["derive_from"] = [ref_a[str(newest)][r]["rng"] for r in range(plan["world_a"])]
        job_b = run_job(spec_b, self.limit_s, orphan_limit_s=SLACK_S)
        rec["b_s"] = round(job_b["wall_s"], 3)
        self._check_b(plan, job_b, ref_a, newest, rec)
        rec["slow_start"] = self._slow_start(job_a) or self._slow_start(job_b)

        checked = in_child(check_storage, storage, root, True, not failures and not rec["hangs"])
        complete_b, incomplete_b = _steps_of(checked["files"])
        rec["complete_after_b"] = complete_b
        last_b = max((s for ev in job_b["events"] for e in ev if e.get("ev") == "done"
                      for s in e["saved_steps"]), default=None)
        if len(complete_b) > KEEP or not complete_b or complete_b[-1] != last_b:
            failures.append(f"retention: complete steps {complete_b} after job B's last save "
                            f"{last_b} (keep_latest={KEEP})")
        stale = [s for s in incomplete_b if complete_b and s < complete_b[-1]]
        if stale:
            failures.append(f"retention: incomplete steps {stale} older than the newest "
                            f"complete one are left")
        for step, text in checked["verify_failed"].items():
            failures.append(f"corrupt: hyperdcp verify of step {step} failed: {text}")
        if "prune_failed" in checked:
            failures.append(f"hyperdcp prune failed: {checked['prune_failed']}")
        if checked["orphans"]:
            failures.append(f"orphaned files after prune: {checked['orphans']}")
        rec["corrupt"] = sum(f.startswith("corrupt") for f in failures)
        if not failures and not rec["hangs"]:  # (the child removed the root)
            shutil.rmtree(folder, ignore_errors=True)
        rec["cycle_s"] = round(time.monotonic() - t0, 3)
        cpu = os.times()  # the ranks' and checks' (and the background processes of ranks
        # that exited normally, which reaped them)
        rec["cpu_s"] = round(sum(cpu[:4]) - sum(cpu0[:4]), 2)
        return rec

    # ------------------------------------------------------------ checks
    @staticmethod
    def _slow_start(job: dict) -> bool:
        """Whether a background save process of ``job`` did not start within
        the timeout (a loaded machine; the library fails that save)."""
        return any("did not start within timeout" in x for events in job["events"]
                   for e in events for x in e.get("errors", ()))

    def _blocking(self, job: dict, rec: dict, who: str, after: float | None = None) -> float:
        """The longest a manager call blocked in ``job`` (calls started after
        ``after`` only, if given); a job hang is recorded."""
        if job["hang"]:
            rec["hangs"].append(f"job {who}: {job['hang']}")
        longest = 0.0
        for events in job["events"]:
            for e in events:
                if "blocked_s" in e and (after is None or e["t"] - e["blocked_s"] >= after):
                    longest = max(longest, e["blocked_s"])
        if longest > self.timeout + SLACK_S:
            rec["hangs"].append(f"job {who}: a manager call blocked {longest:.1f} s "
                                f"(timeout {self.timeout:g} s)")
        return longest

    def _check_a(self, plan: dict, job: dict, ref: dict, rec: dict) -> None:
        failures, kind = rec["failures"], plan["fault"]
        self._blocking(job, rec, "A")
        killed = kind in ("kill_all", "kill_trainers") and job["injected"] is not None \
            and "missed" not in job["injected"]
        for r, events in enumerate(job["events"]):
            for e in events:
                if e["ev"] == "error":
                    failures.append(f"job A rank {r} raised: {e['tb'][-1500:]}")
                if e["ev"] == "trained" and e["digest"] != ref[str(e["step"])][r]["digest"]:
                    failures.append(f"job A rank {r}: the state after step {e['step']} differs "
                                    f"from the reference run's")
            closed = any(e["ev"] == "done" for e in events)  # SIGTERM after close: its default
            if not killed and job["codes"][r] != 0 and not job["hang"] and not (
                    kind == "sigterm" and closed and job["codes"][r] == -signal.SIGTERM):
                failures.append(f"job A rank {r} exited with {job['codes'][r]}")
        done = [next((e for e in ev if e["ev"] == "done"), None) for ev in job["events"]]
        if kind == "storage_transient" and done[0] is not None and done[0]["errors"]:
            failures.append(f"transient faults failed saves: {done[0]['errors']}")
        if kind == "storage_persistent" and done[0] is not None:
            failed = _failed_steps(done[0]["errors"])
            expected = {s for s in done[0]["saved_steps"] if s >= plan["faulty_from"]}
            if failed != expected:
                failures.append(f"persistent faults from step {plan['faulty_from']}: saves "
                                f"{sorted(failed)} failed, expected {sorted(expected)}")
        if kind == "kill_worker" and job["injected"] and job["injected"].get("workers"):
            start = max((e["blocked_s"] for ev in job["events"] for e in ev
                         if "blocked_s" in e and e["t"] < job["injected"]["t"]), default=0.0)
            stall = self._blocking(job, {"hangs": []}, "A", after=job["injected"]["t"])
            rec["worker_stall_s"] = round(stall, 3)
            if rec["hangs"]:  # job A's hangs, after the kill: the stall's (a limit too)
                rec["hangs"][:] = [f"{h}, after the SIGKILL of a background process (issue #32)"
                                   for h in rec["hangs"]]
            elif stall > start + WORKER_STALL * self.timeout:
                rec["hangs"].append(f"job A: the SIGKILL of rank {plan['target']}'s background "
                                    f"process stalled the job {stall:.1f} s (issue #32)")
        preempted = {e["step"] for ev in job["events"] for e in ev if e["ev"] == "preempted"}
        rec["preempted"] = sorted(preempted)
        if len(preempted) > 1:
            failures.append(f"ranks left at different steps after SIGTERM: {sorted(preempted)}")

    def _check_known_commits(self, job: dict, newest: int, rec: dict) -> None:
        """A save whose outcome rank 0 knew as a success (no error named it
        by the next save or close) must not be newer than the newest
        complete step: else the step was lost."""
        events = job["events"][0]
        settled: set[int] = set()
        failed: set[int] = set()
        for e in events:
            if e["ev"] in ("save", "closed", "done"):  # a save waits for the one before
                settled |= set(e["saved_steps"] if e["ev"] != "save" else e["saved_steps"][:-1])
                failed |= _failed_steps(e["errors"])
        known = settled - failed
        preempted = [e["step"] for e in events if e["ev"] == "preempted"]
        known |= set(preempted)
        lost = sorted(s for s in known if s > newest)
        if lost:
            rec["failures"].append(f"lost: step(s) {lost} saved successfully, newest complete "
                                   f"is {newest}")
        if preempted and preempted[0] != newest:
            rec["failures"].append(f"last words at step {preempted[0]}, newest complete is "
                                   f"{newest}")

    def _check_b(self, plan: dict, job: dict, ref: dict, newest: int, rec: dict) -> None:
        failures = rec["failures"]
        self._blocking(job, rec, "B")
        done = next((e for e in job["events"][0] if e["ev"] == "done"), None)
        if done is not None and done["errors"]:  # no fault hits job B
            failures.append(f"job B: saves failed: {done['errors']}")
        same = (plan["world_b"], plan["layout_b"]) == (plan["world_a"], plan["layout_a"])
        resized = plan["world_b"] != plan["world_a"]
        wrong: list[str] = []
        for r, events in enumerate(job["events"]):
            if job["codes"][r] != 0:
                failures.append(f"job B rank {r} exited with {job['codes'][r]}")
            for e in events:
                if e["ev"] == "error":
                    failures.append(f"job B rank {r} raised: {e['tb'][-1500:]}")
            resumed = next((e for e in events if e["ev"] == "resumed"), None)
            if resumed is None:
                continue
            if resumed["step"] != newest:
                wrong.append(f"rank {r} resumed step {resumed['step']}, the newest complete "
                             f"is {newest}")
                continue
            if resumed["warnings"]:
                failures.append(f"job B rank {r} warned on load: {resumed['warnings']}")
            if not newest:
                continue
            at = ref[str(newest)]
            if not resized:
                expected_loader, expected_peek = at[r]["loader"], at[r]["peek"]
            else:
                loaders = [at[q]["loader"] for q in range(plan["world_a"])]
                total = sum(x["samples"] for x in loaders)
                expected_loader = {**loaders[0], "samples": total // plan["world_b"]
                                   + (1 if r < total % plan["world_b"] else 0)}
                expected_peek = resumed.get("expected_peek")
            if resumed["loader"] != expected_loader:
                wrong.append(f"rank {r}: loader {resumed['loader']}, expected {expected_loader}")
            if resumed["peek"] != expected_peek:
                wrong.append(f"rank {r}: the next random numbers differ from the reference's")
            if same and resumed["digest"] != at[r]["digest"]:
                wrong.append(f"rank {r}: the restored state differs from step {newest}'s")
            if r == 0 and resumed.get("full") != at[0]["full"]:
                diff = sorted(k for k in set(at[0]["full"]) | set(resumed.get("full") or {})
                              if at[0]["full"].get(k) != (resumed.get("full") or {}).get(k))
                wrong.append(f"the restored tensors differ from step {newest}'s: {diff[:6]}")
            if same:
                for e in events:
                    if e["ev"] == "trained" and str(e["step"]) in ref \
                            and e["digest"] != ref[str(e["step"])][r]["digest"]:
                        wrong.append(f"rank {r}: the state after step {e['step']} differs "
                                     f"from the uninterrupted run's")
        rec["wrong"] = wrong
        rec["resumed"] = newest
        failures.extend(f"wrong resume: {w}" for w in wrong)


# ------------------------------------------------------------------- report
def summarize(records: list[dict], timeout: float | None = None) -> dict:
    """Totals over cycle records."""
    faults = Counter(r["plan"]["fault"] for r in records)
    missed = Counter(r["plan"]["fault"] for r in records
                     if r["plan"]["fault"] in ("kill_all", "kill_trainers", "kill_worker",
                                               "sigterm")
                     and (r["injected"] is None or "missed" in r["injected"]))
    slow = [r for r in records if r.get("slow_start")]
    hangs = Counter(r["plan"]["fault"] for r in records if r["hangs"] and not r.get("slow_start"))
    return {
        "cycles": len(records), "faults": dict(sorted(faults.items())),
        "not_injected": dict(sorted(missed.items())),
        "resumes_by_world": dict(sorted(Counter(
            f"{r['plan']['world_a']}{r['plan']['layout_a'][0]}->{r['plan']['world_b']}"
            f"{r['plan']['layout_b'][0]}" for r in records).items())),
        "max_steps_lost": max((r["lost_steps"] for r in records), default=0),
        "max_steps_lost_by_fault": {k: max(r["lost_steps"] for r in records
                                           if r["plan"]["fault"] == k) for k in sorted(faults)},
        "wrong_resumes": sum(1 for r in records if r.get("wrong")),
        "lost_or_corrupt": sum(1 for r in records if r.get("corrupt")
                               or any(f.startswith("lost") for f in r["failures"])),
        "hangs": sum(hangs.values()), "hangs_by_fault": dict(sorted(hangs.items())),
        "failed_cycles": sum(1 for r in records if r["failures"]),
        "other_failed": sum(1 for r in records if r["failures"] and not r.get("slow_start")
                            and not r.get("wrong") and not r.get("corrupt")
                            and not any(f.startswith("lost") for f in r["failures"])),
        # a loaded machine: a background save process not started within the
        # timeout (its save fails; its peers wait the timeout): counted apart
        # from hangs and other failed checks, never from wrong resumes or
        # lost or corrupt steps
        "worker_start_over_timeout": len(slow),
        "cycle_s_mean": round(sum(r["cycle_s"] for r in records) / max(len(records), 1), 2),
        "cycle_s_max": max((r["cycle_s"] for r in records), default=0.0),
        "cpu_s_mean": round(sum(r.get("cpu_s", 0.0) for r in records)
                            / max(len(records), 1), 2),
    }


def markdown(results: list[dict]) -> str:
    """The soak table of docs/benchmarks.md: one row per storage."""
    rows = ["| storage | cycles | faults: kill all / kill trainers / kill a background "
            "process / SIGTERM / transient / persistent storage | resumed on 2 / 3 / 4 ranks "
            "(at another layout) | most steps lost: a kill / a persistent storage fault | "
            "wrong resumes | lost or corrupt steps | hangs | other failed checks | cycle s "
            "(mean / max) |", "|" + "---|" * 10]
    kills = ("kill_all", "kill_trainers", "kill_worker", "sigterm")
    for res in results:
        cycles = res["cycles"]
        s = summarize(cycles)
        moved = sum(1 for r in cycles if (r["plan"]["world_a"], r["plan"]["layout_a"])
                    != (r["plan"]["world_b"], r["plan"]["layout_b"]))
        worlds = " / ".join(str(sum(r["plan"]["world_b"] == w for r in cycles)) for w in WORLDS)
        lost = s["max_steps_lost_by_fault"] if "max_steps_lost_by_fault" in s else {}
        lost_text = (f"{max((lost.get(k, 0) for k in kills), default=0)} / "
                     f"{lost.get('storage_persistent', 0)}")
        faults = " / ".join(str(s["faults"].get(k, 0)) for k in FAULTS)
        other = s.get("other_failed", 0)
        slow = s["worker_start_over_timeout"]
        other_text = f"{other}" + (f" (and {slow} cycles with a worker start over the timeout, "
                                   f"a loaded machine)" if slow else "")
        by_fault = ", ".join(f"{k} {v}" for k, v in s["hangs_by_fault"].items())
        hangs = f"{s['hangs']} ({by_fault})" if s["hangs"] else "0"
        rows.append(f"| {res['storage']} | {s['cycles']} | {faults} | {worlds} ({moved}) | "
                    f"{lost_text} | {s['wrong_resumes']} | {s['lost_or_corrupt']} | {hangs} | "
                    f"{other_text} | {s['cycle_s_mean']} / {s['cycle_s_max']} |")
    return "\n".join(rows)


# --------------------------------------------------------------------- main
def _write(path: Path | None, result: dict) -> None:
    if path is None:
        return
    result["summary"] = summarize(result["cycles"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def run(storages: list[str], cycles: int, seed: int, timeout: float, out: Path | None,
        scratch: Path, cache: Path, verbose: bool = True, quick: bool = False,
        note: str = "", start: int = 0) -> list[dict]:
    """``cycles`` cycles on each storage; their results (one per storage).
    Cycle ``i`` of the run (counted over the storages, in turn) draws
    :func:`draw_plan(seed, i)`, so a few cycles over several storages cover
    every fault kind; ``start`` skips the first cycles (to rerun cycle
    ``start`` of a run alone)."""
    cache.mkdir(parents=True, exist_ok=True)
    results = []
    index = start
    with contextlib.ExitStack() as stack:
        endpoint = None
        if "s3" in storages:
            from dcp.testing import local_s3_server

            os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                              AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
            endpoint = stack.enter_context(local_s3_server(min_part_size=1024))
        for kind in storages:
            storage = Storage(kind, Path(tempfile.mkdtemp(prefix=f"soak-{kind}-", dir=scratch)),
                              endpoint)
            if kind == "s3":
                in_child(storage.make_bucket)
            soak = Soak(storage, timeout, cache)
            result = {"storage": kind, "seed": seed, "timeout": timeout, "quick": quick,
                      "note": note,
                      "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "torch": torch.__version__, "cycles": []}
            path = None if out is None else (out if len(storages) == 1 else
                                             out.with_name(f"{out.stem}-{kind}{out.suffix}"))
            for _ in range(cycles):
                plan = draw_plan(seed, index, quick)
                rec = soak.cycle(plan, index)
                index += 1
                result["cycles"].append(rec)
                _write(path, result)
                if verbose:
                    status = "ok" if not rec["failures"] and not rec["hangs"] else "FAIL"
                    print(f"[{kind} {len(result['cycles'])}/{cycles}] {plan['fault']} "
                          f"{plan['world_a']}{plan['layout_a'][0]}->{plan['world_b']}"
                          f"{plan['layout_b'][0]} resumed {rec.get('resumed')} "
                          f"lost {rec['lost_steps']} {rec['cycle_s']:.1f}s {status} "
                          f"{rec['failures'][:2]} {rec['hangs']}", flush=True)
            in_child(storage.remove_all)
            if not any(r["failures"] or r["hangs"] for r in result["cycles"]):
                shutil.rmtree(storage.scratch, ignore_errors=True)
            results.append(result)
    return results


def _preload() -> None:
    """Import once, before any fork, what every rank and check imports (about
    a CPU second per process otherwise); none of it starts a thread."""
    import numpy  # noqa: F401
    import psutil  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import dcp.manager  # noqa: F401
    import dcp.tools.cli  # noqa: F401
    import storage_plugins.faulty  # noqa: F401
    import storage_plugins.posix  # noqa: F401
    import storage_plugins.s3  # noqa: F401
    import storage_plugins.shm  # noqa: F401
    from dcp.core.storage import installed_schemes

    installed_schemes()  # the entry points, scanned once


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", nargs="+", choices=STORAGES, default=["posix"])
    p.add_argument("--cycles", type=int, default=10, help="cycles per storage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, metavar="I",
                   help="begin at cycle I of the seed's sequence (rerun a failed cycle)")
    p.add_argument("--timeout", type=float, default=20.0,
                   help="the manager's timeout, seconds (a hang is detected after it)")
    p.add_argument("--out", type=Path, help="results JSON (one per storage: -<storage> added "
                                            "when several)")
    p.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--cache", type=Path,
                   default=Path(tempfile.gettempdir()) / "hyperdcp-soak-references")
    p.add_argument("--report", type=Path, nargs="+", metavar="FILE",
                   help="print the Markdown table of these results files, run nothing")
    p.add_argument("--note", default="", help="a note kept in the results (the commit run)")
    p.add_argument("--quick", action="store_true",
                   help="CI's cycles: job A on 2 ranks, job B's saves synchronous")
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.report:
        results = []
        for f in a.report:
            try:
                results.append(json.loads(f.read_text()))
            except (OSError, ValueError) as e:
                p.error(f"--report {f}: not a soak results file ({e})")
        print(markdown(results))
        for res in results:
            print(f"\n{res['storage']}: {json.dumps(summarize(res['cycles']))}")
        return 0
    _preload()
    results = run(a.storage, a.cycles, a.seed, a.timeout, a.out, a.scratch, a.cache,
                  verbose=not a.quiet, quick=a.quick, note=a.note,
                  start=a.start)
    print(markdown(results))
    return 0 if not any(r["failures"] or r["hangs"] for res in results
                        for r in res["cycles"]) else 1


if __name__ == "__main__":
    sys.exit(main())
