"""Read once per replica group, pass to the rest (4 gloo ranks).

All ranks share this host and POSIX storage shares its page cache, so the
default planner takes the page cache path (one rank pulls a region, the
others read it from the cache); ``replica_path="shared_memory"`` passes it
through host shared memory and ``"broadcast"`` by ``torch.distributed``
broadcasts: every path runs in every scenario.
Each scenario checks values element-exact and the bytes each rank read from
storage (``LoadReport.bytes_read``), summed over ranks with an all-gather.
"""

from __future__ import annotations

import glob

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _world
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dcp
from dcp.coordination import host_exchange
from dcp.core.planner import LoadPlan, ReadItem
from dist_harness import dist_scenario
from planners.load import DefaultLoadPlanner
from storage_plugins.posix import PosixStorage

TRANSPORTS = [DefaultLoadPlanner(), DefaultLoadPlanner(replica_path="shared_memory"),
              DefaultLoadPlanner(replica_path="broadcast")]


def _exchange_files():
    """Files of the shared-memory fan-out left in /dev/shm (none may stay)."""
    return glob.glob(f"{host_exchange.SHM_ROOT}/hyperdcp-" + "[0-9a-f]" * 32 + "-*")


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _replicated_state(n=16, shape=(64, 256)):
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(shape, generator=g) for i in range(n)}


