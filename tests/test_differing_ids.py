"""Ranks that pass different checkpoint ids (issue 32, point 1): a per-rank
part of the path (``f"{base}/run-{rank}"``) used to commit, on every rank,
metadata naming files in the other ranks' folders.  Now ``dcp.save`` (plan
exchanged or cached), ``dcp.async_save`` (gloo and file coordination) and
``dcp.load`` fail on every rank, naming the ids and their ranks, and nothing
is committed; ids that name one folder in different spellings still agree.

Real gloo ranks in the shared W=2 group of dist_harness (phase 0, where the
async-save workers already run); every load checked element-exact.
"""

from __future__ import annotations

import os

import pytest
import torch

import dcp
from dcp.asynchronous.async_save import _saver_for
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, randn

WAIT = 120  # seconds: bound on every result() of a healthy save


def _state(ctx, seed: int, tag: str) -> dict:
    """Rank ``r`` holds rows ``[4r, 4r + 4)`` of ``w``; ``b`` is replicated."""
    full = randn((8, 16), seed)
    return {f"{tag}.w": dcp.TensorShard(full[4 * ctx.rank:4 * ctx.rank + 4].clone(), (8, 16),
                                        (4 * ctx.rank, 0)),
            f"{tag}.b": randn((5,), seed + 1), f"{tag}.step": seed}


def _target(ctx, tag: str) -> dict:
    return {f"{tag}.w": dcp.TensorShard(torch.zeros(4, 16), (8, 16), (4 * ctx.rank, 0)),
            f"{tag}.b": torch.zeros(5), f"{tag}.step": 0}


def _assert_loaded(target: dict, saved: dict) -> None:
    for k, v in saved.items():
        if isinstance(v, dcp.TensorShard):
            assert_bitwise_equal(target[k].data, v.data, k)
        elif isinstance(v, torch.Tensor):
            assert_bitwise_equal(target[k], v, k)
        else:
            assert target[k] == v, (k, target[k], v)


def _assert_names_both(message: str, ctx, ids: list) -> None:
    assert "different checkpoint ids" in message, message
    for rank, where in enumerate(ids):
        assert f"{str(where)!r} (rank {rank})" in message, (where, message)


@dist_scenario(world_size=2, phase=0, last=True)
def test_different_ids_fail_save_and_load_on_every_rank_w2(ctx):
    """Sync save with the plans exchanged, then with them cached (each rank
    wrote into its own folder before the coordinator compared: deleted), a
    load where rank 1's path differs; one folder spelt three ways saves and
    loads."""
    tag = "ids_sync"
    own = [ctx.dir / f"run-{r}" for r in range(ctx.world_size)]
    sd = _state(ctx, 1, tag)
    with pytest.raises(dcp.CheckpointError) as e:
        dcp.save(sd, str(own[ctx.rank]))
    _assert_names_both(str(e.value), ctx, own)

    # the same structure saved before: every rank hits its cached plan and writes first
    shared = ctx.dir / "shared"
    dcp.save(sd, str(shared))
    cached = [ctx.dir / f"cached-{r}" for r in range(ctx.world_size)]
    with pytest.raises(dcp.CheckpointError) as e:
        dcp.save(sd, str(cached[ctx.rank]))
    _assert_names_both(str(e.value), ctx, cached)
    ctx.barrier()
    for folder in own + cached:
        assert not folder.exists(), f"{folder} left after the refused save: " \
            f"{sorted(p.name for p in folder.iterdir())}"

    # load: rank 1 names another folder; nothing is read, the target untouched
    target = _target(ctx, tag)
    paths = [shared, ctx.dir / "elsewhere"]
    with pytest.raises(dcp.CheckpointError) as e:
        dcp.load(target, str(paths[ctx.rank]))
    assert not isinstance(e.value, dcp.CorruptCheckpointError), str(e.value)
    _assert_names_both(str(e.value), ctx, paths)
    assert not target[f"{tag}.w"].data.any() and not target[f"{tag}.b"].any()
    dcp.load(target, str(shared))
    _assert_loaded(target, sd)

    # one folder, three spellings: a trailing slash, a file:// URI, a relative path
    spelt = [f"{ctx.dir / 'spelt'}/", f"file://{ctx.dir / 'spelt'}"][ctx.rank]
    sd2 = _state(ctx, 2, tag)
    dcp.save(sd2, spelt)
    target = _target(ctx, tag)
    dcp.load(target, [f"file://{ctx.dir}/./spelt/", os.path.relpath(ctx.dir / "spelt")][ctx.rank])
    _assert_loaded(target, sd2)


@dist_scenario(world_size=2, phase=0, last=True)
def test_different_ids_fail_async_saves_w2(ctx):
    """gloo: result() raises on every rank, naming the ids; file: the ranks
    never meet, so both fail by the timeout, whose message names this
    cause; none: nothing compares, and each folder is refused as
    incomplete.  Nothing is committed, and the next save works."""
    tag = "ids_async"
    sd = _state(ctx, 3, tag)
    gloo = [ctx.dir / f"gloo-{r}" for r in range(ctx.world_size)]
    response = dcp.async_save(sd, str(gloo[ctx.rank]))
    with pytest.raises(dcp.CheckpointError) as e:
        response.result(WAIT)
    _assert_names_both(str(e.value), ctx, gloo)

    files = [ctx.dir / f"file-{r}" for r in range(ctx.world_size)]
    # the worker up first (the gloo save ran in the trainer): timeout=1 bounds the meeting
    _saver_for(None).ensure_worker().wait_started(WAIT)
    response = dcp.async_save(sd, str(files[ctx.rank]), coordination="file", timeout=1)
    with pytest.raises(dcp.CheckpointError, match="passed different checkpoint ids"):
        response.result(WAIT)

    none = [ctx.dir / f"none-{r}" for r in range(ctx.world_size)]
    dcp.async_save(sd, str(none[ctx.rank]), coordination="none").result(WAIT)
    ctx.barrier()
    for folder in gloo:
        assert not folder.exists(), f"{folder} left after the refused save"
    for folder in files:  # its exchange files go after the outcome: the folder may still be there
        assert not (folder / "metadata.json").exists(), f"{folder} committed"
    with pytest.raises(dcp.NotACheckpointError, match="never committed"):
        dcp.read_metadata(str(none[ctx.rank]))

    dcp.async_save(sd, str(ctx.dir / "next")).result(WAIT)

    target = _target(ctx, tag)
    dcp.load(target, str(ctx.dir / "next"))
    _assert_loaded(target, sd)
