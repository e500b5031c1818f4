"""Parallel conversions (:mod:`dcp.interop.parallel`): the same bytes from 2
ranks as from 1 (safetensors and PyTorch DCP, both ways), the memory
budget, export casting and prefix filtering, and errors naming the tensor
and file."""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dcp
from dcp.interop import parallel, torch_dcp_io
from dcp.interop.parallel import BufferPool, ByteBudget, tensor_bytes
from dcp.interop.safetensors_io import checkpoint_to_safetensors, safetensors_to_checkpoint
from dcp.interop.torch_dcp_io import checkpoint_to_torch_dcp, torch_dcp_to_checkpoint
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, random_tensor

BUDGET = 1 << 20  # small: many data files, several in flight


def _model() -> dict[str, torch.Tensor]:
    """Mixed dtypes and sizes (some above the budget), a 0-dim and an empty
    tensor; the same on every rank."""
    sd = {}
    for i, (shape, dtype) in enumerate([((300, 512), torch.float32), ((7, 3), torch.bfloat16),
                                        ((1000,), torch.int64), ((700, 500), torch.float32),
                                        ((), torch.float32), ((0, 4), torch.float16),
                                        ((64, 64), torch.float16), ((5,), torch.bool)]):
        sd[f"model.layer{i}.w"] = random_tensor(shape, dtype, seed=i)
    sd["optim.state.m"] = random_tensor((10, 10), torch.float32, seed=99)
    return sd


