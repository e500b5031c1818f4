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
import re

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

    # torch's format_utils: a hyperdcp checkpoint to one torch.save file and back
    dcp.compat.format_utils.dcp_to_torch_save(tmp_path / "c", tmp_path / "c.pt")
    full = torch.load(tmp_path / "c.pt", weights_only=False)  # written just above
    assert sorted(full) == ["bio", "blob", "loader", "model", "n"], sorted(full)
    assert full["loader"] == {"pos": 11, "epoch": 0} and full["n"] == 4 and full["blob"] == b"abc"
    assert full["bio"].getvalue() == b"xyz"
    assert sorted(full["model"]) == sorted(model.state_dict())
    for k, v in model.state_dict().items():
        assert_bitwise_equal(full["model"][k], v, k)
    torch.save({"model": model.state_dict(), "step": 7}, tmp_path / "t.pt")
    from dcp.compat.format_utils import torch_save_to_dcp  # torch's tutorial spelling
    torch_save_to_dcp(tmp_path / "t.pt", tmp_path / "t")
    with pytest.raises(RuntimeError, match=r"'.*missing\.pt': not a torch\.save file .*"
                       r"FileNotFoundError"):
        torch_save_to_dcp(tmp_path / "missing.pt", tmp_path / "m")
    model3 = _mlp(2)
    target3 = {"model": model3, "step": 0}
    dcp.compat.load(target3, checkpoint_id=tmp_path / "t")
    assert target3["step"] == 7
    for k, v in model.state_dict().items():
        assert_bitwise_equal(model3.state_dict()[k], v, k)
    with pytest.raises(dcp.CheckpointError, match=re.escape(
            "dcp.compat.BroadcastingTorchSaveReader is not supported: a torch StorageReader's "
            "I/O would not run: convert the torch.save file once with "
            "dcp.compat.format_utils.torch_save_to_dcp and load that")):
        dcp.compat.format_utils.BroadcastingTorchSaveReader  # noqa: B018

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
    assert list(e.value.failures) == [0] and e.value.failures[0][0] is e.value  # torch's field
    assert "already holds a committed checkpoint" in e.value.failures[0][1]
    with pytest.raises(dcp.CheckpointError) as e:
        dist_cp.load_state_dict({**target, "new": torch.zeros(1)}, dist_cp.FileSystemReader(d))
    assert "planner=DefaultLoadPlanner(allow_partial_load=True)" in str(e.value), str(e.value)
    assert "strict" not in str(e.value), str(e.value)

    # refusals: at the call, or at the name (hasattr says False)
    with pytest.raises(dcp.CheckpointError, match="get_optimizer_state_dict"):
        dist_cp.load_sharded_optimizer_state_dict(target["model"], "optimizer",
                                                  dist_cp.FileSystemReader(d))
    assert not hasattr(dist_cp, "StorageWriter")
    assert not hasattr(dist_cp, "AsyncSaveResponse")  # async_save returns a Future
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
    doc["version"] = 4  # the next one (3 adds compressed chunks: test_compression.py)
    with pytest.raises(dcp.CorruptCheckpointError, match="unsupported version 4"):
        decode(json.dumps(doc).encode())


def _same(got, expected, where="<root>"):
    """``got`` is ``expected``: the same nesting (dicts, lists), tensors bit
    for bit at their dtype, other values equal."""
    if isinstance(expected, torch.Tensor):
        assert_bitwise_equal(got, expected, where)
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(expected), (where, got, expected)
        for k in expected:
            _same(got[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)) and expected and any(
            isinstance(v, (torch.Tensor, dict)) for v in expected):
        assert isinstance(got, list) and len(got) == len(expected), (where, got, expected)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _same(g, e, f"{where}.{i}")
    else:
        assert got == expected, (where, got, expected)


