"""A dimension of 512 over 30 ranks, saved by 30 ranks and loaded at other
world sizes.

Thirty processes would each pay for importing torch on this 2-core
machine, so the 30 ranks are threads, each running the real save phases
(:class:`dcp.orchestration.save._Save`) with the file-flag protocol
(:class:`dcp.coordination.file_flag.FileCoordinator`) over the POSIX plugin: the
same code a rank's background process runs for
``dcp.async_save(coordination="file")``, minus staging.  Sharding as
DTensor's ``Shard(0)`` does it: ``ceil(512 / 30) = 18`` rows for ranks 0-27,
8 for rank 28, none for rank 29.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

import dcp
from dcp.coordination.file_flag import FileCoordinator
from dcp.core.planner import default_planner
from dcp.orchestration.save import _Save, describe_state
from helpers import assert_bitwise_equal, random_tensor
from storage_plugins.posix import PosixStorage

WORLD, ROWS, COLS = 30, 512, 24


def _boxes(world: int, rows: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each rank's rows, as ``Shard(0)`` splits them."""
    step = -(-rows // world)
    return [(min(r * step, rows), max(0, min(step, rows - r * step))) for r in range(world)]


def test_512_rows_over_30_ranks_saved_then_loaded_at_1_and_4(tmp_path):
    full = random_tensor((ROWS, COLS), torch.float32, seed=30)
    bias = random_tensor((7,), torch.bfloat16, seed=31)
    boxes = _boxes(WORLD, ROWS)
    assert [n for _, n in boxes][-3:] == [18, 8, 0]
    ckpt = str(tmp_path / "ckpt")
    save_id = uuid.uuid4().hex[:16]

    def rank(r: int) -> dcp.Metadata:
        offset, length = boxes[r]
        state = {"w": dcp.TensorShard(full[offset:offset + length].clone(), (ROWS, COLS),
                                      (offset, 0)),
                 "bias": bias.clone(), "step": 12}
        storage = PosixStorage(ckpt, thread_count=1)
        coord = FileCoordinator(storage, save_id, r, WORLD, timeout=120.0)
        return _Save(lambda: describe_state(state, False, r, WORLD), storage,
                     default_planner("save"), coord, False).run(save_id)

    with ThreadPoolExecutor(WORLD) as pool:
        results = list(pool.map(rank, range(WORLD)))
    assert all(md.save_id == results[0].save_id for md in results)

    md = dcp.read_metadata(ckpt)
    assert sorted(c.sizes[0] for c in md.tensors["w"].chunks) == sorted(n for _, n in boxes if n)
    assert md.stored_bytes == full.numel() * 4 + bias.numel() * 2

    # world size 1: the whole tensor
    target = {"w": torch.zeros(ROWS, COLS), "bias": torch.zeros(7, dtype=torch.bfloat16), "step": 0}
    dcp.load(target, ckpt)
    assert_bitwise_equal(target["w"], full, "w at world size 1")
    assert_bitwise_equal(target["bias"], bias, "bias")
    assert target["step"] == 12

    # world size 4, each rank's box loaded on its own (128 rows each)
    for offset, length in _boxes(4, ROWS):
        shard = dcp.TensorShard(torch.zeros(length, COLS), (ROWS, COLS), (offset, 0))
        dcp.load({"w": shard}, ckpt, strict=False)
        assert_bitwise_equal(shard.data, full[offset:offset + length], f"w rows {offset}+{length}")
