"""Remapping at load (:mod:`dcp.interop.remap`): MiniLM into a fused-QKV
layout sharded over 2 ranks, the inverse map on export giving the original
bytes, stacked experts, and bad maps refused before anything is read."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dcp
from dcp.interop.remap import MAPS, inverse, load_remapped, remap_metadata
from dcp.interop.safetensors_io import (
    SafetensorsFolder,
    checkpoint_to_safetensors,
    load_safetensors,
)
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, random_tensor
from test_convert_minilm import MODEL, ORIGINAL, _embed

QKV = MAPS["bert_fused_qkv"]
LAYERS = 6


def _qkv(f, layer: int, kind: str) -> torch.Tensor:
    p = f"encoder.layer.{layer}.attention.self."
    return torch.cat([f.get_tensor(p + n + "." + kind) for n in ("query", "key", "value")])


@dist_scenario(world_size=2, phase=0)
def test_minilm_into_fused_qkv_sharded_over_two_ranks(ctx):
    import torch.distributed as dist

    rows = 1152 // 2
    start = ctx.rank * rows
    target = {}
    for i in range(LAYERS):
        p = f"encoder.layer.{i}.attention.self.qkv."
        target[p + "weight"] = dcp.TensorShard(torch.zeros(rows, 384), (1152, 384), (start, 0))
        target[p + "bias"] = dcp.TensorShard(torch.zeros(rows), (1152,), (start,))
    report = load_safetensors(target, str(MODEL), remap=QKV, process_group=dist.group.WORLD)
    with safe_open(ORIGINAL, "pt") as f:
        for i in range(LAYERS):
            p = f"encoder.layer.{i}.attention.self.qkv."
            for kind in ("weight", "bias"):
                expected = _qkv(f, i, kind)[start:start + rows]
                assert_bitwise_equal(target[p + kind].data, expected, p + kind)
    # each rank read only the regions of its own rows (1152 x 385 floats per layer, halved)
    assert report.bytes_read <= LAYERS * rows * 385 * 4 * 1.01, report.bytes_read


def _fused_state() -> dict[str, torch.Tensor]:
    """MiniLM's whole state dict in the fused layout, read through the map."""
    md = remap_metadata(SafetensorsFolder(str(MODEL)).metadata, QKV)
    state = {fqn: torch.zeros(m.shape, dtype=getattr(torch, m.dtype))
             for fqn, m in md.tensors.items()}
    load_safetensors(state, str(MODEL), remap=QKV)
    return state


def test_inverse_map_exports_the_original_bytes_and_embeddings(tmp_path):
    from transformers import BertModel

    state = _fused_state()
    assert "encoder.layer.0.attention.self.qkv.weight" in state
    assert "encoder.layer.0.attention.self.query.weight" not in state
    dcp.save(state, str(tmp_path / "fused"))
    md = dcp.read_metadata(str(tmp_path / "fused"))
    checkpoint_to_safetensors(str(tmp_path / "fused"), str(tmp_path / "hf"),
                              remap=inverse(QKV, md))
    with safe_open(ORIGINAL, "pt") as f, safe_open(tmp_path / "hf" / "model.safetensors",
                                                   "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        for k in f.keys():
            assert_bitwise_equal(g.get_tensor(k), f.get_tensor(k), k)
    shutil.copy(MODEL / "config.json", tmp_path / "hf" / "config.json")
    assert_bitwise_equal(_embed(BertModel.from_pretrained(tmp_path / "hf").eval()),
                         _embed(BertModel.from_pretrained(MODEL).eval()), "embeddings")
    # the same map reads our checkpoint back into the original layout, resharded
    half = {"encoder.layer.2.attention.self.key.weight":
            dcp.TensorShard(torch.zeros(384, 192), (384, 384), (0, 192))}
    load_remapped(half, str(tmp_path / "fused"), inverse(QKV, md), strict=False)
    with safe_open(ORIGINAL, "pt") as f:
        assert_bitwise_equal(half["encoder.layer.2.attention.self.key.weight"].data,
                             f.get_tensor("encoder.layer.2.attention.self.key.weight")[:, 192:],
                             "key")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.float8_e4m3fn, torch.uint8])
