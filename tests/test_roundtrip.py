"""Single-process save/load round trips (no torch.distributed): every state-dict
kind that does not need several ranks.  Every load is compared bitwise with
what was saved."""

from __future__ import annotations

import pytest
import torch

import dcp
from helpers import ALL_DTYPES, assert_bitwise_equal, randn, random_tensor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _assert_same_tree(actual, expected, path="<root>"):
    """Tensors bitwise, everything else by type and ==."""
    if isinstance(expected, torch.Tensor):
        assert_bitwise_equal(actual, expected, path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {type(actual).__name__} instead of dict"
        assert set(actual) == set(expected), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for k in expected:
            _assert_same_tree(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), (
            f"{path}: {type(actual).__name__} != {type(expected).__name__}")
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same_tree(a, e, f"{path}.{i}")
    else:
        assert type(actual) is type(expected) and actual == expected, (
            f"{path}: {actual!r} ({type(actual).__name__}) "
            f"!= {expected!r} ({type(expected).__name__})"
        )


# --------------------------------------------------------------------- nesting
def _nested(seed: int):
    return {
        "model": {
            "layers": [
                {"w": randn((4, 3), seed), "b": randn((3,), seed + 1)},
                {"w": randn((4, 3), seed + 2), "b": randn((3,), seed + 3)},
            ],
            "embed": (randn((5, 2), seed + 4), randn((2,), seed + 5)),
        },
        "optim": {
            "step": 12,
            "lr": 0.1,
            "eps": 1e-8,
            "name": "adamw ✓ \"quoted\"",
            "nesterov": False,
            "clip": None,
            "betas": [0.9, 0.999],
            "big": 2**62 + 1,
            "neg": -7,
            "sched": {"milestones": [1, 2, 3], "gamma": 0.5, "kind": "step"},
        },
    }


def _target_like_nested():
    t = _nested(100)
    for layer in t["model"]["layers"]:
        for k in layer:
            layer[k] = torch.zeros_like(layer[k])
    t["model"]["embed"] = tuple(torch.zeros_like(x) for x in t["model"]["embed"])
    t["optim"] = {
        "step": 0, "lr": 0.0, "eps": 0.0, "name": "", "nesterov": True, "clip": 1.5,
        "betas": [0.0, 0.0], "big": 0, "neg": 0,
        "sched": {"milestones": [0, 0, 0], "gamma": 0.0, "kind": ""},
    }
    return t


def test_nested_dicts_lists_tuples_and_json_values_round_trip(tmp_path):
    sd = _nested(0)
    ckpt = tmp_path / "ckpt"
    md = dcp.save(sd, str(ckpt))
    assert isinstance(md, dcp.Metadata)
    expected_tensors = {
        "model.layers.0.w", "model.layers.0.b", "model.layers.1.w", "model.layers.1.b",
        "model.embed.0", "model.embed.1",
    }
    assert set(md.tensors) == expected_tensors
    assert md.world_size == 1
    assert md.tensors["model.layers.0.w"].shape == (4, 3)
    assert md.tensors["model.layers.0.w"].dtype == "float32"
    for fqn in ("optim.step", "optim.lr", "optim.name", "optim.clip"):
        assert fqn in md.objects, f"{fqn} missing from metadata objects {sorted(md.objects)}"
    assert (ckpt / "metadata.json").is_file()
    assert list(ckpt.glob("*.data")), "no *.data file written"

    read = dcp.read_metadata(str(ckpt))
    assert set(read.tensors) == expected_tensors
    for fqn, t in md.tensors.items():
        assert read.tensors[fqn].shape == t.shape and read.tensors[fqn].dtype == t.dtype
        assert (sorted(c.offsets for c in read.tensors[fqn].chunks)
                == sorted(c.offsets for c in t.chunks))

    target = _target_like_nested()
    w0 = target["model"]["layers"][0]["w"]
    e1 = target["model"]["embed"][1]
    report = dcp.load(target, str(ckpt))
    assert report.missing_keys == [] and report.unexpected_keys == []
    _assert_same_tree(target, _nested(0))
    # tensors are filled in place, not replaced
    assert target["model"]["layers"][0]["w"] is w0
    assert target["model"]["embed"][1] is e1


def test_state_dict_is_not_modified_by_save(tmp_path):
    sd = _nested(0)
    dcp.save(sd, str(tmp_path / "ckpt"))
    _assert_same_tree(sd, _nested(0))


# ---------------------------------------------------------------------- dtypes
def test_every_dtype_round_trips_bitwise(tmp_path):
    """Random bit patterns: NaNs, infs, -0.0, denormals must all survive."""
    sd = {}
    for i, dtype in enumerate(ALL_DTYPES):
        name = _dtype_name(dtype)
        sd[f"{name}.matrix"] = random_tensor((7, 5), dtype, seed=i)
        sd[f"{name}.scalar"] = random_tensor((), dtype, seed=100 + i)
        sd[f"{name}.empty"] = torch.empty((0, 3), dtype=dtype)
    ckpt = str(tmp_path / "ckpt")
    md = dcp.save(sd, ckpt)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, ckpt)

    failures = []
    for k, v in sd.items():
        try:
            assert md.tensors[k].dtype == k.split(".")[0], f"metadata dtype {md.tensors[k].dtype!r}"
            assert md.tensors[k].shape == tuple(v.shape), f"metadata shape {md.tensors[k].shape}"
            assert_bitwise_equal(target[k], v, k)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16],
                         ids=_dtype_name)
