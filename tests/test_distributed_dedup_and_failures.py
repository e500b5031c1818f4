"""Multi-rank save planning and failure handling in real gloo groups:
replicated data is written once and the writes are balanced across ranks;
diverged replicas, I/O errors on one rank, corrupt data and refused
overwrites fail on EVERY rank and never commit."""

from __future__ import annotations

import collections
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dcp
from dist_harness import dist_scenario
from helpers import (
    FailingStorage,
    assert_bitwise_equal,
    data_bytes_on_disk,
    make_dtensor,
    randn,
    random_tensor,
)
from planners.save import DefaultSavePlanner

KiB = 1024
MiB = 1024 * KiB


def _written_bytes_per_rank(md) -> dict[int, int]:
    out = collections.Counter()
    for t in md.tensors.values():
        for c in t.chunks:
            out[c.rank] += c.nbytes
    return dict(out)


def _chunks_per_rank(md) -> dict[int, int]:
    return dict(collections.Counter(c.rank for t in md.tensors.values() for c in t.chunks))


def _assert_disk_within_1pct(ckpt, unique: int) -> None:
    on_disk = data_bytes_on_disk(ckpt)
    assert unique <= on_disk <= unique * 1.01, (
        f"{on_disk} bytes of *.data on disk for {unique} unique bytes ({on_disk / unique:.3f}x)"
    )


# ------------------------------------------------------------ dedup + balance
@dist_scenario(world_size=4)
def test_dp4_replicated_state_is_written_once_and_balanced(ctx):
    # 16 equal replicated plain tensors of 256 KiB: 4 MiB unique, 16 MiB held.
    sd = {"model": {f"p{i:02d}": random_tensor((256, 256), torch.float32, seed=i)
                    for i in range(16)},
          "step": 4}
    unique = 16 * 256 * 256 * 4
    ckpt = ctx.dir / "ckpt"
    md = dcp.save(sd, str(ckpt))
    for fqn, t in md.tensors.items():
        assert len(t.chunks) == 1, (
            f"{fqn}: {len(t.chunks)} chunks written for one replicated tensor")
    assert _chunks_per_rank(md) == {0: 4, 1: 4, 2: 4, 3: 4}, (
        f"per-rank writes {_chunks_per_rank(md)}")
    ctx.barrier()
    _assert_disk_within_1pct(ckpt, unique)

    target = {"model": {k: torch.zeros(256, 256) for k in sd["model"]}, "step": 0}
    dcp.load(target, str(ckpt))
    for k, v in sd["model"].items():
        assert_bitwise_equal(target["model"][k], v, k)
    assert target["step"] == 4

    # save_to_minimum_rank=True: every replicated chunk written by rank 0.
    md_min = dcp.save(sd, str(ctx.dir / "min_rank"),
                      planner=DefaultSavePlanner(save_to_minimum_rank=True))
    assert _chunks_per_rank(md_min) == {0: 16}, f"per-rank writes {_chunks_per_rank(md_min)}"
    ctx.barrier()
    _assert_disk_within_1pct(ctx.dir / "min_rank", unique)


@dist_scenario(world_size=4)
def test_dp_replicated_dtensors_are_deduplicated_and_balanced(ctx):
    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd, fulls = {}, {}
    for i in range(8):  # replicated over all 4 ranks, 256 KiB each
        fulls[f"repl{i}"] = random_tensor((512, 128), torch.float32, seed=100 + i)
        sd[f"repl{i}"] = make_dtensor(fulls[f"repl{i}"], mesh1, "R")
    for i in range(4):  # replicated over dp, sharded over tp: 128 KiB chunks held twice
        fulls[f"tp{i}"] = random_tensor((512, 128), torch.float32, seed=200 + i)
        sd[f"tp{i}"] = make_dtensor(fulls[f"tp{i}"], mesh2, "R,S0")
    unique = 12 * 512 * 128 * 4
    ckpt = ctx.dir / "ckpt"
    md = dcp.save(sd, str(ckpt))
    ctx.barrier()
    _assert_disk_within_1pct(ckpt, unique)
    per_rank = _written_bytes_per_rank(md)
    biggest = max(c.nbytes for t in md.tensors.values() for c in t.chunks)
    spread = max(per_rank.get(r, 0) for r in range(4)) - min(per_rank.get(r, 0) for r in range(4))
    assert spread <= biggest, f"unbalanced writes {per_rank} (largest chunk {biggest})"
    target = {k: make_dtensor(torch.zeros(512, 128), mesh1, "S0") for k in sd}
    dcp.load(target, str(ckpt))
    for k, full in fulls.items():
        assert_bitwise_equal(target[k].to_local(), make_dtensor(full, mesh1, "S0").to_local(), k)


