"""dcp.integrations.lightning with the real Lightning 2.6 on CPU gloo ranks
(tests/lightning_job.py): ``Trainer.fit`` with ``ModelCheckpoint``, resumed
with ``ckpt_path="last"`` on 2 ranks (phase 3) and on 1 (phase 4), and from
S3, the whole training state exact; Lightning's own (PyTorch DCP)
checkpoints refused unless trusted, then loaded."""

from __future__ import annotations

import importlib.util
import os
import uuid

import pytest

if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed (pip install 'hyperdcp[integrations]')",
                allow_module_level=True)

import torch  # noqa: E402

import dcp  # noqa: E402
import s3_server  # noqa: E402
from dist_harness import dist_scenario  # noqa: E402
from helpers import assert_same_state, from_rank0  # noqa: E402

RESUMED = "lightning-resumed.pt"  # the state at the end of the 2-rank resume


@dist_scenario(world_size=2, phase=3, chain="trainers")
def test_lightning_fit_then_resume_last_and_from_s3_exactly_w2(ctx):
    """fit to step 4 with ModelCheckpoint (every 2 steps, save_last): step 2's
    checkpoint removed once step 4's is saved, last.ckpt a hyperdcp
    checkpoint; fit(ckpt_path="last") starts from the state the first fit
    ended with, exactly (model, optimizer, LR schedule, step); the same from
    a checkpoint saved to S3 with the strategy's storage_options."""
    import lightning_job

    ckpts = ctx.shared / "lightning"
    trainer, first = lightning_job.fit(str(ctx.dir), 4, dirpath=str(ckpts))
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    md = dcp.read_metadata(str(ckpts / "last.ckpt"))
    assert "lightning" in md.objects and "state_dict.model.0.weight" in md.tensors
    assert first.end["global_step"] == 4

    options = s3_server.options(from_rank0(s3_server.endpoint))
    s3 = f"s3://{s3_server.BUCKET}/lightning-{from_rank0(lambda: uuid.uuid4().hex[:8])}/4.ckpt"
    trainer.strategy.storage_options = options
    trainer.save_checkpoint(s3)

    _, resumed = lightning_job.fit(str(ctx.dir), 6, ckpt_path="last", dirpath=str(ckpts))
    assert_same_state(resumed.start, first.end)
    assert resumed.end["global_step"] == 6
    _, from_s3 = lightning_job.fit(str(ctx.dir), 5, ckpt_path=s3, storage_options=options)
    assert_same_state(from_s3.start, first.end)
    if ctx.rank == 0:
        torch.save(resumed.end, ctx.shared / RESUMED)


@dist_scenario(world_size=1, phase=4, chain="trainers")
def test_lightning_resumes_last_at_another_world_size_w1(ctx):
    """The 2-rank run's last.ckpt (step 6) resumed by fit(ckpt_path="last")
    on one rank: the state exact, both ranks' shards in one."""
    import lightning_job

    _, resumed = lightning_job.fit(str(ctx.dir), 8, ckpt_path="last",
                                   dirpath=str(ctx.shared / "lightning"))
    assert_same_state(resumed.start, torch.load(ctx.shared / RESUMED, weights_only=True))
    assert resumed.end["global_step"] == 8


@dist_scenario(world_size=2, phase=3, chain="trainers")
def test_lightning_own_checkpoint_needs_trust_w2(ctx):
    """A checkpoint of Lightning's own ModelParallelStrategy (PyTorch DCP and
    meta.pt) is refused, naming load_torch_dcp; with it, it loads exactly."""
    import lightning.pytorch.strategies

    import lightning_job

    trainer, first = lightning_job.fit(str(ctx.dir), 2,
                                       strategy=lightning.pytorch.strategies.ModelParallelStrategy)
    old = str(ctx.dir / "old.ckpt")
    trainer.save_checkpoint(old)
    with pytest.raises(dcp.CheckpointError, match="load_torch_dcp=True"):
        lightning_job.fit(str(ctx.dir), 3, ckpt_path=old)
    _, resumed = lightning_job.fit(str(ctx.dir), 3, ckpt_path=old, load_torch_dcp=True)
    assert_same_state(resumed.start, first.end)