def test_load_keys_nests_as_torchs_load_state_dict_from_keys(tmp_path):
    """Issue 30 point 6: dcp.load_keys, and torch's helper through dcp.compat,
    nest each value along its saved path as torch's own
    _load_state_dict_from_keys does on a torch DCP checkpoint of the same
    state: dicts by string key, lists by int index, keys matched as whole
    path components; a checkpoint without recorded paths gives today's flat
    dict."""
    import warnings

    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from dcp.interop.torch_dcp_io import torch_dcp_to_checkpoint

    t = [random_tensor(s, d, seed) for seed, (s, d) in enumerate([
        ((3, 2), torch.float32), ((4,), torch.bfloat16), ((2,), torch.float64),
        ((5,), torch.float32), ((2, 2), torch.int32), ((3,), torch.float16), ((), torch.float32)])]
    state = {"model": {"a": t[0], "ab": t[1], "0.w": t[2]},  # a key holding a dot
             "blocks": [{"w": t[3]}, {"w": t[4], "n": 5}],
             "optim": {"state": {0: {"exp_avg": t[5], "step": t[6]}},
                       "param_groups": [{"lr": 0.5, "params": [0]}]},
             "model.ab": {"x": t[1]}, "step": 7}
    as_saved = {**state, "optim": {"state": {"0": state["optim"]["state"][0]},
                                   "param_groups": state["optim"]["param_groups"]}}
    ours, torchs, converted = (str(tmp_path / n) for n in ("ours", "torchs", "converted"))
    dcp.save(state, ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: no process group, one process
        tdcp.save(state, checkpoint_id=torchs, no_dist=True)
    torch_dcp_to_checkpoint(torchs, converted, trusted=True)
    assert dcp.read_metadata(converted).path("blocks.1.w") == ("blocks", 1, "w")
    assert dcp.read_metadata(converted).path("model.0.w") == ("model", "0.w")

    def torch_reads(keys):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _load_state_dict_from_keys(keys, checkpoint_id=torchs)

    compat = dcp.compat.state_dict_loader._load_state_dict_from_keys
    cases = {None: as_saved,
             "model.a": {"model": {"a": t[0]}},  # not model.ab, nor the key "model.ab"
             "model": {"model": state["model"]},
             "model.0": {},  # "0.w" is one key: "model.0" is no component of its path
             "blocks": {"blocks": state["blocks"]},
             "blocks.0": {"blocks": [state["blocks"][0]]},
             "optim.state": {"optim": {"state": as_saved["optim"]["state"]}},
             "optim.param_groups": {"optim": {"param_groups": [{"lr": 0.5, "params": [0]}]}},
             "absent": {}}
    for key, expected in cases.items():
        keys = None if key is None else {key}
        _same(torch_reads(keys), expected, f"torch's own, keys {key!r}")
        for where in (ours, converted):
            _same(compat(keys, checkpoint_id=where), expected, f"compat {key!r} from {where}")
            if expected:  # load_keys refuses a key that selects nothing
                _same(dcp.load_keys(where, keys), expected, f"load_keys {key!r} from {where}")
                _same(dcp.load_keys(where, prefix=key), expected, f"prefix {key!r} from {where}")
    # lists by int index; a list torch's own helper does not fill (it refuses the None)
    _same(dcp.load_keys(ours, "blocks.1"), {"blocks": [None, state["blocks"][1]]})
    _same(compat({"blocks.1.n"}, checkpoint_id=converted), {"blocks": [None, {"n": 5}]})
    _same(dcp.load_keys(ours, ["model.a", "model.ab"], prefix="model"),
          {"model": {"a": t[0], "ab": t[1]}})  # the key "model.ab" holds "model.ab.x": outside
    # an empty selection is no error
    assert dcp.load_keys(ours, []) == {} and compat(set(), checkpoint_id=ours) == {}
    assert dcp.load_keys(ours, prefix="model.a.") == {}
    with pytest.raises(dcp.CheckpointError, match="select nothing.*'absent'"):
        dcp.load_keys(ours, ["model.a", "absent"])

    # a checkpoint saved without the paths field: flat by fqn, keys by dotted fqn parts
    doc = json.loads((tmp_path / "ours" / "metadata.json").read_bytes())
    assert doc["paths"]["blocks.1.w"] == ["blocks", 1, "w"] and "step" not in doc["paths"]
    del doc["paths"]
    (tmp_path / "ours" / "metadata.json").write_text(json.dumps(doc))
    assert dcp.read_metadata(ours).paths is None
    flat = {"model.a": t[0], "model.ab": t[1], "model.0.w": t[2], "model.ab.x": t[1]}
    for got in (dcp.load_keys(ours, "model"), compat({"model"}, checkpoint_id=ours)):
        _same(got, flat, "no paths recorded")
    _same(dcp.load_keys(ours, "optim.state.0"), {"optim.state.0.exp_avg": t[5],
                                                  "optim.state.0.step": t[6]})
    # paths that disagree with their fqn are refused as corrupt
    from dcp.core.metadata import decode

    doc["paths"] = {"model.a": ["model", "b"]}
    with pytest.raises(dcp.CorruptCheckpointError, match="path of 'model.a'"):
        decode(json.dumps(doc).encode())


# ------------------------------------------- issue 30: the rest of torch's cases
#
# Saved at W=2 (phase 0) and loaded at W=4 (phase 1), saved at W=4 and loaded
# at W=2 (phase 2), through dcp.compat with torch's FileSystemWriter/Reader:
# ShardedTensors with 2 local shards per rank on both sides, DTensors over
# LocalShardsWrapper (uneven, several shards a rank), a tensor subclass that
# describes its own chunks, a DTensor made by from_local(shape=, stride=).

_SEV_ROWS = (8, 3)
#: ShardedTensor rows per rank, 2 local shards each, saved and loaded
_SEV = {2: [[(0, 2), (4, 6)], [(2, 4), (6, 8)]],
        4: [[(0, 1), (4, 5)], [(1, 2), (5, 6)], [(2, 3), (6, 7)], [(3, 4), (7, 8)]]}
#: LocalShardsWrapper / checkpointable rows per rank: uneven, several or none
_LSW_ROWS = (10, 2)
_LSW_SAVE = {2: [[(0, 3), (5, 6)], [(3, 5), (6, 10)]],
             4: [[(0, 1), (8, 9)], [(1, 4)], [(4, 6), (9, 10)], [(6, 8)]]}
_LSW_LOAD = {2: [[(0, 6)], [(6, 7), (7, 10)]],
             4: [[(0, 2)], [(2, 3), (9, 10)], [], [(3, 9)]]}
#: DTensor.from_local rows per rank (the last one short, as torch's test)
_UNEVEN = {2: [4, 3], 4: [2, 2, 2, 1]}
#: DTensor.from_local rows per rank the placements do not give (they say
#: _UNEVEN): each rank's offset is the sum of the rows before it
_SKEWED = {2: [5, 2], 4: [3, 2, 1, 1]}
#: a (2, 2) mesh's rows by coordinate, [Shard(0), Shard(0)]: mesh dim 0
#: splits the 7 rows into 4 and 3, mesh dim 1 each part unevenly
_SKEWED_2D = [[3, 1], [1, 2]]


class Checkpointable(torch.Tensor):
    """A tensor that describes its own chunks through torch DCP's protocol
    (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``), as torch's test type
    ``CheckpointableDistTensor``: any torch op on it raises."""

    @staticmethod
    def __new__(cls, shards, offsets, size):
        r = torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32)
        r._shards, r._offsets = shards, [torch.Size(o) for o in offsets]
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not supported for Checkpointable")

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=o, sizes=s.size())
                for o, s in zip(self._offsets, self._shards, strict=True)]

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=c, properties=TensorProperties.create_from_tensor(s),
                              size=self.shape))
                for c, s in zip(self.__create_chunk_list__(), self._shards, strict=True)]

    def __get_tensor_shard__(self, index):
        return self._shards[self._offsets.index(index.offset)]


