"""Lightning's sharded checkpoints through hyperdcp.

Lightning 2.6's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism)
saves a sharded checkpoint by calling PyTorch DCP itself: in
``save_checkpoint`` the model's and optimizers' sharded state dicts go to
``torch.distributed.checkpoint.save`` and the rest of the checkpoint
(epoch, loops, callbacks, LR schedulers, hyperparameters) to a ``meta.pt``
that rank 0 writes with ``torch.save``; ``load_checkpoint`` reverses both
(``lightning/fabric/strategies/model_parallel.py``).  The
:class:`ModelParallelStrategy` here is that strategy with both methods on
:func:`dcp.save` / :func:`dcp.load`, so a job switches by the class it
passes to ``Trainer(strategy=...)``:

    from dcp.integrations.lightning import ModelParallelStrategy
    # was: from lightning.pytorch.strategies import ModelParallelStrategy

A checkpoint path is any storage URI (``s3://bucket/run/last.ckpt``: a
folder of hyperdcp files, whatever its suffix) with ``storage_options``
for its plugin.  It holds the same three parts: ``state_dict`` (the
model's DTensors), ``optimizer_<i>`` (each optimizer's, from torch's
``get_optimizer_state_dict``) and ``lightning``, the rest as the bytes of
rank 0's ``torch.save``, read back with ``torch.load(weights_only=True)``
(Lightning's default for ``meta.pt``; classes it does not know go through
``torch.serialization.add_safe_globals``).  A load at another world size or
layout reshards as :func:`dcp.load` does.  Saving to a path replaces the
checkpoint there (``ModelCheckpoint``'s ``last.ckpt``), which stays
loadable until the new one commits; ``remove_checkpoint`` deletes the
commit point (``metadata.json``) before the files.

``save_distributed_checkpoint=False`` (one full file, written by rank 0)
stays Lightning's own.  A checkpoint that is not hyperdcp's loads through
Lightning's code: a single ``.ckpt`` file (``torch.load`` with the
``weights_only`` given); a PyTorch DCP folder only with
``load_torch_dcp=True``, since its metadata is a pickle torch runs.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import dcp
from dcp.core.metadata import METADATA_FILE
from dcp.interop.torch_dcp_io import TORCH_METADATA_FILE

#: The entry holding the rest of Lightning's checkpoint (rank 0's torch.save bytes).
TRAINER_KEY = "lightning"


class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose sharded checkpoints are
    hyperdcp's (module doc).

    Args:
        storage_options: options of the storage plugin a checkpoint path's
            scheme picks (S3's ``endpoint_url``, ``key``, ``secret``, ...).
        load_torch_dcp: load PyTorch DCP checkpoints (Lightning's own
            sharded format) through Lightning's loader, which unpickles
            their metadata: only for checkpoints you trust.
        *args, **kwargs: Lightning's (``data_parallel_size``,
            ``tensor_parallel_size``, ``save_distributed_checkpoint``, ...).

    Raises:
        dcp.CheckpointError: a failed save or load (on every rank), a
            PyTorch DCP folder without ``load_torch_dcp``, a load with
            ``weights_only=False``, or trainer state ``torch.load`` refuses.
    """

    def __init__(self, *args: Any, storage_options: dict | None = None,
                 load_torch_dcp: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage_options = dict(storage_options or {})
        self.load_torch_dcp = load_torch_dcp

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` (Lightning's dict) to ``filepath`` with
        :func:`dcp.save`, replacing what is there; collective.
        ``storage_options``: this save's plugin options, over the
        strategy's."""
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        path = str(self.broadcast(str(filepath)))
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optimizer_state
        if self.global_rank == 0:  # as Lightning's meta.pt: rank 0's, whatever the others hold
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            state[TRAINER_KEY] = buffer.getvalue()
        dcp.save(state, path, overwrite=True,
                 storage_options={**self.storage_options, **(storage_options or {})})

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model and optimizers in place from a hyperdcp checkpoint
        (resharded to this job's layout) and return the rest of Lightning's
        checkpoint; collective."""
        path = str(self.broadcast(str(checkpoint_path)))
        if weights_only is False:
            raise dcp.CheckpointError(
                f"{path!r}: weights_only=False would let torch.load run code from the "
                f"checkpoint; hyperdcp reads Lightning's trainer state with weights_only=True "
                f"(allow its classes with torch.serialization.add_safe_globals)")
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        for i, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optimizer)
        state[TRAINER_KEY] = b""
        try:
            dcp.load(state, path, strict=strict, storage_options=self.storage_options)
        except dcp.NotACheckpointError:
            return self._load_foreign(path, weights_only)
        self.model.load_state_dict(state["state_dict"], strict=strict)
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer,
                                     optim_state_dict=state[f"optimizer_{i}"],
                                     options=StateDictOptions(cpu_offload=True))
        try:
            return torch.load(io.BytesIO(state[TRAINER_KEY]), weights_only=True)
        except pickle.UnpicklingError as e:
            raise dcp.CheckpointError(
                f"{path!r}: Lightning's trainer state holds a value torch.load(weights_only=True) "
                f"refuses; allow its class with torch.serialization.add_safe_globals: {e}") from e

    def _load_foreign(self, path: str, weights_only: bool | None) -> dict[str, Any]:
        """A checkpoint that is not hyperdcp's, through Lightning's loader."""
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, TORCH_METADATA_FILE)) \
                and not self.load_torch_dcp:
            raise dcp.CheckpointError(
                f"{path!r} is a PyTorch DCP checkpoint (Lightning's own sharded format), whose "
                f"metadata is a pickle that loading runs: pass "
                f"ModelParallelStrategy(load_torch_dcp=True) only if you trust it; it then "
                f"loads through Lightning, and the next save is hyperdcp's")
        return super().load_checkpoint(path, weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint: its commit point first (a half-deleted
        checkpoint is never loadable), then its files (rank 0)."""
        if self.is_global_zero:
            fs = get_filesystem(str(filepath))
            head = os.path.join(str(filepath), METADATA_FILE)
            if fs.isdir(str(filepath)) and fs.exists(head):
                fs.rm(head)
        super().remove_checkpoint(filepath)
