"""Remapping at load (:mod:`dcp.interop.remap`): MiniLM into a fused-QKV
layout sharded over 2 ranks (as rows, and transposed as columns), the
inverse map on export giving the original bytes, stacked experts (sharded
over 2 ranks and exported back through selects under their Hugging Face
names), transpositions and selects of every dtype (0-d and empty included)
through load and export, and bad maps refused before anything is read."""

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


#: GPT-2-style fused attention: ``c_attn`` stores ``[in, 3 * out]``, the
#: transpose of the concatenated q/k/v projections.
QKV_T = {"{p}.attention.self.c_attn.weight": {
    "concat": 0, "transpose": [1, 0], "sources": [
        "{p}.attention.self.query.weight", "{p}.attention.self.key.weight",
        "{p}.attention.self.value.weight"]}}


@dist_scenario(world_size=2, phase=0)
def test_minilm_into_transposed_fused_qkv_column_sharded_over_two_ranks(ctx):
    import torch.distributed as dist

    cols = 1152 // 2
    start = ctx.rank * cols
    target = {f"encoder.layer.{i}.attention.self.c_attn.weight":
              dcp.TensorShard(torch.zeros(384, cols), (384, 1152), (0, start))
              for i in range(LAYERS)}
    target["pooler.dense.weight"] = torch.zeros(384, 384)
    report = load_safetensors(target, str(MODEL), remap=QKV_T, process_group=dist.group.WORLD,
                              strict=False)
    with safe_open(ORIGINAL, "pt") as f:
        for i in range(LAYERS):
            fqn = f"encoder.layer.{i}.attention.self.c_attn.weight"
            expected = _qkv(f, i, "weight").T[:, start:start + cols]
            assert_bitwise_equal(target[fqn].data, expected, fqn)
        assert_bitwise_equal(target["pooler.dense.weight"], f.get_tensor("pooler.dense.weight"),
                             "pooler")
    # each rank read only the source rows landing in its columns, and the pooler
    assert report.bytes_read <= (LAYERS * cols * 384 + 384 * 384) * 4 * 1.01, report.bytes_read
    assert not any("staged" in k for k in report.unexpected_keys)
    assert "encoder.layer.0.attention.self.query.bias" in report.unexpected_keys


def test_transposed_fused_qkv_exports_back_to_the_original_bytes(tmp_path):
    md = remap_metadata(SafetensorsFolder(str(MODEL)).metadata, QKV_T)
    targets = md.targets()
    state = {fqn: torch.zeros(m.shape, dtype=getattr(torch, m.dtype))
             for fqn, m in targets.items()}
    assert state["encoder.layer.3.attention.self.c_attn.weight"].shape == (384, 1152)
    load_safetensors(state, str(MODEL), remap=QKV_T)
    dcp.save(state, str(tmp_path / "fused"))
    back = inverse(QKV_T, dcp.read_metadata(str(tmp_path / "fused")))
    assert back["encoder.layer.0.attention.self.key.weight"] == {
        "slice": 1, "source": "encoder.layer.0.attention.self.c_attn.weight", "start": 384,
        "stop": 768, "transpose": [1, 0]}
    checkpoint_to_safetensors(str(tmp_path / "fused"), str(tmp_path / "hf"), remap=back,
                              buffer_bytes=8 << 20)
    with safe_open(ORIGINAL, "pt") as f, safe_open(tmp_path / "hf" / "model.safetensors",
                                                   "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        for k in f.keys():
            assert_bitwise_equal(g.get_tensor(k), f.get_tensor(k), k)


#: Every kind of staged rule: a plain transposition, a 3-D permutation, a
#: transposed concatenation, a 0-d and an empty tensor, slices across a
#: dimension the bytes cannot follow.
TRANSPOSED = {
    "t.w": {"transpose": [1, 0], "source": "s.w"},
    "t.x": {"transpose": [2, 0, 1], "source": "s.x"},
    "n.qkv": {"concat": 0, "transpose": [1, 0], "sources": ["s.q", "s.k", "s.v"]},
    "t.scalar": {"transpose": [], "source": "s.scalar"},
    "t.empty": {"transpose": [1, 0], "source": "s.empty"},
}
SLICED = {
    "t.left": {"slice": 1, "source": "s.w", "start": 0, "stop": 1},
    "t.right": {"slice": 1, "source": "s.w", "start": 1, "stop": 4, "transpose": [1, 0]},
}


def _sources(dtype) -> dict[str, torch.Tensor]:
    shapes = {"s.w": (6, 4), "s.x": (2, 3, 5), "s.q": (5, 4), "s.k": (5, 4), "s.v": (5, 4),
              "s.scalar": (), "s.empty": (0, 3)}
    return {n: random_tensor(shape, dtype, seed=k) for k, (n, shape) in enumerate(shapes.items())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.float8_e4m3fn, torch.uint8])