@dist_scenario(world_size=2, phase=0)
def test_replicated_sizes_3_1_1_1_on_two_ranks_balance_3_to_3(ctx):
    unit = 256 * KiB // 4  # float32 elements in 256 KiB
    sizes = {"big": 3 * unit, "small0": unit, "small1": unit, "small2": unit}
    sd = {k: random_tensor((n,), torch.float32, seed=i) for i, (k, n) in enumerate(sizes.items())}
    ckpt = ctx.dir / "ckpt"
    md = dcp.save(sd, str(ckpt))
    per_rank = _written_bytes_per_rank(md)
    assert per_rank == {0: 3 * unit * 4, 1: 3 * unit * 4}, (
        f"written bytes per rank {per_rank}, expected 3:3")
    ctx.barrier()
    _assert_disk_within_1pct(ckpt, 6 * unit * 4)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, str(ckpt))
    for k, v in sd.items():
        assert_bitwise_equal(target[k], v, k)


@dist_scenario(world_size=2, phase=0)
def test_sync_saves_reuse_cached_plans_and_never_a_stale_one(ctx):
    """A save of a structure the group saved before skips planning, across
    alternating structures (the save id shows it: an exchange names a save
    ``<16 hex>00000000``, the n-th reuse ``<those 16 hex><n>``), and writes
    once.  A layout change on one rank replans.  Structures that differ on
    rank 0 only (an extra shard there, which moves replicated chunks to rank
    1) both stay cached: rank 1, whose part is the same in both, holds two
    plans for it and writes by the one the coordinator names, never by the
    other.  Every checkpoint loads exact, and speculative writes leave no
    files behind."""
    from dcp.orchestration.save import _Save

    replicated = {f"p{i}": randn((64 + 16 * i, 256), seed=i) for i in range(6)}
    extra = randn((512, 256), seed=99)  # 512 KiB, held by rank 0 only
    writes = []
    original = _Save.write

    def counting(self, *args, **kwargs):
        writes.append(1)
        return original(self, *args, **kwargs)

    def structure(kind: str) -> dict:
        sd = dict(replicated)
        if kind == "B":
            sd["b"] = randn((32, 8), seed=7)
        if kind == "C" and ctx.rank == 0:
            sd["extra"] = dcp.TensorShard(extra, tuple(extra.shape), (0, 0))
        return sd

    def save(kind: str, name: str, expected_writes: int = 1) -> str:
        sd, ckpt = structure(kind), ctx.dir / name
        writes.clear()
        md = dcp.save(sd, str(ckpt))
        assert len(writes) == expected_writes, f"{name}: {len(writes)} writes on rank {ctx.rank}"
        ctx.barrier()
        stray = {p.name for p in ckpt.iterdir()} - md.files() - {"metadata.json"}
        assert not stray, f"{name}: files not in the metadata: {stray}"
        target = {k: torch.zeros_like(v) for k, v in replicated.items()}
        if kind == "B":
            target["b"] = torch.zeros(32, 8)
        if kind == "C":
            target["extra"] = torch.zeros_like(extra)
        dcp.load(target, str(ckpt))
        expected = {**sd, "extra": extra} if kind == "C" else sd
        for k, v in expected.items():
            assert_bitwise_equal(target[k], v, f"{name}: {k}")
        ctx.barrier()
        return md.save_id

    _Save.write = counting
    try:
        a1 = save("A", "a1")
        assert a1.endswith("00000000") and len(a1) == 24, a1
        assert save("A", "a2") == a1[:16] + "00000001"
        b1 = save("B", "b1")
        assert b1.endswith("00000000") and b1[:16] != a1[:16], (a1, b1)
        assert save("A", "a3") == a1[:16] + "00000002"
        assert save("B", "b2") == b1[:16] + "00000001"
        # rank 0 misses, rank 1 hits A's plan and wrote by it: replanned
        c1 = save("C", "c1", expected_writes=2 if ctx.rank == 1 else 1)
        assert c1.endswith("00000000") and c1[:16] not in (a1[:16], b1[:16]), (a1, b1, c1)
        c1_md = dcp.read_metadata(str(ctx.dir / "c1"))
        a1_md = dcp.read_metadata(str(ctx.dir / "a1"))
        assert _written_bytes_per_rank(c1_md)[1] > _written_bytes_per_rank(a1_md)[1], \
            "precondition: rank 0's extra shard moves replicated writes to rank 1"
        # rank 1 holds A's and C's plans for its part: told which, it writes once
        assert save("A", "a4") == a1[:16] + "00000003"
        assert save("C", "c2") == c1[:16] + "00000001"
        assert save("A", "a5") == a1[:16] + "00000004"
        writes.clear()  # a refused save on a cache hit writes nothing
        with pytest.raises(dcp.CheckpointError, match="already holds a committed checkpoint"):
            dcp.save(structure("B"), str(ctx.dir / "a5"))
        assert not writes, f"rank {ctx.rank} wrote before the refusal"
    finally:
        _Save.write = original


