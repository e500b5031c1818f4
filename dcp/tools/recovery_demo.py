"""The recovery demo: a host lost, and the job back from host memory.

``hyperdcp demo --recovery`` runs 4 ranks on 2 hosts simulated on this machine: a host is a
group of ranks with a shared-memory folder of its own (``dcp.MemoryTier(host=...,
namespace=...)``), ranks 0-1 on ``h0`` and 2-3 on ``h1``. The layout is DP2 x TP2 with the
tensor-parallel pairs on one host, as jobs place them: the model's rows are split over the
pair and replicated over the data-parallel ranks (so every model chunk is already held on
both hosts), and the optimizer's moments are split over all 4 ranks (ZeRO: each chunk on one
rank only, so the memory tier copies it to the other host).

* Phase A trains ``--steps`` steps through one ``dcp.CheckpointManager``: a memory step every
  step, a persistent one (to ``<work>/run``) every ``--interval``. Each step's update is a
  data-parallel all-reduce of a seeded pseudo-gradient. After the last step committed, host
  ``h1`` is lost: the driver SIGKILLs every process of the job (``h1``'s, and ``h0``'s as a
  launcher tears a job down) and deletes ``h1``'s folder.
* Phase B is the restart: new processes on ``h0`` (its memory intact) and on a replacement
  ``h1`` (an empty folder). ``mgr.load_latest`` takes the newest memory step: ``h0``'s ranks
  from their own host, the replacement's from ``h0``'s copies. Then, beside it, the same state
  is loaded from the persistent tier alone (the newest persistent step, as a job without a
  memory tier would resume).

Both restores are compared element-exact with the uninterrupted run (recomputed on each rank
from the same seeds); the exit code is 0 only if both match and the memory restore took no
byte from the persistent tier. It prints the restart's time, each restore's seconds, bytes by
source and the steps it lost.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import dcp

HOSTS = ("h0", "h0", "h1", "h1")
WORKER_TIMEOUT_S = 240
#: model tensors, each [ROWS, COLS] fp32; rows split over the TP pair
TENSORS, COLS = 4, 1024


def _rows(mib: int) -> int:
    """Rows per model tensor so a rank holds about ``mib`` MiB (model and moments)."""
    return max(8, (mib << 20) // (TENSORS * COLS * 4 * 3 // 4) // 8 * 8)


def _state(rank: int, rows: int) -> dict:
    """This rank's state: TP slices of the model (replicated over DP), quarter slices of the
    momentum (one rank each), and the step."""
    tp, quarter = rank % 2, rows // 4
    model = {f"w{i}": dcp.TensorShard(torch.zeros(rows // 2, COLS), (rows, COLS),
                                      (tp * rows // 2, 0)) for i in range(TENSORS)}
    optim = {f"w{i}": dcp.TensorShard(torch.zeros(quarter, COLS), (rows, COLS),
                                      (rank * quarter, 0)) for i in range(TENSORS)}
    return {"model": model, "momentum": optim, "meta": {"step": 0}}


def _grad(i: int, step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + i)
    return torch.randn(rows, COLS, generator=g)


def _train_step(state: dict, rank: int, rows: int, step: int, dp_group) -> None:
    """One update: the pseudo-gradient averaged over the data-parallel pair (a real gloo
    all-reduce), momentum on this rank's quarter, the model's TP slice moved."""
    for i in range(TENSORS):
        grad = _grad(i, step, rows) * (1 + rank // 2)  # 1x on h0, 2x on h1
        if dp_group is not None:
            dist.all_reduce(grad, group=dp_group)
        _apply(state, i, grad / 3)  # the mean of 1x and 2x: the same on every rank
    state["meta"]["step"] = step


def _apply(state: dict, i: int, grad: torch.Tensor) -> None:
    """Tensor ``i``'s update by the full ``grad``: momentum on this rank's rows, the model's
    slice moved."""
    w, m = state["model"][f"w{i}"], state["momentum"][f"w{i}"]
    m.data.mul_(0.9).add_(grad[m.global_offsets[0]:m.global_offsets[0] + m.data.shape[0]])
    w.data.add_(grad[w.global_offsets[0]:w.global_offsets[0] + w.data.shape[0]], alpha=-0.01)


def _reference(rank: int, rows: int, step: int) -> dict:
    """The uninterrupted run's state of ``rank`` at ``step``, recomputed without collectives."""
    ref = _state(rank, rows)
    for s in range(1, step + 1):
        for i in range(TENSORS):
            g = _grad(i, s, rows)
            _apply(ref, i, (g + g * 2) / 3)  # what the pair's all-reduce and _train_step compute
        ref["meta"]["step"] = s
    return ref