def test_transpositions_every_dtype_sharded_and_exported_back(tmp_path, dtype):
    src = _sources(dtype)
    save_file(src, tmp_path / "model.safetensors")
    full = {"t.w": src["s.w"].T, "t.x": src["s.x"].permute(2, 0, 1),
            "n.qkv": torch.cat([src["s.q"], src["s.k"], src["s.v"]]).T,
            "t.scalar": src["s.scalar"], "t.empty": src["s.empty"].T}
    # boxes of each target: rows 1-2 of t.w (columns of s.w), a corner of t.x, columns 3-10 of
    # t.qkv (across q, k and v)
    target = {"t.w": dcp.TensorShard(torch.zeros(2, 6, dtype=dtype), (4, 6), (1, 0)),
              "t.x": dcp.TensorShard(torch.zeros(3, 2, 2, dtype=dtype), (5, 2, 3), (2, 0, 1)),
              "n": {"qkv": dcp.TensorShard(torch.zeros(4, 8, dtype=dtype), (4, 15),
                                                  (0, 3))},
              "t.scalar": torch.zeros((), dtype=dtype), "t.empty": torch.zeros(3, 0, dtype=dtype)}
    state = {k: v for k, v in target.items()}
    report = load_safetensors(target, str(tmp_path), remap=TRANSPOSED)
    assert list(target) == list(state) and target["n"]["qkv"] is state["n"]["qkv"]
    assert_bitwise_equal(target["t.w"].data, full["t.w"][1:3], "t.w")
    assert_bitwise_equal(target["t.x"].data, full["t.x"][2:5, :, 1:3], "t.x")
    assert_bitwise_equal(target["n"]["qkv"].data, full["n.qkv"][:, 3:11], "n.qkv")
    assert_bitwise_equal(target["t.scalar"], full["t.scalar"], "t.scalar")
    assert report.unexpected_keys == [] and report.missing_keys == []
    # slices across dim 1 (staged), one transposed
    cut = {"t.left": torch.zeros(6, 1, dtype=dtype), "t.right": torch.zeros(3, 6, dtype=dtype)}
    load_safetensors(cut, str(tmp_path), remap=SLICED, strict=False)
    assert_bitwise_equal(cut["t.left"], src["s.w"][:, :1], "t.left")
    assert_bitwise_equal(cut["t.right"], src["s.w"][:, 1:].T, "t.right")
    # the whole targets saved as a checkpoint export back to the original names and bytes
    dcp.save({k: v.contiguous() for k, v in full.items()}, str(tmp_path / "ckpt"))
    back = inverse(TRANSPOSED, dcp.read_metadata(str(tmp_path / "ckpt")))
    checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"), remap=back)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(src)
        for k, v in src.items():
            assert_bitwise_equal(f.get_tensor(k), v, k)
    if dtype.is_floating_point and dtype != torch.float8_e4m3fn:  # and cast on the way
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "cast"), remap=back,
                                  dtype="bfloat16")
        with safe_open(tmp_path / "cast" / "model.safetensors", "pt") as f:
            for k, v in src.items():
                assert_bitwise_equal(f.get_tensor(k), v.bfloat16(), k)


def _fused_state() -> dict[str, torch.Tensor]:
    """MiniLM's whole state dict in the fused layout, read through the map."""
    md = remap_metadata(SafetensorsFolder(str(MODEL)).metadata, QKV).metadata
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


MOE = MAPS["mixtral_stacked_experts"]


def _experts(dtype, layers=2, count=3) -> dict[str, torch.Tensor]:
    """Mixtral-style per-expert weights ``[5, 6]`` under their Hugging Face
    names."""
    return {f"m.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight":
            random_tensor((5, 6), dtype, seed=100 * layer + 10 * e + k)
            for layer in range(layers) for e in range(count)
            for k, w in enumerate(("w1", "w2", "w3"))}


def _assert_file_holds(path, tensors: dict[str, torch.Tensor]) -> None:
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for k, v in tensors.items():
            assert f.get_tensor(k).shape == v.shape, k
            assert_bitwise_equal(f.get_tensor(k), v, k)


