"""Loads judged by requests and paths, on real gloo ranks.

* S3 (moto's server, behind a counting proxy run by rank 0): a Shard(0)
  checkpoint loaded into Shard(1) at W=2 and W=4 makes a bounded number of
  GETs, not one per row.
* Two hosts on one machine, simulated: ranks 0, 1 pass ``host="h0"`` to
  ``dcp.load`` and ranks 2, 3 ``host="h1"`` (the machine is one, so the
  page cache is really shared by all four; the planner only sees the hosts
  it is told).  Replicated and DP2 x TP2 targets load element-exact; on
  POSIX every replica group takes the page cache path and reads the storage
  once per host, on S3 it reads once overall and passes the bytes through
  shared memory within a host and by broadcast across hosts.  Compressed on
  POSIX, replicated regions with frames to decode are decoded once per host
  and passed through shared memory, raw-framed ones keep the page cache.
* The global plan's costs, without processes: readers balanced by seconds
  (decoding included), and the page cache or shared memory per region.
* A reader's failure on any path raises on every rank, and nothing hangs;
  so does a broadcast's, and the load's threads are joined (a process
  exits at once after it).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import threading
import time
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dcp
import s3_server
from dcp.coordination import host_exchange
from dcp.coordination.broadcast import Broadcaster
from dcp.core.compression import RAW
from dcp.core.planner import LoadPlan, ReadItem, Transfer
from dcp.core.read_cost import ReadCost
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, assert_dtensor_equals_full, random_tensor
from planners.load import DefaultLoadPlanner
from storage_plugins.posix import PosixStorage
from storage_plugins.s3 import S3Storage

_PROXY = None


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _proxy_url() -> str:
    """A counting proxy to rank 0's S3 server, run by rank 0, known to all."""
    global _PROXY
    box = [None]
    if dist.get_rank() == 0:
        if _PROXY is None:
            _PROXY = s3_server.FaultProxy(s3_server.endpoint())
        box = [_PROXY.url]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gets() -> int | None:
    """GETs of objects (not listings) the proxy has seen; rank 0 only."""
    if _PROXY is None:
        return None
    _PROXY.idle()
    return _PROXY.count(lambda method, target: method == "GET" and "?" not in target)


def _s3_setup(label: str) -> tuple[str, dict]:
    url = _proxy_url()
    box = [s3_server.fresh_url(label) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0], s3_server.options(url)


def _shard0_to_shard1(ctx):
    world_size = ctx.world_size
    url, options = _s3_setup(f"reshard-w{world_size}")
    mesh = init_device_mesh("cpu", (world_size,))
    # 256 rows of 256 B: a per-row load would make 256 GETs per tensor and rank
    full = {f"w{i}": random_tensor((256, 64), torch.float32, seed=i) for i in range(4)}
    full["h"] = random_tensor((64, 48), torch.bfloat16, seed=9)
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    md = dcp.save(sd, url, storage_options=options)
    ctx.barrier()
    before = _gets()
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}
    report = dcp.load(target, url, storage_options=options)
    for k, v in full.items():
        assert_dtensor_equals_full(target[k], v, k)
    # every rank needs a part of every chunk: each chunk is read whole once
    # for the host, by one rank, and passed whole through shared memory
    chunks = sum(len(t.chunks) for t in md.tensors.values())
    assert sum(_gather(report.requests)) <= chunks, report.requests
    assert sum(_gather(report.bytes_read)) == md.stored_bytes
    assert {way for _, way, _ in report.paths} == {"storage", "shared_memory"}, report.paths
    ctx.barrier()
    if ctx.rank == 0:
        gets = _gets() - before
        # one GET a chunk at most (side by side in a file, fewer), plus the metadata
        assert gets <= chunks + 1, (gets, chunks)


@dist_scenario(world_size=2)
def test_s3_resharded_load_makes_few_gets_2_ranks(ctx):
    _shard0_to_shard1(ctx)