def _hf_folder(folder: Path) -> Path:
    """The model as a sharded safetensors folder (3 files)."""
    if (folder / "model.safetensors.index.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    sd, keys, weight_map = _model(), list(_model()), {}
    for k in range(3):
        name = f"model-{k + 1:05d}-of-00003.safetensors"
        part = {key: sd[key] for key in keys[k::3]}
        save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _fingerprint(ckpt: Path) -> tuple[dict, dict]:
    """A checkpoint's data files by name without the save id (bytes), and
    every chunk without its writer rank and save id."""
    md = dcp.read_metadata(str(ckpt))
    strip = lambda name: re.sub(r"\.[0-9a-f]{16}\.", ".", name)  # noqa: E731
    files = {strip(name): (ckpt / name).read_bytes() for name in md.files()}
    chunks = {fqn: (meta.shape, meta.dtype, [(c.offsets, c.sizes, strip(c.file), c.byte_offset,
                                              c.nbytes, c.checksum) for c in meta.chunks])
              for fqn, meta in md.tensors.items()}
    return files, chunks


@dist_scenario(world_size=2, phase=0)
def test_two_rank_conversions(ctx):
    import torch.distributed as dist

    src = ctx.shared / "parallel-hf"
    if ctx.rank == 0:
        _hf_folder(src)
    ctx.barrier()
    md = safetensors_to_checkpoint(str(src), str(ctx.shared / "parallel-2"), buffer_bytes=BUDGET,
                                   process_group=dist.group.WORLD)
    assert md.world_size == 2 and len(md.tensors) == len(_model())
    assert {c.rank for t in md.tensors.values() for c in t.chunks} == {0, 1}
    result = checkpoint_to_safetensors(str(ctx.shared / "parallel-2"),
                                       str(ctx.shared / "parallel-2-export"),
                                       max_shard_size="400KB", dtype="bfloat16", model_only=True,
                                       buffer_bytes=BUDGET, process_group=dist.group.WORLD)
    assert len(result.files) > 3 and result.files[-1] == "model.safetensors.index.json"
    # PyTorch DCP, both ways: each rank converts a share, one commit
    torch_src = ctx.shared / "parallel-torch"
    if ctx.rank == 0:
        _torch_save({**_model(), "meta": {"epoch": 3}}, torch_src)
        _torch_save({"strided": torch.ones(3, 2).T}, ctx.shared / "strided-torch")
    ctx.barrier()
    md = torch_dcp_to_checkpoint(str(torch_src), str(ctx.shared / "parallel-torch-2"),
                                 trusted=True, buffer_bytes=BUDGET, process_group=dist.group.WORLD)
    assert md.world_size == 2 and md.objects["meta.epoch"].value == 3
    assert {c.rank for t in md.tensors.values() for c in t.chunks} == {0, 1}
    checkpoint_to_torch_dcp(str(ctx.shared / "parallel-torch-2"),
                            str(ctx.shared / "parallel-torch-2-export"), buffer_bytes=BUDGET,
                            process_group=dist.group.WORLD)
    # the CLI under torchrun (its WORLD_SIZE) shares the PyTorch DCP conversions alike
    from unittest import mock

    from dcp.tools.cli import main as hyperdcp
    with mock.patch.dict("os.environ", {"WORLD_SIZE": "2"}):
        assert hyperdcp(["convert", str(torch_src), str(ctx.shared / "parallel-torch-cli"),
                         "--trust-pickle", "--buffer-bytes", str(BUDGET)]) == 0
    # a value rank 0 cannot read (pickled, no allow_pickle) fails every rank, none waits
    pickled = ctx.shared / "parallel-pickled"
    dcp.save({"w": torch.ones(4), "obj": {1, 2}}, str(pickled), allow_pickle=True)
    with pytest.raises(dcp.CheckpointError, match="allow_pickle"):
        checkpoint_to_torch_dcp(str(pickled), str(ctx.shared / "pickled-export"),
                                process_group=dist.group.WORLD)
    with pytest.raises(dcp.CheckpointError, match=r"'strided'.*stride.*without a process group"):
        torch_dcp_to_checkpoint(str(ctx.shared / "strided-torch"), str(ctx.shared / "strided"),
                                trusted=True, process_group=dist.group.WORLD)


def test_two_ranks_write_the_same_bytes_as_one(dist_groups, tmp_path):
    scenario = test_two_rank_conversions
    dist_groups.check(f"{scenario.__module__}:{scenario.__qualname__}")
    shared = dist_groups.shared
    src = _hf_folder(tmp_path / "hf")
    safetensors_to_checkpoint(str(src), str(tmp_path / "one"), buffer_bytes=BUDGET)
    assert _fingerprint(tmp_path / "one") == _fingerprint(shared / "parallel-2")
    assert len(_fingerprint(tmp_path / "one")[0]) >= 2  # several files: both ranks wrote some
    checkpoint_to_safetensors(str(tmp_path / "one"), str(tmp_path / "export"),
                              max_shard_size="400KB", dtype="bfloat16", model_only=True,
                              buffer_bytes=BUDGET)
    names = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert names == sorted(p.name for p in (shared / "parallel-2-export").iterdir())
    for name in names:
        assert (tmp_path / "export" / name).read_bytes() == \
            (shared / "parallel-2-export" / name).read_bytes(), name
    torch_dcp_to_checkpoint(str(shared / "parallel-torch"), str(tmp_path / "torch-one"),
                            trusted=True, buffer_bytes=BUDGET)
    assert _fingerprint(tmp_path / "torch-one") == _fingerprint(shared / "parallel-torch-2")
    assert _fingerprint(tmp_path / "torch-one") == _fingerprint(shared / "parallel-torch-cli")
    exported = shared / "parallel-torch-2-export"
    assert {p.name[:3] for p in exported.glob("*.distcp")} == {"__0", "__1"}  # both ranks wrote
    target = {fqn: torch.zeros_like(t) for fqn, t in _model().items()}
    target["meta"] = {"epoch": None}
    _torch_load(target, exported)
    assert target.pop("meta") == {"epoch": 3}
    for fqn, value in _model().items():
        assert_bitwise_equal(target[fqn], value, fqn)


def _torch_save(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as torch_dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _torch_load(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as torch_dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.load(state, checkpoint_id=str(path), no_dist=True)


def test_export_casts_floating_point_tensors_and_filters_by_prefix(tmp_path):
    sd = _model()
    dcp.save(sd, str(tmp_path / "ckpt"))
    result = checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                       dtype="bfloat16", model_only=True, buffer_bytes=BUDGET)
    assert result.files == ["model.safetensors"]
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(k.removeprefix("model.") for k in sd
                                          if k.startswith("model."))
        for fqn, value in sd.items():
            if not fqn.startswith("model."):
                continue
            expected = value.to(torch.bfloat16) if value.is_floating_point() else value
            assert_bitwise_equal(f.get_tensor(fqn.removeprefix("model.")), expected, fqn)
    # a torch.dtype means the same as its name
    checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out2"),
                              dtype=torch.bfloat16, model_only=True, buffer_bytes=BUDGET)
    assert (tmp_path / "out2" / "model.safetensors").read_bytes() == \
        (tmp_path / "out" / "model.safetensors").read_bytes()
    checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "opt"), prefix="optim.")
    with safe_open(tmp_path / "opt" / "model.safetensors", "pt") as f:
        assert list(f.keys()) == ["state.m"]
        assert_bitwise_equal(f.get_tensor("state.m"), sd["optim.state.m"], "optim.state.m")
    with pytest.raises(dcp.CheckpointError, match="no tensor whose fqn starts with 'nope.'"):
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "x"), prefix="nope.")
    with pytest.raises(dcp.CheckpointError, match="'int8' is not a floating-point dtype"):
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "x"), dtype="int8")
    with pytest.raises(dcp.CheckpointError, match="'int8' is not a floating-point dtype"):
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "x"), dtype=torch.int8)


