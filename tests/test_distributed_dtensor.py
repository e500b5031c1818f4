"""DTensor, TensorShard and FSDP2+TP state dicts in a real 4-rank gloo group:
round trips with the same layout and resharding to another layout at the same
world size.  (World-size changes: test_reshard_world_size.py.)

Every ``@dist_scenario`` runs inside the one shared W=4 group of the session
(see dist_harness.py); ``ctx.dir`` is private to the scenario."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import dcp
from dist_harness import dist_scenario
from helpers import (
    ALL_DTYPES,
    assert_bitwise_equal,
    assert_dtensor_equals_full,
    make_dtensor,
    random_tensor,
    zeros_dtensor,
)


def _mesh_1d():
    return init_device_mesh("cpu", (4,))


def _mesh_2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _assert_chunks_tile(md, fqn):
    """The saved chunks of ``fqn`` cover its global shape exactly once."""
    t = md.tensors[fqn]
    covered = torch.zeros(t.shape, dtype=torch.int32)
    for c in t.chunks:
        sl = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
        covered[sl] += 1
    assert torch.all(covered == 1), (
        f"{fqn}: chunks {[(c.offsets, c.sizes) for c in t.chunks]} do not tile {t.shape}")


# (fqn, global shape, dtype, placements on the 1-D mesh of 4 ranks)
_CASES_1D = [
    ("even.rows", (8, 6), torch.float32, "S0"),
    ("even.cols", (4, 8), torch.float64, "S1"),
    ("uneven.rows6", (6, 3), torch.float32, "S0"),  # 2,2,2,0: rank 3 holds an empty shard
    ("uneven.rows5", (5, 3), torch.bfloat16, "S0"),  # 2,2,1,0
    ("uneven.cols6", (3, 6), torch.int64, "S1"),  # 2,2,2,0
    ("tiny.rows2", (2,), torch.int32, "S0"),  # 1,1,0,0
    ("replicated.vec", (7,), torch.float32, "R"),
    ("replicated.scalar", (), torch.float64, "R"),
]


@dist_scenario(world_size=4)
def test_dtensor_1d_round_trip_with_uneven_and_empty_shards(ctx):
    mesh = _mesh_1d()
    fulls = {f: random_tensor(s, d, seed=i) for i, (f, s, d, _) in enumerate(_CASES_1D)}
    sd = {"model": {f: make_dtensor(fulls[f], mesh, p) for f, _, _, p in _CASES_1D}, "step": 11}
    if ctx.rank == 3:  # the scenario does exercise empty shards
        assert sd["model"]["uneven.rows6"].to_local().shape == (0, 3)
        assert sd["model"]["tiny.rows2"].to_local().shape == (0,)
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(sd, ckpt)
    assert md.world_size == 4
    for f, shape, dtype, _ in _CASES_1D:
        fqn = f"model.{f}"
        assert md.tensors[fqn].shape == shape, (fqn, md.tensors[fqn].shape)
        assert md.tensors[fqn].dtype == str(dtype).removeprefix("torch."), (
            fqn, md.tensors[fqn].dtype)
        _assert_chunks_tile(md, fqn)

    target = {"model": {f: zeros_dtensor(s, d, mesh, p) for f, s, d, p in _CASES_1D}, "step": 0}
    locals_before = {f: target["model"][f].to_local() for f, *_ in _CASES_1D}
    report = dcp.load(target, ckpt)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert target["step"] == 11
    for f, *_ in _CASES_1D:
        assert_dtensor_equals_full(target["model"][f], fulls[f], f)
        assert target["model"][f].to_local() is locals_before[f] or (
            target["model"][f].to_local().data_ptr() == locals_before[f].data_ptr()
        ), f"{f}: local shard was replaced, not filled in place"

    # The same checkpoint into plain (full, replicated) tensors on every rank.
    plain = {"model": {f: torch.zeros(s, dtype=d) for f, s, d, _ in _CASES_1D}, "step": 0}
    dcp.load(plain, ckpt)
    for f, *_ in _CASES_1D:
        assert_bitwise_equal(plain["model"][f], fulls[f], f)


# (fqn, global shape, placements on the (dp=2, tp=2) mesh)
_CASES_2D = [
    ("dp_tp", (8, 6), "S0,S1"),
    ("dp_repl_tp_rows", (8, 6), "R,S0"),
    ("dp_rows_tp_repl", (8, 6), "S0,R"),
    ("nested_rows", (8, 6), "S0,S0"),
    ("nested_rows_uneven", (7, 3), "S0,S0"),  # 4,3 over dp then 2,2 / 2,1
    ("uneven_dp_tp", (5, 3), "S0,S1"),
    ("all_repl", (3, 3), "R,R"),
]


@dist_scenario(world_size=4)
def test_dtensor_2d_mesh_round_trip(ctx):
    mesh = _mesh_2d()
    fulls = {f: random_tensor(s, torch.float32, seed=10 + i)
             for i, (f, s, _) in enumerate(_CASES_2D)}
    sd = {f: make_dtensor(fulls[f], mesh, p) for f, _, p in _CASES_2D}
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(sd, ckpt)
    for f, shape, _ in _CASES_2D:
        assert md.tensors[f].shape == shape
        _assert_chunks_tile(md, f)
    target = {f: zeros_dtensor(s, torch.float32, mesh, p) for f, s, p in _CASES_2D}
    dcp.load(target, ckpt)
    for f, *_ in _CASES_2D:
        assert_dtensor_equals_full(target[f], fulls[f], f)


@dist_scenario(world_size=4)
def test_reshard_1d_to_other_1d_placements(ctx):
    mesh = _mesh_1d()
    cases = {  # fqn: (shape, saved placement, loaded placements)
        "a": ((8, 12), "S0", ["S1", "R"]),
        "b": ((8, 12), "S1", ["S0", "R"]),
        "c": ((6, 5), "S0", ["S1", "R"]),  # 2,2,2,0 rows -> 2,2,1,0 cols
        "d": ((5, 6), "S1", ["S0"]),  # 2,2,2,0 cols -> 2,2,1,0 rows
        "e": ((9,), "R", ["S0"]),
    }
    fulls = {f: random_tensor(s, torch.float32, seed=20 + i)
             for i, (f, (s, _, _)) in enumerate(cases.items())}
    ckpt = str(ctx.dir / "ckpt")
    dcp.save({f: make_dtensor(fulls[f], mesh, p) for f, (_, p, _) in cases.items()}, ckpt)
    for round_ in range(2):
        target = {
            f: zeros_dtensor(s, torch.float32, mesh, loads[round_])
            for f, (s, _, loads) in cases.items() if round_ < len(loads)
        }
        dcp.load(target, ckpt)
        for f, t in target.items():
            assert_dtensor_equals_full(t, fulls[f], f"{f} -> {cases[f][2][round_]}")


@dist_scenario(world_size=4)
def test_reshard_2d_mesh_to_1d_mesh_and_back(ctx):
    mesh1, mesh2 = _mesh_1d(), _mesh_2d()
    shapes = {"w": (8, 6), "u": (7, 5), "v": (6, 6)}
    fulls = {f: random_tensor(s, torch.bfloat16, seed=30 + i)
             for i, (f, s) in enumerate(shapes.items())}
    saved_2d = {"w": "S0,S1", "u": "S0,S1", "v": "R,S0"}
    ckpt2d = str(ctx.dir / "from2d")
    dcp.save({f: make_dtensor(fulls[f], mesh2, saved_2d[f]) for f in shapes}, ckpt2d)
    for placement in ("S0", "S1", "R"):
        target = {f: zeros_dtensor(s, torch.bfloat16, mesh1, placement) for f, s in shapes.items()}
        dcp.load(target, ckpt2d)
        for f in shapes:
            assert_dtensor_equals_full(target[f], fulls[f],
                                       f"{f}: 2-D {saved_2d[f]} -> 1-D {placement}")
    # and a 2-D -> 2-D change of layout
    target = {f: zeros_dtensor(s, torch.bfloat16, mesh2, "S1,S0") for f, s in shapes.items()}
    dcp.load(target, ckpt2d)
    for f in shapes:
        assert_dtensor_equals_full(target[f], fulls[f], f"{f}: 2-D {saved_2d[f]} -> 2-D S1,S0")

    ckpt1d = str(ctx.dir / "from1d")
    dcp.save({f: make_dtensor(fulls[f], mesh1, "S1") for f in shapes}, ckpt1d)
    target = {f: zeros_dtensor(s, torch.bfloat16, mesh2, "S0,S1") for f, s in shapes.items()}
    dcp.load(target, ckpt1d)
    for f in shapes:
        assert_dtensor_equals_full(target[f], fulls[f], f"{f}: 1-D S1 -> 2-D S0,S1")


@dist_scenario(world_size=4)
def test_tensor_shard_descriptors_round_trip_and_reshard(ctx):
    r = ctx.rank
    rows = random_tensor((8, 6), torch.float32, seed=40)
    grid = random_tensor((4, 6), torch.int16, seed=41)
    ragged = random_tensor((10, 3), torch.float16, seed=42)
    ragged_rows = [(0, 4), (4, 5), (5, 9), (9, 10)]  # uneven, Megatron-style explicit offsets
    gr, gc = divmod(r, 2)
    lo, hi = ragged_rows[r]
    sd = {
        "rows": dcp.TensorShard(rows[2 * r:2 * r + 2].clone(), (8, 6), (2 * r, 0)),
        "grid": dcp.TensorShard(grid[2 * gr:2 * gr + 2, 3 * gc:3 * gc + 3].clone(), (4, 6),
                                (2 * gr, 3 * gc)),
        "ragged": dcp.TensorShard(ragged[lo:hi].clone(), (10, 3), (lo, 0)),
    }
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(sd, ckpt)
    for f, full in (("rows", rows), ("grid", grid), ("ragged", ragged)):
        assert md.tensors[f].shape == tuple(full.shape)
        _assert_chunks_tile(md, f)

    # Other partitions: column blocks / transposed grid / one row each.
    col_lo, col_hi = [(0, 2), (2, 3), (3, 5), (5, 6)][r]
    target = {
        "rows": dcp.TensorShard(torch.zeros(8, col_hi - col_lo), (8, 6), (0, col_lo)),
        "grid": dcp.TensorShard(torch.zeros(1, 6, dtype=torch.int16), (4, 6), (r, 0)),
        "ragged": dcp.TensorShard(torch.zeros(3, 3, dtype=torch.float16), (10, 3),
                                  (min(3 * r, 7), 0)),
    }
    dcp.load(target, ckpt)
    assert_bitwise_equal(target["rows"].data, rows[:, col_lo:col_hi], "rows")
    assert_bitwise_equal(target["grid"].data, grid[r:r + 1], "grid")
    assert_bitwise_equal(target["ragged"].data, ragged[min(3 * r, 7):min(3 * r, 7) + 3], "ragged")

    # Into DTensors and into plain full tensors.
    mesh = _mesh_1d()
    as_dt = {"rows": zeros_dtensor((8, 6), torch.float32, mesh, "S1"),
             "grid": zeros_dtensor((4, 6), torch.int16, mesh, "S0"),
             "ragged": zeros_dtensor((10, 3), torch.float16, mesh, "R")}
    dcp.load(as_dt, ckpt)
    for f, full in (("rows", rows), ("grid", grid), ("ragged", ragged)):
        assert_dtensor_equals_full(as_dt[f], full, f)
    plain = {"rows": torch.zeros(8, 6), "grid": torch.zeros(4, 6, dtype=torch.int16),
             "ragged": torch.zeros(10, 3, dtype=torch.float16)}
    dcp.load(plain, ckpt)
    for f, full in (("rows", rows), ("grid", grid), ("ragged", ragged)):
        assert_bitwise_equal(plain[f], full, f)


@dist_scenario(world_size=4)
def test_replicated_plain_tensors_of_every_dtype_with_nan_bits(ctx):
    """Identical replicas containing NaN bit patterns are identical (a value
    comparison would call NaN != NaN a mismatch)."""
    sd = {}
    for i, dtype in enumerate(ALL_DTYPES):
        name = str(dtype).removeprefix("torch.")
        sd[name] = random_tensor((33, 7), dtype, seed=50 + i)
        sd[f"scalars.{name}"] = random_tensor((), dtype, seed=80 + i)
    nan = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0])
    sd["nans"] = nan
    assert torch.isnan(sd["float32"]).any() or torch.isnan(sd["float64"]).any(), (
        "precondition: NaNs present")
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(sd, ckpt)
    for fqn in sd:
        assert len(md.tensors[fqn].chunks) == 1, (
            f"{fqn}: replicated tensor saved {len(md.tensors[fqn].chunks)} times")
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, ckpt)
    for k, v in sd.items():
        assert_bitwise_equal(target[k], v, k)


# ----------------------------------------------------------- FSDP2 + TP model
def _fsdp_tp_model(mesh, seed):
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _train_steps(model, opt, seed, steps):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _full(v):
    from torch.distributed.tensor import DTensor

    return v.full_tensor() if isinstance(v, DTensor) else v


@dist_scenario(world_size=4)
def test_fsdp2_plus_tp_model_and_optimizer_round_trip(ctx):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    mesh = _mesh_2d()
    model = _fsdp_tp_model(mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999), weight_decay=0.01)
    _train_steps(model, opt, seed=1, steps=1)
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt)
    placements = {type(p).__name__ for v in msd.values() for p in v.placements}
    assert "_StridedShard" in placements, f"precondition: strided shards, got {placements}"

    expected_model = {k: _full(v).clone() for k, v in msd.items()}
    expected_state = {k: {kk: _full(vv).clone() for kk, vv in st.items()}
                      for k, st in osd["state"].items()}
    ckpt = str(ctx.dir / "ckpt")
    dcp.save({"model": msd, "optim": osd, "epoch": 1}, ckpt)

    # A fresh, identically built model with different values and hyper-parameters.
    model2 = _fsdp_tp_model(mesh, seed=123)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5, betas=(0.8, 0.95), weight_decay=0.1)
    _train_steps(model2, opt2, seed=7, steps=2)
    target = {"model": get_model_state_dict(model2),
              "optim": get_optimizer_state_dict(model2, opt2), "epoch": 0}
    assert not torch.equal(_full(target["model"]["0.weight"]), expected_model["0.weight"]), (
        "precondition")

    report = dcp.load(target, ckpt)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert target["epoch"] == 1
    set_model_state_dict(model2, target["model"])
    set_optimizer_state_dict(model2, opt2, target["optim"])

    for k, v in get_model_state_dict(model2).items():
        assert_bitwise_equal(_full(v), expected_model[k], f"model.{k}")
    osd2 = get_optimizer_state_dict(model2, opt2)
    assert set(osd2["state"]) == set(expected_state)
    for k, st in osd2["state"].items():
        for kk, vv in st.items():
            assert_bitwise_equal(_full(vv), expected_state[k][kk], f"optim.state.{k}.{kk}")
    group = opt2.param_groups[0]
    assert (group["lr"] == 0.01 and tuple(group["betas"]) == (0.9, 0.999)
            and group["weight_decay"] == 0.01), group

    # Training continues identically from the loaded state.
    _train_steps(model, opt, seed=99, steps=1)
    _train_steps(model2, opt2, seed=99, steps=1)
    for (k, a), b in zip(get_model_state_dict(model).items(),
                         get_model_state_dict(model2).values(), strict=True):
        assert_bitwise_equal(_full(b), _full(a), f"after one more step: model.{k}")