@dist_scenario(world_size=4)
def test_s3_resharded_load_makes_few_gets_4_ranks(ctx):
    _shard0_to_shard1(ctx)


def _two_hosts_state(mesh2):
    g = torch.Generator().manual_seed(21)
    full = {"rep": torch.randn(64, 40, generator=g),
            "rep16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "a": torch.randn(48, 24, generator=g), "b": torch.randint(0, 9, (10, 6), generator=g),
            "s": torch.tensor(4.5)}
    placements = {"a": [Replicate(), Shard(0)], "b": [Replicate(), Shard(1)]}
    sd = {k: (distribute_tensor(v, mesh2, placements[k]) if k in placements else v.clone())
          for k, v in full.items()}
    return full, sd, placements


def _check_two_hosts(ctx, full, target, report, md, storage_once: int):
    for k, v in full.items():
        got = target[k].full_tensor() if hasattr(target[k], "full_tensor") else target[k]
        assert_bitwise_equal(got, v, k)
    assert sum(_gather(report.bytes_read)) == storage_once * md.stored_bytes


@dist_scenario(world_size=4)
def test_two_hosts_posix_take_the_page_cache_once_per_host(ctx):
    host = f"h{ctx.rank // 2}"
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full, sd, placements = _two_hosts_state(mesh2)
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(sd, ckpt)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    for k, p in placements.items():
        target[k] = distribute_tensor(torch.zeros_like(full[k]), mesh2, p)
    report = dcp.load(target, ckpt, host=host)
    # every region read once per host: replicated ones by one rank of each
    # host, the DP2 x TP2 shards (DP replicas live on both hosts) too
    _check_two_hosts(ctx, full, target, report, md, storage_once=2)
    ways = Counter(way for _, way, _ in report.paths)
    assert set(ways) == {"storage", "page_cache"}, report.paths
    for _, way, nbytes in report.paths:
        assert way != "page_cache" or nbytes > 0
    # the other ranks of the host took it from the cache, not from storage
    cached = _gather(report.bytes_from_cache)
    assert sum(cached) == sum(n for _, way, n in report.paths if way == "page_cache")
    assert all(c > 0 for c in cached), cached
    # compressed: a replicated region with frames to decode is decoded once per
    # host and passed through shared memory, one whose frames are raw (random
    # bytes, the 0-dim tensor) keeps the page cache, in the same load
    full["noise"] = torch.randint(0, 256, (6000,), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(5))
    sd["noise"] = full["noise"].clone()
    md = dcp.save(sd, ckpt + "_zstd", compression="zstd")
    coded = {k for k, t in md.tensors.items()
             if any(f != RAW for c in t.chunks for f in c.frames.kinds)}
    assert coded == {"rep", "rep16", "a", "b"}, coded
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    for k, p in placements.items():
        target[k] = distribute_tensor(torch.zeros_like(full[k]), mesh2, p)
    report = dcp.load(target, ckpt + "_zstd", host=host)
    for k, v in full.items():
        got = target[k].full_tensor() if hasattr(target[k], "full_tensor") else target[k]
        assert_bitwise_equal(got, v, k)
    everyone = (0, 1, 2, 3)
    ways = Counter()
    for ranks, way, nbytes in report.paths:
        ways[way] += nbytes
        assert way == "storage" or ranks == everyone, report.paths  # replicated only
    # per host one rank reads each replicated tensor, the other receives it
    assert ways["shared_memory"] == 2 * (full["rep"].nbytes + full["rep16"].nbytes)
    assert ways["page_cache"] == 2 * (full["noise"].nbytes + full["s"].nbytes)
    cached = _gather(report.bytes_from_cache)
    assert sum(cached) == ways["page_cache"]
    # every chunk's frames read from storage once per host
    assert sum(_gather(report.bytes_read)) == ways["storage"] == 2 * sum(
        t.file_bytes for t in md.tensors.values())