# ------------------------------------------------------------------ failures
def _names_rank(msg: str, rank: int) -> bool:
    return re.search(rf"rank\W{{0,3}}{rank}\b", msg, re.I) is not None


@dist_scenario(world_size=4, last=True)
def test_diverged_replicas_fail_save_on_all_ranks_naming_the_fqn(ctx):
    same = randn((32, 32), seed=1)
    diverged = randn((32, 32), seed=2)
    if ctx.rank == 2:
        diverged[7, 3] += 1.0
    ckpt = ctx.dir / "ckpt"
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.save({"model": {"same": same, "diverged": diverged}}, str(ckpt))
    assert "model.diverged" in str(ei.value), f"rank {ctx.rank}: {str(ei.value)!r}"
    ctx.barrier()
    assert not (ckpt / "metadata.json").exists(), "a failed save committed metadata"

    # A replica over the fingerprint's sample size (compared by a sample of
    # its bytes) that diverged throughout, as replicas seeded differently do.
    large = randn((1024, 512), seed=3 if ctx.rank != 1 else 4)  # 2 MiB
    with pytest.raises(dcp.CheckpointError, match=r"model\.large"):
        dcp.save({"model": {"large": large}}, str(ctx.dir / "ckpt3"))
    ctx.barrier()
    assert not (ctx.dir / "ckpt3" / "metadata.json").exists()

    # A 0-dim "step" counter that differs on one rank.
    step = torch.tensor(5 if ctx.rank != 0 else 6)
    with pytest.raises(dcp.CheckpointError, match=r"optim\.step"):
        dcp.save({"optim": {"step": step}, "w": same}, str(ctx.dir / "ckpt2"))
    ctx.barrier()
    assert not (ctx.dir / "ckpt2" / "metadata.json").exists()


def _sixteen_tensors(seed: int) -> dict:
    return {f"layer{i:02d}": {"w": random_tensor((64, 64), torch.float32, seed + i)}
            for i in range(16)}