@dist_scenario(world_size=2, phase=0)
def test_stacked_experts_sharded_over_two_ranks_export_back_to_hf_names(ctx):
    import torch.distributed as dist

    experts = _experts(torch.bfloat16)
    if ctx.rank == 0:
        save_file(experts, ctx.dir / "model.safetensors")
    ctx.barrier()
    # each rank holds rows [3 * rank, 3 * rank + 3) of every expert's [5, 6] (rank 1: 2 rows)
    rows = min(3, 5 - 3 * ctx.rank)
    state = {f"m.layers.{layer}.block_sparse_moe.experts.{w}":
             dcp.TensorShard(torch.zeros(3, rows, 6, dtype=torch.bfloat16), (3, 5, 6),
                             (0, 3 * ctx.rank, 0))
             for layer in range(2) for w in ("w1", "w2", "w3")}
    load_safetensors(state, str(ctx.dir), remap=MOE, process_group=dist.group.WORLD)
    dcp.save(state, str(ctx.dir / "stacked"))
    if ctx.rank == 0:
        md = dcp.read_metadata(str(ctx.dir / "stacked"))
        back = inverse(MOE, md)
        assert back["m.layers.1.block_sparse_moe.experts.2.w3.weight"] == {
            "select": 0, "source": "m.layers.1.block_sparse_moe.experts.w3", "index": 2}
        # a leading-dim select of each rank's chunk is a byte range of it: nothing staged
        seen = remap_metadata(md, back)
        assert not seen.staged
        chunks = seen.metadata.tensors["m.layers.0.block_sparse_moe.experts.1.w2.weight"].chunks
        assert sorted(c.nbytes for c in chunks) == [2 * 6 * 2, 3 * 6 * 2]
        checkpoint_to_safetensors(str(ctx.dir / "stacked"), str(ctx.dir / "hf"), remap=back)
        _assert_file_holds(ctx.dir / "hf" / "model.safetensors", experts)
    ctx.barrier()


#: Stacks the bytes of a chunk cannot follow back: experts stacked along dim
#: 1 (``[5, E, 6]``), and stacked then transposed (``[6, 5, E]``).
STACKED = {"t.mid": {"stack": 1, "sources": "s.mid.{i}"},
           "t.perm": {"stack": 0, "transpose": [2, 1, 0], "sources": "s.perm.{i}"},
           "t.vec": {"stack": 0, "sources": ["s.a", "s.b"]},
           "t.none": {"stack": 1, "sources": "s.none.{i}"}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.float8_e4m3fn, torch.uint8])