def _mismatches(state: dict, ref: dict) -> list[str]:
    bad = [f"{part}.{k}" for part in ("model", "momentum") for k in state[part]
           if not torch.equal(state[part][k].data.view(torch.int32),
                              ref[part][k].data.view(torch.int32))]
    return bad + ([] if state["meta"] == ref["meta"] else ["meta.step"])


def _worker(phase: str, rank: int, port: int, work: Path, shm: Path, steps: int,
            interval: int, mib: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=len(HOSTS), timeout=datetime.timedelta(seconds=120))
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    host, rows = HOSTS[rank], _rows(mib)
    tier = dcp.MemoryTier(host=host, namespace=str(shm / host), run_id="demo")
    mgr = dcp.CheckpointManager(work / "run", interval=interval, keep_latest=2, save_rng=False,
                                memory=tier)
    state = _state(rank, rows)
    out: dict = {"rank": rank, "host": host}
    if phase == "a":
        for step in range(1, steps + 1):
            _train_step(state, rank, rows, step, dp_groups[rank % 2])
            mgr.save(step, state)
        mgr.wait()
        out["memory"], out["persistent"] = mgr.memory_steps(), mgr.persistent_steps()
        (work / f"a.{rank}.json").write_text(json.dumps(out))
        dist.barrier()
        time.sleep(3600)  # the driver kills the job here
    started = time.perf_counter()
    resumed = mgr.load_latest(state)
    r = mgr.last_restore
    out["resumed_at"] = time.time()
    last = max(mgr.persistent_steps())
    out["memory"] = {"step": resumed, "seconds": time.perf_counter() - started,
                     "own": r.bytes_own_host if r else 0,
                     "other": r.bytes_other_hosts if r else 0,
                     "persistent": r.bytes_persistent if r else 0,
                     "bad": _mismatches(state, _reference(rank, rows, resumed or 0))}
    mgr.close()
    dist.barrier()
    plain = _state(rank, rows)
    started = time.perf_counter()
    report = dcp.load(plain, str(work / "run" / f"step-{last}"))
    out["persistent"] = {"step": last, "seconds": time.perf_counter() - started,
                         "bytes": report.bytes_read, "requests": report.requests,
                         "bad": _mismatches(plain, _reference(rank, rows, last))}
    (work / f"b.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(phase: str, work: Path, shm: Path,
           args: argparse.Namespace) -> list[subprocess.Popen]:
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return [subprocess.Popen(
        [sys.executable, "-m", "dcp.tools.recovery_demo", "--worker", phase, "--rank", str(r),
         "--port", str(port), "--out", str(work), "--shm", str(shm), "--steps", str(args.steps),
         "--interval", str(args.interval), "--mib", str(args.mib)], env=env)
        for r in range(len(HOSTS))]


def _wait(procs: list[subprocess.Popen], done, timeout: float) -> None:
    """Wait until ``done()`` or every process ended; a process that failed or a timeout kills
    the rest and raises."""
    deadline = time.monotonic() + timeout
    while not done():
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"worker exit codes {codes}" if any(codes) else "timed out")
        if all(c == 0 for c in codes):
            return
        time.sleep(0.05)


