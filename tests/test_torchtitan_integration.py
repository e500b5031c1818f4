"""dcp.integrations.torchtitan with the real torchtitan 0.3.0 on CPU gloo ranks
(tests/titan_job.py builds what torchtitan's trainer builds, and calls the
checkpointer as the trainer does): a 2-rank job SIGKILLed and resumed at 2
ranks (phase 3) and at 1 (phase 4), state exact and losses matching; a
checkpoint of torchtitan's own checkpointer converted and resumed; each
config field's meaning; a folder on S3."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import uuid
from pathlib import Path

import pytest

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed (pip install 'hyperdcp[integrations]')",
                allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dcp  # noqa: E402
import s3_server  # noqa: E402
from dist_harness import dist_scenario  # noqa: E402
from helpers import assert_same_state, from_rank0, wait_for  # noqa: E402

FIRST = "titan-first"  # the killed job's log, and its dumps beside it
SECOND = "titan-second.json"  # the 2-rank resume's losses, for the 1-rank one


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _dump(ctx, step: int) -> dict:
    return torch.load(ctx.shared / f"{FIRST}.dump-{step}.pt", weights_only=True)


@dist_scenario(world_size=2, phase=3, chain="trainers")
def test_torchtitan_job_killed_then_resumed_exactly_w2(ctx):
    """A 2-rank job (async_with_pinned_mem, a save every 2 steps) SIGKILLed,
    trainers and background savers, after step 5: resumed here on 2 ranks
    from its newest complete step (4, or 2 if 4's save was still in flight),
    every tensor and value of the state exact, and the losses of the steps
    the killed job ran again bit-identical; it saves on (step 6)."""
    import titan_job

    root, out = ctx.shared / "titan", ctx.shared / FIRST
    if ctx.rank == 0:
        procs = titan_job.start(2, str(root), str(out), 8, "--kill-at", "5",
                                "--async-mode", "async_with_pinned_mem")
        codes = [p.wait(timeout=300) for p in procs]
        shutil.copytree(root, ctx.shared / "titan-w1")  # the 1-rank resume's, untouched here
        (ctx.dir / "codes").write_text(json.dumps(codes))
    assert json.loads(wait_for(ctx.dir / "codes")) == [-signal.SIGKILL] * 2
    first = _records(out)
    assert first[-1] == {"killed": 5}
    losses_first = {r["step"]: r["loss"] for r in first if "step" in r}

    job = titan_job.Job(str(root))
    step = job.resume()
    assert step in (2, 4) and job.checkpointer.manager.steps()[-1] == step
    assert_same_state(job.full_state(), _dump(ctx, step))
    losses = job.train(7)
    job.checkpointer.close()
    for s, loss in zip(range(step + 1, 8), losses, strict=True):
        if s in losses_first:
            assert loss.hex() == losses_first[s], s
    assert job.checkpointer.manager.steps()[-1] == 6
    if ctx.rank == 0:
        (ctx.shared / SECOND).write_text(json.dumps(
            {"from": step, "losses": dict(zip(range(step + 1, 8), losses, strict=True))}))


@dist_scenario(world_size=1, phase=4, chain="trainers")
def test_torchtitan_resumes_at_another_world_size_w1(ctx):
    """The killed 2-rank job's folder (copied before any resume) resumed on
    one rank: the same step, the state exact (the FSDP shards of both ranks
    in one), and the losses of the 2-rank resume within float rounding
    (gradient accumulation in place of the second rank)."""
    import titan_job

    second = json.loads((ctx.shared / SECOND).read_text())
    job = titan_job.Job(str(ctx.shared / "titan-w1"))
    step = job.resume()
    assert step == second["from"]
    assert_same_state(job.full_state(), _dump(ctx, step))
    losses = job.train(7)
    job.checkpointer.close()
    expected = [second["losses"][str(s)] for s in range(step + 1, 8)]
    assert losses == pytest.approx(expected, rel=1e-5)


@dist_scenario(world_size=2, phase=3, chain="trainers")
def test_torchtitan_own_checkpoint_loads_after_conversion_w2(ctx):
    """Steps written by torchtitan's own CheckpointManager (PyTorch DCP): a
    folder holding only them is refused, naming the conversion; converted
    (dcp.interop.torch_dcp_io, shared over both ranks) and given as
    initial_load_path with initial_load_model_only=False, the whole state
    loads exactly and training goes on with the same loss."""
    from torchtitan.components.checkpoint import CheckpointManager as TitanManager

    import titan_job
    from dcp.interop.torch_dcp_io import torch_dcp_to_checkpoint

    native = ctx.dir / "native"
    job = titan_job.Job(str(native), config=TitanManager.Config, last_save_model_only=False)
    job.resume()
    job.train(2)  # step 2 saved by torchtitan
    expected = job.full_state()
    loss3 = job.train(3)
    job.checkpointer.close()

    mine = titan_job.Job(str(native))
    with pytest.raises(dcp.CheckpointError, match=r"step\(s\) \[2, 3\] saved by torchtitan's own"):
        mine.resume()
    wrong = titan_job.Job(str(ctx.dir / "a"), initial_load_path=str(native / "step-2"),
                          initial_load_model_only=False)
    with pytest.raises(dcp.CheckpointError, match="is a PyTorch DCP checkpoint"):
        wrong.resume()

    imported = ctx.dir / "imported"
    torch_dcp_to_checkpoint(str(native / "step-2"), str(imported), trusted=True,
                            process_group=dist.group.WORLD)
    job = titan_job.Job(str(ctx.dir / "ours"), initial_load_path=str(imported),
                        initial_load_model_only=False)
    assert job.resume() == 2
    assert_same_state(job.full_state(), expected)
    assert job.train(3) == loss3
    job.checkpointer.close()


class _HfNames:
    """A state dict adapter as torchtitan's models have (to_hf / from_hf):
    Hugging Face names are ours under ``model.``."""

    hf_assets_path = None

    def to_hf(self, state: dict) -> dict:
        return {f"model.{k}": v for k, v in state.items()}

    def from_hf(self, hf: dict) -> dict:
        return {k.removeprefix("model."): v for k, v in hf.items()}


def _model(job) -> dict:
    return job.full_state()["model"]


@dist_scenario(world_size=2, phase=3, chain="trainers")
def test_torchtitan_fields_keep_their_meaning_w2(ctx):
    """Synchronous saves, every field: enable_first_step_checkpoint, interval,
    keep_latest_k with keep_every_n_steps (retention), last_save_model_only
    with export_dtype (bfloat16, model only), exclude_from_loading, load_step
    (a complete older step only with load_only, which never saves),
    last_save_in_hf / initial_load_in_hf through a state dict adapter, and
    the refused fields and values, each named."""
    import titan_job

    folder = str(ctx.dir / "run")
    job = titan_job.Job(folder, enable_first_step_checkpoint=True, keep_latest_k=2,
                        keep_every_n_steps=2, export_dtype="bfloat16")
    job.resume()
    job.train(7, dump=str(ctx.dir / "run"))
    final = _model(job)
    job.checkpointer.close()
    assert job.checkpointer.manager.steps() == [2, 4, 6]  # 1 deleted; 2 kept as a multiple of 2
    export = dcp.read_metadata(f"{folder}/export-7")
    assert sorted(export.tensors) == sorted(final) and not export.objects
    assert {m.dtype for m in export.tensors.values()} == {"bfloat16"}
    exported = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in final.items()}
    dcp.load(exported, f"{folder}/export-7", process_group=dist.group.WORLD)
    assert_same_state(exported, {k: v.to(torch.bfloat16) for k, v in final.items()})

    job = titan_job.Job(folder, exclude_from_loading=["dataloader"])
    assert job.resume() == 6 and job.loader.consumed == 0
    job = titan_job.Job(folder, load_step=4)
    with pytest.raises(dcp.CheckpointError, match=r"load_step=4: step 6 .* is newer"):
        job.resume()
    job = titan_job.Job(folder, load_step=3, load_only=True)
    with pytest.raises(dcp.CheckpointError, match=r"load_step=3: .* no complete step 3"):
        job.resume()
    job = titan_job.Job(folder, load_step=4, load_only=True)
    assert job.resume() == 4
    assert_same_state(job.full_state(), torch.load(ctx.dir / "run.dump-4.pt", weights_only=True))
    assert job.checkpointer.save(6) is False and job.checkpointer.manager.steps() == [2, 4, 6]

    hf = str(ctx.dir / "hf")
    job = titan_job.Job(hf, sd_adapter=_HfNames(), last_save_in_hf=True, export_dtype="bfloat16")
    job.resume()
    job.train(1)
    trained = _model(job)
    job.checkpointer.close()
    job = titan_job.Job(str(ctx.dir / "from-hf"), sd_adapter=_HfNames(), initial_load_in_hf=True,
                        initial_load_path=f"{hf}/export-1")
    assert job.resume() == 0
    assert_same_state(_model(job), {k: v.to(torch.bfloat16).float() for k, v in trained.items()})

    with pytest.raises(dcp.CheckpointError, match="initial_load_in_hf_quantized"):
        titan_job.Job(folder, initial_load_in_hf=True, initial_load_in_hf_quantized=True,
                      initial_load_path=hf)
    with pytest.raises(dcp.CheckpointError, match="async_mode='threads'"):
        titan_job.Job(folder, async_mode="threads")
    with pytest.raises(dcp.CheckpointError, match="last_save_in_hf: the model has no state dict"):
        titan_job.Job(folder, last_save_in_hf=True)
    with pytest.raises(dcp.CheckpointError, match=r"exclude_from_loading: \['rng'\]"):
        titan_job.Job(folder, exclude_from_loading=["rng"])


@dist_scenario(world_size=2, phase=3, chain="trainers")
def test_torchtitan_folder_on_s3_w2(ctx):
    """checkpoint.folder an s3:// URI with storage_options (moto): a step
    saved there resumes exactly."""
    import titan_job

    endpoint = from_rank0(s3_server.endpoint)
    folder = f"s3://{s3_server.BUCKET}/titan-{from_rank0(lambda: uuid.uuid4().hex[:8])}"
    options = s3_server.options(endpoint)
    job = titan_job.Job(folder, storage_options=options)
    job.resume()
    job.train(3, dump=str(ctx.dir / "s3"))
    job.checkpointer.close()
    job = titan_job.Job(folder, storage_options=options)
    assert job.resume() == 2
    assert_same_state(job.full_state(), torch.load(ctx.dir / "s3.dump-2.pt", weights_only=True))


@dist_scenario(world_size=1, phase=4, chain="trainers")
def test_torchtitan_seed_checkpoint_and_model_only_initial_load_w1(ctx):
    """create_seed_checkpoint (torchtitan's train.py calls save(0,
    last_step=True) on one rank): step 0 holds the model only; a run there
    resumes from it model-only (the step and the optimizer stay fresh); and
    initial_load_path (initial_load_model_only, the default) loads the model
    from it into another folder."""
    import titan_job

    folder = str(ctx.dir / "seed")
    job = titan_job.Job(folder, create_seed_checkpoint=True)
    with torch.no_grad():
        for p in job.model.parameters():
            p.mul_(2)
    seed = _model(job)
    assert job.checkpointer.save(curr_step=0, last_step=True)
    job.checkpointer.close()
    assert not [f for f in dcp.read_metadata(f"{folder}/step-0").fqns() if f.startswith("optim")]

    for job in (titan_job.Job(folder),
                titan_job.Job(str(ctx.dir / "fresh"), initial_load_path=f"{folder}/step-0")):
        assert job.resume() == 0
        state = job.full_state()
        assert_same_state(state["model"], seed)
        moments = [v for k, v in state["optimizer"].items() if k.endswith("exp_avg")]
        assert moments and not any(v.any() for v in moments)  # no step taken
        job.train(1)
        job.checkpointer.close()


@dist_scenario(world_size=1, phase=4, chain="trainers")
def test_torchtitan_memory_tier_resumes_from_the_newest_tier_w1(ctx):
    """The memory tier from the config's memory_* fields (a memory step every
    step, a persistent one every 3): after 5 steps (the last exported) host
    memory holds step 4 and the folder step 3; the resume restores step 4
    from host memory, its state exact and step 5's loss bit-identical.
    load_step=3 is refused while memory step 4 is newer (load_only loads
    it); create_seed_checkpoint with the memory tier is refused; and over a
    seed checkpoint (step 0, persistent) a run with the memory tier starts
    from the seed, then resumes from its newest memory step, exactly."""
    import titan_job

    folder = str(ctx.dir / "memory-run")
    memory = {"memory_interval": 1, "memory_host": "h0",
              "memory_namespace": str(ctx.dir / "shm"), "interval": 3}
    job = titan_job.Job(folder, **memory)
    assert job.resume() == 0
    losses = job.train(5, dump=str(ctx.dir / "memory-run"))
    job.checkpointer.close()
    manager = job.checkpointer.manager
    assert manager.persistent_steps() == [3] and manager.memory_steps() == [4]

    with pytest.raises(dcp.CheckpointError, match=r"load_step=3: memory step 4 .* is newer"):
        titan_job.Job(folder, load_step=3, **memory).resume()
    job = titan_job.Job(folder, load_step=3, load_only=True, **memory)
    assert job.resume() == 3
    job.checkpointer.close()
    job = titan_job.Job(folder, **memory)
    assert job.resume() == 4
    report = job.checkpointer.manager.last_restore
    assert report is not None and report.step == 4 and report.bytes_own_host > 0
    assert report.bytes_persistent == 0
    assert_same_state(job.full_state(),
                      torch.load(ctx.dir / "memory-run.dump-4.pt", weights_only=True))
    assert job.train(6)[0].hex() == losses[-1].hex()  # step 5 again
    job.checkpointer.close()

    with pytest.raises(dcp.CheckpointError,
                       match=r"create_seed_checkpoint with checkpoint\.memory_interval=1"):
        titan_job.Job(str(ctx.dir / "seeded"), create_seed_checkpoint=True, **memory)

    # a seed checkpoint (persistent step 0, the model only) and newer memory steps
    seeded = str(ctx.dir / "seeded")
    job = titan_job.Job(seeded, create_seed_checkpoint=True)
    assert job.checkpointer.save(curr_step=0, last_step=True)
    job.checkpointer.close()
    memory.update(interval=10, memory_namespace=str(ctx.dir / "shm-seeded"))
    job = titan_job.Job(seeded, **memory)
    assert job.resume() == 0  # the seed, model only: no memory step yet
    job.train(3, dump=seeded)
    job.checkpointer.close()
    assert job.checkpointer.manager.steps() == [0, 2]
    job = titan_job.Job(seeded, **memory)
    assert job.resume() == 2
    assert_same_state(job.full_state(), torch.load(f"{seeded}.dump-2.pt", weights_only=True))
    job.checkpointer.close()
