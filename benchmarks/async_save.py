"""Asynchronous save: how long training stalls, how long the save takes, and
what the background persistence costs the training loop.

State dict per rank: ``NUM_TENSORS`` fp32 DTensors, each ``Shard(0)`` of a
``[ROWS * W, COLS]`` tensor on a 1-D mesh, so every rank holds 16 x
[2048, 4096] = 512 MiB of distinct data.  For each world size, one gloo
process group measures, per system:

- ``stall``: wall time until the async call returns (median over the saves
  after the first; the first also pays process start and buffer allocation,
  reported as ``first_stall``/``first_total``);
- ``total``: wall time until the save is committed (same saves);
- ``lost``: a training-step loop that does not touch the saved state runs
  from the return of the call until the save is committed; ``lost`` is its
  elapsed time minus its steps times the step time measured without any
  checkpoint (the mean of a measurement just before and one just after).
  Two loops, on alternate saves (see :class:`_Trainer`): ``device``, the host
  side of an accelerator job (GIL-held Python work, then waiting for the
  device), and ``cpu``, a CPU-bound step that competes for the cores;
- for hyperdcp, ``plan1``/``plan2``: background planning time of the first
  save (which includes waiting for the slowest rank to arrive) and the
  median of the later ones (plan-cache hits).

Every number is the slowest rank's. Systems: ``hyperdcp-gloo``/``-file``/
``-none`` (``dcp.async_save`` with each coordination), ``torch-thread``
(``torch.distributed.checkpoint.async_save``, THREAD) and ``torch-process``
(PROCESS, with its shared-memory ``DefaultStager``). The floor, ``memcpy``,
is a ``Tensor.copy_`` of the rank's bytes into preallocated buffers,
measured right before every save (conditions drift over a run: memory in
use, page cache); ``stall × memcpy`` is the median over saves of the slowest
rank's stall over the slowest rank's memcpy, both of that save. (A per-rank
ratio would compare a rank's stall with its own memcpy at another moment:
with more ranks than cores, one rank gets a core to itself for one copy and
shares it for the other, and its ratio swings 0.5-2.3 from save to save; the
slowest rank is also when training can go on.)

``run(out_dir)`` runs it and returns the rows (also written to
``out_dir/async_save.json``, their table to ``async_save.md``);
``python -m benchmarks.async_save`` prints the table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from .common import launch
from .report import Column, markdown_table, write_table

NUM_TENSORS, ROWS, COLS = 16, 2048, 4096
QUICK = (4, 64, 128)
SYSTEMS = ("torch-thread", "torch-process", "hyperdcp-none", "hyperdcp-file", "hyperdcp-gloo")
STEP_LAYERS, STEP_WIDTH, STEP_SCALARS = 4, 512, 300
DEVICE_WAIT_S = 0.01


def _state(rank: int, world_size: int, shape: tuple[int, int, int]) -> dict:
    count, rows, cols = shape
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(rank)
    return {f"layer{i}.weight": DTensor.from_local(torch.rand((rows, cols), generator=g), mesh,
                                                   [Shard(0)], run_check=False)
            for i in range(count)}


class _Trainer:
    """Stand-ins for a training step, independent of the saved state.

    ``"device"``: an accelerator job's host side — Python bookkeeping under
    the GIL (optimizer, scheduler and logging code over many parameters) and
    a small CPU op, then ``DEVICE_WAIT_S`` waiting for the device (a sleep:
    the CPU and the GIL are free meanwhile, as while a GPU computes).
    ``"cpu"``: a CPU-bound step (an MLP forward and backward on the host),
    which on this machine competes with everything else for the cores.
    """

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(STEP_WIDTH, STEP_WIDTH, generator=g, requires_grad=True)
                        for _ in range(STEP_LAYERS)]
        self.x = torch.randn(64, STEP_WIDTH, generator=g)
        self.stats = {f"p{i}": 0.0 for i in range(STEP_SCALARS)}

    def step(self, kind: str) -> None:
        for _ in range(10):  # the Python side of a step (optimizer, schedulers, logging, hooks)
            for k in self.stats:
                self.stats[k] = self.stats[k] * 0.9 + 0.1
        if kind == "device":
            torch.tanh(self.x[:8] @ self.weights[0][:, :64])
            time.sleep(DEVICE_WAIT_S)
            return
        h = self.x
        for w in self.weights:
            h = torch.tanh(h @ w)
        h.sum().backward()
        with torch.no_grad():
            for w in self.weights:
                w.sub_(1e-6 * w.grad)
                w.grad = None

    def step_time(self, kind: str, seconds: float = 0.5) -> float:
        """Mean seconds per step over about ``seconds``."""
        self.step(kind)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.step(kind)
            n += 1
        return (time.perf_counter() - start) / n

    def run_until(self, kind: str, done) -> tuple[float, int]:
        """Steps until ``done()``; (elapsed seconds, steps)."""
        n, start = 0, time.perf_counter()
        while not done():
            self.step(kind)
            n += 1
        return time.perf_counter() - start, n


class _System:
    """Starts one async save; ``start`` returns a ``done()`` poll and a
    ``wait()`` that returns the save's background planning seconds (or
    None)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stager = None
        if name.startswith("torch-"):
            import torch.distributed.checkpoint as tdcp
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self.tdcp = tdcp
            if name == "torch-process":
                self.stager = DefaultStager(StagingOptions(
                    use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
                    use_non_blocking_copy=False))

    def start(self, sd: dict, path: str):
        if self.name.startswith("hyperdcp-"):
            import dcp
            response = dcp.async_save(sd, path, coordination=self.name.split("-")[1])

            def wait():
                response.result()
                return response.stats.planning_s
            return response.done, wait
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType as kind
        future = self.tdcp.async_save(
            sd, storage_writer=self.tdcp.FileSystemWriter(path), async_stager=self.stager,
            async_checkpointer_type=kind.PROCESS if self.name == "torch-process" else kind.THREAD)
        return future.done, (lambda: future.result() and None)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def _measure(rank: int, world_size: int, shape, repeat: int, scratch: str) -> list[dict]:
    """This rank's rows, one per system."""
    torch.set_num_threads(1)
    sd = _state(rank, world_size, shape)
    floor = [torch.empty_like(t.to_local()) for t in sd.values()]

    def memcpy() -> float:
        """The floor: seconds to copy the rank's bytes into preallocated buffers."""
        dist.barrier()
        start = time.perf_counter()
        for dst, t in zip(floor, sd.values(), strict=True):
            dst.copy_(t.to_local())
        return time.perf_counter() - start

    memcpy()
    trainer = _Trainer()
    rows = []
    for name in SYSTEMS:
        system = _System(name)
        named = {f"{name}.{fqn}": t for fqn, t in sd.items()}  # a structure of its own
        samples = []
        # save 0 starts processes and allocates; then `repeat` saves per loop kind
        for i, kind in enumerate(["device"] + ["device", "cpu"] * repeat):
            path = str(Path(scratch) / f"{name}-{i}")
            before = trainer.step_time(kind)
            floor_s = memcpy()
            dist.barrier()
            start = time.perf_counter()
            done, wait = system.start(named, path)
            stall = time.perf_counter() - start
            busy, steps = trainer.run_until(kind, done)
            planning = wait()
            total = time.perf_counter() - start
            base = (before + trainer.step_time(kind)) / 2
            slowest = torch.tensor([stall, floor_s], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # after the save: nothing timed waits
            samples.append(dict(kind=kind, stall=stall, total=total, planning=planning,
                                lost=max(0.0, busy - steps * base), busy=busy, floor=floor_s,
                                ratio=float(slowest[0] / slowest[1])))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        system.close()
        later = samples[1:]

        def median(key, kind=None, later=later):
            return statistics.median(s[key] for s in later if kind in (None, s["kind"]))

        row = dict(system=name, world_size=world_size,
                   first_stall_s=samples[0]["stall"], first_total_s=samples[0]["total"],
                   stall_s=median("stall"), total_s=median("total"),
                   memcpy_s=median("floor"), stall_x_memcpy=median("ratio"),
                   stall_x_memcpy_each=[round(s["ratio"], 3) for s in later],
                   lost_device_s=median("lost", "device"), lost_cpu_s=median("lost", "cpu"),
                   busy_device_s=median("busy", "device"), busy_cpu_s=median("busy", "cpu"))
        if samples[0]["planning"] is not None:
            row["plan1_s"] = samples[0]["planning"]
            row["plan2_s"] = median("planning")
        rows.append(row)
    return rows


def _slowest(per_rank: list[list[dict]]) -> list[dict]:
    """One row per system from every rank's rows: the slowest rank's value
    of each number."""
    merged = []
    for per_system in zip(*per_rank, strict=True):
        row = dict(per_system[0])
        for key in row:
            if key.endswith("_s") or key == "stall_x_memcpy":
                row[key] = max(r[key] for r in per_system)
        merged.append(row)
    return merged


def run(out_dir: str | Path, *, world_sizes=(2, 4), repeat: int = 3, quick: bool = False,
        scratch: str | None = None) -> list[dict]:
    """Measure every system at every world size; returns one row per (world
    size, system) with seconds (``*_s``, slowest rank), ``slowdown`` (fraction
    of loop time lost) and ``stall_x_memcpy`` (stall over the memcpy floor);
    also written to ``out_dir/async_save.json`` and ``async_save.md``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = QUICK if quick else (NUM_TENSORS, ROWS, COLS)
    rows = []
    for world_size in world_sizes:
        work = Path(tempfile.mkdtemp(prefix=f"async-save-w{world_size}-", dir=scratch))
        try:
            rows += _slowest(launch(_measure, world_size, shape, repeat, str(work)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    write_table(out_dir, "async_save", rows, markdown(rows))
    return rows


#: The resume scenario: 4 x [2048, 4096] fp32 (128 MiB) per rank, five
#: saves, one per 1 s training step, of which ``RESUME_WORK_S`` (measured
#: alone before the resume) is GIL-held Python work, the rest host waiting.
RESUME_SHAPE, RESUME_SAVES, RESUME_STEP_S, RESUME_WORK_S = (4, 2048, 4096), 5, 1.0, 0.2
RESUME_SYSTEMS = ("cold", "prestarted")


def _python_work(n: int) -> float:
    """Seconds of ``n`` rounds of GIL-held Python bookkeeping."""
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i % 7
    return time.perf_counter() - start


def _resume(rank: int, world_size: int, shape, system: str, scratch: str) -> dict:
    """One resumed job's rank: load the previous job's checkpoint (``system``
    ``"prestarted"``: after :func:`dcp.prestart_async_worker`, as
    :class:`dcp.CheckpointManager` does), then a training step (Python work
    that takes ``RESUME_WORK_S`` alone, then host waiting for the device, to
    ``RESUME_STEP_S`` in all) before each of ``RESUME_SAVES`` async saves;
    seconds of the resume, of each save's call (its block: waiting for the
    save in flight, then staging) and of each step's Python work, and which
    saves ran in the trainer (``AsyncSaveStats.in_trainer``)."""
    import dcp

    torch.set_num_threads(1)
    rounds = int(1e6 * RESUME_WORK_S / max(_python_work(10**6), 1e-6))
    sd = _state(rank, world_size, shape)
    previous = str(Path(scratch) / "previous")
    dcp.save(sd, previous)  # the previous job's checkpoint; a sync save starts no process
    dist.barrier()
    start = time.perf_counter()
    if system == "prestarted":
        dcp.prestart_async_worker()
    dcp.load(sd, previous)
    resume = time.perf_counter() - start
    blocks, work, responses = [], [], []
    for i in range(RESUME_SAVES):
        work.append(_python_work(rounds))
        time.sleep(max(RESUME_STEP_S - work[-1], 0.0))
        t = time.perf_counter()
        responses.append(dcp.async_save(sd, str(Path(scratch) / f"step{i + 1}")))
        blocks.append(time.perf_counter() - t)
    responses[-1].result()
    in_trainer = [r.stats is not None and r.stats.in_trainer for r in responses]
    return dict(system=system, world_size=world_size, resume_s=resume, block_s=blocks,
                work_s=work, in_trainer=in_trainer)


def run_resume(out_dir: str | Path, *, world_sizes=(2, 4), quick: bool = False,
               scratch: str | None = None) -> list[dict]:
    """Block time of the first saves after a resume, without and with the
    background process prestarted: one fresh job (process group) per world
    size and system; rows with the slowest rank's seconds, also written to
    ``out_dir/async_resume.json`` and ``async_resume.md``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = QUICK if quick else RESUME_SHAPE
    rows = []
    for world_size in world_sizes:
        for system in RESUME_SYSTEMS:
            work = Path(tempfile.mkdtemp(prefix=f"async-resume-w{world_size}-", dir=scratch))
            try:
                ranks = launch(_resume, world_size, shape, system, str(work))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            rows.append(dict(ranks[0], resume_s=max(r["resume_s"] for r in ranks),
                             block_s=[max(b) for b in zip(*(r["block_s"] for r in ranks),
                                                          strict=True)],
                             work_s=[max(w) for w in zip(*(r["work_s"] for r in ranks),
                                                         strict=True)],
                             in_trainer=sum(sum(r["in_trainer"]) for r in ranks)))
    write_table(out_dir, "async_resume", rows, markdown_resume(rows))
    return rows


