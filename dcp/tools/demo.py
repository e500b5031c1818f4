"""End-to-end demo: a training job checkpointed by ``dcp.CheckpointManager``, killed in the
middle of a save, resumed under a different layout, then preempted.

``hyperdcp demo`` (or ``python -m dcp demo``) runs two torchrun jobs on CPU/gloo. Both train
through the same ``dcp.CheckpointManager`` configuration: one root, an async save every
``--interval`` steps (training goes on while each save persists in a background process per
rank), the newest ``KEEP_LATEST`` complete steps kept, a per-rank sample counter
(``dcp.PerRank`` with the ``dcp.SumOf`` rule) and RNG states (``rng_on_resize=DeriveRNG()``).

* Phase A, 4 ranks, 2-D mesh DP2 x TP2: a ~11.6M-parameter GPT-style language model is
  tensor-parallelised over "tp" (``parallelize_module`` with Colwise/RowwiseParallel) and
  then sharded over "dp" with FSDP2 (``fully_shard``), so parameters and AdamW state are
  DTensors with ``_StridedShard`` placements. It trains on synthetic Markov-chain tokens for
  ``--steps`` steps: this is the uninterrupted reference run, every loss recorded. Right
  after ``mgr.save`` returned for the last step, whose async save is still persisting, rank 0
  kills the whole job with SIGKILL, as a node failure would: torchrun, every trainer and
  every background save process.
* Phase B, 2 ranks, TP2 only: ``mgr.load_latest`` resumes from the newest complete step, the
  one before the killed one (the killed step has no committed metadata: it is neither loaded
  nor listed). The data-parallel degree went from 2 to 1, so the sample counters are summed
  and the RNG streams derived by the declared rules. It trains the same global batches; at
  step ``--steps - 1``, which no interval saves, rank 1 alone gets SIGTERM: at that step's
  ``mgr.save`` every rank saves it synchronously, ``mgr.preempted`` ends the loop, and a
  freshly built model and optimizer load the last-words step back.

The exit code is 0 only if every check passes: the killed save was in flight, its step is
incomplete and not listed, and no process of the killed job survives; right after loading,
every model parameter and optimizer state tensor is bit-identical to what phase A saved at
that step, and the sample counter is the sum of phase A's; the resumed losses match the
uninterrupted run within ``LOSS_RTOL``; both ranks saved the same last-words step, which is
complete, the newest, and loads bit-identical; retention kept the newest ``KEEP_LATEST``.
Losses are not expected to be bit-exact: phase A averages the gradients of two half batches
across DP ranks while phase B computes the full-batch gradient on each rank, so
floating-point sums happen in a different order. The measured differences are about 1e-7
relative (at most 4.4e-7 over 55 resumed steps); rtol 1e-4 leaves a wide margin for longer
runs and other CPUs. The loss comparison catches gross restore errors (a tensor or the
optimizer state not restored, a wrong step); subtler corruption, such as a 1% error in one
Adam moment, can stay within rtol and is what the bit-exact tensor comparison is for.

It prints a short summary: the steps saved and how long each save blocked training, what
was killed and what it left, what resumed, load and last-words save times, the checkpoint's
bytes against the unique state bytes, and each phase's time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dcp
from dcp.manager import DeriveRNG

# Model and training configuration, shared by both phases.
VOCAB = 2048
D_MODEL = 512
N_HEADS = 8
N_LAYERS = 3
SEQ_LEN = 64
GLOBAL_BATCH = 8
LR = 3e-3
WEIGHT_DECAY = 0.01
SEED = 1234
KEEP_LATEST = 2  # retention: the newest complete steps kept
MARKOV_FANOUT = 8  # each token has this many possible successors

LOSS_RTOL = 1e-4
WORKER_TIMEOUT_S = 600
SAVE_TIMEOUT_S = 120  # the manager's: for the background save processes to start, for a peer

# Phase name -> (number of ranks, mesh shape, mesh dim names, description).
LAYOUTS: dict[str, tuple[int, tuple[int, ...], tuple[str, ...], str]] = {
    "a": (4, (2, 2), ("dp", "tp"), "DP2 x TP2, FSDP2 + TP"),
    "b": (2, (2,), ("tp",), "TP2"),
}


# --------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.wk = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.wv = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.wo = nn.Linear(D_MODEL, D_MODEL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        head_dim = D_MODEL // N_HEADS
        # Under TP, wq/wk/wv return this rank's heads only; -1 picks up the local count.
        q, k, v = (w(x).view(b, t, -1, head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D_MODEL, 4 * D_MODEL, bias=False)
        self.w2 = nn.Linear(4 * D_MODEL, D_MODEL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)  # untied from tok_emb

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(mesh: DeviceMesh) -> nn.Module:
    """Build the GPT identically on every rank, TP over "tp", then FSDP2 over "dp" if present."""
    torch.manual_seed(SEED)
    model = GPT()
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(N_LAYERS):
        plan.update({
            f"blocks.{i}.attn.wq": ColwiseParallel(),
            f"blocks.{i}.attn.wk": ColwiseParallel(),
            f"blocks.{i}.attn.wv": ColwiseParallel(),
            f"blocks.{i}.attn.wo": RowwiseParallel(),
            f"blocks.{i}.mlp.w1": ColwiseParallel(),
            f"blocks.{i}.mlp.w2": RowwiseParallel(),
        })
    parallelize_module(model, mesh["tp"], plan)
    if "dp" in (mesh.mesh_dim_names or ()):
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


# --------------------------------------------------------------------------- data


def global_batch(step: int) -> torch.Tensor:
    """The (GLOBAL_BATCH, SEQ_LEN + 1) token batch of ``step``, identical on every rank and run.

    Tokens follow a fixed random Markov chain (each token has MARKOV_FANOUT weighted
    successors), so the data is learnable: the loss can fall from ln(VOCAB) towards the
    chain's entropy.
    """
    chain = torch.Generator().manual_seed(SEED)
    successors = torch.randint(VOCAB, (VOCAB, MARKOV_FANOUT), generator=chain)
    weights = torch.rand(VOCAB, MARKOV_FANOUT, generator=chain) ** 2
    gen = torch.Generator().manual_seed(SEED + step)
    tokens = [torch.randint(VOCAB, (GLOBAL_BATCH,), generator=gen)]
    for _ in range(SEQ_LEN):
        cur = tokens[-1]
        pick = torch.multinomial(weights[cur], 1, generator=gen).squeeze(1)
        tokens.append(successors[cur, pick])
    return torch.stack(tokens, dim=1)


# --------------------------------------------------------------------------- worker


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts/lists into dotted keys (fqns)."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _full_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` gathered to its full global value (collective over all ranks)."""
    full = {}
    for fqn, value in _flatten(state).items():
        if isinstance(value, DTensor):
            full[fqn] = value.full_tensor()
        elif isinstance(value, torch.Tensor):
            full[fqn] = value.detach().clone()
    return full