def test_zero_dim_tensor_round_trip(tmp_path, dtype):
    value = random_tensor((), dtype, seed=3)
    ckpt = str(tmp_path / "ckpt")
    md = dcp.save({"scalar": value}, ckpt)
    assert md.tensors["scalar"].shape == ()
    target = {"scalar": torch.zeros((), dtype=dtype) if dtype != torch.bool else ~value}
    dcp.load(target, ckpt)
    assert_bitwise_equal(target["scalar"], value)


# ------------------------------------------------------- non-contiguous views
def _views(base: torch.Tensor) -> dict:
    return {
        "transposed": base.t(),  # (6, 8)
        "every_other_col": base[:, ::2],  # (8, 3)
        "block": base[1:5, 2:5],  # (4, 3)
        "reversed_strides": base.view(2, 4, 6).permute(2, 0, 1),  # (6, 2, 4)
    }


def test_non_contiguous_views_save(tmp_path):
    base = randn((8, 6), seed=1)
    sd = _views(base)
    sd["expanded"] = randn((3,), seed=2).expand(4, 3)  # stride 0
    assert not any(v.is_contiguous() for v in sd.values())
    ckpt = str(tmp_path / "ckpt")
    md = dcp.save(sd, ckpt)
    for k, v in sd.items():
        assert md.tensors[k].shape == tuple(v.shape), k
    target = {k: torch.zeros(v.shape) for k, v in sd.items()}
    dcp.load(target, ckpt)
    for k, v in sd.items():
        assert_bitwise_equal(target[k], v.contiguous(), k)


def test_non_contiguous_views_as_load_targets(tmp_path):
    saved = {k: v.contiguous() for k, v in _views(randn((8, 6), seed=1)).items()}
    ckpt = str(tmp_path / "ckpt")
    dcp.save(saved, ckpt)

    sentinel = -12345.0
    bases = {k: torch.full((8, 6), sentinel) for k in saved}
    target = {k: _views(bases[k])[k] for k in saved}
    dcp.load(target, ckpt)
    for k in saved:
        assert_bitwise_equal(target[k], saved[k], k)
        # The elements of the base outside the view are untouched.
        mask = torch.ones(8, 6, dtype=torch.bool)
        _views(mask)[k].fill_(False)
        outside = bases[k][mask]
        assert torch.all(outside == sentinel), f"{k}: load wrote outside the target view"