def test_a_corrupt_chunk_fails_the_import_naming_tensor_and_file_and_commits_nothing(tmp_path):
    src = _hf_folder(tmp_path / "hf")
    path = src / "model-00001-of-00003.safetensors"
    path.write_bytes(path.read_bytes()[:-100])  # truncated: its last tensor is short
    with pytest.raises(dcp.CheckpointError, match=r"model-00001-of-00003\.safetensors"):
        safetensors_to_checkpoint(str(src), str(tmp_path / "ckpt"), buffer_bytes=BUDGET)
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())


def test_conversion_files_are_listed_as_orphans_and_replaced_on_overwrite(tmp_path):
    from dcp.core.storage import open_storage
    from dcp.orchestration.inventory import inspect_checkpoint

    src, ckpt = _hf_folder(tmp_path / "hf"), tmp_path / "ckpt"
    safetensors_to_checkpoint(str(src), str(ckpt), buffer_bytes=BUDGET)
    first = {p.name for p in ckpt.iterdir()} - {"metadata.json"}
    assert first and all(n.startswith("convert-") for n in first)
    stale = ckpt / "convert-00042.0123456789abcdef.data"  # an interrupted conversion's
    stale.write_bytes(b"x" * 10)
    inventory = inspect_checkpoint(open_storage(str(ckpt)))
    assert inventory.state == "complete" and list(inventory.orphans) == [stale.name]
    safetensors_to_checkpoint(str(src), str(ckpt), buffer_bytes=BUDGET, overwrite=True)
    now = {p.name for p in ckpt.iterdir()}
    assert not now & first and stale.name not in now
    assert not inspect_checkpoint(open_storage(str(ckpt))).orphans


def test_byte_budget_holds_at_most_its_capacity_but_lets_a_larger_request_pass_alone():
    budget = ByteBudget(10)
    budget.acquire(6)
    budget.acquire(4)
    assert budget.held == 10
    budget.release(10)
    budget.acquire(25)  # larger than the whole budget: granted once nothing is held
    assert budget.peak == 25
    budget.release(25)