def _rows(full, ranges):
    return [full[lo:hi].clone() for lo, hi in ranges], [(lo, 0) for lo, _ in ranges]


def _lsw(full, ranges, mesh):
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    shards, offsets = _rows(full, ranges)
    wrapper = LocalShardsWrapper(shards, offsets)
    return DTensor.from_local(wrapper, mesh, [Shard(0)], run_check=False,
                              shape=full.shape, stride=full.stride()), shards


def _uneven(full, ws, rank, mesh, sizes=None):
    from torch.distributed.tensor import DTensor, Shard

    sizes = _UNEVEN[ws] if sizes is None else sizes
    lo = sum(sizes[:rank])
    return DTensor.from_local(full[lo:lo + sizes[rank]].clone(), mesh, [Shard(0)],
                              run_check=False, shape=full.shape, stride=full.stride())


def _skewed_2d(full, rank, mesh):
    """Rank ``rank``'s rows of ``full`` on a (2, 2) mesh sharding dim 0 twice,
    by :data:`_SKEWED_2D`."""
    from torch.distributed.tensor import DTensor, Shard

    i, j = divmod(rank, 2)
    lo = sum(map(sum, _SKEWED_2D[:i])) + sum(_SKEWED_2D[i][:j])
    return DTensor.from_local(full[lo:lo + _SKEWED_2D[i][j]].clone(), mesh, [Shard(0), Shard(0)],
                              run_check=False, shape=full.shape, stride=full.stride()), lo