# ---------------------------------------------------------------- tied weights
def test_tied_weights_round_trip_and_stay_tied(tmp_path):
    w = randn((6, 4), seed=5)
    sd = {"embed": {"weight": w}, "head": {"weight": w}, "other": randn((2,), seed=6)}
    ckpt = str(tmp_path / "ckpt")
    md = dcp.save(sd, ckpt)
    assert {"embed.weight", "head.weight"} <= set(md.tensors)

    tied = torch.zeros(6, 4)
    target = {"embed": {"weight": tied}, "head": {"weight": tied}, "other": torch.zeros(2)}
    report = dcp.load(target, ckpt)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert target["embed"]["weight"] is target["head"]["weight"] is tied
    assert_bitwise_equal(tied, w)

    untied = {"embed": {"weight": torch.zeros(6, 4)}, "head": {"weight": torch.zeros(6, 4)},
              "other": torch.zeros(2)}
    dcp.load(untied, ckpt)
    assert_bitwise_equal(untied["embed"]["weight"], w, "embed.weight")
    assert_bitwise_equal(untied["head"]["weight"], w, "head.weight")
    assert_bitwise_equal(untied["other"], sd["other"], "other")


def test_views_of_one_storage_saved_as_separate_tensors(tmp_path):
    """Two fqns that are different views of one storage (e.g. fused qkv split)."""
    qkv = randn((9, 4), seed=7)
    sd = {"q": qkv[0:3], "k": qkv[3:6], "v": qkv[6:9]}
    ckpt = str(tmp_path / "ckpt")
    dcp.save(sd, ckpt)
    target_base = torch.zeros(9, 4)
    target = {"q": target_base[0:3], "k": target_base[3:6], "v": target_base[6:9]}
    dcp.load(target, ckpt)
    assert_bitwise_equal(target_base, qkv)


# ---------------------------------------------------------------- TensorShard
def test_tensor_shard_targets_read_sub_boxes(tmp_path):
    full = random_tensor((8, 6), torch.float32, seed=9)
    ckpt = str(tmp_path / "ckpt")
    dcp.save({"w": full}, ckpt)
    boxes = [((0, 0), (8, 6)), ((2, 1), (3, 4)), ((7, 5), (1, 1)), ((4, 0), (4, 6))]
    for offsets, sizes in boxes:
        shard = dcp.TensorShard(torch.zeros(sizes), (8, 6), offsets)
        dcp.load({"w": shard}, ckpt)
        (r, c), (h, w) = offsets, sizes
        assert_bitwise_equal(shard.data, full[r:r + h, c:c + w], f"box {offsets}+{sizes}")


def test_tensor_shard_covering_whole_tensor_saves(tmp_path):
    full = random_tensor((5, 3), torch.float16, seed=10)
    ckpt = str(tmp_path / "ckpt")
    md = dcp.save({"w": dcp.TensorShard(full, (5, 3), (0, 0))}, ckpt)
    assert md.tensors["w"].shape == (5, 3) and md.tensors["w"].dtype == "float16"
    target = {"w": torch.zeros(5, 3, dtype=torch.float16)}
    dcp.load(target, ckpt)
    assert_bitwise_equal(target["w"], full)


def test_tuples_and_torch_size_come_back_as_the_target_holds_them(tmp_path):
    """JSON has no tuple: a saved tuple, named tuple or torch.Size loads as
    the target's type where the target holds one of the same length."""
    import collections

    pair = collections.namedtuple("pair", "a b")
    saved = {"t": (1, 2, "a"), "size": torch.Size([3, 4]), "nested": {"k": [(5, 6), 7]},
             "named": pair(1, (2, 3)), "betas": [{"betas": (0.9, 0.999)}]}
    dcp.save(saved, str(tmp_path / "c"))
    target = {"t": (0, 0, ""), "size": torch.Size([0, 0]), "nested": {"k": [(0, 0), 0]},
              "named": pair(0, (0, 0)), "betas": [{"betas": (0.0, 0.0)}]}
    dcp.load(target, str(tmp_path / "c"))
    assert target == saved
    assert type(target["size"]) is torch.Size and type(target["named"]) is pair
    assert type(target["nested"]["k"][0]) is tuple and type(target["betas"][0]["betas"]) is tuple
    # with no structure to follow (a placeholder), a tuple comes back as a list
    loose = {"t": None, "size": None, "nested": {"k": None}, "named": None,
             "betas": [{"betas": None}]}
    dcp.load(loose, str(tmp_path / "c"))
    assert loose["t"] == [1, 2, "a"] and loose["size"] == [3, 4]
