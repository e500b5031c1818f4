"""Code written for PyTorch DCP, run against hyperdcp (issue 15).

Real gloo ranks, exact values.  Groups run in phase order: W=2 (phase 0)
saves into ``ctx.shared`` what W=4 (phase 1) loads, and W=4 saves what a
later W=2 group (phase 2) loads, so every case below is resharded 2 -> 4
and 4 -> 2:

* Stateful objects, at the top level and nested: FSDP2 and TP models with
  AdamW behind ``get_state_dict`` / ``set_state_dict`` wrappers (torchtitan's
  ``ModelWrapper`` / ``OptimizersContainer`` pattern), an LR scheduler and a
  dataloader position;
* the leaves torch users have: ``bytes`` and ``io.BytesIO``, ``ShardedTensor``
  (uneven, empty and several shards per rank) loaded into ShardedTensor,
  DTensor and plain targets and back, DTensors on a sub-mesh that leaves
  some ranks out, and meta-device targets;
* ``dcp.compat`` running torch-DCP-style code: ``FileSystemWriter`` /
  ``FileSystemReader``, ``allow_partial_load``, ``async_save`` returning a
  Future, and ``no_dist=True`` in a single process (in-process tests).
"""

from __future__ import annotations

import concurrent.futures
import io
import json

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import dcp
import dcp.compat
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, assert_dtensor_equals_full, make_dtensor, random_tensor

# ------------------------------------------------------------------ helpers


class Loader:
    """A dataloader's position, Stateful."""

    def __init__(self, pos: int = 0) -> None:
        self.pos, self.epoch = pos, 0
        self.loaded = 0

    def state_dict(self):
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, sd):
        self.pos, self.epoch = sd["pos"], sd["epoch"]
        self.loaded += 1


class ModelWrapper:
    """torchtitan's ModelWrapper: the model's state dict through get_state_dict."""

    def __init__(self, model) -> None:
        self.model = model

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, sd)


class OptimizerWrapper:
    """torchtitan's OptimizersContainer, for one optimizer."""

    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, sd)


class AppState:
    """The PyTorch DCP tutorial's AppState: model and optimizer together."""

    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])


def _mlp(seed):
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))


def _fsdp_model(ws, seed):
    from torch.distributed.fsdp import fully_shard

    model = _mlp(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))
    return model