def _several(name):
    return {"st": random_tensor(_SEV_ROWS, torch.float32, seed=31),
            "lsw": random_tensor(_LSW_ROWS, torch.float32, seed=32),
            "cdt": random_tensor(_LSW_ROWS, torch.float32, seed=33),
            "uneven": random_tensor((7, 2), torch.float32, seed=34),
            "skewed": random_tensor((7, 2), torch.float32, seed=35)}[name]


def _save_several(ctx, name):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ws, rank = ctx.world_size, ctx.rank
    mesh = init_device_mesh("cpu", (ws,))
    shards, offsets = _rows(_several("cdt"), _LSW_SAVE[ws][rank])
    sd = {"st": _sharded(_several("st"), _SEV[ws], rank),
          "lsw": _lsw(_several("lsw"), _LSW_SAVE[ws][rank], mesh)[0],
          "cdt": Checkpointable(shards, offsets, _LSW_ROWS),
          "uneven": _uneven(_several("uneven"), ws, rank, mesh),
          # shards the placements do not give (they say _UNEVEN): torch 2.13
          # commits the placements' boxes over other bytes
          "skewed": _uneven(_several("skewed"), ws, rank, mesh, _SKEWED[ws])}
    mesh_2d = init_device_mesh("cpu", (2, 2)) if ws == 4 else None
    if mesh_2d is not None:  # two mesh dims sharding one tensor dim, unevenly; replicas
        sd["skewed_2d"] = _skewed_2d(_several("skewed"), rank, mesh_2d)[0]
        lo = sum(_SKEWED[2][:rank % 2])
        sd["skewed_replicated"] = DTensor.from_local(
            _several("uneven")[lo:lo + _SKEWED[2][rank % 2]].clone(), mesh_2d,
            [Replicate(), Shard(0)], run_check=False, shape=(7, 2), stride=(2, 1))
    md = dcp.compat.save(sd, storage_writer=FileSystemWriter(ctx.shared / name))
    assert len(md.tensors["st"].chunks) == 2 * ws, md.tensors["st"].chunks
    assert sorted(c.offsets[0] for c in md.tensors["lsw"].chunks) == sorted(
        lo for ranges in _LSW_SAVE[ws] for lo, _ in ranges)
    for fqn, sizes in (("uneven", _UNEVEN[ws]), ("skewed", _SKEWED[ws]),
                       ("skewed_2d", [n for row in _SKEWED_2D for n in row]),
                       ("skewed_replicated", _SKEWED[2])):
        if fqn in md.tensors:
            boxes = sorted((c.offsets, c.sizes) for c in md.tensors[fqn].chunks)
            assert boxes == [((sum(sizes[:r]), 0), (n, 2)) for r, n in enumerate(sizes)], boxes
    # loaded back at once, through dcp.load, into the same layouts and whole
    again = _uneven(torch.zeros(7, 2), ws, rank, mesh, _SKEWED[ws])
    whole = torch.zeros(7, 2)
    dcp.load({"skewed": again}, str(ctx.shared / name))
    dcp.load({"skewed": whole}, str(ctx.shared / name))
    lo = sum(_SKEWED[ws][:rank])
    assert_bitwise_equal(again.to_local(), _several("skewed")[lo:lo + _SKEWED[ws][rank]],
                         "skewed DTensor, same W")
    assert_bitwise_equal(whole, _several("skewed"), "skewed DTensor as plain, same W")
    if mesh_2d is not None:
        target, lo = _skewed_2d(torch.zeros(7, 2), rank, mesh_2d)
        dcp.load({"skewed_2d": target}, str(ctx.shared / name))
        i, j = divmod(rank, 2)
        assert_bitwise_equal(target.to_local(), _several("skewed")[lo:lo + _SKEWED_2D[i][j]],
                             "skewed 2-D mesh DTensor")

    # layouts whose boxes do not tile, a protocol that raises: refused before any I/O
    bad = ctx.dir / "bad"
    past = {2: [4, 4], 4: [2, 2, 2, 2]}[ws]  # 8 rows of 7: the last rank's lie past the end
    wrong = DTensor.from_local(torch.zeros(past[rank], 2), mesh, [Shard(0)], run_check=False,
                               shape=(7, 2), stride=(2, 1))
    with pytest.raises(dcp.CheckpointError,
                       match=r"'wrong': DTensor of shape \(2, 2\) at offsets \(6, 0\) does not "
                             r"fit global shape \(7, 2\)" if ws == 4 else
                             r"'wrong': DTensor of shape \(4, 2\) at offsets \(4, 0\) does not "
                             r"fit global shape \(7, 2\)"):
        dcp.compat.save({"wrong": wrong}, checkpoint_id=bad)
    short = {2: [3, 3], 4: [2, 2, 1, 1]}[ws]  # 6 rows of 7
    missing = DTensor.from_local(torch.zeros(short[rank], 2), mesh, [Shard(0)],
                                 run_check=False, shape=(7, 2), stride=(2, 1))
    with pytest.raises(dcp.CheckpointError,
                       match=r"'missing': the ranks' chunks cover 12 of its 14 elements"):
        dcp.compat.save({"missing": missing}, checkpoint_id=bad)
    from torch.distributed.tensor.placement_types import _StridedShard

    lo = sum(_SKEWED[ws][:rank])
    strided = DTensor.from_local(_several("skewed")[lo:lo + _SKEWED[ws][rank]].clone(), mesh,
                                 [_StridedShard(0, split_factor=2)], run_check=False,
                                 shape=(7, 2), stride=(2, 1))
    with pytest.raises(dcp.CheckpointError,
                       match=r"'strided': a DTensor with strided-shard placements"):
        dcp.save({"strided": strided}, str(bad))

    class Failing:  # raises on the last rank only, before its leaves are known
        def state_dict(self):
            if rank == ws - 1:
                raise ValueError("no state here")
            return {"w": sd["skewed"]}

        def load_state_dict(self, state_dict):
            pass

    with pytest.raises(dcp.CheckpointError, match=rf"failed on rank {ws - 1}: .*no state here"):
        dcp.save({"m": Failing()}, str(bad))
    with pytest.raises(dcp.CheckpointError, match=rf"failed on rank {ws - 1}: .*no state here"):
        dcp.load({"m": Failing()}, str(ctx.shared / name), strict=False)

    class Broken(Checkpointable):
        def __get_tensor_shard__(self, index):
            raise KeyError(index)

    with pytest.raises(dcp.CheckpointError,
                       match="'b': Broken implements torch DCP's checkpointable protocol"):
        dcp.compat.save({"b": Broken(shards, offsets, _LSW_ROWS)}, checkpoint_id=bad)
    assert not bad.exists()