class _LooksForSmallRegions(PosixStorage):
    """POSIX whose read cost makes regions of 200 bytes and more worth
    looking for in the page cache (the tests' regions are small)."""

    def __init__(self, path):
        super().__init__(path)
        self.read_cost = dataclasses.replace(self.read_cost, latency_s=1e-7)


class _TrickleCache(_LooksForSmallRegions):
    """The page cache as a rank sees it while other ranks pull a file in:
    each look gives at most ``piece`` more bytes of a region.  Its own
    reads take ``delay`` seconds a call and, however slowly the looks come
    on a loaded machine, do not end before a look has found every region
    it asked for whole (at most ``patience`` seconds), so every region is
    taken by looks while they are in flight."""

    def __init__(self, path, piece, delay, patience=30.0):
        super().__init__(path)
        self.piece, self.delay, self.patience = piece, delay, patience
        self.whole: dict[str, bool] = {}  # file -> did its last look find all it asked for

    def read_cached(self, name, ranges):
        self.whole[name] = all(len(b) <= self.piece for _, b in ranges)
        return [super(_TrickleCache, self).read_cached(name, [(o, b[:self.piece])])[0]
                for o, b in ranges]

    def read_requests(self, name, requests):
        time.sleep(self.delay)
        deadline = time.monotonic() + self.patience
        while not (self.whole and all(self.whole.values())) and time.monotonic() < deadline:
            time.sleep(0.01)
        super().read_requests(name, requests)


class _NothingArrives(_LooksForSmallRegions):
    """A page cache that never has the bytes yet, requests of at most
    ``max_request_bytes``; records the size of every request."""

    def __init__(self, path, max_request_bytes):
        super().__init__(path)
        self.read_cost = dataclasses.replace(self.read_cost, max_request_bytes=max_request_bytes)
        self.sizes = []

    def read_cached(self, name, ranges):
        return [0] * len(ranges)

    def read_requests(self, name, requests):
        self.sizes += [sum(len(v) for v in views) for _, views in requests]
        super().read_requests(name, requests)


class _CacheFails(_LooksForSmallRegions):
    def __init__(self, path, fail_rank):
        super().__init__(path)
        self.fail = dist.get_rank() == fail_rank

    def read_cached(self, name, ranges):
        if self.fail:
            raise OSError(5, "injected EIO in a page-cache read", name)
        return super().read_cached(name, ranges)

    def read_requests(self, name, requests):
        time.sleep(0.05)  # own reads in flight while the cache is looked at
        super().read_requests(name, requests)


