"""Interop with PyTorch DCP, single process: checkpoints written by
``torch.distributed.checkpoint.save`` convert to ours (only when trusted: its
metadata is a pickle), and ours export to checkpoints that
``torch.distributed.checkpoint.load`` reads.  Comparisons are bitwise.  (A
checkpoint written by two ranks: test_convert_minilm.py.)"""

from __future__ import annotations

import pathlib
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import dcp
from dcp.interop.safetensors_io import SAFETENSORS_DTYPES
from dcp.interop.torch_dcp_io import checkpoint_to_torch_dcp, torch_dcp_to_checkpoint
from helpers import assert_bitwise_equal, assert_names, random_tensor

DTYPES = [getattr(torch, name) for name in SAFETENSORS_DTYPES.values()]


def _state(seed: int = 0) -> dict:
    return {
        "model": {str(d).removeprefix("torch."): random_tensor((4, 3), d, seed=seed + i)
                  for i, d in enumerate(DTYPES)},
        "extra": {"scalar": random_tensor((), torch.float64, seed=seed + 50),
                  "empty": torch.empty(0, 5), "empty2": torch.empty(2, 0, dtype=torch.int32)},
        "optim": {"step": 12, "lr": 3e-4, "name": "adamw", "betas": [0.9, 0.999], "none": None},
    }


def _zeros(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _zeros(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def _assert_same(actual, expected, path=""):
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), path
        for k in expected:
            _assert_same(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, torch.Tensor):
        assert_bitwise_equal(actual, expected, path)
    else:
        assert actual == expected and type(actual) is type(expected), (path, actual, expected)


def _torch_save(state: dict, path: pathlib.Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _torch_load(state: dict, path: pathlib.Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.load(state, checkpoint_id=str(path), no_dist=True)


def test_torch_dcp_converts_to_ours_and_back(tmp_path):
    state = _state()
    _torch_save(state, tmp_path / "torch")

    md = torch_dcp_to_checkpoint(str(tmp_path / "torch"), f"file://{tmp_path}/ours", trusted=True,
                                 buffer_bytes=64)
    assert "model.bfloat16" in md.tensors and md.objects["optim.step"].value == 12
    assert len({c.file for t in md.tensors.values() for c in t.chunks}) > 1  # buffered in groups
    target = _zeros(state)
    report = dcp.load(target, str(tmp_path / "ours"))
    assert report.missing_keys == [] and report.unexpected_keys == []
    _assert_same(target, state)

    result = checkpoint_to_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "back"))
    assert result.tensors == len(md.tensors) and result.files[0] == ".metadata"
    target = _zeros(state)
    _torch_load(target, tmp_path / "back")
    _assert_same(target, state)

    with pytest.raises(dcp.CheckpointError, match="overwrite"):
        checkpoint_to_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "back"))
    checkpoint_to_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "back"), overwrite=True,
                            rename={"model.float32": "model.f32"})
    renamed = {"model": {"f32": torch.zeros(4, 3)}}
    _torch_load(renamed, tmp_path / "back")
    assert_bitwise_equal(renamed["model"]["f32"], state["model"]["float32"])


def test_reading_torch_dcp_needs_trust_and_never_unpickles_without_it(tmp_path):
    marker = tmp_path / "executed"
    _torch_save({"w": torch.ones(2), "evil": _TouchOnUnpickle(marker)}, tmp_path / "torch")
    with pytest.raises(dcp.CheckpointError) as e:
        torch_dcp_to_checkpoint(str(tmp_path / "torch"), str(tmp_path / "ours"))
    assert_names(str(e.value), str(tmp_path / "torch"), "pickle", "trusted=True")
    assert not marker.exists() and not (tmp_path / "ours").exists()


