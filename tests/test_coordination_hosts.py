"""The gloo path's two-level gather (one leader per host) with real gloo
ranks: 2 simulated hosts x 2 ranks, saves through the plan cache that load
bit-exact, a cached save whose write results carry only what the
coordinator's plans lack, the bytes that reach the coordinator, and a
failure on the other host's non-leader named on every rank."""

from __future__ import annotations

import torch

import dcp
from dcp.coordination import wire
from dcp.coordination.collectives import Coordinator
from dcp.coordination.plan_cache import PlanCache
from dcp.core.planner import default_planner
from dcp.orchestration.save import _Save, describe_state
from dist_harness import dist_scenario
from helpers import RecordingKinds, assert_bitwise_equal, random_tensor
from storage_plugins.posix import PosixStorage


class _Recording(RecordingKinds, Coordinator):
    """Coordinator keeping the kinds of the write results it gathered."""


def _coordinator() -> _Recording:
    import torch.distributed as dist

    coord = _Recording(host=f"host-{dist.get_rank() // 2}", two_level_from=2)
    coord.kinds = []
    return coord


@dist_scenario(world_size=4)
def test_two_level_gather_through_host_leaders_saves_bit_exact(ctx):
    rows, cols = 4 * 6 + 3, 5
    full = random_tensor((rows, cols), torch.float32, seed=7)
    bias = random_tensor((9,), torch.bfloat16, seed=8)  # replicated: held by all, written once
    step = -(-rows // 4)
    offset, length = min(ctx.rank * step, rows), max(0, min(step, rows - ctx.rank * step))
    cache = PlanCache()
    ckpt = str(ctx.dir / "ckpt")

    def save(scale: float, coord: _Recording):
        state = {"w": dcp.TensorShard(full[offset:offset + length] * scale, (rows, cols),
                                      (offset, 0)), "bias": bias * scale, "step": 3}
        job = _Save(lambda: describe_state(state, False, ctx.rank, 4),
                    PosixStorage(ckpt, thread_count=2), default_planner("save"), coord, True)
        return cache.save(job)

    first_coord = _coordinator()
    assert first_coord.hosts is not None and first_coord.hosts.hosts == [[0, 1], [2, 3]]
    first = save(1.0, first_coord)
    second_coord = _coordinator()
    second = save(2.0, second_coord)
    assert first.exchanged and not second.exchanged
    if ctx.rank == 0:
        # the cached save's one gather brought results relative to the cached plans
        assert second_coord.kinds == [{"CachedWriteResult"}], second_coord.kinds
        assert first_coord.kinds[0] == {"ColumnarSavePlan"}, first_coord.kinds
        miss, hit = first_coord.stats["gathered_bytes"], second_coord.stats["gathered_bytes"]
        assert 0 < hit < miss, (hit, miss)
    else:
        assert first_coord.stats["gathered_bytes"] == 0
    ctx.barrier()
    target = {"w": torch.zeros(rows, cols), "bias": torch.zeros(9, dtype=torch.bfloat16),
              "step": 0}
    dcp.load(target, ckpt)
    assert_bitwise_equal(target["w"], full * 2.0, "w")
    assert_bitwise_equal(target["bias"], bias * 2.0, "bias")
    assert target["step"] == 3

    failing = _coordinator()

    def local():
        if ctx.rank == 3:
            raise OSError("disk on fire on host 1")
        return ctx.rank

    try:
        failing.run_all("writing", local)
    except dcp.CheckpointError as e:
        assert "writing failed on rank 3" in str(e) and "disk on fire" in str(e), str(e)
    else:
        raise AssertionError("no failure")
    # every rank got every part, in rank order, through the leaders
    values = _coordinator().gather_broadcast("sum", lambda: wire.encode(ctx.rank * 10),
                                             lambda parts: [wire.decode(p, "p") for p in parts])
    assert values == [0, 10, 20, 30]


@dist_scenario(world_size=4)
def test_two_level_gather_with_a_host_of_one_rank_makes_no_groups(ctx):
    """Hosts of unequal sizes (rank 0 alone, ranks 1-3 together): the
    two-level gather once made a group of each host and one of the leaders
    with torch's locally synchronised ``new_group``, whose name counts the
    groups the calling process holds, so rank 1 (which had made its host's
    group first) and rank 0 (which had none to make) waited for each other
    under different names until the job's timeout.  Its levels now run
    point to point: no group is made, on any rank; a second coordinator
    over another group of the same ranks finds its own layout, and a host
    name that changed on one rank does not make that rank gather alone."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1, 2, 3], backend="gloo") for _ in range(2)]  # fresh layouts
    held = len(dist.distributed_c10d._world.pg_names)
    host = "alone" if ctx.rank == 0 else "shared"
    coord = Coordinator(groups[0], host=host, two_level_from=2)
    assert coord.hosts is not None and coord.hosts.hosts == [[0], [1, 2, 3]], coord.hosts
    got = coord.gather_broadcast("gather", lambda: f"part of {ctx.rank}", list)
    assert got == [f"part of {r}" for r in range(4)], got
    again = Coordinator(groups[0], host=f"renamed-{ctx.rank}", two_level_from=2)  # once a group
    assert again.hosts == coord.hosts
    assert again.gather_broadcast("again", lambda: ctx.rank * 10, sum) == 60
    assert len(dist.distributed_c10d._world.pg_names) == held  # nothing made
    third = Coordinator(groups[1], host=host, two_level_from=2)
    assert third.hosts is not None and third.hosts.hosts == [[0], [1, 2, 3]]
    assert third.gather_broadcast("third", lambda: [ctx.rank], list) == [[0], [1], [2], [3]]
    # a locally synchronised group made afterwards is named alike on its members
    pair = dist.new_group([0, 1], backend="gloo", use_local_synchronization=True)
    if ctx.rank in (0, 1):
        box = [ctx.rank]
        dist.broadcast_object_list(box, group=pair, group_src=1)
        assert box == [1]
    for group in groups:
        dist.destroy_process_group(group)
    if ctx.rank in (0, 1):
        dist.destroy_process_group(pair)