def test_stacks_every_dtype_export_back_through_inverse_selects(tmp_path, dtype):
    src = _experts(dtype, layers=1)
    src.update({f"s.mid.{i}": random_tensor((5, 6), dtype, seed=50 + i) for i in range(3)})
    src.update({f"s.perm.{i}": random_tensor((5, 6), dtype, seed=60 + i) for i in range(3)})
    src.update({"s.a": random_tensor((), dtype, seed=70), "s.b": random_tensor((), dtype, seed=71)})
    src.update({f"s.none.{i}": torch.empty((0, 2), dtype=dtype) for i in range(2)})
    save_file(src, tmp_path / "model.safetensors")
    mapping = {**MOE, **STACKED}
    targets = remap_metadata(SafetensorsFolder(str(tmp_path)).metadata, mapping).targets()
    state = {f: torch.zeros(m.shape, dtype=dtype) for f, m in targets.items()}
    load_safetensors(state, str(tmp_path), remap=mapping)
    assert state["t.perm"].shape == (6, 5, 3) and state["t.vec"].shape == (2,)
    assert_bitwise_equal(state["t.mid"], torch.stack([src[f"s.mid.{i}"] for i in range(3)], 1),
                         "t.mid")
    dcp.save(state, str(tmp_path / "stacked"))
    md = dcp.read_metadata(str(tmp_path / "stacked"))
    back = inverse(mapping, md)
    assert back["s.perm.1"] == {"select": 2, "source": "t.perm", "index": 1,
                                "transpose": [1, 0]}
    assert back["s.b"] == {"select": 0, "source": "t.vec", "index": 1}
    # selects across dim 1 and transposed ones staged; leading-dim selects (experts) not
    staged = remap_metadata(md, back).staged
    assert {f"s.mid.{i}" for i in range(3)} | {f"s.perm.{i}" for i in range(3)} <= set(staged)
    assert not any("experts" in f or f in ("s.a", "s.b") for f in staged)
    checkpoint_to_safetensors(str(tmp_path / "stacked"), str(tmp_path / "hf"), remap=back)
    _assert_file_holds(tmp_path / "hf" / "model.safetensors", src)
    # a staged select read back as a box of this rank's: rows 2-4 of the middle expert
    box = {"s.mid.1": dcp.TensorShard(torch.zeros(3, 6, dtype=dtype), (5, 6), (2, 0))}
    load_remapped(box, str(tmp_path / "stacked"), back, strict=False)
    assert_bitwise_equal(box["s.mid.1"].data, src["s.mid.1"][2:], "s.mid.1")


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
      "b": {"slice": 0, "source": "q", "start": 1, "stop": 2}}, r"'q' is sliced or selected along"),
    ({"a": {"concat": 0, "slice": 0, "sources": ["q", "k"]}}, r"'a' must have exactly one of"),
    ({"a": {"transpose": [1, 1], "source": "q"}}, r"'a' \(transpose of 'q'\).*\[1, 1\] is not"),
    ({"a": {"transpose": [0, 1, 2], "source": "q"}}, r"'a'.*not a permutation of the 2"),
    ({"a": {"concat": 1, "transpose": [1], "sources": ["q", "k"]}}, r"'a' \(concat of 'q', 'k'\)"),
    ({"a": {"transpose": [1, 0], "sources": ["q", "k"]}}, r"'a'.*a transpose takes one source"),
    ({"a": {"select": 0, "source": "q", "index": 4}},
     r"'a' \(select of 'q'\): index 4 of dim 0 does not fit shape \[4, 2\]"),
    ({"a": {"select": 0, "source": "q", "index": -1}}, r"'a' \(select of 'q'\): index -1"),
    ({"a": {"select": 0, "source": "q"}}, r"'a' \(select of 'q'\): index None"),
    ({"a": {"select": 2, "source": "q", "index": 0}}, r"'a' \(select of 'q'\): dim 2 out of"),
    ({"a": {"select": "0", "source": "q", "index": 0}}, r"'a'.*takes a dimension, not '0'"),
    ({"a": {"select": 0, "sources": ["q", "k"], "index": 0}}, r"'a'.*a select takes one source"),
    ({"a": {"select": 1, "source": "q", "index": 0, "transpose": [1, 0]}},
     r"'a' \(select of 'q'\).*not a permutation of the 1"),
    ({f"e{k}": {"select": 0, "source": "q", "index": i} for k, i in enumerate((0, 1, 1, 3))},
     r"'e1' and 'e2' of 'q' overlap at 1"),
    ({f"e{i}": {"select": 0, "source": "q", "index": i} for i in (0, 1, 3)},
     r"selects of 'q' leave a gap \[2:3\].*'e3'"),
    ({"e0": {"select": 1, "source": "q", "index": 0},
      "e1": {"slice": 0, "source": "q", "start": 0, "stop": 4}},
     r"'q' is sliced or selected along"),
])
def test_bad_maps_raise_before_reading_naming_target_and_sources(mapping, message):
    md = _md(q=(4, 2), k=(4, 2), v=(4, 2), w=(4, 3))
    with pytest.raises(dcp.CheckpointError, match=message):
        remap_metadata(md, mapping)


def test_inverse_refuses_stacks_it_cannot_undo_naming_the_target():
    md = _md(**{"x_w1": (3, 4, 2), "y_w1": (3,)})
    with pytest.raises(dcp.CheckpointError, match=r"'x.w1' stacks 3 along dim 0, its rule names 2"):
        inverse({"x.w1": {"stack": 0, "sources": ["a", "b"]}}, md)
    with pytest.raises(dcp.CheckpointError, match=r"'y.w1' of shape \[3\] has no dim 1"):
        inverse({"{p}.w1": {"stack": 1, "sources": "{p}.e.{i}"}}, md)
    with pytest.raises(dcp.CheckpointError, match=r"cannot invert the rule for 'x.w1'"):
        inverse({"x.w1": {"select": 0, "source": "x", "index": 0}}, md)


def test_staged_target_of_another_shape_or_in_a_list_raises_naming_it(tmp_path):
    save_file({"s.w": torch.ones(6, 4)}, tmp_path / "model.safetensors")
    rule = {"t.w": {"transpose": [1, 0], "source": "s.w"}}
    with pytest.raises(dcp.CheckpointError, match=r"'t.w'.*shape \[6, 4\].*gives \[4, 6\]"):
        load_safetensors({"t": {"w": torch.zeros(6, 4)}}, str(tmp_path), remap=rule)
    with pytest.raises(dcp.CheckpointError, match=r"'t.w.0'.*must sit in a dict"):
        load_safetensors({"t": {"w": [torch.zeros(4, 6)]}}, str(tmp_path),
                         remap={"t.w.0": rule["t.w"]})