def _tp_model(ws, seed):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _mlp(seed)
    parallelize_module(model, init_device_mesh("cpu", (ws,)),
                       {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _train(model, opt, sched, seed, steps):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _full(v):
    from torch.distributed.tensor import DTensor

    return v.full_tensor() if isinstance(v, DTensor) else v


def _expected(model, opt):
    """Every model and optimizer value as a full tensor (or plain value)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": _full(v).clone() for k, v in msd.items()}
    for k, st in osd["state"].items():
        for kk, vv in st.items():
            out[f"optim.{k}.{kk}"] = _full(vv).clone()
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                           for g in osd["param_groups"]]
    return out


def _check_expected(model, opt, expected, what):
    got = _expected(model, opt)
    assert set(got) == set(expected), (what, sorted(set(got) ^ set(expected)))
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert_bitwise_equal(got[k], v, f"{what}: {k}")
        else:  # a tuple (AdamW's betas) loads as a list
            assert json.loads(json.dumps(got[k])) == json.loads(json.dumps(v)), (what, k, got[k])


def _training_state(ws, seed, lr):
    """Two Stateful models (FSDP2, TP) with AdamW, a scheduler each, a loader."""
    out = {}
    for kind, build in (("fsdp", _fsdp_model), ("tp", _tp_model)):
        model = build(ws, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        out[kind] = (model, opt, sched)
    return out


def _state_dict(state, loader):
    """Statefuls at the top level (model, optimizer) and nested (the
    schedulers inside a dict, the loader two levels down)."""
    return {
        "fsdp_model": ModelWrapper(state["fsdp"][0]),
        "fsdp_optim": OptimizerWrapper(state["fsdp"][0], state["fsdp"][1]),
        "tp_model": ModelWrapper(state["tp"][0]),
        "tp_optim": OptimizerWrapper(state["tp"][0], state["tp"][1]),
        "schedulers": {"fsdp": state["fsdp"][2], "tp": state["tp"][2]},
        "data": {"train": {"loader": loader}, "step": 0},
    }


def _save_training(ctx, name):
    ws = ctx.world_size
    state = _training_state(ws, seed=0, lr=0.01)
    for model, opt, sched in state.values():
        _train(model, opt, sched, seed=1, steps=3)
    loader = Loader(pos=37 + ws)
    sd = _state_dict(state, loader)
    sd["data"]["step"] = 3
    dcp.save(sd, str(ctx.shared / name))
    expected = {kind: _expected(m, o) for kind, (m, o, _) in state.items()}
    if ctx.rank == 0:
        torch.save({"expected": expected, "pos": loader.pos,
                    "sched": {k: s.state_dict() for k, (_, _, s) in state.items()}},
                   ctx.shared / f"{name}.expected.pt")
    ctx.barrier()


def _load_training(ctx, name):
    ws = ctx.world_size
    saved = torch.load(ctx.shared / f"{name}.expected.pt")
    state = _training_state(ws, seed=99, lr=0.5)  # other values and hyper-parameters
    for model, opt, sched in state.values():
        _train(model, opt, sched, seed=5, steps=1)
    loader = Loader()
    sd = _state_dict(state, loader)
    top_objects = dict(sd)
    report = dcp.load(sd, str(ctx.shared / name))
    assert report.missing_keys == [] and report.unexpected_keys == [], report
    assert all(sd[k] is v for k, v in top_objects.items()), "the Stateful objects stay in place"
    assert loader.pos == saved["pos"] and loader.loaded == 1, (loader.pos, loader.loaded)
    assert sd["data"]["train"]["loader"] is loader and sd["data"]["step"] == 3, sd["data"]
    for kind, (model, opt, sched) in state.items():
        _check_expected(model, opt, saved["expected"][kind], f"{kind} W={ws}")
        assert sched.state_dict() == saved["sched"][kind], (kind, sched.state_dict())
        assert opt.param_groups[0]["lr"] == saved["expected"][kind]["param_groups"][0]["lr"]


# ------------------------------------------------------------- leaf kinds

_ROWS = (7, 3)
#: ShardedTensor row ranges per rank: saved (several per rank at W=2, an
#: empty rank at W=4), and loaded into (an empty rank at W=4)
_ST_SAVE = {2: [[(0, 2), (4, 6)], [(2, 4), (6, 7)]], 4: [[(0, 3)], [(3, 5)], [(5, 7)], []]}
_ST_LOAD = {2: [[(0, 5)], [(5, 7)]], 4: [[(0, 1)], [(1, 4)], [], [(4, 7)]]}
#: ranks of the sub-mesh a DTensor lives on, saved and loaded
_SUB_SAVE = {2: [1], 4: [2, 3]}
_SUB_LOAD = {2: [0], 4: [0, 1, 2]}


def _value(fqn):
    return random_tensor(_ROWS, torch.float32, seed=sum(map(ord, fqn)))


def _sharded(full, ranges, rank, device=None):
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    shards = [Shard.from_tensor_and_offsets(
        full[lo:hi].clone() if device is None else torch.empty(hi - lo, full.shape[1],
                                                              device=device),
        [lo, 0], rank) for lo, hi in ranges[rank]]
    return init_from_local_shards(shards, *full.shape)


def _assert_sharded(st, full, what):
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    assert isinstance(st, ShardedTensor), (what, type(st))
    for shard in st.local_shards():
        lo = shard.metadata.shard_offsets[0]
        assert_bitwise_equal(shard.tensor, full[lo:lo + shard.tensor.shape[0]], what)


def _sub_mesh(ranks):
    return DeviceMesh("cpu", ranks)


def _save_leaves(ctx, name):
    ws, rank = ctx.world_size, ctx.rank
    mesh = init_device_mesh("cpu", (ws,))
    sub = _sub_mesh(_SUB_SAVE[ws])
    sd = {
        "blob": b"\x00\x80raw bytes, never pickled\xff",
        "bio": io.BytesIO(b"torch.save output, say"),
        "empty": b"",
        "st": _sharded(_value("st"), _ST_SAVE[ws], rank),
        "dt": make_dtensor(_value("dt"), mesh, "S0"),
        "pl": _value("pl"),
        "sub": {"rows": make_dtensor(random_tensor((5, 2), torch.float32, seed=7), sub, "S0"),
                "scalar": make_dtensor(torch.tensor(2.5), sub, "R")},
    }
    sd["bio"].seek(5)  # the whole buffer is saved, wherever its position
    md = dcp.save(sd, str(ctx.shared / name))
    assert md.version == 2 and md.objects["blob"].raw is not None
    assert md.objects["bio"].raw_type == "BytesIO" and md.objects["blob"].pickled is None
    assert md.tensors["st"].shape == _ROWS and md.tensors["sub.scalar"].shape == ()
    raw = md.objects["blob"].raw
    data = (ctx.shared / name / raw.file).read_bytes()[raw.byte_offset:raw.byte_offset + raw.nbytes]
    assert data == sd["blob"], data  # stored as the bytes themselves


def _load_leaves(ctx, name):
    ws, rank = ctx.world_size, ctx.rank
    ckpt = str(ctx.shared / name)
    mesh = init_device_mesh("cpu", (ws,))
    from torch.distributed.tensor import DTensor

    # bytes and BytesIO come back as the type they were saved as
    target = {"blob": None, "bio": b"", "empty": None}
    dcp.load(target, ckpt, strict=False)
    assert target["blob"] == b"\x00\x80raw bytes, never pickled\xff", target["blob"]
    assert isinstance(target["bio"], io.BytesIO) and target["bio"].tell() == 0
    assert target["bio"].getvalue() == b"torch.save output, say" and target["empty"] == b""

    # every fqn into ShardedTensor, DTensor and plain targets: all directions
    fqns = ("st", "dt", "pl")
    sts = {f: _sharded(torch.zeros(_ROWS), _ST_LOAD[ws], rank) for f in fqns}
    dcp.load(sts, ckpt, strict=False)
    for f in fqns:
        _assert_sharded(sts[f], _value(f), f"{f} -> ShardedTensor at W={ws}")
    for placement in ("S0", "S1"):
        dts = {f: make_dtensor(torch.zeros(_ROWS), mesh, placement) for f in fqns}
        dcp.load(dts, ckpt, strict=False)
        for f in fqns:
            assert_dtensor_equals_full(dts[f], _value(f), f"{f} -> DTensor {placement}")
    plains = {f: torch.zeros(_ROWS) for f in fqns}
    dcp.load(plains, ckpt, strict=False)
    for f in fqns:
        assert_bitwise_equal(plains[f], _value(f), f"{f} -> plain at W={ws}")

    # a DTensor on a sub-mesh: ranks outside it are skipped, not an IndexError
    sub = _sub_mesh(_SUB_LOAD[ws])
    rows = random_tensor((5, 2), torch.float32, seed=7)
    target = {"sub": {"rows": make_dtensor(torch.zeros(5, 2), sub, "S0"),
                      "scalar": make_dtensor(torch.tensor(0.0), sub, "R")}}
    report = dcp.load(target, ckpt, strict=False)
    assert report.missing_keys == []
    if rank in _SUB_LOAD[ws]:
        assert_dtensor_equals_full(target["sub"]["rows"], rows, "sub-mesh rows")
        assert target["sub"]["scalar"].to_local().item() == 2.5
    # and the whole sub-mesh tensor as a plain one, on every rank
    plain = {"sub": {"rows": torch.zeros(5, 2)}}
    dcp.load(plain, ckpt, strict=False)
    assert_bitwise_equal(plain["sub"]["rows"], rows, "sub-mesh rows as plain")

    # meta-device targets are materialized with the saved dtype, and said so
    meta = {"pl": torch.empty(_ROWS, device="meta", dtype=torch.bfloat16),
            "dt": make_dtensor(torch.empty(_ROWS, device="meta"), mesh, "S1"),
            "st": _sharded(torch.zeros(_ROWS), _ST_LOAD[ws], rank, device="meta"),
            "blob": None}
    report = dcp.load(meta, ckpt, strict=False)
    holds_st = ["st"] if _ST_LOAD[ws][rank] else []  # a rank without shards has none to fill
    assert sorted(report.materialized) == ["dt", "pl", *holds_st], report.materialized
    assert meta["pl"].device.type == "cpu" and meta["pl"].dtype == torch.float32
    assert_bitwise_equal(meta["pl"], _value("pl"), "meta plain")
    assert isinstance(meta["dt"], DTensor) and not meta["dt"].to_local().is_meta
    assert_dtensor_equals_full(meta["dt"], _value("dt"), "meta DTensor")
    _assert_sharded(meta["st"], _value("st"), "meta ShardedTensor")
    # one the checkpoint lacks raises, naming it, on every rank
    with pytest.raises(dcp.CheckpointError, match="'absent' is on the meta device"):
        dcp.load({"absent": torch.empty(3, device="meta"), "pl": torch.zeros(_ROWS)}, ckpt,
                 strict=False)


def _save_differing_bytes_refused(ctx):
    with pytest.raises(dcp.CheckpointError, match="'seed': ranks 0 and 1 hold different bytes"):
        dcp.save({"seed": bytes([ctx.rank])}, str(ctx.dir / "differ"))


# ------------------------------------------------------------- phases


@dist_scenario(world_size=2, phase=0)
def test_stateful_training_state_saved_at_2(ctx):
    _save_training(ctx, "stateful_w2")


@dist_scenario(world_size=2, phase=0)
def test_leaf_kinds_saved_at_2(ctx):
    _save_leaves(ctx, "leaves_w2")
    _save_differing_bytes_refused(ctx)


@dist_scenario(world_size=4, phase=1)
def test_stateful_training_state_resharded_2_to_4(ctx):
    _load_training(ctx, "stateful_w2")


@dist_scenario(world_size=4, phase=1)
def test_leaf_kinds_resharded_2_to_4(ctx):
    _load_leaves(ctx, "leaves_w2")


@dist_scenario(world_size=4, phase=1)
def test_stateful_training_state_saved_at_4(ctx):
    _save_training(ctx, "stateful_w4")


@dist_scenario(world_size=4, phase=1)
def test_leaf_kinds_saved_at_4(ctx):
    _save_leaves(ctx, "leaves_w4")


@dist_scenario(world_size=2, phase=2)
def test_stateful_training_state_resharded_4_to_2(ctx):
    _load_training(ctx, "stateful_w4")


@dist_scenario(world_size=2, phase=2)
def test_leaf_kinds_resharded_4_to_2(ctx):
    _load_leaves(ctx, "leaves_w4")


# ------------------------------------------------------------- dcp.compat


@dist_scenario(world_size=2, phase=0)
def test_compat_runs_torch_dcp_code(ctx):
    """The PyTorch DCP tutorial's code, with ``dcp.compat`` imported in place
    of ``torch.distributed.checkpoint``."""
    from torch.distributed.checkpoint import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
        FileSystemReader,
        FileSystemWriter,
    )
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dcp_ = dcp.compat
    ws = ctx.world_size
    path = ctx.dir / "ckpt"
    model = _fsdp_model(ws, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    _train(model, opt, sched, seed=1, steps=2)
    expected = _expected(model, opt)
    state_dict = {"app": AppState(model, opt), "extra": {"note": "hi", "blob": b"\x01\x02"}}
    md = dcp_.save(state_dict, storage_writer=FileSystemWriter(path))
    assert isinstance(md, dcp.Metadata)
    dcp_.save(state_dict, checkpoint_id=path, planner=DefaultSavePlanner())  # overwrites, as torch

    model2 = _fsdp_model(ws, seed=5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.3)
    _train(model2, opt2, torch.optim.lr_scheduler.StepLR(opt2, 1), seed=2, steps=1)
    target = {"app": AppState(model2, opt2), "extra": {"note": "", "blob": b""}}
    dcp_.load(target, storage_reader=FileSystemReader(path))
    _check_expected(model2, opt2, expected, "compat FileSystemReader")
    assert target["extra"] == {"note": "hi", "blob": b"\x01\x02"}, target["extra"]

    # Accelerate's calls, through the alias: torch's deprecated save_state_dict / load_state_dict
    accel = ctx.dir / "accelerate"
    dcp_.save_state_dict(state_dict=state_dict, storage_writer=dcp_.FileSystemWriter(accel),
                         planner=dcp_.DefaultSavePlanner())
    model4 = _fsdp_model(ws, seed=4)
    opt4 = torch.optim.AdamW(model4.parameters(), lr=0.3)
    _train(model4, opt4, torch.optim.lr_scheduler.StepLR(opt4, 1), seed=2, steps=1)
    target = {"app": AppState(model4, opt4), "extra": {"note": "", "blob": b""}}
    dcp_.load_state_dict(state_dict=target, storage_reader=dcp_.FileSystemReader(accel),
                         planner=dcp_.DefaultLoadPlanner())
    _check_expected(model4, opt4, expected, "compat save_state_dict/load_state_dict")
    assert target["extra"] == {"note": "hi", "blob": b"\x01\x02"}, target["extra"]

    # a key the checkpoint lacks: torch raises too; allow_partial_load loads the rest
    partial = {"app": AppState(_fsdp_model(ws, seed=6), None), "new": torch.full((2,), 7.0)}
    partial["app"].opt = torch.optim.AdamW(partial["app"].model.parameters(), lr=0.3)
    with pytest.raises(dcp.CheckpointError, match="not in the checkpoint: new"):
        dcp_.load(partial, checkpoint_id=path)
    report = dcp_.load(partial, checkpoint_id=path,
                       planner=DefaultLoadPlanner(allow_partial_load=True))
    assert report.missing_keys == ["new"] and torch.equal(partial["new"], torch.full((2,), 7.0))
    _check_expected(partial["app"].model, partial["app"].opt, expected, "allow_partial_load")

    # where torch would cast or drop silently, CheckpointError
    plain_path = ctx.dir / "plain"
    dcp_.save({"w": torch.arange(4.0)}, checkpoint_id=plain_path)
    with pytest.raises(dcp.CheckpointError, match="'w': checkpoint dtype float32 != target"):
        dcp_.load({"w": torch.zeros(4, dtype=torch.bfloat16)}, checkpoint_id=plain_path)
    with pytest.raises(dcp.CheckpointError, match="not JSON-representable"):
        dcp_.save({"obj": object()}, checkpoint_id=ctx.dir / "obj")
    # settings and planners whose hooks would not run are refused clearly
    with pytest.raises(dcp.CheckpointError, match="dedup_save_to_lowest_rank"):
        dcp_.save({"w": torch.arange(4.0)}, checkpoint_id=plain_path,
                  planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    with pytest.raises(dcp.CheckpointError, match="flatten_state_dict"):
        dcp_.load({"w": torch.zeros(4)}, checkpoint_id=plain_path,
                  planner=DefaultLoadPlanner(flatten_state_dict=False))

    class MyPlanner(DefaultLoadPlanner):
        pass

    with pytest.raises(dcp.CheckpointError, match="MyPlanner is not supported"):
        dcp_.load({"w": torch.zeros(4)}, checkpoint_id=plain_path, planner=MyPlanner())
    with pytest.raises(dcp.CheckpointError, match="no_dist=True in a job of 2 ranks"):
        dcp_.load({"w": torch.zeros(4)}, checkpoint_id=plain_path, no_dist=True)

    # async_save returns a concurrent.futures.Future of the committed metadata
    async_path = ctx.dir / "async"
    future = dcp_.async_save(state_dict, storage_writer=FileSystemWriter(async_path),
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    assert isinstance(future, concurrent.futures.Future)
    md = future.result(timeout=300)
    assert isinstance(md, dcp.Metadata) and md.world_size == ws
    model3 = _fsdp_model(ws, seed=8)
    opt3 = torch.optim.AdamW(model3.parameters(), lr=0.3)
    _train(model3, opt3, torch.optim.lr_scheduler.StepLR(opt3, 1), seed=3, steps=1)
    target = {"app": AppState(model3, opt3), "extra": {"note": "", "blob": b""}}
    dcp_.load(target, checkpoint_id=async_path)
    _check_expected(model3, opt3, expected, "compat async_save")
    assert target["extra"] == {"note": "hi", "blob": b"\x01\x02"}, target["extra"]


def test_compat_no_dist_single_process(tmp_path):
    """``no_dist=True`` in a process without torch.distributed: a Stateful,
    bytes and BytesIO, a plain model; FileSystemWriter's path as the id."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    model = _mlp(0)
    loader = Loader(pos=11)
    sd = {"model": model, "loader": loader, "blob": b"abc", "bio": io.BytesIO(b"xyz"), "n": 4}
    dcp.compat.save(sd, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert json.loads((tmp_path / "c" / "metadata.json").read_bytes())["version"] == 2

    model2, loader2 = _mlp(1), Loader()
    target = {"model": model2, "loader": loader2, "blob": None, "bio": None, "n": 0}
    report = dcp.compat.load(target, storage_reader=FileSystemReader(tmp_path / "c"),
                             no_dist=True)
    assert report.missing_keys == [] and loader2.pos == 11 and target["n"] == 4
    assert target["model"] is model2 and target["loader"] is loader2
    for k, v in model.state_dict().items():
        assert_bitwise_equal(model2.state_dict()[k], v, k)
    assert target["blob"] == b"abc" and target["bio"].getvalue() == b"xyz"

    with pytest.raises(dcp.CheckpointError, match="differ"):
        dcp.compat.save(sd, checkpoint_id=tmp_path / "a", storage_writer=FileSystemWriter(
            tmp_path / "b"))
    with pytest.raises(dcp.CheckpointError, match="has no 'path'"):
        dcp.compat.save(sd, storage_writer=object())
    with pytest.raises(dcp.CheckpointError, match="give checkpoint_id"):
        dcp.compat.load(target)


def test_compat_names_used_through_the_module_alias(tmp_path):
    """What Accelerate (``dist_cp.save_state_dict(state_dict=...,
    storage_writer=dist_cp.FileSystemWriter(d), planner=DefaultSavePlanner())``)
    and Lightning (``save_state_dict(state, FileSystemWriter(path=...,
    single_file_per_rank=True))``, ``load_state_dict(state, reader)``) reach
    through ``import torch.distributed.checkpoint as dist_cp``, with
    ``dcp.compat`` in its place: loads exact; torch's own objects where
    they are settings; clear refusals naming the way."""
    import torch.distributed.checkpoint as torch_dcp

    import dcp.compat as dist_cp

    model = _mlp(0)
    sd = {"model": model.state_dict(), "step": 3}
    d = tmp_path / "accelerate"
    md = dist_cp.save_state_dict(state_dict=sd, storage_writer=dist_cp.FileSystemWriter(d),
                                 planner=dist_cp.DefaultSavePlanner())
    assert isinstance(md, dist_cp.Metadata) and isinstance(md, dcp.Metadata)
    target = {"model": _mlp(1).state_dict(), "step": 0}
    dist_cp.load_state_dict(state_dict=target, storage_reader=dist_cp.FileSystemReader(d),
                            planner=dist_cp.DefaultLoadPlanner())
    for k, v in sd["model"].items():
        assert_bitwise_equal(target["model"][k], v, k)
    assert target["step"] == 3

    lightning = tmp_path / "lightning.ckpt"  # Lightning's folder name; positional writer
    dist_cp.state_dict_saver.save_state_dict(
        sd, dist_cp.FileSystemWriter(path=lightning, single_file_per_rank=True))
    target = {"model": _mlp(2).state_dict(), "step": 0}
    dist_cp.state_dict_loader.load_state_dict(target, dist_cp.FileSystemReader(lightning))
    for k, v in sd["model"].items():
        assert_bitwise_equal(target["model"][k], v, k)
    target = {"model": _mlp(3).state_dict(), "step": 0}
    dist_cp.load(target, checkpoint_id=lightning)
    assert_bitwise_equal(target["model"]["0.weight"], sd["model"]["0.weight"], "load")

    # torch's own objects, hyperdcp's where it has one
    assert dist_cp.FileSystemWriter is torch_dcp.FileSystemWriter
    assert dist_cp.DefaultLoadPlanner is torch_dcp.DefaultLoadPlanner
    assert dist_cp.state_dict_saver.AsyncCheckpointerType.PROCESS.value == "process"
    assert dist_cp.CheckpointException is dcp.CheckpointError
    from dcp.core.planner import SavePlanner
    assert dist_cp.SavePlanner is SavePlanner

    # torch's way out, not hyperdcp keywords
    with pytest.raises(dist_cp.CheckpointException) as e:
        dist_cp.save_state_dict(sd, dist_cp.FileSystemWriter(d, overwrite=False))
    assert "FileSystemWriter(..., overwrite=True)" in str(e.value), str(e.value)
    with pytest.raises(dcp.CheckpointError) as e:
        dist_cp.load_state_dict({**target, "new": torch.zeros(1)}, dist_cp.FileSystemReader(d))
    assert "planner=DefaultLoadPlanner(allow_partial_load=True)" in str(e.value), str(e.value)
    assert "strict" not in str(e.value), str(e.value)

    # refusals: at the call, or at the name (hasattr says False)
    with pytest.raises(dcp.CheckpointError, match="get_optimizer_state_dict"):
        dist_cp.load_sharded_optimizer_state_dict(target["model"], "optimizer",
                                                  dist_cp.FileSystemReader(d))
    assert not hasattr(dist_cp, "StorageWriter")
    with pytest.raises(dcp.CheckpointError, match="StorageReader.s I/O would not run"):
        dist_cp.StorageReader  # noqa: B018
    with pytest.raises(dcp.CheckpointError, match="Hugging Face safetensors"):
        dist_cp.save(sd, storage_writer=torch_dcp.HuggingFaceStorageWriter(str(tmp_path / "hf")))
    with pytest.raises(AttributeError, match="has torch.distributed.checkpoint's save, load"):
        dist_cp.no_such_name  # noqa: B018


def test_a_torch_dcp_checkpoint_or_a_file_says_what_it_is(tmp_path):
    """Loaded as a checkpoint: a PyTorch DCP checkpoint says so and how to
    convert it once; a regular file says it is a file."""
    import warnings

    import torch.distributed.checkpoint as torch_dcp

    path = tmp_path / "torch_dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.save({"w": torch.ones(2)}, checkpoint_id=str(path), no_dist=True)
    (tmp_path / "model.pt").write_bytes(b"not a folder")
    for where, says in ((path, f"it is a PyTorch DCP checkpoint (.metadata, a pickle): convert "
                               f"it once, if you trust it, with `hyperdcp convert "
                               f"--trust-pickle {path} DST`"),
                        (tmp_path / "model.pt", "it is a file, not a folder")):
        for call in (lambda w=where: dcp.compat.load({"w": torch.zeros(2)}, checkpoint_id=w),
                     lambda w=where: dcp.load({"w": torch.zeros(2)}, str(w)),
                     lambda w=where: dcp.read_metadata(str(w))):
            with pytest.raises(dcp.NotACheckpointError) as e:
                call()
            assert says in str(e.value), str(e.value)


def test_stateful_errors_name_the_fqn(tmp_path):
    class Broken:
        def state_dict(self):
            raise ValueError("boom")

        def load_state_dict(self, sd):
            raise ValueError("bang")

    class Good(Broken):
        def state_dict(self):
            return {"x": 1}

    with pytest.raises(dcp.CheckpointError, match=r"'a.b': Broken.state_dict raised ValueError"):
        dcp.save({"a": {"b": Broken()}}, str(tmp_path / "s"))
    dcp.save({"a": [Good()]}, str(tmp_path / "g"))
    with pytest.raises(dcp.CheckpointError, match=r"'a.0': Good.load_state_dict raised"):
        dcp.load({"a": [Good()]}, str(tmp_path / "g"))
    with pytest.raises(dcp.CheckpointError, match=r"'a.0': Broken.state_dict raised"):
        dcp.load({"a": [Broken()]}, str(tmp_path / "g"))


def test_metadata_version_1_without_raw_blobs_and_raw_refused_in_version_1(tmp_path):
    from dcp.core.metadata import decode

    md = dcp.save({"w": torch.ones(2), "n": 1}, str(tmp_path / "v1"))
    doc = json.loads((tmp_path / "v1" / "metadata.json").read_bytes())
    assert doc["version"] == 1, "a checkpoint without raw blobs stays readable by older builds"
    assert md.objects["n"].value == 1
    dcp.save({"b": b"x"}, str(tmp_path / "v2"))
    doc = json.loads((tmp_path / "v2" / "metadata.json").read_bytes())
    assert doc["version"] == 2 and doc["objects"]["b"]["type"] == "bytes"
    doc["version"] = 1  # a raw entry is not part of version 1
    with pytest.raises(dcp.CorruptCheckpointError, match="object 'b'"):
        decode(json.dumps(doc).encode())
    doc["version"], doc["objects"]["b"]["type"] = 2, "pickle"
    with pytest.raises(dcp.CorruptCheckpointError, match="raw type 'pickle'"):
        decode(json.dumps(doc).encode())
    doc["version"] = 3
    with pytest.raises(dcp.CorruptCheckpointError, match="unsupported version 3"):
        decode(json.dumps(doc).encode())
