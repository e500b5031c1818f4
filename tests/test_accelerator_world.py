"""An NCCL- or HCCL-like job, on CPU: 4 gloo ranks whose default group is
made again on a backend registered for an accelerator device type only
(``helpers.accelerator_world``), so that no collective of the world's can
carry a host tensor, as in a job that calls ``init_process_group("nccl")``.

Every collective hyperdcp issues must then run on gloo groups it makes
itself: a load's broadcasts (replica groups of part of the world, and of a
subgroup the load runs on), conversions shared over the world, and managers
on two subgroups side by side.  Values are checked element-exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dcp
from dcp.coordination.collectives import coordination_group
from dcp.interop.safetensors_io import checkpoint_to_safetensors, safetensors_to_checkpoint
from dist_harness import dist_scenario
from helpers import ACCELERATOR_ONLY, accelerator_world, assert_bitwise_equal, random_tensor
from planners.load import DefaultLoadPlanner

ROWS = 32


def _full():
    return {"a": random_tensor((16, 8), torch.float32, seed=81),
            "b": random_tensor((ROWS, 4), torch.bfloat16, seed=82)}


def _barrier():
    dist.barrier(group=coordination_group())


def _half(full: torch.Tensor, upper: bool) -> dcp.TensorShard:
    """A target for rows [0, ROWS/2) or [ROWS/2, ROWS) of ``full``."""
    start = ROWS // 2 if upper else 0
    return dcp.TensorShard(torch.zeros_like(full[start:start + ROWS // 2]), full.shape,
                           (start, 0))


@dist_scenario(world_size=4)
def test_an_accelerator_only_world_loads_through_broadcasts_on_parts_of_it(ctx):
    with accelerator_world(ctx):
        assert dist.get_backend() == ACCELERATOR_ONLY
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.broadcast(torch.ones(3), src=0)
        full = _full()
        ckpt = str(ctx.dir / "ckpt")
        dcp.save(full, ckpt)
        # ranks {0, 2} need the upper rows of "b", {1, 3} the lower: replica
        # groups of two ranks on two hosts, and the whole world for "a"
        host = f"h{ctx.rank // 2}"
        for path in ("broadcast", "shared_memory"):
            target = {"a": torch.zeros_like(full["a"]), "b": _half(full["b"], ctx.rank % 2 == 0)}
            report = dcp.load(target, ckpt, host=host,
                              planner=DefaultLoadPlanner(replica_path=path))
            assert_bitwise_equal(target["a"], full["a"], f"a via {path}")
            start = target["b"].global_offsets[0]
            assert_bitwise_equal(target["b"].data, full["b"][start:start + ROWS // 2],
                                 f"b via {path}")
            assert ((0, 2), "broadcast") in {(ranks, way) for ranks, way, _ in report.paths}
        # a load on a subgroup of ranks 0-2 (rank 3 takes no part), whose
        # replica group {0, 1} is part of it
        sub = dist.new_group([0, 1, 2])
        if ctx.rank < 3:
            target = {"a": torch.zeros_like(full["a"]), "b": _half(full["b"], ctx.rank == 2)}
            report = dcp.load(target, ckpt, process_group=sub,
                              planner=DefaultLoadPlanner(replica_path="broadcast"))
            assert_bitwise_equal(target["a"], full["a"], "a on the subgroup")
            start = target["b"].global_offsets[0]
            assert_bitwise_equal(target["b"].data, full["b"][start:start + ROWS // 2],
                                 "b on the subgroup")
            assert ((0, 1), "broadcast") in {(ranks, way) for ranks, way, _ in report.paths}
        _barrier()


@dist_scenario(world_size=4)
def test_an_accelerator_only_world_shares_conversions(ctx):
    with accelerator_world(ctx):
        full = _full()
        ckpt = str(ctx.dir / "ckpt")
        dcp.save(full, ckpt)
        folder = str(ctx.dir / "hf")
        checkpoint_to_safetensors(ckpt, folder, process_group=dist.group.WORLD)
        back = str(ctx.dir / "back")
        safetensors_to_checkpoint(folder, back, process_group=dist.group.WORLD)
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        dcp.load(target, back)
        for k, v in full.items():
            assert_bitwise_equal(target[k], v, k)
        _barrier()


@dist_scenario(world_size=4)
def test_an_accelerator_only_world_runs_a_manager_on_each_of_two_subgroups(ctx):
    with accelerator_world(ctx):
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = pairs[ctx.rank // 2]
        root = ctx.dir / f"run-{ctx.rank // 2}"
        state = {"w": random_tensor((8, 8), torch.float32, seed=90 + ctx.rank // 2),
                 "step": ctx.rank // 2}
        with dcp.CheckpointManager(root, process_group=mine, async_save=False) as mgr:
            assert mgr.save(5, state, force=True)
        target = {"w": torch.zeros(8, 8), "step": -1}
        with dcp.CheckpointManager(root, process_group=mine, async_save=False) as mgr:
            assert mgr.load_latest(target) == 5
        assert_bitwise_equal(target["w"], state["w"], "w")
        assert target["step"] == ctx.rank // 2
        _barrier()