def test_conversions_hold_tensors_within_the_budget_less_its_reserve(tmp_path, monkeypatch):
    """Every conversion's byte budget is ``buffer_bytes`` less the share
    kept for the process's own memory, and what it held stayed within that
    (or one tensor larger than it, alone)."""
    budgets: list[ByteBudget] = []

    class Recorded(ByteBudget):
        def __init__(self, capacity: int) -> None:
            super().__init__(capacity)
            budgets.append(self)

    monkeypatch.setattr(parallel, "ByteBudget", Recorded)
    monkeypatch.setattr(torch_dcp_io, "ByteBudget", Recorded)
    largest = max(t.numel() * t.element_size() for t in _model().values())
    src = _hf_folder(tmp_path / "hf")
    safetensors_to_checkpoint(str(src), str(tmp_path / "ckpt"), buffer_bytes=BUDGET)
    checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "hf-out"),
                              max_shard_size="400KB", buffer_bytes=BUDGET)
    checkpoint_to_torch_dcp(str(tmp_path / "ckpt"), str(tmp_path / "torch"), buffer_bytes=BUDGET)
    torch_dcp_to_checkpoint(str(tmp_path / "torch"), str(tmp_path / "back"), trusted=True,
                            buffer_bytes=BUDGET)
    assert len(budgets) == 4
    assert tensor_bytes(BUDGET) == BUDGET - BUDGET // 16
    for budget in budgets:
        assert budget.capacity == tensor_bytes(BUDGET)
        assert 0 < budget.peak <= max(budget.capacity, largest), budget.peak
    target = {fqn: torch.zeros_like(t) for fqn, t in _model().items()}
    dcp.load(target, str(tmp_path / "back"))
    for fqn, t in _model().items():
        assert_bitwise_equal(target[fqn], t, fqn)


def test_buffer_pool_hands_buffers_out_again_within_its_capacity():
    pool = BufferPool(10 << 20)
    a = pool.take(4 << 20)
    assert len(a) == 4 << 20 and not a.readonly
    a[:3] = b"abc"
    mapping = a.obj
    pool.give(a)
    b = pool.take(3 << 20)  # the free 4 MiB buffer, cut to size
    assert b.obj is mapping and len(b) == 3 << 20 and bytes(b[:3]) == b"abc"
    c = pool.take(6 << 20)  # nothing free fits: a new one (4 + 6 MiB kept)
    assert c.obj is not mapping
    pool.give(b)
    pool.give(c)
    d = pool.take(9 << 20)  # 9 MiB fits no free buffer: both are let go to make room
    assert d.obj is not mapping and d.obj is not c.obj and pool._kept == 9 << 20
    assert len(pool.take(0)) == 0


def test_byte_budget_grants_one_waiter_when_every_holder_waits():
    import threading

    budget = ByteBudget(10)
    budget.acquire(6)  # file A's buffer
    budget.acquire(4)  # file B's
    granted: list[str] = []

    def wait(name: str, n: int, holding: int) -> None:
        budget.acquire(n, holding=holding)
        granted.append(name)

    def waiting(stuck: int) -> None:  # until the budget counts ``stuck`` bytes held by waiters
        with budget._cv:
            assert budget._cv.wait_for(lambda: budget._stuck == stuck, timeout=60)

    a = threading.Thread(target=wait, args=("a", 5, 6), daemon=True)
    a.start()
    waiting(6)  # A waits, holding 6 ...
    assert a.is_alive() and not granted  # ... while B holds bytes and is not waiting
    b = threading.Thread(target=wait, args=("b", 5, 4), daemon=True)
    b.start()  # now every holder waits: one of them is granted, the other waits on
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while not granted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(granted) == 1 and budget.held == 15
    first = granted[0]
    budget.release({"a": 6 + 5, "b": 4 + 5}[first])  # the granted file finishes
    a.join(60)
    b.join(60)
    assert sorted(granted) == ["a", "b"] and not a.is_alive() and not b.is_alive()