def _mismatches(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> list[str]:
    """The fqns missing on either side or not bit-identical."""
    return sorted(fqn for fqn in saved.keys() | loaded.keys()
                  if fqn not in saved or fqn not in loaded or not torch.equal(saved[fqn],
                                                                              loaded[fqn]))


class TrainState:
    """The model and its AdamW optimizer as one Stateful: the manager calls ``state_dict``
    only when it saves or loads a step (torch's state-dict API, which fills in an
    optimizer's state before its first step, so a fresh job has targets to load into)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.model),
                "optim": get_optimizer_state_dict(self.model, self.optim)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd["model"])
        set_optimizer_state_dict(self.model, self.optim, sd["optim"])


def _fresh_state(mesh: DeviceMesh) -> tuple[dict[str, Any], dict[str, int]]:
    """A freshly built model and optimizer, and a sample counter, as the manager's state."""
    model = build_model(mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    samples = {"samples": 0}
    return {"train": TrainState(model, optim),
            "data": dcp.PerRank(samples, on_resize=dcp.SumOf("samples"))}, samples


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run the collective ``fn`` between barriers; return its result and wall seconds."""
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return result, time.perf_counter() - start


def _quiet_torch() -> None:
    """Silence two torch notices that are expected here and would drown the demo's output."""
    # The model returns the local view of the replicated lm_head output; nothing modifies it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # full_tensor() of _StridedShard parameters needs two all-gathers; fine for a check.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _kill_job(groups: list[int]) -> None:
    """SIGKILL to the whole job, as a node failure would: torchrun's process group (the
    driver starts it in a session of its own), every other trainer's group (torchrun starts
    each worker in a session of its own, and a trainer's background save process is in its
    group), then this rank's group, this process included."""
    agent, own = os.getppid(), os.getpgrp()
    targets = [g for g in groups if g != own] + [own]
    if os.getpgid(agent) == agent:
        targets.insert(0, agent)
    else:  # torchrun shares a group with its caller: kill torchrun alone
        os.kill(agent, signal.SIGKILL)
    for group in targets:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def _bytes_in(folder: Path) -> int:
    """Bytes of the files in ``folder`` now (files renamed or removed meanwhile skipped)."""
    total = 0
    for f in folder.glob("*") if folder.exists() else ():
        with contextlib.suppress(OSError):
            total += f.stat().st_size
    return total


def _rng_digest() -> str:
    import hashlib

    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def _worker(phase: str, work: Path, steps: int, interval: int) -> None:
    torch.set_num_threads(1)
    _quiet_torch()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _, shape, names, layout = LAYOUTS[phase]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_group = mesh.get_group("dp") if "dp" in names else None
    dp_rank, dp_size = (mesh["dp"].get_local_rank(), mesh["dp"].size()) if dp_group else (0, 1)
    tag = f"[phase {phase.upper()}]"

    def manager() -> dcp.CheckpointManager:
        return dcp.CheckpointManager(work / "run", interval=interval, keep_latest=KEEP_LATEST,
                                     data_parallel=(dp_rank, dp_size),
                                     rng_on_resize=DeriveRNG(), timeout=SAVE_TIMEOUT_S)

    groups: list[Any] = [None] * world
    dist.all_gather_object(groups, os.getpgrp())
    state, samples = _fresh_state(mesh)
    result: dict[str, Any] = {"layout": layout, "world_size": world, "losses": {},
                              "saves": {}, "groups": groups, "agent": os.getppid()}
    if rank == 0:
        n_params = sum(p.numel() for p in GPT().parameters())
        result["parameters"] = n_params
        print(f"{tag} {layout} on {world} ranks, {n_params / 1e6:.1f}M parameters", flush=True)

    mgr = manager()
    rng_before = _rng_digest()
    resumed, result["load_seconds"] = _timed(lambda: mgr.load_latest(state))
    result["resumed_step"], result["resumed_at"] = resumed, time.time()
    if resumed is not None:  # phase B: check what was restored against what phase A saved
        loaded = _full_tensors(state["train"].state_dict())
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, (rng_before, _rng_digest()))
        result["rng_restored"] = all(before != after for before, after in digests)
        result["rng_shared"] = len({after for _, after in digests}) == 1
        result["samples"] = samples["samples"]
        if rank == 0:
            dump = work / f"tensors-step-{resumed}.pt"
            saved = torch.load(dump, weights_only=True) if dump.exists() else {}
            result["tensors_checked"] = len(saved)
            result["tensor_mismatches"] = _mismatches(saved, loaded) if saved else ["(none saved)"]
            print(f"{tag} load_latest resumed step {resumed} in {result['load_seconds']:.2f} s",
                  flush=True)

    last = steps if phase == "a" else steps - 1  # B: preempted at a step no interval saves
    first = (resumed or 0) + 1
    step = first - 1
    for step in range(first, last + 1):
        tokens = global_batch(step).chunk(dp_size)[dp_rank]
        logits = state["train"].model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        state["train"].optim.step()
        state["train"].optim.zero_grad()
        samples["samples"] += tokens.shape[0]
        loss = loss.detach()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss /= dp_size
        result["losses"][step] = loss.item()
        if phase == "b" and step == last and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice, to this rank alone
        started = time.perf_counter()
        saved_now = mgr.save(step, state)
        blocked = time.perf_counter() - started
        note = ""
        if saved_now:
            result["saves"][step] = blocked
            how = "synchronously: last words" if mgr.preempted else "async"
            note = f"  saved ({how}), training blocked {blocked:.3f} s"
        if rank == 0:
            print(f"{tag} step {step:3d}  loss {loss.item():.6f}{note}", flush=True)
        if phase == "a" and saved_now and step == steps - interval:
            full = _full_tensors(state["train"].state_dict())  # what phase B must get back
            if rank == 0:
                torch.save(full, work / f"tensors-step-{step}.pt")
        if phase == "a" and step == steps and rank == 0:
            folder, deadline = work / "run" / f"step-{step}", time.monotonic() + SAVE_TIMEOUT_S
            while mgr.in_flight == step and not _bytes_in(folder) and time.monotonic() < deadline:
                time.sleep(0.002)  # until the background saves have written some data
            result["killed"] = {"step": step, "in_flight": mgr.in_flight == step,
                                "bytes_seen": _bytes_in(folder)}
            (work / "phase_a.json").write_text(json.dumps(result, indent=1))
            print(f"{tag} SIGKILL to the whole job while step {step}'s save persists", flush=True)
            _kill_job(groups)
        if mgr.preempted:
            break

    if phase == "b":
        outcome: list[Any] = [None] * world
        dist.all_gather_object(outcome, (mgr.preempted, step, step in result["saves"]))
        result["preemption"] = outcome
        last_words = _full_tensors(state["train"].state_dict())
        mgr.close()
        fresh, _ = _fresh_state(mesh)  # a new model and optimizer load the last words back
        mgr = manager()
        result["reloaded_step"], result["reload_seconds"] = _timed(lambda: mgr.load_latest(fresh))
        reloaded = _full_tensors(fresh["train"].state_dict())
        result["reload_mismatches"] = _mismatches(last_words, reloaded)
        result["final_steps"] = mgr.steps()
    mgr.close()
    if rank == 0:
        (work / f"phase_{phase}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def _launch(phase: str, work: Path, steps: int, interval: int) -> int:
    """Run one phase under torchrun; return its exit code (negative: killed by that signal)."""
    nproc = LAYOUTS[phase][0]
    # --standalone makes torchrun's rendezvous bind a free local port itself.
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "dcp.tools.demo", "--worker", phase, "--out", str(work),
        "--steps", str(steps), "--interval", str(interval),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    # A session of its own: phase A's rank 0 kills torchrun's process group, not ours.
    job = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return job.wait(timeout=WORKER_TIMEOUT_S)
    except BaseException:
        # On a timeout or Ctrl-C, SIGTERM lets torchrun stop its workers (they run in
        # sessions of their own, out of reach of a signal to torchrun's group).
        job.terminate()
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
        raise


def _survivors(groups: set[int], wait_s: float = 10.0) -> list[int] | None:
    """The processes still running in ``groups`` once they had ``wait_s`` seconds to die
    (zombies count as gone); ``None`` where there is no /proc to look in."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for stat in proc.glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            if int(fields[2]) in groups and fields[0] not in ("Z", "X"):
                alive.append(int(stat.parent.name))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _step_bytes(run: Path, step: int) -> tuple[int, int, int]:
    """(files, bytes on disk, unique state bytes) of ``run``'s ``step``."""
    folder = run / f"step-{step}"
    files = [f for f in folder.rglob("*") if f.is_file()]
    meta = dcp.read_metadata(str(folder))
    unique = sum(math.prod(t.shape) * getattr(torch, t.dtype).itemsize
                 for t in meta.tensors.values())
    return len(files), sum(f.stat().st_size for f in files), unique


def _after_kill(work: Path, steps: int, interval: int) -> dict[str, Any]:
    """What phase A's kill left: the killed step's folder, the complete steps, survivors."""
    a = json.loads((work / "phase_a.json").read_text())
    killed = a["killed"]["step"]
    left = _survivors(set(a["groups"]) | {a["agent"]})
    run = work / "run"
    folder = run / f"step-{killed}"
    files = [f for f in folder.rglob("*") if f.is_file()] if folder.exists() else []
    mgr = dcp.CheckpointManager(run, async_save=False, save_on_preemption=False)
    complete, latest = mgr.steps(), mgr.latest_step()
    mgr.close()
    resume = steps - interval
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "metadata": (folder / "metadata.json").exists(), "complete": complete,
            "latest": latest, "survivors": left,
            "resume_bytes": _step_bytes(run, resume) if resume in complete else None}


def _report(work: Path, steps: int, interval: int, times: dict[str, float],
            kill: dict[str, Any], kept: bool) -> bool:
    """Print the summary and the loss comparison; return whether every check passed.
    ``kept``: whether ``work`` outlives the demo."""
    a = json.loads((work / "phase_a.json").read_text())
    b = json.loads((work / "phase_b.json").read_text())
    killed, resume, last = steps, steps - interval, steps - 1
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    def save_list(saves: dict[str, float]) -> str:
        return ", ".join(f"{s} ({t:.2f} s)" for s, t in saves.items())

    print("\n=== hyperdcp demo ===")
    print(f"root        {work / 'run'}" if kept else
          "root        removed with the temporary work directory at exit "
          "(--keep or --out DIR keeps it)")
    print(f"phase A     {a['layout']} on {a['world_size']} ranks, "
          f"{a['parameters'] / 1e6:.1f}M parameters, AdamW: steps 1-{killed} in "
          f"{times['a']:.1f} s; async saves at (training blocked): {save_list(a['saves'])}")
    in_flight = a["killed"]["in_flight"]
    print(f"killed      SIGKILL to torchrun, {a['world_size']} trainers and their background "
          f"save processes right after step {killed}'s save started "
          f"({'still persisting' if in_flight else 'NOT in flight any more'})")
    check(in_flight and a["killed"]["bytes_seen"] > 0,
          f"step {killed}'s save was not writing when the kill landed")
    check(str(killed) in a["saves"], f"step {killed} was not saved")
    survivors = kill["survivors"]
    print(f"            step-{killed}: {kill['files']} file(s), {_mib(kill['bytes'])} on disk once "
          f"the job was dead ({_mib(a['killed']['bytes_seen'])} there when SIGKILL was sent), "
          f"{'metadata.json' if kill['metadata'] else 'no metadata.json: incomplete'}; "
          f"complete steps {kill['complete']}, latest {kill['latest']}; "
          + ("processes left: not checked (no /proc)" if survivors is None else
             f"processes of the job left: {len(survivors)}"))
    check(not kill["metadata"] and killed not in kill["complete"],
          f"the killed step {killed} is complete")
    check(kill["latest"] == resume, f"the latest complete step is {kill['latest']}, "
                                    f"not {resume}")
    check(not survivors, f"processes {survivors} of the killed job survived")
    if kill["resume_bytes"]:
        files, on_disk, unique = kill["resume_bytes"]
        print(f"checkpoint  step-{resume}: {files} files, {on_disk:,} bytes "
              f"({_mib(on_disk)}), disk/unique state = {on_disk / unique:.3f}")

    print(f"phase B     {b['layout']} on {b['world_size']} ranks: load_latest -> step "
          f"{b['resumed_step']} in {b['load_seconds']:.2f} s, "
          f"{times['b_start']:.1f} s after the relaunch")
    check(b["resumed_step"] == resume, f"resumed at step {b['resumed_step']}, expected {resume}")
    mismatches = b.get("tensor_mismatches", ["(no load)"])
    print(f"            {b.get('tensors_checked', 0)} model and optimizer tensors "
          + ("bit-identical to phase A's step" if not mismatches else
             f"checked, {len(mismatches)} differ from phase A's step, e.g. {mismatches[:3]}"))
    check(not mismatches, "restored tensors differ from the saved ones")
    expected_samples = resume * GLOBAL_BATCH
    rng_note = "derived (DeriveRNG), shared by the TP ranks" if b.get("rng_shared") else \
        "NOT shared by the TP ranks"
    print(f"            data-parallel degree 2 -> 1: samples seen {b.get('samples')} "
          f"(dcp.SumOf, expected {expected_samples}); RNG streams {rng_note}")
    check(b.get("samples") == expected_samples, "the sample counter was not summed")
    check(bool(b.get("rng_restored")) and bool(b.get("rng_shared")),
          "the RNG states were not set by the rule")

    outcome = b["preemption"]
    same = {tuple(o) for o in outcome} == {(True, last, True)}
    print(f"preempted   SIGTERM to rank 1 alone at step {last}: "
          + (f"every rank saved step {last} synchronously "
             f"({b['saves'].get(str(last), 0):.2f} s), mgr.preempted ended the loop" if same else
             f"(preempted, step, saved) by rank: {outcome}"))
    check(same, "the ranks did not all save the last-words step and stop")
    reload_ok = b["reloaded_step"] == last and not b["reload_mismatches"]
    print(f"            step {last} is the latest: a fresh model and optimizer loaded it in "
          f"{b['reload_seconds']:.2f} s, "
          + ("every tensor bit-identical" if reload_ok else
             f"step {b['reloaded_step']}, {len(b['reload_mismatches'])} tensors differ"))
    check(reload_ok, "the last-words step did not load back exactly")
    leftovers = (work / "run" / f"step-{killed}").exists()
    print(f"retention   complete steps at the end {b['final_steps']} (keep_latest={KEEP_LATEST})"
          + (f"; the killed step-{killed}'s files stay (newer than the newest complete step, "
             f"as a save in flight would be; the next save of step {killed} replaces them)"
             if leftovers else ""))
    check(b["final_steps"] == [resume, last], f"complete steps {b['final_steps']}, "
                                              f"expected {[resume, last]}")
    print(f"phase B     steps {resume + 1}-{last} in {times['b']:.1f} s (launch to exit)")

    print(f"\nloss, uninterrupted {a['layout']} run vs resumed {b['layout']} run "
          f"(rtol {LOSS_RTOL:g}: a different DP layout reorders float reductions)")
    print(f"{'step':>5}  {'uninterrupted':>14}  {'resumed':>14}  {'rel diff':>9}")
    compared = 0
    for step in sorted({*a["losses"], *b["losses"]}, key=int):
        loss_a, loss_b = a["losses"].get(step), b["losses"].get(step)
        if loss_a is None or loss_b is None:
            if int(step) > resume - 2 or loss_a is None:
                shown_a = f"{loss_a:14.6f}" if loss_a is not None else f"{'':>14}"
                shown_b = f"{loss_b:14.6f}" if loss_b is not None else f"{'':>14}"
                note = {resume: "  <-- resumed from here", last: "  <-- last words"}
                print(f"{step:>5}  {shown_a}  {shown_b}  {'':>9}{note.get(int(step), '')}")
            continue
        compared += 1
        rel = abs(loss_b - loss_a) / abs(loss_a)
        flag = "  <-- exceeds rtol" if rel > LOSS_RTOL else ""
        check(rel <= LOSS_RTOL, f"step {step}: loss differs by {rel:.2e}")
        print(f"{step:>5}  {loss_a:14.6f}  {loss_b:14.6f}  {rel:9.2e}{flag}")
    check(compared == interval - 1, f"{compared} losses compared, expected {interval - 1}")
    for what in failures:
        print(f"FAIL: {what}")
    print("\nPASS" if not failures else "\nFAIL")
    return not failures


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hyperdcp demo",
        description="Train a GPT under DP2 x TP2 through dcp.CheckpointManager, SIGKILL the job "
                    "during an async save, resume under TP2 from the newest complete step, "
                    "compare losses, then SIGTERM one rank for a last-words checkpoint.",
    )
    parser.add_argument("--out", type=Path, help="work directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the default temp work directory")
    parser.add_argument("--steps", type=int, default=20,
                        help="steps of the first job, whose save at the last step is killed "
                             "(default 20, a multiple of --interval)")
    parser.add_argument("--interval", type=int, default=5,
                        help="save every this many steps (default 5); the second job resumes "
                             "from step STEPS - INTERVAL and is preempted at STEPS - 1")
    parser.add_argument("--recovery", action="store_true",
                        help="run the recovery demo instead: a host lost, the job back from "
                             "host memory (hyperdcp demo --recovery --help for its options)")
    parser.add_argument("--worker", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.interval < 2 or args.steps % args.interval or args.steps < 2 * args.interval:
        parser.error("need --interval at least 2 and --steps a multiple of it, at least twice")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args.worker, args.out, args.steps, args.interval)
        return 0

    work = args.out or Path(tempfile.mkdtemp(prefix="hyperdcp-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "run", ignore_errors=True)  # a fresh root: phase A starts at step 1
    started = time.perf_counter()
    times: dict[str, float] = {}
    ok = False
    try:
        code = _launch("a", work, args.steps, args.interval)
        times["a"] = time.perf_counter() - started
        if code != -signal.SIGKILL or not (work / "phase_a.json").exists():
            print(f"FAIL: phase A exited with {code}, not killed by SIGKILL mid-save",
                  file=sys.stderr)
        else:
            kill = _after_kill(work, args.steps, args.interval)
            relaunch, relaunch_clock = time.perf_counter(), time.time()
            code = _launch("b", work, args.steps, args.interval)
            times["b"] = time.perf_counter() - relaunch
            if code:
                print(f"FAIL: phase B exited with {code}", file=sys.stderr)
            else:
                b = json.loads((work / "phase_b.json").read_text())
                times["b_start"] = b["resumed_at"] - relaunch_clock
                ok = _report(work, args.steps, args.interval, times, kill,
                             kept=args.out is not None or args.keep)
    except subprocess.TimeoutExpired as exc:
        print(f"FAIL: worker job failed: {exc}", file=sys.stderr)
    finally:
        if args.out is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.out is None:
            print(f"work directory kept at {work}")
    print(f"demo finished in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