class _TouchOnUnpickle:
    """Unpickling this creates ``path``: proof that a pickle ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_values_that_are_not_json_need_allow_pickle_both_ways(tmp_path):
    _torch_save({"w": torch.ones(2), "meta": {"classes": {3, 1, 2}}}, tmp_path / "torch")
    with pytest.raises(dcp.CheckpointError) as e:
        torch_dcp_to_checkpoint(str(tmp_path / "torch"), str(tmp_path / "ours"), trusted=True)
    assert_names(str(e.value), "meta.classes", "allow_pickle")
    assert not (tmp_path / "ours" / "metadata.json").exists()

    torch_dcp_to_checkpoint(str(tmp_path / "torch"), str(tmp_path / "ours"), trusted=True,
                            allow_pickle=True)
    target = {"w": torch.zeros(2), "meta": {"classes": None}}
    dcp.load(target, str(tmp_path / "ours"), allow_pickle=True)
    assert target["meta"]["classes"] == {1, 2, 3}

    with pytest.raises(dcp.CheckpointError) as e:
        checkpoint_to_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "back"))
    assert_names(str(e.value), "meta.classes", "allow_pickle")
    checkpoint_to_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "back"), allow_pickle=True)
    target = {"w": torch.zeros(2), "meta": {"classes": None}}
    _torch_load(target, tmp_path / "back")
    assert target["meta"]["classes"] == {1, 2, 3}


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its AdamW after two steps (state: step, exp_avg,
    exp_avg_sq per parameter; two param groups)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    optim = torch.optim.AdamW([{"params": model[0].parameters()},
                               {"params": model[2].parameters(), "lr": 3e-3 + seed}],
                              lr=1e-3, betas=(0.8, 0.9 + seed / 100))
    for _ in range(2):
        model(torch.randn(5, 16)).square().sum().backward()
        optim.step()
    return model, optim


def _assert_optim_same(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for k, state in expected["state"].items():
        for name, value in state.items():
            assert_bitwise_equal(actual["state"][k][name], value, f"state.{k}.{name}")


def test_model_and_adamw_round_trip_into_nested_state_dicts(tmp_path):
    model, optim = _trained(0)
    _torch_save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "torch")
    md = torch_dcp_to_checkpoint(str(tmp_path / "torch"), str(tmp_path / "ours"), trusted=True)
    assert "optim.param_groups" in md.objects and "optim.state.0.exp_avg" in md.tensors
    assert not any(k.startswith("optim.param_groups.") for k in md.fqns())
    assert all(c.checksum is not None for t in md.tensors.values() for c in t.chunks)
    other, other_optim = _trained(1)  # the same structure, other values
    target = {"model": other.state_dict(), "optim": other_optim.state_dict()}
    report = dcp.load(target, str(tmp_path / "ours"))
    assert report.missing_keys == [] and report.unexpected_keys == []
    for name, value in model.state_dict().items():
        assert_bitwise_equal(target["model"][name], value, name)
    _assert_optim_same(target["optim"], optim.state_dict())
    assert target["optim"]["param_groups"][1]["betas"] == (0.8, 0.9)  # tuples as they were
    other_optim.load_state_dict(target["optim"])  # and the optimizer takes it
    # back to PyTorch DCP: torch's load fills the nested targets, and converting that again
    # gives the same checkpoint
    checkpoint_to_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "back"))
    archives = [f for f in (tmp_path / "back").glob("*.distcp") if zipfile.is_zipfile(f)
                and any(n.endswith("/data/0") for n in zipfile.ZipFile(f).namelist())]
    assert len(archives) == len(md.tensors)  # one torch.save archive per tensor, CRCs right
    assert all(zipfile.ZipFile(f).testzip() is None for f in archives)
    third, third_optim = _trained(2)
    target = {"model": third.state_dict(), "optim": third_optim.state_dict()}
    _torch_load(target, tmp_path / "back")
    for name, value in model.state_dict().items():
        assert_bitwise_equal(target["model"][name], value, name)
    for group in target["optim"]["param_groups"]:  # JSON keeps no tuples
        group["betas"] = tuple(group["betas"])
    _assert_optim_same(target["optim"], optim.state_dict())
    again = torch_dcp_to_checkpoint(str(tmp_path / "back"), str(tmp_path / "again"), trusted=True)
    assert again.objects == md.objects and sorted(again.tensors) == sorted(md.tensors)


def test_tensors_torch_stored_strided_go_through_its_loader(tmp_path):
    w = random_tensor((6, 4), torch.bfloat16, seed=3)
    state = {"t": w.T, "w": w, "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3),
             "meta": {"epoch": 3}}
    _torch_save(state, tmp_path / "torch")
    md = torch_dcp_to_checkpoint(str(tmp_path / "torch"), str(tmp_path / "ours"), trusted=True)
    assert md.objects["meta.epoch"].value == 3
    target = {"t": torch.zeros(4, 6, dtype=torch.bfloat16), "w": torch.zeros_like(w),
              "scalar": torch.tensor(0.0), "empty": torch.empty(0, 3), "meta": {"epoch": 0}}
    dcp.load(target, str(tmp_path / "ours"))
    _assert_same(target, {**state, "t": w.T.contiguous()})


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_export_of_a_damaged_checkpoint_names_the_tensor_and_file(tmp_path):
    dcp.save({"a": torch.arange(1000.0), "b": torch.ones(10)}, str(tmp_path / "ours"))
    md = dcp.read_metadata(str(tmp_path / "ours"))
    chunk = md.tensors["a"].chunks[0]
    path = tmp_path / "ours" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(dcp.CorruptCheckpointError) as e:
        checkpoint_to_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "torch"))
    assert_names(str(e.value), "'a'", chunk.file, "checksum")
    with pytest.raises(dcp.CheckpointError, match="local paths"):
        checkpoint_to_torch_dcp(str(tmp_path / "ours"), "s3://bucket/torch")
    with pytest.raises(dcp.NotACheckpointError):
        torch_dcp_to_checkpoint(str(tmp_path / "nothing"), str(tmp_path / "x"), trusted=True)