def _mib_text(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hyperdcp demo --recovery",
        description="4 ranks on 2 simulated hosts with a memory tier: lose host h1, replace "
                    "it, resume from host memory; beside it, the restore from the persistent "
                    "tier alone.")
    p.add_argument("--recovery", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=12, help="steps before the host is lost (12)")
    p.add_argument("--interval", type=int, default=5, help="persistent step every N (5)")
    p.add_argument("--mib", type=int, default=32, help="state per rank, MiB (32)")
    p.add_argument("--out", type=Path, help="work directory (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the default temp work directory")
    p.add_argument("--worker", choices=("a", "b"), help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shm", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.interval < 1 or args.steps < args.interval or args.mib < 1:
        p.error("need 1 <= --interval <= --steps and --mib >= 1")
    if args.worker:
        _worker(args.worker, args.rank, args.port, args.out, args.shm, args.steps,
                args.interval, args.mib)
        return 0
    work = args.out or Path(tempfile.mkdtemp(prefix="hyperdcp-recovery-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "run", ignore_errors=True)
    for f in work.glob("[ab].*.json"):
        f.unlink()
    # the hosts' memory: folders in /dev/shm (removed at the end), as a real host's would be
    shm = Path(tempfile.mkdtemp(prefix="hyperdcp-recovery-demo-",
                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    began = time.perf_counter()
    try:
        return _drive(work, shm, args, began)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if args.out is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.out is None:
            print(f"work directory kept at {work}")
        print(f"demo finished in {time.perf_counter() - began:.1f} s")


def _drive(work: Path, shm: Path, args: argparse.Namespace, began: float) -> int:
    print("\n=== hyperdcp demo --recovery ===")
    print("4 ranks, DP2 x TP2, on 2 hosts simulated on this machine: h0 = ranks 0-1, "
          "h1 = ranks 2-3, each host a shared-memory folder of its own")
    print(f"phase A: {args.steps} steps, a memory step every step, a persistent step every "
          f"{args.interval}, ~{args.mib} MiB of state per rank")
    procs = _spawn("a", work, shm, args)
    _wait(procs, lambda: all((work / f"a.{r}.json").exists() for r in range(len(HOSTS))),
          WORKER_TIMEOUT_S)
    a = [json.loads((work / f"a.{r}.json").read_text()) for r in range(len(HOSTS))]
    print(f"  trained in {time.perf_counter() - began:.1f} s; memory steps per host "
          f"{ {x['host']: x['memory'] for x in a} }, persistent steps {a[0]['persistent']}")
    for proc in procs[2:] + procs[:2]:  # h1 lost; the launcher tears h0's ranks down
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
    shutil.rmtree(shm / "h1")
    print("host h1 lost: every process of the job SIGKILLed, h1's shared memory deleted; "
          "h1 replaced by new processes with empty memory")
    restart = time.time()
    procs = _spawn("b", work, shm, args)
    _wait(procs, lambda: False, WORKER_TIMEOUT_S)
    b = [json.loads((work / f"b.{r}.json").read_text()) for r in range(len(HOSTS))]
    resumed = max(x["resumed_at"] for x in b) - restart
    mem = [x["memory"] for x in b]
    per = [x["persistent"] for x in b]
    step = mem[0]["step"]
    print(f"\n{'restore':<26}{'step':>5}{'steps lost':>11}{'seconds':>9}"
          f"{'own host':>14}{'other hosts':>14}{'persistent':>14}")
    print(f"{'memory tier':<26}{step:>5}{args.steps - step:>11}"
          f"{max(m['seconds'] for m in mem):9.3f}{_mib_text(sum(m['own'] for m in mem))}"
          f"{_mib_text(sum(m['other'] for m in mem))}"
          f"{_mib_text(sum(m['persistent'] for m in mem))}")
    print(f"{'persistent tier alone':<26}{per[0]['step']:>5}{args.steps - per[0]['step']:>11}"
          f"{max(x['seconds'] for x in per):9.3f}{_mib_text(0)}{_mib_text(0)}"
          f"{_mib_text(sum(x['bytes'] for x in per))}  "
          f"({sum(x['requests'] for x in per)} requests)")
    for x in b:
        print(f"  rank {x['rank']} ({'h0, memory intact' if x['host'] == 'h0' else 'h1, replaced'})"
              f": {_mib_text(x['memory']['own']).strip()} from its host, "
              f"{_mib_text(x['memory']['other']).strip()} from the other host")
    print(f"restart until every rank resumed from memory: {resumed:.1f} s (process start, "
          f"import torch and the process group included)")
    print(f"the persistent tier here is {work / 'run'} on a local disk whose files are still in "
          f"the page cache; from S3 or a shared file system it reads at that storage's speed")
    failures = []
    if step != args.steps:
        failures.append(f"the memory restore took step {step}, not {args.steps}")
    for x in b:
        for what, res in (("memory", x["memory"]), ("persistent", x["persistent"])):
            if res["bad"]:
                failures.append(f"rank {x['rank']}: {what} restore differs from the "
                                f"uninterrupted run in {res['bad']}")
    if any(m["persistent"] for m in mem):
        failures.append("the memory restore read bytes from the persistent tier")
    if not any(x["memory"]["other"] for x in b if x["host"] == "h1"):
        failures.append("the replacement host took nothing from the other host")
    for f in failures:
        print(f"FAIL: {f}")
    print("element-exact against the uninterrupted run: "
          + ("yes, both restores" if not failures else "no"))
    print("\nPASS" if not failures else "\nFAIL")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
