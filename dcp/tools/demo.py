"""End-to-end demo: checkpoint a real training job and resume it under a different layout.

``hyperdcp demo`` (or ``python -m dcp demo``) runs two torchrun jobs on CPU/gloo:

* Phase A, 4 ranks, 2-D mesh DP2 x TP2: a ~11.6M-parameter GPT-style language model is
  tensor-parallelised over "tp" (``parallelize_module`` with Colwise/RowwiseParallel) and
  then sharded over "dp" with FSDP2 (``fully_shard``), so parameters and AdamW state are
  DTensors with ``_StridedShard`` placements. It trains on synthetic Markov-chain tokens,
  saves model + optimizer state with ``dcp.async_save`` every ``SAVE_EVERY`` steps and
  after ``--save-step`` steps (training goes on while each save persists in a background
  process) and keeps training to ``--steps``: this is the uninterrupted reference run.
* Phase B, 2 ranks, TP2 only: it builds the same model, fills a freshly built state dict
  with ``dcp.load`` and resumes training with the same global batches.

It proves that a checkpoint written under one parallel layout restores under another:
right after loading, every model parameter and optimizer state tensor is bit-identical
to what phase A saved, and the resumed losses match the uninterrupted run within
``LOSS_RTOL``. Losses are not expected to be bit-exact: phase A averages the gradients of
two half batches across DP ranks while phase B computes the full-batch gradient on each
rank, so floating-point sums happen in a different order. The measured differences are
about 1e-7 relative (at most 4.4e-7 over 55 resumed steps); rtol 1e-4 leaves a wide margin
for longer runs and other CPUs. The loss comparison catches gross restore errors (a tensor
or the optimizer state not restored, a wrong step); subtler corruption, such as a 1% error
in one Adam moment, can stay within rtol and is what the bit-exact tensor comparison is for.

It also prints checkpoint bytes on disk against the unique state bytes, bytes written per
rank, and save and load times. The exit code is 0 only if every check passes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
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
SAVE_EVERY = 5  # phase A saves a checkpoint (async) every this many steps
MARKOV_FANOUT = 8  # each token has this many possible successors

LOSS_RTOL = 1e-4
WORKER_TIMEOUT_S = 600

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


def _train_state(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "step": step,
    }


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


def _worker(phase: str, work: Path, steps: int, save_step: int) -> None:
    torch.set_num_threads(1)
    _quiet_torch()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _, shape, names, layout = LAYOUTS[phase]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_group = mesh.get_group("dp") if "dp" in names else None
    dp_rank, dp_size = (mesh["dp"].get_local_rank(), mesh["dp"].size()) if dp_group else (0, 1)

    model = build_model(mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    checkpoint = work / "checkpoint"
    result: dict[str, Any] = {"layout": layout, "world_size": dist.get_world_size(), "losses": {}}
    if rank == 0:
        n_params = sum(p.numel() for p in GPT().parameters())
        print(f"[phase {phase.upper()}] {layout} on {dist.get_world_size()} ranks, "
              f"{n_params / 1e6:.1f}M parameters", flush=True)

    first_step, pending = 1, None
    if phase == "b":
        state = _train_state(model, optim, 0)
        report, result["load_seconds"] = _timed(lambda: dcp.load(state, str(checkpoint)))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        first_step = state["step"] + 1
        result["resumed_step"] = state["step"]
        result["missing_keys"] = list(report.missing_keys)
        result["unexpected_keys"] = list(report.unexpected_keys)
        loaded = _full_tensors(_train_state(model, optim, 0))
        if rank == 0:
            saved = torch.load(work / "saved_tensors.pt", weights_only=True)
            result["tensors_checked"] = len(saved)
            result["tensor_mismatches"] = sorted(
                fqn for fqn in saved.keys() | loaded.keys()
                if fqn not in saved or fqn not in loaded or not torch.equal(saved[fqn], loaded[fqn])
            )

    for step in range(first_step, steps + 1):
        tokens = global_batch(step).chunk(dp_size)[dp_rank]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss /= dp_size
        result["losses"][step] = loss.item()
        if rank == 0:
            print(f"[phase {phase.upper()}] step {step:3d}  loss {loss.item():.6f}", flush=True)
        if phase == "a" and (step % SAVE_EVERY == 0 or step == save_step):
            if pending is not None:
                pending.result()  # one save in flight; surfaces its errors
            state = _train_state(model, optim, step)
            target = checkpoint if step == save_step else work / "periodic" / f"step{step}"
            pending, stall = _timed(
                lambda: dcp.async_save(state, str(target), overwrite=True))  # noqa: B023 (run now)
            if step == save_step:
                result["save_seconds"] = stall
                saved = _full_tensors(state)
                if rank == 0:
                    torch.save(saved, work / "saved_tensors.pt")
            if rank == 0:
                print(f"[phase A] async_save at step {step}: training blocked {stall:.3f} s, "
                      f"persisting in the background", flush=True)

    if pending is not None:
        pending.result()
    if rank == 0:
        (work / f"phase_{phase}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def _launch(phase: str, work: Path, steps: int, save_step: int) -> None:
    nproc = LAYOUTS[phase][0]
    # --standalone makes torchrun's rendezvous bind a free local port itself.
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "dcp.tools.demo", "--worker", phase, "--out", str(work),
        "--steps", str(steps), "--save-step", str(save_step),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    job = subprocess.Popen(cmd, env=env)
    try:
        returncode = job.wait(timeout=WORKER_TIMEOUT_S)
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
    if returncode:
        raise subprocess.CalledProcessError(returncode, cmd)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _report(work: Path, save_step: int, kept: bool = True) -> bool:
    """Print sizes, timings and the loss comparison; return whether every check
    passed.  ``kept``: whether ``work`` outlives the demo (else the report says
    that the checkpoint is removed instead of naming a path about to vanish)."""
    a = json.loads((work / "phase_a.json").read_text())
    b = json.loads((work / "phase_b.json").read_text())
    checkpoint = work / "checkpoint"
    meta = dcp.read_metadata(str(checkpoint))
    on_disk = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    unique = sum(math.prod(t.shape) * getattr(torch, t.dtype).itemsize
                 for t in meta.tensors.values())
    per_rank: dict[int, int] = {}
    for t in meta.tensors.values():
        for chunk in t.chunks:
            per_rank[chunk.rank] = per_rank.get(chunk.rank, 0) + chunk.nbytes

    print("\n=== hyperdcp demo report ===")
    print(f"checkpoint        {checkpoint}" if kept else
          "checkpoint        removed with the temporary work directory at exit "
          "(--keep or --out DIR keeps it)")
    print(f"  tensors/objects {len(meta.tensors)} / {len(meta.objects)}, "
          f"saved by world size {meta.world_size}")
    print(f"  bytes on disk   {on_disk:,} ({_mib(on_disk)})")
    print(f"  unique state    {unique:,} ({_mib(unique)}), disk/unique = {on_disk / unique:.3f}")
    for r in sorted(per_rank):
        print(f"  written by rank {r}: {per_rank[r]:,} ({_mib(per_rank[r])})")
    print(f"save (async)      {a['save_seconds']:.3f} s training blocked  "
          f"({a['world_size']} ranks, {a['layout']}; a checkpoint every {SAVE_EVERY} steps)")
    print(f"load              {b['load_seconds']:.3f} s  ({b['world_size']} ranks, {b['layout']})")

    ok = True
    if b["resumed_step"] != save_step:
        print(f"FAIL: resumed at step {b['resumed_step']}, expected {save_step}")
        ok = False
    if b["missing_keys"] or b["unexpected_keys"]:
        print(f"FAIL: missing keys {b['missing_keys']}, unexpected keys {b['unexpected_keys']}")
        ok = False
    if b["tensor_mismatches"]:
        print(f"FAIL: {len(b['tensor_mismatches'])} tensors differ from the saved values "
              f"after load, e.g. {b['tensor_mismatches'][:5]}")
        ok = False
    else:
        print(f"after load        all {b['tensors_checked']} model and optimizer tensors "
              "bit-identical to the saved values")

    print(f"\nloss, uninterrupted {a['layout']} run vs resumed {b['layout']} run "
          f"(rtol {LOSS_RTOL:g}: different DP layout reorders float reductions)")
    print(f"{'step':>5}  {'uninterrupted':>14}  {'resumed':>14}  {'rel diff':>9}")
    for step, loss_a in a["losses"].items():
        loss_b = b["losses"].get(step)
        if loss_b is None:
            note = "  <-- checkpoint saved" if int(step) == save_step else ""
            print(f"{step:>5}  {loss_a:14.6f}  {'':>14}  {'':>9}{note}")
            continue
        rel = abs(loss_b - loss_a) / abs(loss_a)
        flag = "" if rel <= LOSS_RTOL else "  <-- exceeds rtol"
        ok &= rel <= LOSS_RTOL
        print(f"{step:>5}  {loss_a:14.6f}  {loss_b:14.6f}  {rel:9.2e}{flag}")
    print("\nPASS" if ok else "\nFAIL")
    return ok


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hyperdcp demo",
        description="Train a GPT under DP2 x TP2, checkpoint it, resume under TP2 "
                    "and compare losses.",
    )
    parser.add_argument("--out", type=Path, help="work directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the default temp work directory")
    parser.add_argument("--steps", type=int, default=20, help="total training steps (default 20)")
    parser.add_argument("--save-step", type=int, default=10,
                        help=f"the step whose checkpoint the second job resumes from (default "
                             f"10; the first job also saves every {SAVE_EVERY} steps)")
    parser.add_argument("--worker", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.save_step < args.steps:
        parser.error("need 0 < --save-step < --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args.worker, args.out, args.steps, args.save_step)
        return 0

    work = args.out or Path(tempfile.mkdtemp(prefix="hyperdcp-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        for phase in ("a", "b"):
            _launch(phase, work, args.steps, args.save_step)
        ok = _report(work, args.save_step, kept=args.out is not None or args.keep)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"FAIL: worker job failed: {exc}", file=sys.stderr)
        ok = False
    finally:
        if args.out is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.out is None:
            print(f"work directory kept at {work}")
    print(f"demo finished in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
