"""The S3 plugin against a real S3 server (moto's, on 127.0.0.1; see
s3_server.py): multipart uploads, failed and interrupted writes, retries,
competing committers, listing freshness, errors, and 4-rank round trips with
resharded loads.  The generic contract is checked by
test_storage_conformance.py."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dcp
import s3_server
from dcp.coordination.file_flag import EXCHANGE_PREFIX
from dcp.core.metadata import METADATA_FILE
from dcp.core.storage import open_storage
from dist_harness import dist_scenario
from helpers import (
    assert_bitwise_equal,
    assert_dtensor_equals_full,
    make_dtensor,
    random_tensor,
    zeros_dtensor,
)
from planners.save import DefaultSavePlanner
from storage_plugins.s3 import S3Storage


def _payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture(scope="module")
def endpoint():
    return s3_server.endpoint()


@pytest.fixture(scope="module")
def raw(endpoint):
    return s3_server.client(endpoint)


@pytest.fixture
def proxy(endpoint):
    proxy = s3_server.FaultProxy(endpoint)
    yield proxy
    proxy.close()


def _pending_uploads(raw, key: str) -> list[dict]:
    return [u for u in raw.list_multipart_uploads(s3_server.BUCKET) if u["Key"] == key]


def _key(url: str, name: str) -> str:
    return f"{url.removeprefix(f's3://{s3_server.BUCKET}/')}/{name}"


def _names(raw, url: str) -> list[str]:
    """The names of every object under ``url``, relative to it."""
    prefix = url.removeprefix("s3://") + "/"
    return sorted(p.removeprefix(prefix) for p in raw.find(url))


def _part_sizes(raw, url: str, name: str) -> list[int]:
    """The sizes of the parts the object was uploaded in (one for a PUT)."""
    def head(number: int) -> dict:
        return raw.call_s3("head_object", Bucket=s3_server.BUCKET, Key=_key(url, name),
                           PartNumber=number)
    return [head(n)["ContentLength"] for n in range(1, head(1).get("PartsCount", 1) + 1)]


def _is_part(number: int):
    return lambda method, target: method == "PUT" and f"partNumber={number}&" in target + "&"


# ------------------------------------------------------------------ writes
def test_large_file_is_uploaded_in_parts_of_part_size(endpoint, raw):
    url = s3_server.fresh_url("multipart")
    storage = open_storage(url, **s3_server.options(endpoint, part_size=2048, max_concurrency=2))
    data = _payload(5000)
    storage.write_file("big.data", [data[:3000], memoryview(data)[3000:]])
    storage.write_file("small.data", [data[:2048]])
    assert raw.cat_file(f"{url}/big.data") == data
    assert _part_sizes(raw, url, "big.data") == [2048, 2048, 904]
    assert _part_sizes(raw, url, "small.data") == [2048]  # one PUT
    assert _pending_uploads(raw, _key(url, "big.data")) == []


def test_failed_multipart_upload_publishes_nothing(endpoint, raw, proxy):
    url = s3_server.fresh_url("failed-upload")
    storage = open_storage(url, **s3_server.options(proxy.url, part_size=1024, max_concurrency=2,
                                                    max_attempts=1))
    proxy.inject(_is_part(3), 500)
    with pytest.raises(OSError) as info:
        storage.write_file("f.data", [_payload(5000)])
    assert f"{url}/f.data" in str(info.value)
    assert proxy.count(_is_part(1)) == 1 and proxy.count(_is_part(3)) == 1
    assert proxy.count(lambda m, t: m == "DELETE" and "uploadId=" in t) == 1  # aborted
    proxy.idle()
    assert not raw.exists(f"{url}/f.data")
    assert _pending_uploads(raw, _key(url, "f.data")) == []


def test_interrupted_multipart_upload_publishes_nothing(endpoint, raw, proxy):
    """Ctrl-C (SIGINT) while part 2 is in flight: the upload is aborted, and
    the parts still in flight can no longer complete it."""
    url = s3_server.fresh_url("interrupted")
    storage = open_storage(url, **s3_server.options(proxy.url, part_size=1024, max_concurrency=2))

    def interrupt_then_stall() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt in the main thread
        time.sleep(1.0)

    proxy.inject(_is_part(2), interrupt_then_stall, times=1)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            storage.write_file("f.data", [_payload(5000)])
    finally:
        signal.signal(signal.SIGINT, previous)
    proxy.idle()
    assert not raw.exists(f"{url}/f.data")
    assert _pending_uploads(raw, _key(url, "f.data")) == []
    assert proxy.count(lambda m, t: m == "POST" and "uploadId=" in t) == 0  # never completed


def test_failed_save_leaves_no_object(endpoint, raw, proxy):
    """A save whose data upload fails half-way: every rank's error names the
    file, and no object at all is left under the checkpoint."""
    url = s3_server.fresh_url("failed-save")
    options = s3_server.options(proxy.url, part_size=1024, max_attempts=1, thread_count=1)
    proxy.inject(_is_part(2), 503)
    state = {"w": random_tensor((40, 16), torch.float32, seed=1), "step": 4}
    with pytest.raises(dcp.CheckpointError) as info:
        dcp.save(state, url, storage_options=options)
    assert "r00000-0." in str(info.value) and url in str(info.value)
    proxy.idle()
    assert _names(raw, url) == []
    with pytest.raises(dcp.NotACheckpointError):
        dcp.read_metadata(url, storage_options=options)


# ----------------------------------------------------------------- retries
def test_transient_errors_are_retried(endpoint, raw, proxy):
    url = s3_server.fresh_url("retry")
    storage = open_storage(url, **s3_server.options(proxy.url))
    key = f"/{s3_server.BUCKET}/{_key(url, 'f.data')}"
    put = lambda method, target: method == "PUT" and target == key  # noqa: E731
    ranged = lambda method, target: method == "GET" and target == key  # noqa: E731
    proxy.inject(put, 503, times=1)
    proxy.inject(put, "reset", times=1)
    proxy.inject(ranged, 500, times=1)
    data = _payload(300)
    storage.write_file("f.data", [data])
    assert proxy.count(put) == 3
    buf = bytearray(100)
    storage.read_ranges("f.data", [(50, memoryview(buf))])
    assert bytes(buf) == data[50:150] and proxy.count(ranged) == 2


def test_persistent_errors_fail_after_bounded_attempts(endpoint, raw, proxy):
    url = s3_server.fresh_url("retry")
    storage = open_storage(url, **s3_server.options(proxy.url, max_attempts=3))
    key = f"/{s3_server.BUCKET}/{_key(url, 'f.data')}"
    put = lambda method, target: method == "PUT" and target == key  # noqa: E731
    proxy.inject(put, 503)
    with pytest.raises(OSError) as info:
        storage.write_file("f.data", [b"never stored"])
    assert f"{url}/f.data" in str(info.value)
    assert proxy.count(put) == 3
    assert not raw.exists(f"{url}/f.data")


# ------------------------------------------------------------------ commit
def test_second_committer_loses_cleanly(endpoint, raw):
    """Two saves to one location: the one that commits second fails (even
    though it passed the existence check before the first committed), its
    data files are removed, and the winner stays whole."""
    url = s3_server.fresh_url("race")
    options = s3_server.options(endpoint)
    winner = {"w": torch.arange(12, dtype=torch.float32), "who": "winner"}
    committed = {}

    class CommitsFirstElsewhere(DefaultSavePlanner):
        def create_global_plan(self, plans):
            committed["md"] = dcp.save(winner, url, storage_options=options)
            return super().create_global_plan(plans)

    loser = {"w": torch.zeros(12), "who": "loser"}
    with pytest.raises(dcp.CheckpointError, match="another save committed a checkpoint here first"):
        dcp.save(loser, url, planner=CommitsFirstElsewhere(), storage_options=options)
    assert _names(raw, url) == sorted(committed["md"].files() | {METADATA_FILE})
    target = {"w": torch.ones(12), "who": ""}
    dcp.load(target, url, storage_options=options)
    assert_bitwise_equal(target["w"], winner["w"])
    assert target["who"] == "winner"


def test_commit_whose_answer_was_lost_is_not_refused_by_itself(endpoint, raw, proxy):
    """The exclusive create of metadata.json reaches S3 but its answer is
    lost; botocore retries, and S3 refuses the retry (the object exists — it
    is the one the first attempt wrote).  The commit still succeeds."""
    url = s3_server.fresh_url("lost-answer")
    key = f"/{s3_server.BUCKET}/{_key(url, METADATA_FILE)}"
    commit = lambda method, target: method == "PUT" and target == key  # noqa: E731
    proxy.inject(commit, "lose-answer", times=1)
    state = {"w": torch.arange(6, dtype=torch.float32)}
    md = dcp.save(state, url, storage_options=s3_server.options(proxy.url))
    assert proxy.count(commit) == 2
    assert dcp.read_metadata(url, storage_options=s3_server.options(endpoint)).save_id == md.save_id
    storage = open_storage(url, **s3_server.options(endpoint))
    with pytest.raises(FileExistsError):  # a different commit is still refused
        storage.commit_file(METADATA_FILE, b"another save", overwrite=False)


# ---------------------------------------------------------------- listings
def test_other_clients_objects_are_visible_at_once(endpoint, raw):
    """Another process's new objects show in listings and existence checks
    right away.  (With s3fs's listings cache, on by default, the existence
    check below would keep answering False: the directory listing cached
    after this rank's own write hides the newcomer.)"""
    url = s3_server.fresh_url("fresh")
    storage = open_storage(url, **s3_server.options(endpoint))
    storage.write_exchange("exchange/plan.0", b"mine")
    assert storage.list_files() == ["exchange/plan.0"] and not storage.exists("exchange/plan.1")
    raw.pipe_file(f"{url}/exchange/plan.1", b"from another rank")
    assert storage.exists("exchange/plan.1")
    assert storage.list_files() == ["exchange/plan.0", "exchange/plan.1"]
    raw.rm_file(f"{url}/exchange/plan.0")
    assert storage.list_files() == ["exchange/plan.1"] and not storage.exists("exchange/plan.0")


# ------------------------------------------------------- options and errors
def test_storage_options_reach_s3fs(endpoint):
    storage = open_storage(s3_server.fresh_url("options"), **s3_server.options(
        endpoint, thread_count=3, max_concurrency=2, max_attempts=7,
        config_kwargs={"connect_timeout": 9}, client_kwargs={"region_name": "eu-west-1"}))
    assert isinstance(storage, S3Storage)
    assert (storage.thread_count, storage.max_concurrency) == (3, 2)
    assert storage.fs.endpoint_url == endpoint
    assert storage.fs.client_kwargs == {"region_name": "eu-west-1"}
    assert storage.fs.config_kwargs == {"retries": {"total_max_attempts": 7, "mode": "standard"},
                                        "max_pool_connections": 6, "connect_timeout": 9}
    assert storage.fs.max_concurrency == 2


def test_missing_bucket_is_named(endpoint):
    url = "s3://no-such-bucket-hyperdcp/ckpt"
    with pytest.raises(dcp.CheckpointError) as info:
        dcp.save({"x": torch.ones(2)}, url, storage_options=s3_server.options(endpoint))
    assert url in str(info.value) and "bucket" in str(info.value)


# --------------------------------------------------- 4 ranks against S3
def _shared(value_on_rank0):
    box = [value_on_rank0() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _setup(label: str, **extra) -> tuple[str, dict]:
    """Rank 0's S3 server and a fresh checkpoint URL, known to every rank."""
    endpoint = _shared(s3_server.endpoint)
    return _shared(lambda: s3_server.fresh_url(label)), s3_server.options(endpoint, **extra)


@dist_scenario(world_size=4)
def test_s3_save_and_resharded_loads_4_ranks(ctx):
    url, options = _setup("dist", part_size=1024, max_concurrency=3, thread_count=2)
    mesh = init_device_mesh("cpu", (4,))
    full_w = random_tensor((64, 32), torch.float32, seed=11)
    full_h = random_tensor((8, 12), torch.bfloat16, seed=12)
    bias = random_tensor((5,), torch.int64, seed=13)
    rows = random_tensor((4, 3), torch.float64, seed=14)
    state = {"w": make_dtensor(full_w, mesh, "S0"), "h": make_dtensor(full_h, mesh, "S1"),
             "bias": bias,
             "rows": dcp.TensorShard(rows[ctx.rank:ctx.rank + 1], (4, 3), (ctx.rank, 0)),
             "meta": {"step": 3}}
    md = dcp.save(state, url, storage_options=options)
    if ctx.rank == 0:
        raw = s3_server.client(options["endpoint_url"])
        assert _names(raw, url) == sorted(md.files() | {METADATA_FILE})
        assert raw.list_multipart_uploads(s3_server.BUCKET) == []

    # same 4 ranks, other layouts
    mesh2 = init_device_mesh("cpu", (2, 2))
    target = {"w": zeros_dtensor((64, 32), torch.float32, mesh, "S1"),
              "h": zeros_dtensor((8, 12), torch.bfloat16, mesh2, "S0,S1"),
              "bias": torch.zeros(5, dtype=torch.int64),
              "rows": torch.zeros(4, 3, dtype=torch.float64),
              "meta": {"step": 0}}
    dcp.load(target, url, storage_options=options)
    assert_dtensor_equals_full(target["w"], full_w, "w")
    assert_dtensor_equals_full(target["h"], full_h, "h")
    assert_bitwise_equal(target["bias"], bias, "bias")
    assert_bitwise_equal(target["rows"], rows, "rows")
    assert target["meta"] == {"step": 3}

    # 4 ranks' checkpoint into 2 ranks (a 2-rank group, halves of the rows)
    pair = dist.new_group([0, 1])
    if ctx.rank < 2:
        half = {"w": dcp.TensorShard(torch.zeros(32, 32), (64, 32), (32 * ctx.rank, 0))}
        report = dcp.load(half, url, process_group=pair, strict=False, storage_options=options)
    ctx.barrier()  # ranks 2 and 3 wait here, whatever the pair's assertions find
    if ctx.rank < 2:
        assert_bitwise_equal(half["w"].data, full_w[32 * ctx.rank:32 * (ctx.rank + 1)], "w half")
        assert sorted(report.unexpected_keys) == ["bias", "h", "meta.step", "rows"]


@dist_scenario(world_size=4)
def test_s3_async_save_and_resharded_load_4_ranks(ctx):
    """dcp.async_save to S3 with each coordination — through a gloo group of
    the background processes, through exchange files on S3 itself, and with
    none (each rank commits its own metadata file; the load merges them) —
    then a resharded load; tensors changed after async_save returns do not
    reach the checkpoint, and no exchange file is left behind."""
    base, options = _setup("async", part_size=1024)
    mesh = init_device_mesh("cpu", (4,))
    full = random_tensor((32, 16), torch.float32, seed=21)
    loaded = {}
    for mode in ("gloo", "file", "none"):
        url = f"{base}/{mode}"
        state = {"w": make_dtensor(full, mesh, "S0"), "step": 5}
        response = dcp.async_save(state, url, coordination=mode, storage_options=options)
        state["w"].to_local().add_(1)
        md = response.result(120)
        if mode == "none":  # each rank's result covers its own part only
            ctx.barrier()
        target = {"w": zeros_dtensor((32, 16), torch.float32, mesh, "S1"), "step": 0}
        dcp.load(target, url, storage_options=options)
        loaded[mode] = target, md, url
    ctx.barrier()
    for mode, (target, md, url) in loaded.items():
        assert_dtensor_equals_full(target["w"], full, f"{mode}: w")
        assert target["step"] == 5
        if ctx.rank == 0:
            names = _names(s3_server.client(options["endpoint_url"]), url)
            if mode == "none":  # data files plus one metadata file per rank
                merged = dcp.read_metadata(url, storage_options=options)
                assert not [n for n in names if n.startswith(EXCHANGE_PREFIX)], names
                assert merged.files() <= set(names), (merged.files(), names)
                assert set(names) - merged.files() == {f"metadata.rank{r:05d}.json"
                                                       for r in range(4)}, names
            else:
                assert names == sorted(md.files() | {METADATA_FILE}), (mode, names)


@dist_scenario(world_size=4)
def test_s3_exchange_files_between_ranks(ctx):
    """The file-flag exchange over S3: each rank publishes an exchange file
    and polls for the others' (no listing or existence cache may hide them);
    a torn file never reads as complete."""
    url, options = _setup("exchange")
    storage = open_storage(url, **options)
    before = storage.list_files(), storage.read_exchange("exchange/plan.3")
    ctx.barrier()
    storage.write_exchange(f"exchange/plan.{ctx.rank}", _payload(100 + ctx.rank, ctx.rank))
    if ctx.rank == 1:
        storage.write_file("exchange/torn", [_payload(40)])
    seen, deadline = {}, time.monotonic() + 60
    while len(seen) < 4 and time.monotonic() < deadline:
        for rank in set(range(4)) - set(seen):
            payload = storage.read_exchange(f"exchange/plan.{rank}")
            if payload is not None:
                seen[rank] = payload
        time.sleep(0.01)
    ctx.barrier()
    assert before == ([], None)
    assert seen == {r: _payload(100 + r, r) for r in range(4)}
    assert storage.list_files() == ["exchange/plan.0", "exchange/plan.1", "exchange/plan.2",
                                    "exchange/plan.3", "exchange/torn"]
    assert storage.read_exchange("exchange/torn") is None


@dist_scenario(world_size=4, last=True)
def test_s3_failed_rank_leaves_no_objects(ctx):
    """Rank 2's writes fail (its bucket does not exist): the save fails on
    every rank naming rank 2 and the bucket, and no object is left."""
    url, options = _setup("failing-rank")
    broken = "s3://no-such-bucket-hyperdcp/ckpt"
    storage = open_storage(broken if ctx.rank == 2 else url, **options)
    state = {"w": make_dtensor(random_tensor((16, 8), torch.float32, seed=5),
                               init_device_mesh("cpu", (4,)), "S0")}
    with pytest.raises(dcp.CheckpointError) as info:
        dcp.save(state, url, storage=storage)
    assert "rank 2" in str(info.value) and broken in str(info.value)
    ctx.barrier()
    if ctx.rank == 0:
        assert _names(s3_server.client(options["endpoint_url"]), url) == []


def test_unreachable_endpoint_is_a_checkpoint_error():
    """No S3 server behind the endpoint: read_metadata raises CheckpointError
    naming the checkpoint, not the botocore error."""
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
               "max_attempts": 1, "config_kwargs": {"connect_timeout": 1}}
    with pytest.raises(dcp.CheckpointError, match="s3://nobucket/ckpt"):
        dcp.read_metadata("s3://nobucket/ckpt", storage_options=options)