def test_stacked_experts_every_dtype_and_export_cast(tmp_path, dtype):
    experts = {f"m.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight":
               random_tensor((6, 4), dtype, seed=10 * layer + e)
               for layer in range(2) for e in range(3) for w in ("w1", "w2", "w3")}
    experts["m.scalar"] = random_tensor((), dtype, seed=7)
    experts["m.empty"] = torch.empty((0, 3), dtype=dtype)
    save_file(experts, tmp_path / "model.safetensors")
    target = {f"m.layers.{layer}.block_sparse_moe.experts.{w}":
              dcp.TensorShard(torch.zeros(2, 6, 4, dtype=dtype), (3, 6, 4), (1, 0, 0))
              for layer in range(2) for w in ("w1", "w2", "w3")}
    target["m.scalar"] = torch.zeros((), dtype=dtype)
    target["m.empty"] = torch.empty((0, 3), dtype=dtype)
    load_safetensors(target, str(tmp_path), remap=MAPS["mixtral_stacked_experts"])
    for (fqn, shard) in target.items():
        if "experts" not in fqn:
            assert_bitwise_equal(shard, experts[fqn], fqn)
            continue
        stem = fqn.rsplit(".", 1)
        expected = torch.stack([experts[f"{stem[0]}.{e}.{stem[1]}.weight"] for e in range(3)])
        assert_bitwise_equal(shard.data, expected[1:], fqn)
    if dtype.is_floating_point and dtype != torch.float8_e4m3fn:
        dcp.save({k: v for k, v in experts.items()}, str(tmp_path / "ckpt"))
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                  dtype="float16", prefix="m.")
        with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
            assert_bitwise_equal(f.get_tensor("scalar"), experts["m.scalar"].half(), "scalar")
            assert f.get_tensor("empty").shape == (0, 3)


def _md(**shapes) -> dcp.Metadata:
    """A safetensors-like metadata of float32 tensors ``name=shape``."""
    from dcp.core.metadata import ChunkMeta, Metadata, TensorMeta

    md = Metadata(save_id="x", world_size=1)
    for name, shape in shapes.items():
        meta = TensorMeta(shape, "float32")
        meta.chunks.append(ChunkMeta((0,) * len(shape), shape, "f", 0, meta.nbytes, None, 0))
        md.tensors[name.replace("_", ".")] = meta
    return md


@pytest.mark.parametrize(("mapping", "message"), [
    ({"qkv": {"concat": 0, "sources": ["q", "k", "nope"]}}, r"'qkv'.*\['nope'\] not in"),
    ({"qkv": {"concat": 2, "sources": ["q", "k", "v"]}}, r"'qkv'.*dim 2 out of range"),
    ({"qkv": {"concat": 0, "sources": ["q", "k", "w"]}}, r"'qkv'.*differ outside dim 0"),
    ({"a": {"concat": 0, "sources": ["q", "k"]}, "b": {"concat": 0, "sources": ["k", "v"]}},
     r"'b'.*source 'k' is used by 'a'"),
    ({"a": {"slice": 0, "source": "q", "start": 0, "stop": 3},
      "b": {"slice": 0, "source": "q", "start": 2, "stop": 4}}, r"'a' and 'b' of 'q' overlap"),
    ({"a": {"slice": 0, "source": "q", "start": 0, "stop": 1},
      "b": {"slice": 0, "source": "q", "start": 2, "stop": 4}}, r"gap \[1:2\].*'b'"),
    ({"a": {"slice": 0, "source": "q", "start": 0, "stop": 9}}, r"'a'.*\[0:9\].*does not fit"),
    ({"a": {"slice": 1, "source": "q", "start": 0, "stop": 1},
      "b": {"slice": 1, "source": "q", "start": 1, "stop": 2}}, r"'a'.*without a copy"),
    ({"a": {"transpose": [1, 0], "source": "q"}}, r"'a' must have exactly one of"),
])
def test_bad_maps_raise_before_reading_naming_target_and_sources(mapping, message):
    md = _md(q=(4, 2), k=(4, 2), v=(4, 2), w=(4, 3))
    with pytest.raises(dcp.CheckpointError, match=message):
        remap_metadata(md, mapping)
