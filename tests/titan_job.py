"""A torchtitan training job whose checkpointer is hyperdcp's
(dcp.integrations.torchtitan), for tests/test_integrations.py.

torchtitan 0.3.0's ``Trainer`` does not run on a CPU-only machine (its device
type falls back to ``cuda``, and ``torchtitan.trainer`` imports ``triton``), so
this job builds what the trainer builds, with torchtitan's own classes: the
checkpointer from its config through ``Config.build(dataloader=,
model_parts=, optimizers=, lr_schedulers=, states=, sd_adapter=,
base_folder=)``, torchtitan's ``OptimizersContainer`` (AdamW) and
``LRSchedulersContainer`` (warmup, linear decay), a ``BaseDataLoader`` of
synthetic tokens and a train state; the model, a small token MLP, is
sharded with FSDP2 over every rank.  The loop calls the checkpointer as
``Trainer.train`` does: ``load(step=load_step)``, ``maybe_wait_for_staging()``
before ``optimizers.step()``, ``save(step, last_step=...)``, ``close()``.

A step takes ``GLOBAL_BATCH`` samples whatever the world size (gradient
accumulation makes up the rest), sample ``i`` the same tokens everywhere,
so runs at different world sizes train on the same data.

``python tests/titan_job.py RANK WORLD PORT ROOT OUT STEPS [--kill-at K]
[--async-mode M]``: rank 0 writes one JSON line per step to ``OUT``
(``{"step", "loss"}``, the loss as hex, exact) after a first
``{"resumed": step}``, and the full state (every tensor gathered) after
the steps in ``DUMP_STEPS`` to ``OUT.dump-<step>.pt``; with ``--kill-at
K``, rank 0 kills the whole job (trainers and background savers) with
SIGKILL right after step K's ``save`` call.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from dcp.integrations.torchtitan import CheckpointManager

VOCAB, WIDTH, SEQ = 64, 32, 8
GLOBAL_BATCH, MICRO_BATCH = 4, 2
#: the schedule's length (the LR schedule depends on it, whatever STEPS a job runs)
TRAINING_STEPS = 10
DUMP_STEPS = (2, 4)


class TokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(2 * WIDTH, WIDTH)) for _ in range(2))
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``[batch, seq]`` int64 -> logits ``[batch * seq, VOCAB]``."""
        h = self.embed(tokens.flatten())
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class TokenLoader(BaseDataLoader):
    """Batches of ``MICRO_BATCH`` synthetic sequences; this rank's ``j``-th
    batch is global micro-batch ``j * dp_world_size + dp_rank``.  Its state,
    the global micro-batches consumed, is the same on every rank and
    survives a change of the data-parallel degree."""

    def __init__(self, dp_rank: int, dp_world_size: int) -> None:
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.consumed = 0  # global micro-batches before this rank's next one

    def __iter__(self):
        while True:
            first = (self.consumed + self.dp_rank) * MICRO_BATCH
            tokens = torch.stack([torch.randint(0, VOCAB, (SEQ + 1,),
                                                generator=torch.Generator().manual_seed(i))
                                  for i in range(first, first + MICRO_BATCH)])
            self.consumed += self.dp_world_size
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = state_dict["consumed"]


class TrainState:
    """``Trainer``'s own Stateful part: the step and the tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


class Job:
    """The pieces torchtitan's trainer would build, on this rank of the
    default process group."""

    def __init__(self, folder: str, config: Any = CheckpointManager.Config,
                 sd_adapter: Any = None, **checkpoint: Any) -> None:
        """``config``: the checkpointer's config class (torchtitan's own, or
        hyperdcp's), built with ``folder``, ``interval=2`` and ``checkpoint``."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        self.model = TokenModel()
        mesh = init_device_mesh("cpu", (self.world,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1,
        ).build(optimizers=self.optimizers, training_steps=TRAINING_STEPS)
        self.loader = TokenLoader(self.rank, self.world)
        self.train_state = TrainState()
        self.config = config(**{"enable": True, "folder": folder, "interval": 2, **checkpoint})
        self.checkpointer = self.config.build(
            dataloader=self.loader, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state},
            sd_adapter=sd_adapter, base_folder="")

    def resume(self) -> int:
        """The checkpointer's load, as ``Trainer.train`` starts; the step loaded
        (0: a fresh start)."""
        self.checkpointer.load(step=self.config.load_step)
        return self.train_state.step

    def train(self, steps: int, log=None, kill_at: int | None = None,
              dump: str | None = None) -> list[float]:
        """``Trainer.train``'s loop from the current step to ``steps``; the
        losses of the steps run (``dump``: the full state after each of
        ``DUMP_STEPS`` to ``<dump>.dump-<step>.pt``)."""
        accumulation = GLOBAL_BATCH // (MICRO_BATCH * self.world)
        batches = iter(self.loader)
        losses = []
        while self.train_state.step < steps:
            self.train_state.step += 1
            step = self.train_state.step
            self.optimizers.zero_grad()
            total = torch.zeros(())
            for _ in range(accumulation):
                inputs, labels = next(batches)
                logits = self.model(inputs["input"])
                loss = F.cross_entropy(logits, labels.flatten()) / accumulation
                loss.backward()
                total += loss.detach()
                self.train_state.ntokens_seen += labels.numel()
            dist.all_reduce(total)
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            losses.append(float(total) / self.world)
            if log is not None:
                log({"step": step, "loss": losses[-1].hex()})
            self.checkpointer.save(step, last_step=step == steps)
            if dump is not None and step in DUMP_STEPS:
                state = self.full_state()
                if self.rank == 0:
                    torch.save(state, f"{dump}.dump-{step}.pt")
            if step == kill_at and self.rank == 0:
                if log is not None:
                    log({"killed": step})
                os.killpg(os.getpgrp(), signal.SIGKILL)
        return losses

    def full_state(self) -> dict[str, Any]:
        """A copy of every value of the training state, DTensors gathered
        (collective)."""
        def full(value):
            return value.full_tensor() if isinstance(value, DTensor) else copy.deepcopy(value)

        return {"model": {k: full(v) for k, v in self.model.state_dict().items()},
                "optimizer": {k: full(v) for k, v in self.optimizers.state_dict().items()},
                "lr_scheduler": self.lr_schedulers.state_dict(),
                "dataloader": self.loader.state_dict(),
                "train_state": self.train_state.state_dict()}


# ------------------------------------------------- a job in processes of its own
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(world: int, root: str, out: str, steps: int, *extra: str) -> list[subprocess.Popen]:
    """The ranks of a job of this module, in one process group (the first rank's)."""
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), env.get("PYTHONPATH", "")])
    procs: list[subprocess.Popen] = []
    for rank in range(world):
        procs.append(subprocess.Popen(
            [sys.executable, __file__, str(rank), str(world), str(port), root, out, str(steps),
             *extra], env=env, process_group=0 if not procs else procs[0].pid))
    return procs


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port"):
        p.add_argument(name, type=int)
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--async-mode", default="disabled")
    a = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    with open(a.out, "a", buffering=1) as out:
        def log(record: dict) -> None:
            if a.rank == 0:
                out.write(json.dumps(record) + "\n")

        job = Job(a.root, async_mode=a.async_mode)
        log({"resumed": job.resume()})
        job.train(a.steps, log=log, kill_at=a.kill_at, dump=a.out)
        job.checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
