"""A small training job run through dcp.CheckpointManager, launched by
tests/test_manager.py as separate processes (one per rank) so that it can be
killed with SIGKILL mid-save; :func:`run` is the same job in a process group
that exists already (the test resumes it in its gloo group).

``python tests/manager_job.py RANK WORLD PORT ROOT OUT STEPS [--kill-at K]
[--kill-trainers-at K] [--store] [--options JSON]``: trains steps
``1..STEPS`` (after resuming from the newest complete step), saving every 2
steps asynchronously; each step draws from Python's, NumPy's and torch's
generators and advances a per-rank loader position.  Rank ``r`` writes one
JSON line per step to ``OUT.r``: the step, the loss, the draws and the
loader position (floats as hex, exact), and, after resuming, a digest of
its whole state.  With ``--kill-at K``, rank 0 kills the whole job (process
group: trainers and their background save processes) with SIGKILL right
after step K's save started (with 64 MiB of ballast), while it is in flight
(a last line says it was).  With ``--kill-trainers-at K`` every trainer
kills only itself with SIGKILL once step K's save (sent once the background
process is up) has returned and that process has started writing (a last
line gives the digest of the state saved and that process's pid): the
background processes live on and commit step K.  ``--store``: the
rendezvous store is at PORT, served by the launcher (as torchrun's agent
serves it), so it outlives the trainers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dcp  # noqa: E402
from dcp.asynchronous.async_save import _savers  # noqa: E402  # the background process's pid


class AppState:
    """The model and its optimizer as one Stateful, through torch's
    get_state_dict / set_state_dict (which fill in an optimizer's state
    before its first step, so a fresh job has targets to load into)."""

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


#: float32 elements (64 MiB, half written by each of 2 ranks) added to the
#: state of the step whose save is killed: the small model alone saves in a
#: few milliseconds, which a loaded machine can let pass between ``save``
#: returning and the kill.
BALLAST_ELEMENTS = 16 << 20


def digest(model, optim, loader: dict) -> str:
    """A SHA-256 of every model and optimizer tensor's bytes, the loader
    position and every generator's state: equal exactly when a resume
    restored all of it."""
    h = hashlib.sha256()
    for t in [*model.state_dict().values(),
              *(v for s in optim.state_dict()["state"].values() for v in s.values())]:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr((loader, random.getstate(), np.random.get_state()[1].tolist())).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def _wait_writing(root: str, step: int, rank: int, options: dict | None) -> None:
    """Until this rank's background process has written a data file of
    ``step``: the save is past every rank's meeting, in the background's hands."""
    from dcp.core.storage import open_storage

    storage = open_storage(f"{root.rstrip('/')}/step-{step}", **(options or {}))
    while not any(n.startswith(f"r{rank:05d}-") for n in storage.list_files()):
        time.sleep(0.002)


def run(rank: int, world: int, root: str, out: str, steps: int, kill_at: int | None = None,
        options: dict | None = None, kill_trainers_at: int | None = None,
        async_save: bool = True) -> None:
    """The job on this rank of the default process group (module doc);
    ``async_save=False`` saves synchronously (no background process to start)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = {"pos": 0}
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)
    mgr = dcp.CheckpointManager(root, interval=2, keep_latest=2, storage_options=options,
                                timeout=120, async_save=async_save)
    state = {"app": AppState(model, optim), "loader": dcp.PerRank(loader)}
    start = mgr.load_latest(state) or 0
    with open(f"{out}.{rank}", "a") as log:
        log.write(json.dumps({"resumed": start, "digest": digest(model, optim, loader)}) + "\n")
        for step in range(start + 1, steps + 1):
            x = torch.randn(4, 8)  # this rank's stream: the data
            noise = random.random() + float(np.random.rand())
            loss = (model(x).square().mean() + noise * 0)
            optim.zero_grad()
            loss.backward()
            for prm in model.parameters():  # the data-parallel all-reduce
                dist.all_reduce(prm.grad)
                prm.grad /= world
            mgr.wait_for_staging()
            optim.step()
            loader["pos"] += rank + 1
            log.write(json.dumps({"step": step, "loss": float(loss.detach()).hex(),
                                  "noise": noise.hex(), "pos": loader["pos"]}) + "\n")
            log.flush()
            if step == kill_at:  # a checkpoint of some size, still persisting at the kill
                mgr.save(step, {**state, "ballast": torch.zeros(BALLAST_ELEMENTS)})
            elif step == kill_trainers_at:  # the trainer dies while these are written
                # by the background process: a save before it is up runs in the trainer
                next(iter(_savers.values())).worker.wait_started(120)
                mgr.save(step, {**state, "ballast": torch.zeros(BALLAST_ELEMENTS // 16)})
            else:
                mgr.save(step, state)
            if step == kill_trainers_at:
                saved = digest(model, optim, loader)  # what the save captured: nothing moved
                _wait_writing(root, step, rank, options)
                log.write(json.dumps({"killed": step, "digest": saved, "worker": next(
                    iter(_savers.values())).worker.process.pid}) + "\n")
                log.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == kill_at and rank == 0:
                log.write(json.dumps({"killed": step, "in_flight": mgr.in_flight == step}) + "\n")
                log.flush()
                os.killpg(os.getpgrp(), signal.SIGKILL)
    mgr.close()


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port"):
        p.add_argument(name, type=int)
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-trainers-at", type=int)
    p.add_argument("--store", action="store_true", help="the launcher serves the store at PORT")
    p.add_argument("--options", type=json.loads, help="storage_options as JSON")
    a = p.parse_args()
    if a.store:
        store = dist.TCPStore("127.0.0.1", a.port, a.world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    run(a.rank, a.world, a.root, a.out, a.steps, a.kill_at, a.options, a.kill_trainers_at)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