@dist_scenario(world_size=2)
def test_regions_other_ranks_pull_are_copied_from_the_page_cache_as_they_arrive(ctx):
    """Replicated tensors on one host: each rank pulls half of them from
    storage and copies the other half out of the page cache while its own
    reads are in flight, in as many pieces as the cache gives (pieces that
    cut elements in two); a region too small to look for (the scalar) is
    read once its own reads are done."""
    g = torch.Generator().manual_seed(5)
    full = {"f32": torch.randn(96, 40, generator=g),
            "f32b": torch.randn(80, 48, generator=g),
            "bf16": torch.randn(33, 70, generator=g).to(torch.bfloat16),
            "f8": torch.randn(50, 90, generator=g).to(torch.float8_e4m3fn),
            "i64": torch.randint(-2**40, 2**40, (70, 30), generator=g),
            "bool": torch.rand(41, 50, generator=g) > 0.5,
            "scalar": torch.tensor(4.5, dtype=torch.float64),
            "empty": torch.zeros(0, 6)}
    ckpt = str(ctx.dir / "ckpt")
    md = dcp.save(full, ckpt)
    for piece in (999, 1 << 30):  # trickling in, cutting elements; all there at the first look
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        report = dcp.load(target, ckpt, storage=_TrickleCache(ckpt, piece, delay=0.2))
        for k, v in full.items():
            assert_bitwise_equal(target[k], v, k)
        # every byte once: from storage by one rank, from the cache by the other
        assert sum(_gather(report.bytes_read)) == md.stored_bytes
        cached = sum(n for _, way, n in report.paths if way == "page_cache")
        assert sum(_gather(report.bytes_from_cache)) == cached > 0
        # each rank pulls about half of the bytes and takes the rest from the cache
        taken = _gather((report.bytes_from_cache, report.cache_requests))
        assert all(nbytes > 10_000 for nbytes, _ in taken), taken
        if piece == 999:  # taken while its own reads ran: 999 bytes a look at most
            assert all(n >= -(-nbytes // 999) for nbytes, n in taken), taken
    # what is left when the own reads end is read in requests capped as the
    # read cost says (here nothing ever arrives: every byte is left)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    capped = _NothingArrives(ckpt, max_request_bytes=4096)
    report = dcp.load(target, ckpt, storage=capped)
    for k, v in full.items():
        assert_bitwise_equal(target[k], v, k)
    assert report.bytes_from_cache > 10_000 and max(capped.sizes) <= 4096, capped.sizes
    # a page-cache read failing on one rank fails the load on both, naming it
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    with pytest.raises(dcp.CheckpointError,
                       match=r"failed on rank 1.*reading chunk.*injected EIO in a page-cache"):
        dcp.load(target, ckpt, storage=_CacheFails(ckpt, 1))
    ctx.barrier()
    assert glob.glob(f"{host_exchange.SHM_ROOT}/hyperdcp-" + "[0-9a-f]" * 32 + "-*") == []
    # a data file cut short inside the last of its tensors: every rank names that one
    cut = str(ctx.dir / "cut")
    md = dcp.save(full, cut, storage=PosixStorage(cut, thread_count=1))  # one file a rank
    ctx.barrier()
    file, end, last = max((c.file, c.byte_offset + c.nbytes, fqn)
                          for fqn, t in md.tensors.items() for c in t.chunks)
    held = [f for f, t in md.tensors.items() for c in t.chunks if c.file == file]
    assert len(held) > 1, held
    if ctx.rank == 0:
        os.truncate(os.path.join(cut, file), end - 100)
    ctx.barrier()
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, cut, storage=_LooksForSmallRegions(cut))
    named = set(re.findall(r"'(\w+)': reading chunk", str(caught.value)))
    assert named == {last}, (str(caught.value), held)


@dist_scenario(world_size=4)
def test_two_hosts_s3_read_once_shared_memory_within_broadcast_across(ctx):
    host = f"h{ctx.rank // 2}"
    url, options = _s3_setup("two-hosts")
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full, sd, placements = _two_hosts_state(mesh2)
    md = dcp.save(sd, url, storage_options=options)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    for k, p in placements.items():
        target[k] = distribute_tensor(torch.zeros_like(full[k]), mesh2, p)
    report = dcp.load(target, url, storage_options=options, host=host)
    _check_two_hosts(ctx, full, target, report, md, storage_once=1)
    assert report.bytes_from_cache == 0
    paths = {(ranks, way) for ranks, way, _ in report.paths}
    # replicated tensors: all four ranks, one reader, both ways out of it
    assert ((0, 1, 2, 3), "shared_memory") in paths and ((0, 1, 2, 3), "broadcast") in paths
    # DP2 x TP2 shards: the DP replicas are ranks {0, 2} and {1, 3}, on two hosts
    assert ((0, 2), "broadcast") in paths and ((1, 3), "broadcast") in paths
    assert ((0, 2), "shared_memory") not in paths
    moved = sum(n for _, way, n in report.paths if way != "storage")
    got = (sum(_gather(report.bytes_read)), moved)
    # every byte each rank needs came from storage or from another rank, once
    sharded = sum(c.nbytes for k in placements for c in md.tensors[k].chunks)
    assert got[0] + got[1] == 4 * md.stored_bytes - 2 * sharded, got


@dist_scenario(world_size=4)
def test_a_chunk_read_whole_by_a_host_is_checked_once_and_fails_everywhere(ctx):
    """Saved Shard(0), loaded Shard(1): every rank of the host needs a part
    of every chunk; one of them checks each chunk's CRC-32C for all.  A
    flipped byte fails the load on every rank, naming the tensor."""
    mesh = init_device_mesh("cpu", (4,))
    full = {f"w{i}": random_tensor((64, 32), torch.float32, seed=40 + i) for i in range(3)}
    ckpt = ctx.dir / "ckpt"
    md = dcp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, str(ckpt))
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}
    report = dcp.load(target, str(ckpt))
    for k, v in full.items():
        assert_dtensor_equals_full(target[k], v, k)
    ctx.barrier()
    if ctx.rank == 0:
        chunk = md.tensors["w1"].chunks[2]
        path = ckpt / chunk.file
        data = bytearray(path.read_bytes())
        data[chunk.byte_offset + chunk.nbytes - 1] ^= 0x01
        path.write_bytes(bytes(data))
    ctx.barrier()
    with pytest.raises(dcp.CheckpointError, match=r"'w1'.*checksum mismatch"):
        dcp.load(target, str(ckpt))
    # unchecked, the bytes load: each rank copies only its own columns
    report = dcp.load(target, str(ckpt), verify="none")
    assert report.requests == len(md.tensors) * 4  # one mapped chunk each


