"""The read planner: byte runs become few large requests by the storage's
read cost, and every load stays exact (single process, no ranks).

Resharded targets are ``dcp.TensorShard`` column slices of a checkpoint
saved whole: each row of the slice is one byte run of the saved chunk, the
pattern of a Shard(0) -> Shard(1) load.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

import dcp
from dcp.core.boxes import byte_runs, run_extent
from dcp.core.read_cost import ReadCost
from dcp.core.read_plan import (
    Request,
    Run,
    coalesce,
    join_adjacent,
    largest_gap,
    whole_chunk_cheaper,
)
from dcp.core.storage import open_storage
from helpers import assert_bitwise_equal, random_tensor
from planners.load import DefaultLoadPlanner
from storage_plugins.posix import PosixStorage

S3_COST = ReadCost(latency_s=0.02, bandwidth_bps=1e8, concurrency=10,
                   max_request_bytes=16 << 20)
POSIX_COST = PosixStorage("/unused").read_cost


def _column_runs(rows: int, cols: int, itemsize: int, start: int, width: int,
                 base: int = 0) -> list[Run]:
    """The runs of columns ``start:start+width`` of a row-major chunk."""
    runs, pos = [], 0
    for offset, length in byte_runs((rows, cols), (0, start), (rows, width), itemsize):
        runs.append(Run(base + offset, length, 0, pos))
        pos += length
    return runs


@pytest.mark.parametrize("cost", [S3_COST, POSIX_COST], ids=["s3", "posix"])
def test_rows_of_a_shard1_target_become_a_few_large_requests(cost):
    # a [512, 4096] fp32 chunk (8 MiB) read for a quarter of its columns:
    # 512 runs of 4 KiB with 12 KiB gaps
    runs = _column_runs(512, 4096, 4, 1024, 1024)
    assert len(runs) == 512
    planner = DefaultLoadPlanner()
    requests = planner.create_requests(runs, cost)
    assert len(requests) == 1
    assert requests[0].kept == 512 * 4096
    # every run lands once, in order, at its own position
    assert [r for q in requests for r in q.runs] == runs
    # the gaps are cheaper to read than to skip: read the chunk whole (and check it)
    extent = run_extent((512, 4096), (0, 1024), (512, 1024), 4)
    assert extent == (4096, 511 * 16384 + 8192, 12288)
    assert planner.read_whole_chunk(512 * 4096 * 4, [extent], cost)


def test_gaps_dearer_than_a_request_are_skipped():
    # rows of 4 MiB, needing 1 MiB of each: 3 MiB gaps > S3's 2 MB hole
    runs = _column_runs(4, 1 << 20, 4, 0, 1 << 18)
    requests = coalesce(runs, S3_COST)
    assert len(requests) == 4
    assert sum(r.length for r in requests) == sum(r.length for r in runs)  # 1.0x the bytes
    extent = run_extent((4, 1 << 20), (0, 0), (4, 1 << 18), 4)
    assert not whole_chunk_cheaper(16 << 20, [extent], S3_COST)
    # with no latency nothing is worth reading through: one request a run
    free = ReadCost(latency_s=0.0)
    assert len(coalesce(_column_runs(64, 256, 4, 0, 64), free)) == 64


def test_requests_are_capped_and_overlaps_kept_apart():
    cost = ReadCost(latency_s=1e-3, bandwidth_bps=1e6, max_request_bytes=1000)  # 1000-byte holes
    big = [Run(0, 2500, 0, 0)]
    requests = coalesce(big, cost)
    assert [(r.offset, r.length) for r in requests] == [(0, 1000), (1000, 1000), (2000, 500)]
    assert [r.runs[0].pos for r in requests] == [0, 1000, 2000]
    # two buffers needing the same bytes: separate requests, never one scatter
    requests = coalesce([Run(0, 100, 0, 0), Run(50, 100, 1, 0), Run(400, 10, 2, 0)], cost)
    assert [(r.offset, r.length) for r in requests] == [(0, 100), (50, 360)]
    assert largest_gap(requests) == 250
    assert coalesce([Run(5, 0, 0, 0)], cost) == []
    assert largest_gap([Request(0, 10, (Run(0, 10, 0, 0),))]) == 0


def test_whole_chunk_needs_cheap_gaps_ends_and_one_request():
    cost = ReadCost(latency_s=1e-3, bandwidth_bps=1e5, max_request_bytes=1000)  # 100-byte holes
    assert whole_chunk_cheaper(1000, [(100, 900, 100)], cost)
    assert not whole_chunk_cheaper(1000, [(100, 900, 101)], cost)  # a gap inside too long
    assert not whole_chunk_cheaper(1000, [(101, 1000, 0)], cost)  # leading gap too long
    assert not whole_chunk_cheaper(1000, [(0, 899, 0)], cost)  # trailing gap too long
    assert not whole_chunk_cheaper(1001, [(0, 1001, 0)], cost)  # more than one request
    # two regions: the gap between them counts
    assert whole_chunk_cheaper(1000, [(0, 400, 0), (500, 1000, 0)], cost)
    assert not whole_chunk_cheaper(1000, [(0, 300, 0), (500, 1000, 0)], cost)


def test_run_extent_matches_the_runs():
    rng = random.Random(1)
    for _ in range(2000):
        ndim = rng.randint(1, 4)
        chunk = [rng.randint(1, 5) for _ in range(ndim)]
        rel = [rng.randint(0, c - 1) for c in chunk]
        sizes = [rng.randint(0, c - r) for c, r in zip(chunk, rel, strict=True)]
        itemsize = rng.choice([1, 2, 4, 8])
        extent = run_extent(chunk, rel, sizes, itemsize)
        if not all(sizes):
            assert extent is None, (chunk, rel, sizes)
            continue
        runs = list(byte_runs(chunk, rel, sizes, itemsize))
        gaps = [b[0] - (a[0] + a[1]) for a, b in zip(runs, runs[1:], strict=False)]
        assert extent == (runs[0][0], runs[-1][0] + runs[-1][1], max(gaps, default=0))
    assert run_extent((), (), (), 2) == (0, 2, 0)


def test_read_cost_is_overridden_through_storage_options(tmp_path):
    storage = open_storage(str(tmp_path), read_cost={"latency_s": 0.5, "concurrency": 3})
    assert storage.read_cost.latency_s == 0.5 and storage.read_cost.concurrency == 3
    assert storage.read_cost.shared_cache  # the rest stays the plugin's
    with pytest.raises(dcp.CheckpointError, match="unknown read_cost field.*latency_ms"):
        open_storage(str(tmp_path), read_cost={"latency_ms": 1})
    with pytest.raises(dcp.CheckpointError, match=re.escape(
            f"{str(tmp_path)!r}: read_cost bandwidth_bps=0: a number > 0 (bytes per second)")):
        open_storage(str(tmp_path), read_cost={"bandwidth_bps": 0})
    with pytest.raises(dcp.CheckpointError, match="read_cost must be a mapping"):
        open_storage(str(tmp_path), read_cost=3)
    assert not open_storage("memory://x").read_cost.shared_cache
    assert open_storage(str(tmp_path), read_cost={"decode_bps": 3e9}).read_cost.decode_bps == 3e9
    assert open_storage(str(tmp_path)).read_cost.decode_bps == 1.5e9  # the measured default
    for bad in (0, -1.0, float("nan"), "fast", True):
        with pytest.raises(dcp.CheckpointError, match=r"read_cost decode_bps=.*: a number > 0"):
            open_storage(str(tmp_path), read_cost={"decode_bps": bad})
    with pytest.raises(dcp.CheckpointError, match=r"concurrency=2\.5: an integer >= 1"):
        open_storage(str(tmp_path), read_cost={"concurrency": 2.5})
    with pytest.raises(dcp.CheckpointError, match="shared_cache='yes': True or False"):
        open_storage(str(tmp_path), read_cost={"shared_cache": "yes"})


def test_a_regions_seconds_add_latency_transfer_and_decoding():
    cost = ReadCost(latency_s=0.5, bandwidth_bps=4, max_request_bytes=8, decode_bps=2)
    # two requests of at most 8 bytes, 12 stored bytes at 4/s, 6 decoded at 2/s
    assert cost.seconds(12, 6) == 0.5 * 2 + 3 + 3
    assert cost.seconds(12, 6, requests=1) == 0.5 + 3 + 3
    assert cost.seconds(0) == 0.5  # a request, even for nothing


DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool, torch.float32]


def _full(dtype, shape, seed):
    return random_tensor(shape, dtype, seed=seed)


@pytest.mark.parametrize("uri", ["posix", "memory"])
@pytest.mark.parametrize("verify", ["chunks", "none", "all"])
def test_column_slices_load_exact_in_few_requests(tmp_path, uri, verify):
    root = str(tmp_path / "ckpt") if uri == "posix" else f"memory://read-plan-{verify}"
    full = {f"t{i}": _full(d, (96, 80), i) for i, d in enumerate(DTYPES)}
    full["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    full["empty"] = torch.zeros(0, 7, dtype=torch.int64)
    md = dcp.save(full, root)
    for start, width in [(0, 80), (16, 24), (79, 1), (40, 0)]:
        target = {k: dcp.TensorShard(torch.zeros(96, width, dtype=v.dtype), (96, 80), (0, start))
                  for k, v in full.items() if v.dim() == 2 and v.numel()}
        target["scalar"] = torch.zeros((), dtype=torch.bfloat16)
        target["empty"] = dcp.TensorShard(torch.zeros(0, 3, dtype=torch.int64), (0, 7), (0, 2))
        report = dcp.load(target, root, verify=verify)
        for k, v in full.items():
            got = target[k].data if isinstance(target[k], dcp.TensorShard) else target[k]
            want = v[:, start:start + width] if v.dim() == 2 else v
            if k == "empty":
                want = v[:, 2:5]
            assert_bitwise_equal(got, want, f"{k} cols {start}:{start + width} ({verify})")
        # every chunk in one request or fewer, never one request per row
        assert report.requests <= len(md.tensors), (start, width, report.requests)
        assert report.bytes_read <= md.stored_bytes


def test_no_coalescing_reads_exactly_the_needed_bytes(tmp_path):
    full = {"w": _full(torch.float32, (64, 32), 1)}
    dcp.save(full, str(tmp_path / "c"))
    target = {"w": dcp.TensorShard(torch.zeros(64, 8), (64, 32), (0, 8))}
    report = dcp.load(target, str(tmp_path / "c"),
                      storage_options={"read_cost": {"latency_s": 0}})
    assert_bitwise_equal(target["w"].data, full["w"][:, 8:16], "w")
    assert (report.requests, report.bytes_read) == (64, 64 * 8 * 4)


def test_a_chunk_read_whole_is_verified_for_a_part(tmp_path):
    """A flipped byte outside the needed columns, in a chunk the planner
    reads whole: the default load names it; verify="none" reads the
    columns without looking."""
    full = {"w": _full(torch.float32, (64, 32), 2)}
    md = dcp.save(full, str(tmp_path / "c"))
    chunk = md.tensors["w"].chunks[0]
    path = tmp_path / "c" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset + 4 * 31] ^= 0xFF  # row 0, last column
    path.write_bytes(bytes(data))
    target = {"w": dcp.TensorShard(torch.zeros(64, 8), (64, 32), (0, 0))}
    with pytest.raises(dcp.CorruptCheckpointError, match="'w'.*checksum mismatch"):
        dcp.load(target, str(tmp_path / "c"))
    dcp.load(target, str(tmp_path / "c"), verify="none")
    assert_bitwise_equal(target["w"].data, full["w"][:, :8], "w")


def test_a_truncated_file_is_named_not_a_crash(tmp_path):
    """The part of a chunk is copied out of the mapped file: a file shorter
    than its chunks must raise, not fault."""
    full = {"w": _full(torch.float32, (64, 32), 3)}
    md = dcp.save(full, str(tmp_path / "c"))
    chunk = md.tensors["w"].chunks[0]
    path = tmp_path / "c" / chunk.file
    path.write_bytes(path.read_bytes()[:chunk.byte_offset + chunk.nbytes - 1])
    target = {"w": dcp.TensorShard(torch.zeros(64, 8), (64, 32), (0, 8))}
    for verify in ("chunks", "none"):
        with pytest.raises(dcp.CorruptCheckpointError, match=f"'w'.*{chunk.file}.*truncated"):
            dcp.load(target, str(tmp_path / "c"), verify=verify)


def test_a_cast_copies_straight_from_the_cache(tmp_path):
    full = {"w": _full(torch.bfloat16, (40, 24), 4), "i": _full(torch.int64, (7, 9), 5)}
    dcp.save(full, str(tmp_path / "c"))
    target = {"w": dcp.TensorShard(torch.zeros(40, 5), (40, 24), (0, 19)),
              "i": torch.zeros(7, 9, dtype=torch.float64)}
    report = dcp.load(target, str(tmp_path / "c"), allow_dtype_cast=True)
    assert_bitwise_equal(target["w"].data, full["w"][:, 19:].float(), "w")
    assert_bitwise_equal(target["i"], full["i"].double(), "i")
    assert report.requests == 2


def test_a_missing_file_is_corrupt_and_named_a_failed_read_is_not_corrupt(tmp_path):
    full = {"w": _full(torch.float32, (64, 32), 6)}
    md = dcp.save(full, str(tmp_path / "c"))
    chunk = md.tensors["w"].chunks[0]
    (tmp_path / "c" / chunk.file).unlink()
    for target in ({"w": torch.zeros(64, 32)},  # read into the target
                   {"w": dcp.TensorShard(torch.zeros(64, 8), (64, 32), (0, 8))}):  # mapped
        with pytest.raises(dcp.CorruptCheckpointError,
                           match=rf"'w'.*offsets \[0, 0\].*{chunk.file}.*FileNotFoundError"):
            dcp.load(target, str(tmp_path / "c"))

    class Failing(PosixStorage):
        def read_requests(self, name, requests):
            raise OSError(28, "injected ENOSPC")

        def read_ranges(self, name, ranges):
            raise OSError(28, "injected ENOSPC")

    md = dcp.save(full, str(tmp_path / "d"))
    with pytest.raises(dcp.CheckpointError, match=r"'w'.*injected ENOSPC") as e:
        dcp.load({"w": torch.zeros(64, 32)}, str(tmp_path / "d"),
                 storage=Failing(str(tmp_path / "d")))
    assert not isinstance(e.value, dcp.CorruptCheckpointError)


def test_requests_end_to_end_are_joined_within_the_limit_and_gaps_are_kept():
    a = Request(0, 10, (Run(0, 10, 0, 0),))
    b = Request(10, 5, (Run(10, 5, 1, 0),))
    c = Request(20, 5, (Run(20, 5, 2, 0),))  # a gap before it: never read through
    d = Request(25, 30, (Run(25, 30, 3, 0),))  # would pass the limit joined to c
    joined = join_adjacent([c, b, d, a], limit=30)
    assert joined == [Request(0, 15, (*a.runs, *b.runs)), c, d]
    assert sum(r.length for r in joined) == sum(r.kept for r in joined) == 50
    assert join_adjacent([], 40) == []

