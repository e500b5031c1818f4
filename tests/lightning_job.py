"""A Lightning 2.6 job on the ranks of the default (gloo) process group, for
tests/test_lightning_integration.py: a small MLP sharded with FSDP2 in
``configure_model``, AdamW with a StepLR schedule, ``ModelCheckpoint``
every 2 steps, and a callback that captures the whole training state (full
tensors) when training starts, after any restore, and when it ends."""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from dcp.integrations.lightning import ModelParallelStrategy


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                         torch.nn.Linear(32, 1))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g),
                                        torch.randn(64, 1, generator=g)), batch_size=4)


def full_state(trainer: L.Trainer, module: Net) -> dict[str, Any]:
    """A copy of the training state, every tensor whole (collective)."""
    options = StateDictOptions(full_state_dict=True)
    optimizer = trainer.optimizers[0]
    return copy.deepcopy({
        "model": get_model_state_dict(module, options=options),
        "optimizer": get_optimizer_state_dict(module, optimizer, options=options),
        "lr_scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": trainer.global_step})


class Capture(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.start = full_state(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = full_state(trainer, pl_module)


def fit(root: str, max_steps: int, *, ckpt_path: str | None = None, dirpath: str | None = None,
        strategy: type = ModelParallelStrategy,
        **strategy_options: Any) -> tuple[L.Trainer, Capture]:
    """``Trainer.fit`` on every rank of the default group (``LOCAL_RANK`` set,
    so Lightning launches nothing); ``dirpath``: ``ModelCheckpoint``'s
    (``None``: no checkpoint callback)."""
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    world = dist.get_world_size()
    capture = Capture()
    callbacks: list[Callback] = [capture]
    if dirpath is not None:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=2))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=max_steps, default_root_dir=root,
        strategy=strategy(data_parallel_size=world, tensor_parallel_size=1, **strategy_options),
        callbacks=callbacks, enable_checkpointing=dirpath is not None, logger=False,
        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), ckpt_path=ckpt_path)
    return trainer, capture