@dist_scenario(world_size=4, last=True)
def test_io_error_in_one_writer_thread_on_one_rank_fails_everywhere(ctx):
    ckpt = ctx.dir / "ckpt"
    first = _sixteen_tensors(0)
    md1 = dcp.save(first, str(ckpt))
    ctx.barrier()
    before = (ckpt / "metadata.json").read_bytes()
    rank1_files = {c.file for t in md1.tensors.values() for c in t.chunks if c.rank == 1}
    assert rank1_files, "precondition: rank 1 writes data"

    # Fail rank 1's first write_file call, then (if it writes several files) its second.
    for fail_on in (1, 2) if len(rank1_files) >= 2 else (1,):
        storage = FailingStorage(str(ckpt), thread_count=4, fail_on=fail_on if ctx.rank == 1 else 0)
        with pytest.raises(dcp.CheckpointError) as ei:
            dcp.save(_sixteen_tensors(1000 * fail_on), str(ckpt), storage=storage, overwrite=True)
        msg = str(ei.value)
        if ctx.rank == 1:
            assert storage.failed_name is not None, "precondition: the injected error fired"
            assert storage.failed_in_thread != "MainThread", (
                "precondition: the error starts in a writer thread")
        else:
            assert _names_rank(msg, 1), (
                f"rank {ctx.rank}: error does not name failing rank 1: {msg!r}")
        ctx.barrier()
        assert (ckpt / "metadata.json").read_bytes() == before, (
            f"fail_on={fail_on}: metadata.json changed")

        target = {k: {"w": torch.zeros(64, 64)} for k in first}
        dcp.load(target, str(ckpt))
        for k in first:
            assert_bitwise_equal(target[k]["w"], first[k]["w"],
                                 f"fail_on={fail_on}: {k} of the first checkpoint")
        ctx.barrier()


@dist_scenario(world_size=4, last=True)
def test_existing_checkpoint_needs_overwrite_on_all_ranks(ctx):
    ckpt = ctx.dir / "ckpt"
    first = {"w": randn((8, 8), seed=1)}
    dcp.save(first, str(ckpt))
    ctx.barrier()
    before = (ckpt / "metadata.json").read_bytes()
    listing = sorted(p.name for p in ckpt.iterdir())
    ctx.barrier()
    with pytest.raises(dcp.CheckpointError):
        dcp.save({"w": randn((8, 8), seed=2)}, str(ckpt))
    ctx.barrier()
    assert (ckpt / "metadata.json").read_bytes() == before
    assert sorted(p.name for p in ckpt.iterdir()) == listing, "a refused save left files behind"
    second = {"w": randn((8, 8), seed=3)}
    dcp.save(second, str(ckpt), overwrite=True)
    target = {"w": torch.zeros(8, 8)}
    dcp.load(target, str(ckpt))
    assert_bitwise_equal(target["w"], second["w"])


@dist_scenario(world_size=4, last=True)
def test_corrupt_or_missing_checkpoint_fails_load_on_all_ranks(ctx):
    ckpt = ctx.dir / "ckpt"
    sd = {"alpha": random_tensor((64, 64), torch.float32, 1),
          "beta": random_tensor((64, 64), torch.float32, 2)}
    md = dcp.save(sd, str(ckpt))
    ctx.barrier()
    (chunk,) = md.tensors["beta"].chunks
    if ctx.rank == 0:
        path = ckpt / chunk.file
        data = bytearray(path.read_bytes())
        data[chunk.byte_offset + 100] ^= 0x01
        path.write_bytes(bytes(data))
    ctx.barrier()
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.load({k: torch.zeros(64, 64) for k in sd}, str(ckpt))
    assert "beta" in str(ei.value), f"rank {ctx.rank}: {str(ei.value)!r}"
    ctx.barrier()

    with pytest.raises(dcp.CheckpointError):
        dcp.load({k: torch.zeros(64, 64) for k in sd}, str(ctx.dir / "never_saved"))
