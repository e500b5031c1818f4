"""Loading at another world size: a checkpoint saved by a W=2 group loads in
the W=4 group (2 -> 4), and one saved by the W=4 group loads in a later W=2
group (4 -> 2).  The checkpoints live in ``ctx.shared``, which persists
between the session's groups; groups run in phase order 0 (W=2) -> 1 (W=4)
-> 2 (W=2).

Uneven and empty shards on purpose: dim 6 over 4 ranks is 2,2,2,0; dim 5 over
4 ranks is 2,2,1,0; dim 5 over 2 ranks is 3,2.  (The "dim 512 over 30 ranks"
case is not run: it needs a 30-rank group, far beyond the CI budget; the
same arithmetic is covered by the cases here, and every rank also loads the
boxes that Shard(0) of dim 512 over 30 ranks would hold (18 rows each, then
8, then an empty one) as ``dcp.TensorShard`` targets.)"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import dcp
from dist_harness import dist_scenario
from helpers import (
    assert_bitwise_equal,
    assert_dtensor_equals_full,
    make_dtensor,
    random_tensor,
    zeros_dtensor,
)

# fqn -> (global shape, dtype, seed)
TENSORS = {
    "rows6": ((6, 4), torch.float32, 1),
    "rows5": ((5, 3), torch.bfloat16, 2),
    "cols6": ((4, 6), torch.int32, 3),
    "cols5": ((3, 5), torch.float64, 4),
    "odd": ((7, 5), torch.float16, 5),
    "vec": ((9,), torch.float32, 6),
    "scalar": ((), torch.float32, 7),
    "dim512": ((512, 3), torch.float32, 8),
}
# how each fqn is laid out when SAVED, per world size ("S0,S1" = 2-D (2, 2) mesh)
SAVE_LAYOUT = {
    2: {"rows6": "S0", "rows5": "S0", "cols6": "S1", "cols5": "S1", "odd": "S0", "vec": "R",
        "scalar": "R", "dim512": "S0"},
    4: {"rows6": "S0", "rows5": "S0", "cols6": "S1", "cols5": "S1", "odd": "S0,S1", "vec": "S0",
        "scalar": "R", "dim512": "S0"},
}
# how each fqn is laid out when LOADED: several layouts tried one after another
LOAD_LAYOUTS = {
    2: [
        {"rows6": "S0", "rows5": "S1", "cols6": "S0", "cols5": "S1", "odd": "S1", "vec": "S0",
         "scalar": "R", "dim512": "S1"},
        {f: "R" for f in TENSORS},
    ],
    4: [
        {"rows6": "S0", "rows5": "S0", "cols6": "S1", "cols5": "S0", "odd": "S0", "vec": "S0",
         "scalar": "R", "dim512": "S1"},
        {"rows6": "S1", "rows5": "S1", "cols6": "S0", "cols5": "S1", "odd": "S0,S1", "vec": "R",
         "scalar": "R", "dim512": "R"},
        {"rows6": "S0,S1", "rows5": "R,S0", "cols6": "S1,S0", "cols5": "S0,R", "odd": "S1,S1",
         "vec": "S0,S0", "scalar": "R,R", "dim512": "S0,S0"},
    ],
}
# TensorShard row partitions of a (10, 3) tensor, per world size
SHARD_ROWS = {2: [(0, 7), (7, 10)], 4: [(0, 1), (1, 5), (5, 5), (5, 10)]}  # rank 2 of W=4: empty


def _full(fqn):
    shape, dtype, seed = TENSORS[fqn]
    return random_tensor(shape, dtype, seed=seed)


def _megatron_full():
    return random_tensor((10, 3), torch.float32, seed=99)


def _meshes(world_size):
    meshes = {1: init_device_mesh("cpu", (world_size,))}
    if world_size == 4:
        meshes[2] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return meshes


def _mesh_for(meshes, layout):
    return meshes[len(layout.split(","))]


def _save(ctx, name):
    ws = ctx.world_size
    meshes = _meshes(ws)
    sd = {"model": {}, "meta": {"saved_by": ws, "names": sorted(TENSORS)}}
    for fqn, layout in SAVE_LAYOUT[ws].items():
        sd["model"][fqn] = make_dtensor(_full(fqn), _mesh_for(meshes, layout), layout)
    lo, hi = SHARD_ROWS[ws][ctx.rank]
    sd["model"]["megatron"] = dcp.TensorShard(_megatron_full()[lo:hi].clone(), (10, 3), (lo, 0))
    sd["model"]["plain"] = random_tensor((4, 4), torch.int64, seed=42)
    md = dcp.save(sd, str(ctx.shared / name))
    assert md.world_size == ws


def _load_and_check(ctx, name, saved_by):
    ws = ctx.world_size
    ckpt = str(ctx.shared / name)
    md = dcp.read_metadata(ckpt)
    assert md.world_size == saved_by, f"metadata world_size {md.world_size}, saved by {saved_by}"
    meshes = _meshes(ws)
    for i, layouts in enumerate(LOAD_LAYOUTS[ws]):
        target = {"model": {}, "meta": {"saved_by": 0, "names": ["?"] * len(TENSORS)}}
        for fqn, layout in layouts.items():
            shape, dtype, _ = TENSORS[fqn]
            target["model"][fqn] = zeros_dtensor(shape, dtype, _mesh_for(meshes, layout), layout)
        lo, hi = SHARD_ROWS[ws][(ctx.rank + i) % ws]  # a different partition than any saved one
        target["model"]["megatron"] = dcp.TensorShard(torch.zeros(hi - lo, 3), (10, 3), (lo, 0))
        target["model"]["plain"] = torch.zeros(4, 4, dtype=torch.int64)
        report = dcp.load(target, ckpt)
        assert report.missing_keys == [] and report.unexpected_keys == []
        for fqn, layout in layouts.items():
            assert_dtensor_equals_full(
                target["model"][fqn], _full(fqn),
                f"{fqn}: W={saved_by} {SAVE_LAYOUT[saved_by][fqn]} -> W={ws} {layout}"
            )
        assert_bitwise_equal(target["model"]["megatron"].data, _megatron_full()[lo:hi], "megatron")
        assert_bitwise_equal(target["model"]["plain"], random_tensor((4, 4), torch.int64, seed=42),
                             "plain")
        assert target["meta"] == {"saved_by": saved_by, "names": sorted(TENSORS)}, target["meta"]

    # The rows Shard(0) over 30 ranks would hold (torch.chunk arithmetic:
    # 28 x 18, then 8, then 0), as TensorShard targets spread over the ranks.
    # Each load is collective, so every rank makes the same number of calls.
    full512 = _full("dim512")
    boxes = [(lo, min(lo + 18, 512)) for lo in range(0, 30 * 18, 18)]
    boxes = [(min(lo, 512), min(hi, 512)) for lo, hi in boxes]
    assert [hi - lo for lo, hi in boxes][-3:] == [18, 8, 0]
    for i in range(-(-30 // ws)):
        lo, hi = boxes[min(i * ws + ctx.rank, 29)]
        shard = dcp.TensorShard(torch.zeros(hi - lo, 3), (512, 3), (lo, 0))
        dcp.load({"model": {"dim512": shard}}, ckpt, strict=False)
        assert_bitwise_equal(shard.data, full512[lo:hi], f"dim512 rows {lo}:{hi} of 30-way split")

    # Everything as plain full tensors on every rank.
    plain = {"model": {f: torch.zeros(TENSORS[f][0], dtype=TENSORS[f][1]) for f in TENSORS}}
    plain["model"]["megatron"] = torch.zeros(10, 3)
    dcp.load(plain, ckpt, strict=False)
    for fqn in TENSORS:
        assert_bitwise_equal(plain["model"][fqn], _full(fqn), f"{fqn} as a full tensor")
    assert_bitwise_equal(plain["model"]["megatron"], _megatron_full(), "megatron as a full tensor")


@dist_scenario(world_size=2, phase=0)
def test_save_at_world_size_2(ctx):
    _save(ctx, "saved_by_w2")


@dist_scenario(world_size=4, phase=1)
def test_load_world_size_2_checkpoint_at_4(ctx):
    _load_and_check(ctx, "saved_by_w2", saved_by=2)


@dist_scenario(world_size=4, phase=1)
def test_save_at_world_size_4(ctx):
    _save(ctx, "saved_by_w4")


@dist_scenario(world_size=2, phase=2)
def test_load_world_size_4_checkpoint_at_2(ctx):
    _load_and_check(ctx, "saved_by_w4", saved_by=4)