def markdown_resume(rows: list[dict]) -> str:
    """The resume rows as a Markdown table."""
    columns: list[Column] = [("W", lambda r: str(r["world_size"])),
                             ("worker", lambda r: r["system"]),
                             ("resume s", lambda r: f"{r['resume_s']:.2f}")]
    columns += [(f"save {i + 1} blocks s", lambda r, i=i: f"{r['block_s'][i]:.3f}")
                for i in range(RESUME_SAVES)]
    columns += [(f"saves in a trainer, of W×{RESUME_SAVES}", lambda r: str(r["in_trainer"])),
                (f"step work s ({RESUME_WORK_S:g} alone): steps 2-3 / 4-5",
                 lambda r: f"{max(r['work_s'][1:3]):.3f} / {max(r['work_s'][3:5]):.3f}")]
    return markdown_table(rows, columns)


def _planning(r: dict) -> str:
    return f"{r['plan1_s']:.4f} / {r['plan2_s']:.5f}" if "plan1_s" in r else ""


COLUMNS: list[Column] = [
    ("W", lambda r: str(r["world_size"])),
    ("system", lambda r: r["system"]),
    ("stall s", lambda r: f"{r['stall_s']:.3f}"),
    ("memcpy s", lambda r: f"{r['memcpy_s']:.3f}"),
    ("stall × memcpy", lambda r: f"{r['stall_x_memcpy']:.2f}"),
    ("total s", lambda r: f"{r['total_s']:.2f}"),
    ("first stall / total s", lambda r: f"{r['first_stall_s']:.3f} / {r['first_total_s']:.2f}"),
    ("loop time lost s: accelerator-like / CPU-bound",
     lambda r: f"{r['lost_device_s']:.2f} / {r['lost_cpu_s']:.2f}"),
    ("planning 1st / later s", _planning),
]


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    return markdown_table(rows, COLUMNS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.async_save",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--repeat", type=int, default=3, help="saves after the first (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny tensors: a harness check")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--scratch", default=None, help="where checkpoints go (default: tmp)")
    parser.add_argument("--resume", action="store_true",
                        help="the resume scenario: block time of saves 1-5 after a resume")
    args = parser.parse_args()
    if args.resume:
        print(markdown_resume(run_resume(args.out, world_sizes=tuple(args.world_sizes),
                                         quick=args.quick, scratch=args.scratch)))
    else:
        print(markdown(run(args.out, world_sizes=tuple(args.world_sizes), repeat=args.repeat,
                           quick=args.quick, scratch=args.scratch)))