@dist_scenario(world_size=4)
def test_replicated_state_is_read_once_and_balanced(ctx):
    full = _replicated_state()
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(full, ckpt)
    groups_before = len(_world.pg_map)
    for planner in TRANSPORTS:
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        # 256 KiB in flight: every rank waits for its receivers over and over
        report = dcp.load(target, ckpt, planner=planner, max_inflight_bytes=256 << 10)
        for k, v in full.items():
            assert torch.equal(target[k], v), (k, planner.replica_path)
        assert len(_world.pg_map) == groups_before, "groups created for the load were not destroyed"
        read = _gather(report.bytes_read)
        assert abs(sum(read) - md.stored_bytes) <= 0.01 * md.stored_bytes, (read, md.stored_bytes)
        assert all(r == md.stored_bytes // 4 for r in read), read  # 16 equal tensors: 4 each
        ctx.barrier()
        assert _exchange_files() == []

    # broadcast off: every rank reads everything itself, same values
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    report = dcp.load(target, ckpt, planner=DefaultLoadPlanner(replica_path="none"))
    for k, v in full.items():
        assert torch.equal(target[k], v), k
    assert _gather(report.bytes_read) == [md.stored_bytes] * 4


@dist_scenario(world_size=4)
def test_dp2_tp2_reads_each_tp_shard_once(ctx):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(3)
    full = {"a": torch.randn(64, 48, generator=g),
            "b": torch.randn(30, 7, generator=g).to(torch.bfloat16),
            "c": torch.randint(0, 100, (9,), generator=g)}
    placements = {"a": [Replicate(), Shard(0)], "b": [Replicate(), Shard(1)],
                  "c": [Replicate(), Replicate()]}
    sd = {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(sd, ckpt)
    for planner in TRANSPORTS:
        target = {k: distribute_tensor(torch.zeros_like(v), mesh, placements[k])
                  for k, v in full.items()}
        report = dcp.load(target, ckpt, planner=planner)
        for k, v in full.items():
            assert torch.equal(target[k].full_tensor(), v), (k, planner.replica_path)
        assert sum(_gather(report.bytes_read)) == md.stored_bytes


@dist_scenario(world_size=4)
def test_broadcast_composes_with_resharding(ctx):
    """Saved Shard(0) over 4 ranks; loaded Shard(1) over TP with DP2
    replicas: every intersection is read by one DP replica only."""
    g = torch.Generator().manual_seed(5)
    full = {"x": torch.randn(40, 64, generator=g), "y": torch.randn(6, 10, generator=g).double(),
            "s": torch.tensor(1.25)}
    mesh1 = init_device_mesh("cpu", (4,))
    sd = {"x": distribute_tensor(full["x"], mesh1, [Shard(0)]),
          "y": distribute_tensor(full["y"], mesh1, [Shard(0)]), "s": full["s"].clone()}
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(sd, ckpt)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for planner in [*TRANSPORTS, DefaultLoadPlanner(replica_path="none")]:
        broadcast = planner.replica_path != "none"
        target = {"x": distribute_tensor(torch.zeros(40, 64), mesh2, [Replicate(), Shard(1)]),
                  "y": distribute_tensor(torch.zeros(6, 10, dtype=torch.float64), mesh2,
                                         [Replicate(), Shard(1)]),
                  "s": torch.tensor(0.0)}
        # no coalescing (zero latency): bytes read are exactly the regions'
        report = dcp.load(target, ckpt, planner=planner,
                          storage_options={"read_cost": {"latency_s": 0}})
        for k in ("x", "y"):
            assert torch.equal(target[k].full_tensor(), full[k]), (k, broadcast)
        assert torch.equal(target["s"], full["s"])
        total = sum(_gather(report.bytes_read))
        expected = md.stored_bytes if broadcast else 2 * (md.stored_bytes - 4) + 4 * 4
        assert total == expected, (broadcast, total, expected)


class _FailingReads(PosixStorage):
    """POSIX storage whose reads fail on one rank."""

    def __init__(self, path, fail_rank):
        super().__init__(path)
        self.fail = dist.get_rank() == fail_rank

    def read_requests(self, name, requests):
        if self.fail:
            raise OSError(5, "injected EIO", name)
        super().read_requests(name, requests)


@dist_scenario(world_size=4, last=True)
def test_read_error_on_a_reading_rank_raises_on_all(ctx):
    full = _replicated_state(n=8, shape=(16, 16))
    ckpt = str(ctx.dir / "ckpt")
    dcp.save(full, ckpt)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    for planner in TRANSPORTS:
        with pytest.raises(dcp.CheckpointError, match=r"failed on rank 2.*injected EIO"):
            dcp.load(target, ckpt, storage=_FailingReads(ckpt, fail_rank=2), planner=planner)
        ctx.barrier()
        assert _exchange_files() == []
    # the group is still usable: a clean load works afterwards
    dcp.load(target, ckpt)
    for k, v in full.items():
        assert torch.equal(target[k], v), k


def _plan(host, items):
    return LoadPlan(items=list(items), host=host, shared_memory=bool(host))


def test_transport_follows_hosts():
    """Same-host replica groups go through shared memory, groups spanning
    hosts (or ranks without /dev/shm) through broadcasts, which alone need
    process groups."""
    a = ReadItem("w", 0, 0, (0,), (4,), 16)
    b = ReadItem("w", 0, 1, (4,), (4,), 16)
    planner = DefaultLoadPlanner(replica_path="shared_memory")
    # ranks 0,1 on host h1, ranks 2,3 on h2; chunk a needed by 0,1; b by all
    final = planner.create_global_plan([_plan("h1", [a, b]), _plan("h1", [a, b]),
                                        _plan("h2", [b]), _plan("h2", [b])])
    kinds = {(t.ranks, t.shared_memory) for p in final for t in p.transfers}
    # a: read by rank 0, to rank 1 through shared memory; b (balanced onto
    # rank 1): to rank 0 through shared memory, to ranks 2 and 3 by broadcast
    assert kinds == {((0, 1), True), ((1, 2, 3), False)}
    assert all(p.groups == [(1, 2, 3)] for p in final)
    final = planner.create_global_plan([_plan("", [a]), _plan("", [a])])
    assert [t.shared_memory for p in final for t in p.transfers] == [False, False]
    final = DefaultLoadPlanner(replica_path="broadcast").create_global_plan(
        [_plan("h1", [a]), _plan("h1", [a])])
    assert [t.shared_memory for p in final for t in p.transfers] == [False, False]
    assert final[0].groups == [(0, 1)]
