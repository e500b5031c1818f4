"""Splitting replicated chunks among their holders (``DefaultSavePlanner``,
``split_replicated=True``): pieces along dimension 0 written by different
holders, every distinct byte written once, exact values on load (replicated
and resharded targets), uneven sizes, and differing replicas still refused."""

from __future__ import annotations

import collections
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dcp
from dcp.core.planner import SavePlan, TensorDecl, WriteItem
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, data_bytes_on_disk, make_dtensor, randn, random_tensor
from planners.save import DefaultSavePlanner

MiB = 1 << 20


def _plan(*chunks: tuple[str, tuple[int, ...], tuple[int, ...], int]) -> SavePlan:
    """A local plan of fp32 chunks ``(fqn, shape, offsets, rows)`` (sizes: ``rows`` x shape[1:])."""
    plan = SavePlan()
    for fqn, shape, offsets, rows in chunks:
        sizes = (rows, *shape[1:])
        plan.tensors[fqn] = TensorDecl(shape, "float32")
        plan.items.append(WriteItem(fqn, offsets, sizes, 4 * torch.Size(sizes).numel()))
    return plan


def _covers_once(final: list[SavePlan], shape: tuple[int, ...], fqn: str) -> None:
    """The pieces of ``fqn`` tile its rows exactly once."""
    rows = sorted((i.offsets[0], i.sizes[0]) for p in final for i in p.items if i.fqn == fqn)
    position = 0
    for start, count in rows:
        assert start == position and count > 0, f"{fqn}: pieces {rows}"
        position += count
    assert position == shape[0], f"{fqn}: pieces {rows} do not cover {shape[0]} rows"


def test_pieces_tile_uneven_chunks_and_balance_writers():
    # 1023 rows over 4 holders (uneven pieces), 3 rows over 4 holders (3
    # pieces), 2.5 MiB over 4 holders (2 pieces of at least 1 MiB).
    shapes = {"a": (1023, 1030), "b": (3, 300_000), "c": (640, 1024)}
    plans = [_plan(*[(fqn, shape, (0, 0), shape[0]) for fqn, shape in shapes.items()])
             for _ in range(4)]
    final = DefaultSavePlanner().create_global_plan(plans)
    for fqn, shape in shapes.items():
        _covers_once(final, shape, fqn)
    pieces = collections.Counter(i.fqn for p in final for i in p.items)
    assert pieces == {"a": 4, "b": 3, "c": 2}, pieces
    loads = [sum(i.nbytes for i in p.items) for p in final]
    whole = DefaultSavePlanner(split_replicated=False).create_global_plan(plans)
    assert max(loads) < max(sum(i.nbytes for i in p.items) for p in whole)
    largest = max(i.nbytes for p in final for i in p.items)
    assert max(loads) - min(loads) <= largest, f"unbalanced writes {loads}"


def test_balanced_whole_chunks_are_not_split():
    # 8 equal 2 MiB tensors over 4 ranks: whole chunks balance 2:2:2:2.
    plans = [_plan(*[(f"w{k}", (512, 1024), (0, 0), 512) for k in range(8)]) for _ in range(4)]
    final = DefaultSavePlanner().create_global_plan(plans)
    assert all(i.sizes == (512, 1024) for p in final for i in p.items)
    assert [len(p.items) for p in final] == [2, 2, 2, 2]


def test_dp_replicas_with_sharded_optimizer_state_balance():
    # DP4: one 4 MiB weight replicated on every rank, 1 MiB of optimizer
    # state on each rank (single holder): each writes 1 MiB + 1 MiB.
    plans = [_plan(("w", (1024, 1024), (0, 0), 1024), ("m", (1024, 1024), (256 * r, 0), 256))
             for r in range(4)]
    final = DefaultSavePlanner().create_global_plan(plans)
    assert [sum(i.nbytes for i in p.items) for p in final] == [2 * MiB] * 4


@pytest.mark.parametrize("planner", [DefaultSavePlanner(split_replicated=False),
                                     DefaultSavePlanner(save_to_minimum_rank=True)])
def test_splitting_off_keeps_whole_chunks(planner):
    plans = [_plan(("w", (1024, 1024), (0, 0), 1024)) for _ in range(4)]
    final = planner.create_global_plan(plans)
    assert [len(p.items) for p in final] == [1, 0, 0, 0]