def _load_several(ctx, name):
    from torch.distributed.checkpoint import FileSystemReader

    ws, rank = ctx.world_size, ctx.rank
    mesh = init_device_mesh("cpu", (ws,))
    reader = FileSystemReader(ctx.shared / name)
    lsw, lsw_shards = _lsw(torch.zeros(_LSW_ROWS), _LSW_LOAD[ws][rank], mesh)
    cdt_shards, offsets = _rows(torch.zeros(_LSW_ROWS), _LSW_LOAD[ws][rank])
    target = {"st": _sharded(torch.zeros(_SEV_ROWS), _SEV[ws], rank), "lsw": lsw,
              "cdt": Checkpointable(cdt_shards, offsets, _LSW_ROWS),
              "uneven": torch.zeros(7, 2)}
    dcp.compat.load(target, storage_reader=reader)
    assert len(target["st"].local_shards()) == 2
    _assert_sharded(target["st"], _several("st"), f"2 local shards each, at W={ws}")
    for fqn, shards in (("lsw", lsw_shards), ("cdt", cdt_shards)):
        for (lo, hi), shard in zip(_LSW_LOAD[ws][rank], shards, strict=True):
            assert_bitwise_equal(shard, _several(fqn)[lo:hi], f"{fqn} rows {lo}:{hi}")
    assert_bitwise_equal(target["uneven"], _several("uneven"), "from_local(shape=) as plain")

    # and across kinds: each into 2-shard ShardedTensors and uneven from_local DTensors
    fqns = ("st", "lsw", "cdt")
    sts = {f: _sharded(torch.zeros(_SEV_ROWS if f == "st" else _LSW_ROWS),
                       {2: [[(0, 1), (5, 8)], [(1, 5), (8, 10)]],
                        4: [[(0, 1), (4, 5)], [(1, 2), (5, 6)], [(2, 3), (6, 7)],
                            [(3, 4), (7, 10)]]}[ws] if f != "st" else _SEV[ws], rank)
           for f in fqns}
    sts["st"] = _sharded(torch.zeros(_SEV_ROWS), {2: [[(0, 5), (7, 8)], [(5, 7)]],
                                                  4: _SEV[4]}[ws], rank)
    dcp.compat.load(sts, checkpoint_id=ctx.shared / name)
    for f in fqns:
        _assert_sharded(sts[f], _several(f), f"{f} -> ShardedTensor at W={ws}")
    uneven = {"uneven": _uneven(torch.zeros(7, 2), ws, rank, mesh)}
    dcp.compat.load(uneven, checkpoint_id=ctx.shared / name)
    lo = sum(_UNEVEN[ws][:rank])
    assert_bitwise_equal(uneven["uneven"].to_local(),
                         _several("uneven")[lo:lo + _UNEVEN[ws][rank]], "uneven DTensor")

    # shards the placements do not give, saved at the other W: into plain
    # tensors, the same layout, the placements' layout, and the placements'
    # layout saved into them
    whole = {"skewed": torch.zeros(7, 2)}
    dcp.compat.load(whole, checkpoint_id=ctx.shared / name)
    assert_bitwise_equal(whole["skewed"], _several("skewed"), "skewed DTensor as plain")
    for source, sizes, load in (("skewed", _SKEWED[ws], dcp.compat.load),
                                ("skewed", _UNEVEN[ws], dcp.compat.load),
                                ("uneven", _SKEWED[ws], dcp.load)):
        target = _uneven(torch.zeros(7, 2), ws, rank, mesh, sizes)
        if load is dcp.load:
            dcp.load({source: target}, str(ctx.shared / name))
        else:
            dcp.compat.load({source: target}, checkpoint_id=ctx.shared / name)
        lo = sum(sizes[:rank])
        assert_bitwise_equal(target.to_local(), _several(source)[lo:lo + sizes[rank]],
                             f"{source} into rows {sizes}")
    if ws == 2:  # saved at W=4 on a (2, 2) mesh
        whole = {"skewed_2d": torch.zeros(7, 2), "skewed_replicated": torch.zeros(7, 2)}
        dcp.load(whole, str(ctx.shared / name))
        assert_bitwise_equal(whole["skewed_2d"], _several("skewed"), "skewed 2-D mesh as plain")
        assert_bitwise_equal(whole["skewed_replicated"], _several("uneven"),
                             "skewed replicated as plain")

    # no targets: dcp.load_keys, and torch's _load_state_dict_from_keys routed to it
    from torch.distributed.checkpoint import state_dict_loader  # noqa: F401 - torch's module

    got = dcp.load_keys(str(ctx.shared / name), ["st", "cdt"])
    assert list(got) == ["st", "cdt"], list(got)
    for f in ("st", "cdt"):
        assert got[f].device.type == "cpu"
        assert_bitwise_equal(got[f], _several(f), f"load_keys {f}")
    assert list(dcp.load_keys(str(ctx.shared / name), prefix="lsw")) == ["lsw"]
    assert dcp.load_keys(str(ctx.shared / name), prefix="ls") == {}, "whole components only"
    nested = dcp.compat.state_dict_loader._load_state_dict_from_keys(
        {"lsw", "uneven"}, checkpoint_id=ctx.shared / name)
    assert sorted(nested) == ["lsw", "uneven"], nested.keys()
    assert_bitwise_equal(nested["lsw"], _several("lsw"), "_load_state_dict_from_keys")
    assert dcp.compat.state_dict_loader._load_state_dict_from_keys(
        "absent", checkpoint_id=ctx.shared / name) == {}, "torch's: no error"