@dist_scenario(world_size=4)
def test_a_chunk_a_rank_checks_is_read_whole_though_the_page_cache_has_its_part(ctx):
    """DP2 x TP2 targets of a replicated checkpoint: each DP replica of a TP
    shard is a region of the chunk that one rank pulls and the other could
    take from the page cache; the rank that checks the chunk for its host
    reads it whole instead.  A flipped byte fails the load on every rank."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(5, 22500, generator=g)  # a TP shard of 180-270 KB: worth a look of its own
    p = torch.randn(256, 256, generator=g)
    ckpt = ctx.dir / "ckpt-dp-tp"
    md = dcp.save({"w": w, "p": p}, str(ckpt))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    target = {"w": distribute_tensor(torch.zeros_like(w), mesh2, [Replicate(), Shard(0)])}
    if ctx.rank == 0:  # rank 0 reads more of its own: the other DP replica pulls the shard
        target["p"] = torch.zeros_like(p)
    dcp.load(target, str(ckpt))
    assert_dtensor_equals_full(target["w"], w, "w")
    ctx.barrier()
    if ctx.rank == 0:
        chunk = md.tensors["w"].chunks[0]
        with open(ckpt / chunk.file, "r+b") as f:  # a byte of the first TP shard
            f.seek(chunk.byte_offset + 100)
            byte = f.read(1)
            f.seek(chunk.byte_offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    ctx.barrier()
    for verify in ("chunks", "all"):
        with pytest.raises(dcp.CorruptCheckpointError, match=r"'w': checksum mismatch"):
            dcp.load(target, str(ckpt), verify=verify)


class _FailingPosix(PosixStorage):
    def __init__(self, path, fail_rank):
        super().__init__(path)
        self.fail = dist.get_rank() == fail_rank

    def read_requests(self, name, requests):
        if self.fail:
            raise OSError(5, "injected EIO", name)
        super().read_requests(name, requests)


class _FailingS3(S3Storage):
    def __init__(self, url, fail_rank, **options):
        super().__init__(url, **options)
        self.fail = dist.get_rank() == fail_rank

    def read_requests(self, name, requests):
        if self.fail:
            raise OSError(5, "injected EIO", name)
        super().read_requests(name, requests)


@dist_scenario(world_size=4, last=True)
def test_a_failing_reader_raises_on_every_rank_on_every_path(ctx):
    host = f"h{ctx.rank // 2}"
    full = {f"w{i}": random_tensor((16, 16), torch.float32, seed=i) for i in range(8)}
    ckpt = str(ctx.dir / "ckpt")
    dcp.save(full, ckpt)
    url, options = _s3_setup("failing")
    dcp.save(full, url, storage_options=options)
    cases = [(lambda: _FailingPosix(ckpt, 1), ckpt, path)
             for path in ("auto", "page_cache", "shared_memory", "broadcast")]
    cases.append((lambda: _FailingS3(url, 2, **options), url, "auto"))
    for make, where, path in cases:
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        with pytest.raises(dcp.CheckpointError, match=r"failed on rank [12].*injected EIO"):
            dcp.load(target, where, storage=make(), host=host,
                     planner=DefaultLoadPlanner(replica_path=path))
        ctx.barrier()
        assert glob.glob(f"{host_exchange.SHM_ROOT}/hyperdcp-" + "[0-9a-f]" * 32 + "-*") == []
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(target, url, storage_options=options, host=host)
    for k, v in full.items():
        assert_bitwise_equal(target[k], v, k)
    # a resharded load, each chunk read once per host and passed whole: the
    # reading rank fails, its receivers hear of it
    mesh = init_device_mesh("cpu", (4,))
    sharded = f"{url}-sharded"
    dcp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, sharded,
             storage_options=options)
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}
    with pytest.raises(dcp.CheckpointError, match=r"failed on rank 2.*injected EIO"):
        dcp.load(target, sharded, storage=_FailingS3(sharded, 2, **options))
    ctx.barrier()
    assert glob.glob(f"{host_exchange.SHM_ROOT}/hyperdcp-" + "[0-9a-f]" * 32 + "-*") == []
    dcp.load(target, sharded, storage_options=options)
    for k, v in full.items():
        assert_dtensor_equals_full(target[k], v, k)


@dist_scenario(world_size=4, last=True)
def test_a_load_whose_broadcasts_fail_joins_its_threads(ctx):
    """Replicated tensors on two hosts, passed through shared memory within
    a host and by broadcast across: every broadcast fails as it starts (a
    broken group), on every rank.  The load raises on every rank, and no
    thread of it is left, though the shared-memory publisher has regions
    no receiver will take."""
    host = f"h{ctx.rank // 2}"
    full = {f"w{i}": random_tensor((64, 64), torch.float32, seed=70 + i) for i in range(8)}
    ckpt = str(ctx.dir / "ckpt")
    dcp.save(full, ckpt)
    before = set(threading.enumerate())

    def broken(*args, **kwargs):
        raise RuntimeError("injected: the group is broken")

    target = {k: torch.zeros_like(v) for k, v in full.items()}
    started = time.monotonic()
    with mock.patch.object(Broadcaster, "start", broken), \
            pytest.raises(dcp.CheckpointError, match="injected: the group is broken"):
        dcp.load(target, ckpt, host=host, planner=DefaultLoadPlanner(replica_path="shared_memory"),
                 max_inflight_bytes=32 << 10)
    left = [t.name for t in set(threading.enumerate()) - before]
    assert left == [], left
    assert time.monotonic() - started < 30  # the exchange's waits are 1800 s
    ctx.barrier()
    assert glob.glob(f"{host_exchange.SHM_ROOT}/hyperdcp-" + "[0-9a-f]" * 32 + "-*") == []
    dcp.load(target, ckpt, host=host, planner=DefaultLoadPlanner(replica_path="shared_memory"))
    for k, v in full.items():
        assert_bitwise_equal(target[k], v, k)


# --- the planner's cost of decoding (no processes) ----------------------------

def _cost_plans(cost: ReadCost, items_per_rank, host: str = "h", shared_memory: bool = True):
    return [LoadPlan(items=list(items), host=host, shared_memory=shared_memory,
                     shared_cache=cost.shared_cache, read_cost=cost) for items in items_per_rank]


def test_readers_are_balanced_by_seconds_decoding_included():
    """Rank 0 alone needs a compressed region (1,000 stored bytes, 4,000
    to decode), rank 1 an uncompressed one of 8,000 bytes; by bytes rank 0
    has read less, by seconds (decoding at 1e8 B/s) more: the region both
    need goes to rank 1, unless decoding is (nearly) free."""
    compressed = ReadItem("c", 0, 0, (0,), (1000,), 4000, stored_nbytes=1000, decode_nbytes=4000)
    plain = ReadItem("u", 0, 0, (0,), (2000,), 8000)
    both = ReadItem("s", 1, 0, (0,), (25,), 100)
    for decode_bps, reader in ((1e8, 1), (1e15, 0)):
        cost = ReadCost(latency_s=0.0, bandwidth_bps=1e9, decode_bps=decode_bps)
        assert compressed.seconds(cost) == 1000 / 1e9 + 4000 / decode_bps
        final = DefaultLoadPlanner(replica_path="broadcast").create_global_plan(
            _cost_plans(cost, [[compressed, both], [plain, both]]))
        assert [p.items for p in final] == (
            [[compressed], [plain, both]] if reader == 1 else [[compressed, both], [plain]])
        assert [(t.ranks, t.src) for t in final[0].transfers] == [((0, 1), reader)]
        # storage bytes count the compressed region's stored bytes
        assert final[0].paths == [((0, 1), "broadcast", 100), ((0, 1), "storage", 100)]


def test_a_compressed_region_a_host_shares_is_decoded_once_and_sent_through_shm():
    """On storage whose cache the host shares, four ranks of one host need
    a compressed region and an uncompressed one: the compressed one is read
    and decoded by one rank and reaches the three others through host
    shared memory (cheaper than three re-reads and decodings); the
    uncompressed one keeps the page cache path."""
    cost = ReadCost(latency_s=1e-4, bandwidth_bps=2e9, shared_cache=True)  # POSIX's
    c = ReadItem("c", 0, 0, (0,), (4096,), 16384, stored_nbytes=12000, decode_nbytes=16384)
    u = ReadItem("u", 1, 0, (0,), (2048,), 8192)
    # per extra rank: a copy of 16,384 bytes against a re-read and a decoding
    assert cost.seconds(16384) == 1e-4 + 16384 / 2e9
    assert cost.seconds(12000, 16384) == 1e-4 + 12000 / 2e9 + 16384 / 1.5e9
    final = DefaultLoadPlanner().create_global_plan(_cost_plans(cost, [[c, u]] * 4))
    # c, the dearer, first: rank 0; u to the least loaded of the rest, rank 1
    assert [p.items for p in final] == [[c], [u], [], []]
    assert [p.cached for p in final] == [[u], [], [u], [u]]
    assert all(p.transfers == [Transfer((0, 1, 2, 3), 0, (c,), True)] for p in final)
    assert all(p.groups == [] for p in final)  # no process group: shared memory only
    assert final[0].paths == [((0, 1, 2, 3), "page_cache", 3 * 8192),
                              ((0, 1, 2, 3), "shared_memory", 3 * 16384),
                              ((0, 1, 2, 3), "storage", 12000 + 8192)]
    # ranks that cannot receive through shared memory: the page cache
    final = DefaultLoadPlanner().create_global_plan(
        _cost_plans(cost, [[c, u]] * 4, shared_memory=False))
    assert [p.items for p in final] == [[c], [u], [], []]
    assert [p.cached for p in final] == [[u], [c], [c, u], [c, u]]
    assert all(p.transfers == [] for p in final)
    # decoding (nearly) free: a re-read of 12,000 stored bytes beats a copy of 16,384
    free = dataclasses.replace(cost, decode_bps=1e15)
    final = DefaultLoadPlanner().create_global_plan(_cost_plans(free, [[c, u]] * 4))
    assert all(p.transfers == [] for p in final)
    assert [ways for _, ways, _ in final[0].paths] == ["page_cache", "storage"]