# ------------------------------------------------- real ranks, real files
def _chunks_by_rank(md, fqn: str) -> dict[int, list]:
    out = collections.defaultdict(list)
    for c in md.tensors[fqn].chunks:
        out[c.rank].append(c)
    return out


@dist_scenario(world_size=4)
def test_split_replicated_chunks_round_trip_exactly(ctx):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fulls = {
        "even": random_tensor((1024, 1024), torch.float32, seed=1),  # 4 MiB, 4 pieces
        "uneven": random_tensor((1023, 1030), torch.float32, seed=2),  # pieces of 255/256 rows
        "few_rows": random_tensor((3, 300_000), torch.float32, seed=3),  # 3 pieces, 4 holders
        "tp": random_tensor((2048, 1024), torch.float32, seed=4),  # TP shards held by 2 DP ranks
    }
    sd = {"model": {k: v.clone() for k, v in fulls.items() if k != "tp"},
          "tp": make_dtensor(fulls["tp"], mesh, "R,S0")}
    ckpt = ctx.dir / "ckpt"
    md = dcp.save(sd, str(ckpt))

    assert len(md.tensors["model.even"].chunks) == 4
    assert len(_chunks_by_rank(md, "model.even")) >= 3, "pieces written by several holders"
    assert len(md.tensors["model.few_rows"].chunks) == 3
    assert len(md.tensors["tp"].chunks) == 4  # two TP shards, each in two pieces
    for c in md.tensors["tp"].chunks:  # a TP shard's pieces are written by its own DP holders
        tp_rank = c.offsets[0] // 1024
        assert c.rank % 2 == tp_rank, f"piece {c.offsets} written by rank {c.rank}"
    unique = sum(v.numel() * 4 for v in fulls.values())
    ctx.barrier()
    on_disk = data_bytes_on_disk(ckpt)
    assert unique <= on_disk <= unique * 1.01, f"{on_disk} bytes on disk for {unique} unique"
    written = collections.Counter()
    for t in md.tensors.values():
        for c in t.chunks:
            written[c.rank] += c.nbytes
    largest = max(c.nbytes for t in md.tensors.values() for c in t.chunks)
    assert max(written.values()) - min(written.values()) <= largest, f"unbalanced {dict(written)}"
    assert largest <= 2 * 1024 * 1024 * 4 // 4, f"a piece of {largest} bytes"

    # back into plain replicated tensors, and resharded: Shard(1) on 4 ranks
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
              "tp": make_dtensor(torch.zeros(2048, 1024), mesh, "R,S0")}
    dcp.load(target, str(ckpt))
    for k, v in target["model"].items():
        assert_bitwise_equal(v, fulls[k], k)
    assert_bitwise_equal(target["tp"].to_local(), sd["tp"].to_local(), "tp")
    mesh1 = init_device_mesh("cpu", (4,))
    resharded = {"model": {k: make_dtensor(torch.zeros_like(v), mesh1, "S1")
                           for k, v in fulls.items() if k != "tp"},
                 "tp": make_dtensor(torch.zeros(2048, 1024), mesh1, "S1")}
    dcp.load(resharded, str(ckpt))
    for k, v in resharded["model"].items():
        assert_bitwise_equal(v.to_local(), make_dtensor(fulls[k], mesh1, "S1").to_local(), k)
    assert_bitwise_equal(resharded["tp"].to_local(),
                         make_dtensor(fulls["tp"], mesh1, "S1").to_local(), "tp")


@dist_scenario(world_size=4, last=True)
def test_differing_replicas_of_a_split_chunk_fail_the_save(ctx):
    for odd_rank in (0, 2):  # the first piece's writer, and another piece's
        big = randn((1024, 1024), seed=5 if ctx.rank != odd_rank else 6)  # 4 MiB: split
        ckpt = ctx.dir / f"ckpt{odd_rank}"
        with pytest.raises(dcp.CheckpointError, match=r"model\.big") as ei:
            dcp.save({"model": {"big": big}}, str(ckpt))
        pair = re.search(r"ranks (\d+) and (\d+)", str(ei.value))
        assert pair and str(odd_rank) in pair.groups(), str(ei.value)
        ctx.barrier()
        assert not (ckpt / "metadata.json").exists(), "a failed save committed metadata"