class _Gathers:
    """A Stateful whose load_state_dict all-gathers (torch's test: ``Foo``)."""

    def __init__(self):
        self.got = None

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        import torch.distributed as dist

        ws = dist.get_world_size()
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(ws)]
        dist.all_gather(out, torch.arange(2, dtype=torch.int64) + 1 + 2 * dist.get_rank())
        self.got = torch.cat(out)


class _Reduces:
    """A Stateful whose load_state_dict all-reduces (torch's test: ``Bar``)."""

    def __init__(self):
        self.got = None

    def state_dict(self):
        return {"w": torch.arange(3.0)}

    def load_state_dict(self, state_dict):
        import torch.distributed as dist

        t = torch.arange(2, dtype=torch.int64) + 1 + 2 * dist.get_rank()
        dist.all_reduce(t)
        self.got = (t, state_dict["w"].clone())


def _statefuls_with_collectives(ctx):
    """Statefuls whose load_state_dict runs collectives, under keys in
    reversed orders on odd ranks (nested too): every rank calls them in one
    order, so the collectives meet (they crossed, and the job waited for its
    timeout, when each rank called them in its own dict's order)."""
    ws, rank = ctx.world_size, ctx.rank
    path = ctx.dir / "ordered"
    items = [("A", _Gathers()), ("B", _Reduces()), ("C", {"inner": _Reduces(), "x": 1})]
    sd = dict(items if rank % 2 == 0 else reversed(items))
    dcp.compat.save(sd, checkpoint_id=path)
    dcp.compat.load(sd, checkpoint_id=path)
    expected = torch.arange(1, 2 * ws + 1, dtype=torch.int64)
    assert torch.equal(sd["A"].got, expected), sd["A"].got
    summed = sum(torch.arange(2, dtype=torch.int64) + 1 + 2 * r for r in range(ws))
    for reduces in (sd["B"], sd["C"]["inner"]):
        assert torch.equal(reduces.got[0], summed), reduces.got
        assert_bitwise_equal(reduces.got[1], torch.arange(3.0), "loaded before")


def _tutorial_overwrite_loop(ctx):
    """The DCP tutorial's loop, unchanged but for the import: a save each
    step over the same folder with ``FileSystemWriter(..., overwrite=True)``
    (also torch's default), each loaded back exactly; torch's other writer
    settings mapped or refused by name."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example

    import dcp.compat as dcp_  # was: import torch.distributed.checkpoint as dcp

    ws = ctx.world_size
    checkpoint_dir = ctx.dir / "tutorial"
    model = _fsdp_model(ws, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    for step in range(3):
        _train(model, optimizer, sched, seed=step, steps=1)
        state_dict = {"app": AppState(model, optimizer)}
        writer = (FileSystemWriter(checkpoint_dir, overwrite=True) if step != 1 else
                  FileSystemWriter(checkpoint_dir, thread_count=2, sync_files=False,
                                   _extensions=[ZStandard()]))
        dcp_.save(state_dict, storage_writer=writer)
        chunks = [c for t in dcp.read_metadata(str(checkpoint_dir)).tensors.values()
                  for c in t.chunks]
        assert any(c.frames is not None for c in chunks) == (step == 1)  # ZStandard: zstd
        expected = _expected(model, optimizer)
        model2 = _fsdp_model(ws, seed=9)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.3)
        _train(model2, opt2, torch.optim.lr_scheduler.StepLR(opt2, 1), seed=7, steps=1)
        dcp_.load({"app": AppState(model2, opt2)}, checkpoint_id=checkpoint_dir)
        _check_expected(model2, opt2, expected, f"tutorial step {step}")
    files = sorted(p.name for p in checkpoint_dir.iterdir())
    assert len({f.split(".")[1] for f in files if f.endswith(".data")}) == 1, files  # old gone
    with pytest.raises(RuntimeError, match="^Checkpoint already exists"):
        dcp_.save({"app": AppState(model, optimizer)},
                  storage_writer=FileSystemWriter(checkpoint_dir, overwrite=False))
    for kwargs, name in ((dict(per_thread_copy_ahead=1), "per_thread_copy_ahead"),
                         (dict(_extensions=[ZStandard(), Rot13Example()]), "_extensions")):
        with pytest.raises(dcp.CheckpointError, match=f"FileSystemWriter\\({name}="):
            dcp_.save({"w": torch.zeros(2)},
                      storage_writer=FileSystemWriter(ctx.dir / "refused", **kwargs))
    assert not (ctx.dir / "refused").exists()
    _check_expected(model2, opt2, expected, "the last step, after the refusals")


@dist_scenario(world_size=2, phase=0)
def test_compat_several_shards_a_rank_saved_at_2(ctx):
    _save_several(ctx, "several_w2")


@dist_scenario(world_size=4, phase=1)
def test_compat_several_shards_a_rank_resharded_2_to_4(ctx):
    _load_several(ctx, "several_w2")


@dist_scenario(world_size=4, phase=1)
def test_compat_several_shards_a_rank_saved_at_4(ctx):
    _save_several(ctx, "several_w4")


@dist_scenario(world_size=2, phase=2)
def test_compat_several_shards_a_rank_resharded_4_to_2(ctx):
    _load_several(ctx, "several_w4")


@dist_scenario(world_size=2, phase=0)
def test_compat_statefuls_with_collectives_at_2(ctx):
    _statefuls_with_collectives(ctx)


@dist_scenario(world_size=4, phase=1)
def test_compat_statefuls_with_collectives_at_4(ctx):
    _statefuls_with_collectives(ctx)


@dist_scenario(world_size=2, phase=0)
def test_compat_tutorial_overwrite_loop(ctx):
    _tutorial_overwrite_loop(ctx)


def test_compat_top_level_values_set_through_the_callers_dict(tmp_path):
    """Non-Stateful top-level values are set through the caller's
    ``__setitem__`` after a load (a dict subclass sees it), Statefuls are
    loaded in place and never replaced: torch's
    ``test_stateful_and_non_stateful_loads``."""

    class StateDict(dict):
        def __init__(self):
            self.set_keys = []

        def __setitem__(self, key, value):
            self.set_keys.append(key)
            super().__setitem__(key, value)

    loader = Loader(pos=3)
    sd = StateDict()
    sd["loader"] = loader
    sd.set_keys.clear()
    dcp.compat.save(sd, checkpoint_id=tmp_path / "a")
    loader.pos = 0
    dcp.compat.load(sd, checkpoint_id=tmp_path / "a")
    assert loader.pos == 3 and sd["loader"] is loader and sd.set_keys == []

    sd = StateDict()
    inner = {"w": torch.arange(6.0), "n": [1, 2]}
    sd["foo"], sd["loader"] = inner, Loader(pos=5)
    dcp.compat.save(sd, checkpoint_id=tmp_path / "b")
    inner["w"].zero_()
    sd.set_keys.clear()
    dcp.compat.load(sd, checkpoint_id=tmp_path / "b")
    assert sd.set_keys == ["foo"] and sd["foo"] is inner  # filled in place, then set
    assert_bitwise_equal(inner["w"], torch.arange(6.0), "w")

    sd = StateDict()  # no Stateful at all: torch's second case
    sd["foo"] = inner
    dcp.compat.save(sd, checkpoint_id=tmp_path / "c")
    inner["w"].zero_()
    sd.set_keys.clear()
    dcp.compat.load(sd, checkpoint_id=tmp_path / "c")
    assert sd.set_keys == ["foo"] and sd["foo"] is inner, sd.set_keys
    assert_bitwise_equal(inner["w"], torch.arange(6.0), "w, no Stateful")


def test_compat_errors_are_runtime_errors_in_torch_words(tmp_path):
    """Code written for torch DCP catches ``RuntimeError`` and matches
    torch's words: "Cannot detect" for an id no storage plugin serves,
    "Checkpoint already exists", "Missing key in checkpoint state_dict";
    each is a dcp.CheckpointError too."""
    from torch.distributed.checkpoint import FileSystemWriter

    for call in (lambda: dcp.compat.save({"w": torch.zeros(2)}, checkpoint_id="abc://abc.abc"),
                 lambda: dcp.compat.load({"w": torch.zeros(2)}, checkpoint_id="abc://abc.abc")):
        with pytest.raises(RuntimeError, match="^Cannot detect which StorageReader or "
                                               "StorageWriter to use for 'abc://abc.abc'") as e:
            call()
        assert isinstance(e.value, dcp.CheckpointError)
    dcp.compat.save({"w": torch.arange(2.0)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(RuntimeError, match="^Checkpoint already exists") as e:
        dcp.compat.save({"w": torch.zeros(2)},
                        storage_writer=FileSystemWriter(tmp_path / "c", overwrite=False))
    assert isinstance(e.value, dcp.CheckpointError)
    with pytest.raises(RuntimeError, match="^Missing key in checkpoint state_dict.*: v"):
        dcp.compat.load({"v": torch.zeros(2)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(dcp.CorruptCheckpointError) as e:  # subclasses keep their kind
        (tmp_path / "c" / "metadata.json").write_text("{")
        dcp.compat.load({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "c")
    assert isinstance(e.value, RuntimeError)
    target = {"w": torch.zeros(2)}
    with pytest.raises(dcp.NotACheckpointError):
        dcp.load(target, str(tmp_path / "none"))  # hyperdcp's own API: not RuntimeErrors
