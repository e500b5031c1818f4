"""Compressed checkpoints (``dcp.save(..., compression=...)``): exact round
trips for every dtype, partial loads that read only the frames covering
their bytes, corruption and hostile frame indexes refused, S3 and shm://.

In-process, world size 1, but for one save at W=2 (twice: the second by the
cached plan) loaded resharded at W=4, its replicated tensor decoded once and
passed through host shared memory; frames of 4 KiB (the smallest) so small
tensors span several."""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import dcp
import s3_server
from dcp.core import compression
from dcp.core.metadata import METADATA_FILE, _pack, _unpack, decode
from dcp.core.storage import open_storage
from dist_harness import dist_scenario
from storage_plugins.posix import PosixStorage
from storage_plugins.shm import DEFAULT_ROOT

SMALL = dcp.Compression(frame_bytes=4096)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]


def _value(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, generator=g, dtype=torch.complex64 if dtype.is_complex
                           else torch.float32) * 0.02
        return base.to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal (NaNs of fp8 included)."""
    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.reshape(-1).contiguous().view(torch.uint8).numpy())
    return a.shape == b.shape and a.dtype == b.dtype and raw(a) == raw(b)


def _edit_metadata(root: Path, edit) -> None:
    path = root / METADATA_FILE
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def test_every_dtype_round_trips_exactly(tmp_path):
    state = {f"{dtype}".removeprefix("torch."): _value(dtype, (37, 129), k)  # odd sizes
             for k, dtype in enumerate(DTYPES)}
    state["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    state["empty"] = torch.empty(0, 5)
    state["one"] = torch.tensor([7], dtype=torch.int64)
    state["random_bytes"] = torch.randint(0, 256, (9000,), dtype=torch.uint8)
    md = dcp.save(state, tmp_path / "c", compression=SMALL)
    out = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(out, tmp_path / "c")
    for k, v in state.items():
        assert _same(out[k], v), k
    saved = dcp.read_metadata(str(tmp_path / "c"))
    assert saved.version == 3
    kinds = {fqn: set(c.frames.kinds) for fqn, t in saved.tensors.items() for c in t.chunks
             if c.frames is not None}
    assert kinds["bfloat16"] == {compression.GROUPED}
    assert compression.ZSTD in kinds["int64"]
    assert kinds["random_bytes"] == {compression.RAW}  # noise does not shrink: stored raw
    assert saved.tensors["empty"].chunks == [] or all(
        c.frames is None for c in saved.tensors["empty"].chunks)
    frames = saved.tensors["bfloat16"].chunks[0].frames
    assert len(frames.stored) == -(-37 * 129 * 2 // 4096)
    assert md.tensors.keys() == saved.tensors.keys()


def test_floats_shrink_and_integers_round_trip_without_compression_too(tmp_path):
    w = _value(torch.bfloat16, (512, 512))
    dcp.save({"w": w}, tmp_path / "z", compression="zstd")
    dcp.save({"w": w}, tmp_path / "p")
    stored = sum(f.stat().st_size for f in (tmp_path / "z").glob("*.data"))
    plain = sum(f.stat().st_size for f in (tmp_path / "p").glob("*.data"))
    assert stored < plain / 1.2  # bf16 N(0, 0.02): about 1.4x
    assert dcp.read_metadata(str(tmp_path / "p")).version == 1  # off by default
    out = {"w": torch.empty_like(w)}
    dcp.load(out, tmp_path / "z")
    assert torch.equal(out["w"], w)
    # each byte plane its own zstd block: frames under zstd's 128 KiB block
    # shrink as 2 MiB frames do (one table for all planes gave bf16 1.28x)
    w32 = _value(torch.float32, (256, 512))
    for dtype, least in ((torch.bfloat16, 1.45), (torch.float32, 1.17)):
        ratios = []
        for frame_bytes in (4096, 64 << 10, 2 << 20):
            path = tmp_path / f"{dtype}-{frame_bytes}"
            md = dcp.save({"w": w32.to(dtype)}, path,
                          compression=dcp.Compression(frame_bytes=frame_bytes))
            ratios.append(md.unique_bytes / sum(f.stat().st_size for f in path.glob("*.data")))
            got = {"w": torch.empty(256, 512, dtype=dtype)}
            dcp.load(got, path)
            assert torch.equal(got["w"], w32.to(dtype))
        assert min(ratios) >= least and max(ratios) - min(ratios) < 0.04, (dtype, ratios)


def test_a_partial_load_reads_only_the_covering_frames(tmp_path):
    w = _value(torch.bfloat16, (256, 512))  # 1 KiB rows: 4 rows per 4 KiB frame
    dcp.save({"w": w}, tmp_path / "c", compression=SMALL)
    frames = dcp.read_metadata(str(tmp_path / "c")).tensors["w"].chunks[0].frames
    rows = torch.empty(10, 512, dtype=torch.bfloat16)  # rows 50..59: frames 12..14
    report = dcp.load({"w": dcp.TensorShard(rows, (256, 512), (50, 0))}, tmp_path / "c")
    assert torch.equal(rows, w[50:60])
    assert report.bytes_read == sum(frames.stored[12:15])
    assert report.requests == 1  # adjacent frames: one request
    cols = torch.empty(256, 100, dtype=torch.bfloat16)  # Shard(1): every frame
    report = dcp.load({"w": dcp.TensorShard(cols, (256, 512), (0, 300))}, tmp_path / "c")
    assert torch.equal(cols, w[:, 300:400])
    assert report.bytes_read == frames.stored_nbytes


def test_read_items_carry_their_covering_frames_stored_and_decoded_bytes(tmp_path):
    """The load plan prices a region of a compressed chunk by its covering
    frames: their stored bytes, and the logical bytes of the coded ones
    (random bytes do not shrink: their frames are raw, nothing to decode)."""
    from dcp.core.planner import ReadRequest
    from planners.load import DefaultLoadPlanner
    w = _value(torch.bfloat16, (256, 512))  # 4 rows per 4 KiB frame
    r = _value(torch.float32, (3000,), 6)  # 12,000 bytes: frames of 4,096, 4,096, 3,808
    noise = torch.randint(0, 256, (10000,), dtype=torch.uint8, generator=torch.Generator()
                          .manual_seed(3))
    dcp.save({"w": w, "r": r, "noise": noise}, tmp_path / "c", compression=SMALL)
    md = dcp.read_metadata(str(tmp_path / "c"))
    fw, fr, fn = (md.tensors[k].chunks[0].frames for k in ("w", "r", "noise"))
    assert set(fw.kinds) | set(fr.kinds) == {compression.GROUPED}
    assert set(fn.kinds) == {compression.RAW}
    requests = [ReadRequest("w", (50, 0), (10, 512), (256, 512), "bfloat16"),  # frames 12..14
                ReadRequest("w", (0, 300), (256, 100), (256, 512), "bfloat16"),  # all 64
                ReadRequest("r", (0,), (3000,), (3000,), "float32"),
                ReadRequest("r", (2000,), (1,), (3000,), "float32"),  # byte 8,000: frame 1
                ReadRequest("noise", (0,), (5000,), (10000,), "uint8")]  # frames 0, 1
    items = DefaultLoadPlanner().create_local_plan(md, requests, [], strict=False,
                                                   allow_dtype_cast=False).items
    assert [(i.nbytes, i.stored_nbytes, i.decode_nbytes) for i in items] == [
        (10240, sum(fw.stored[12:15]), 3 * 4096),
        (51200, fw.stored_nbytes, 256 * 1024),
        (12000, fr.stored_nbytes, 12000),
        (4, fr.stored[1], 4096),
        (5000, 8192, 0)]
    assert items[4].read_nbytes == 8192
    plain = dcp.save({"w": w}, tmp_path / "p")
    items = DefaultLoadPlanner().create_local_plan(plain, requests[:1], [], strict=True,
                                                   allow_dtype_cast=False).items
    assert [(i.stored_nbytes, i.decode_nbytes, i.read_nbytes) for i in items] == [(0, 0, 10240)]


def _frame_spans(root: Path, fqn: str) -> tuple[Path, list[tuple[int, int]]]:
    chunk = dcp.read_metadata(str(root)).tensors[fqn].chunks[0]
    starts = chunk.frames.stored_offsets()
    return root / chunk.file, [(chunk.byte_offset + s, n)
                               for s, n in zip(starts, chunk.frames.stored, strict=True)]


def test_a_flipped_byte_in_a_frame_names_the_tensor_and_file(tmp_path):
    w = _value(torch.float32, (64, 64))
    dcp.save({"w": w}, tmp_path / "c", compression=SMALL)
    path, spans = _frame_spans(tmp_path / "c", "w")
    data = bytearray(path.read_bytes())
    start, length = spans[2]
    data[start + length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(dcp.CorruptCheckpointError, match=rf"'w'.*{path.name}.*frame 2"):
        dcp.load({"w": torch.empty_like(w)}, tmp_path / "c")
    rows = torch.empty(4, 64)  # frames 0 and 1 only: the flipped frame is not read
    dcp.load({"w": dcp.TensorShard(rows, (64, 64), (0, 0))}, tmp_path / "c")
    assert torch.equal(rows, w[:4])


def test_a_truncated_frame_raises(tmp_path):
    w = _value(torch.float32, (64, 64))
    dcp.save({"w": w}, tmp_path / "c", compression=SMALL)
    path, spans = _frame_spans(tmp_path / "c", "w")
    start, length = spans[-1]
    with path.open("r+b") as f:
        f.truncate(start + length // 2)
    with pytest.raises(dcp.CheckpointError, match=rf"'w'.*{path.name}"):
        dcp.load({"w": torch.empty_like(w)}, tmp_path / "c")


def test_a_hostile_frame_index_raises_checkpoint_error(tmp_path):
    w = _value(torch.bfloat16, (64, 64))
    ints = torch.arange(2000, dtype=torch.int32)
    dcp.save({"w": w, "i": ints}, tmp_path / "c", compression=SMALL)
    original = (tmp_path / "c" / METADATA_FILE).read_bytes()
    doc = json.loads(original)
    section = doc["frames"]
    lengths = {"row": section["chunks"], "frame_bytes": section["chunks"],
               "count": section["chunks"], "stored": section["frames"],
               "kind": section["frames"], "crc": section["frames"]}
    rng = random.Random(31)
    outcomes = {"refused": 0, "loaded": 0}
    for trial in range(150):
        fuzzed = json.loads(original)
        s = fuzzed["frames"]
        name = rng.choice([*lengths, "chunks", "frames", "bytes"])
        if name in ("chunks", "frames"):
            s[name] = rng.choice([0, s[name] - 1, s[name] + 1, 10**9, -1, "x"])
        elif name == "bytes":  # the packed text itself
            key = rng.choice(list(lengths))
            text = list(s[key])
            text[rng.randrange(len(text))] = rng.choice("AZaz09+/=")
            s[key] = "".join(text)
        else:
            column = _unpack(s, name, lengths[name], "test").copy()
            column[rng.randrange(len(column))] += rng.choice([-1, 1, 7, -4096, 1 << 20, 1 << 40])
            s[name] = _pack(column)
        (tmp_path / "c" / METADATA_FILE).write_text(json.dumps(fuzzed))
        target = {"w": torch.empty_like(w), "i": torch.empty_like(ints)}
        try:
            dcp.load(target, tmp_path / "c")
        except dcp.CheckpointError:
            outcomes["refused"] += 1
            continue
        # a change that leaves a valid index (a packed text that decodes alike)
        assert torch.equal(target["w"], w) and torch.equal(target["i"], ints), (trial, name)
        outcomes["loaded"] += 1
    assert outcomes["refused"] > 100, outcomes


def test_decoding_never_exceeds_a_frames_declared_size():
    bomb = compression._compressor(1).compress(bytes(1 << 20))  # 1 MiB of zeros, tiny frame
    out = memoryview(bytearray(4096))
    with pytest.raises(dcp.CorruptCheckpointError, match="declares 1048576 bytes"):
        compression.decode_frame(memoryview(bomb), compression.ZSTD, out, 1, "chunk")
    headless = zstandard_frame_without_size(bytes(1 << 16))
    with pytest.raises(dcp.CorruptCheckpointError):
        compression.decode_frame(memoryview(headless), compression.ZSTD, out, 1, "chunk")


def zstandard_frame_without_size(data: bytes) -> bytes:
    import zstandard
    return zstandard.ZstdCompressor(write_content_size=False).compress(data)


def test_an_unknown_codec_is_refused_by_name(tmp_path):
    w = _value(torch.float32, (16, 16))
    dcp.save({"w": w}, tmp_path / "c", compression="zstd")
    _edit_metadata(tmp_path / "c", lambda doc: doc["frames"].update(codec="lz9"))
    with pytest.raises(dcp.CheckpointError, match="codec 'lz9'") as caught:
        dcp.load({"w": torch.empty_like(w)}, tmp_path / "c")
    assert not isinstance(caught.value, dcp.CorruptCheckpointError)
    _edit_metadata(tmp_path / "c", lambda doc: doc["frames"].update(codec="zstd", version=9))
    with pytest.raises(dcp.CheckpointError, match=r"frame index is version 9, newer than this "
                       r"build reads \(1\); load it with a newer hyperdcp") as caught:
        dcp.load({"w": torch.empty_like(w)}, tmp_path / "c")
    assert not isinstance(caught.value, dcp.CorruptCheckpointError)
    _edit_metadata(tmp_path / "c", lambda doc: doc["frames"].update(version=1))
    _edit_metadata(tmp_path / "c", lambda doc: doc.update(version=2) or doc["frames"].update(
        codec="zstd"))
    with pytest.raises(dcp.CorruptCheckpointError, match="frames section in a version 2"):
        dcp.load({"w": torch.empty_like(w)}, tmp_path / "c")


def test_the_policy_is_validated(tmp_path):
    for bad in ({"codec": "lz4"}, {"level": 0}, {"level": 1.5}, {"frame_bytes": 1}):
        with pytest.raises(dcp.CheckpointError):
            dcp.Compression(**bad)
    for name in ("lz4", "None", ""):
        with pytest.raises(dcp.CheckpointError, match=re.escape(
                f"unknown compression {name!r} (known: zstd; None or 'none' for no "
                f"compression)")):
            dcp.save({"w": torch.zeros(3)}, tmp_path / "c", compression=name)
    with pytest.raises(dcp.CheckpointError):
        dcp.save({"w": torch.zeros(3)}, tmp_path / "c", compression=3)


def test_metadata_round_trips_the_frame_index(tmp_path):
    w = _value(torch.float16, (100, 77))
    md = dcp.save({"w": w}, tmp_path / "c", compression=SMALL)
    data = (tmp_path / "c" / METADATA_FILE).read_bytes()
    again = decode(data)
    assert again.tensors["w"].chunks == md.tensors["w"].chunks
    assert np.all(np.array(again.tensors["w"].chunks[0].frames.stored) > 0)


def test_s3_round_trip():
    url = s3_server.fresh_url("compressed")
    options = s3_server.options(s3_server.endpoint())
    w = _value(torch.bfloat16, (128, 96))
    dcp.save({"w": w, "n": torch.arange(5000)}, url, storage_options=options,
             compression=SMALL)
    out = {"w": torch.empty_like(w), "n": torch.empty(5000, dtype=torch.int64)}
    dcp.load(out, url, storage_options=options)
    assert torch.equal(out["w"], w) and torch.equal(out["n"], torch.arange(5000))
    rows = torch.empty(8, 96, dtype=torch.bfloat16)
    dcp.load({"w": dcp.TensorShard(rows, (128, 96), (64, 0))}, url, storage_options=options)
    assert torch.equal(rows, w[64:72])


def test_shm_round_trip():
    name = f"compressed-{uuid.uuid4().hex[:8]}"
    try:
        w = _value(torch.float32, (200, 33))
        dcp.save({"w": w}, f"shm://{name}", compression=SMALL)
        out = {"w": torch.empty_like(w)}
        dcp.load(out, f"shm://{name}")
        assert torch.equal(out["w"], w)
    finally:
        shutil.rmtree(Path(DEFAULT_ROOT) / name, ignore_errors=True)


def test_write_results_carry_frame_indexes_across_ranks():
    from dcp.coordination import wire
    from dcp.core.metadata import ChunkMeta
    from dcp.orchestration.save import WriteResult
    index = compression.FrameIndex(4096, (100, 30), (compression.GROUPED, compression.ZSTD),
                                   (5, 2**32 - 1))
    result = WriteResult(chunks=[("w", ChunkMeta((0,), (2100,), "f.data", 0, 4200, 7, 1))],
                         frames={("w", (0,)): index})
    decoded = wire.decode(wire.encode(result), "test")
    assert decoded.frames == {("w", (0,)): index}
    assert decoded.chunks == result.chunks


# 256 bf16 per row: 512 bytes, 8 rows per 4 KiB frame
_W = _value(torch.bfloat16, (128, 256), 5)
_R = _value(torch.float32, (3000,), 6)


@dist_scenario(world_size=2, phase=0)
def test_compressed_save_at_w2(ctx):
    rows = slice(64 * ctx.rank, 64 * ctx.rank + 64)
    for name in ("compressed_w2", "compressed_w2_cached"):  # the second save: cached plan
        state = {"w": dcp.TensorShard(_W[rows].clone(), (128, 256), (64 * ctx.rank, 0)),
                 "r": _R.clone()}
        dcp.save(state, str(ctx.shared / name), compression=SMALL)


@dist_scenario(world_size=4, phase=1)
def test_compressed_w2_checkpoint_loads_resharded_at_w4(ctx):
    for name in ("compressed_w2", "compressed_w2_cached"):
        ckpt = str(ctx.shared / name)
        chunks = dcp.read_metadata(ckpt).tensors["w"].chunks
        assert [c.frames is not None for c in chunks] == [True, True]
        cols = torch.empty(128, 64, dtype=torch.bfloat16)  # Shard(0) -> Shard(1)
        r = torch.empty(3000)
        report = dcp.load({"w": dcp.TensorShard(cols, (128, 256), (0, 64 * ctx.rank)), "r": r},
                          ckpt)
        assert torch.equal(cols, _W[:, 64 * ctx.rank:64 * ctx.rank + 64]) and torch.equal(r, _R)
        # r, replicated: decoded by one rank of the host, passed to 3 through shared memory
        everyone = [(ranks, way) for ranks, way, _ in report.paths if ranks == (0, 1, 2, 3)]
        assert everyone == [((0, 1, 2, 3), "shared_memory"), ((0, 1, 2, 3), "storage")]
        assert ((0, 1, 2, 3), "shared_memory", 3 * 12000) in report.paths
        lo = 32 * ctx.rank  # rows of one saved chunk: 4 of its 8 frames
        rows = torch.empty(32, 256, dtype=torch.bfloat16)
        report = dcp.load({"w": dcp.TensorShard(rows, (128, 256), (lo, 0))}, ckpt, strict=False)
        assert torch.equal(rows, _W[lo:lo + 32])
        frames = chunks[lo // 64].frames
        first = (lo % 64) // 8
        assert report.bytes_read == sum(frames.stored[first:first + 4]), report.bytes_read
        if ctx.rank == 0:  # the conversions' reader: two chunks decoded and placed
            from dcp.core.storage import open_storage
            from dcp.interop.streaming import read_tensor
            md = dcp.read_metadata(ckpt)
            assert torch.equal(read_tensor(open_storage(ckpt), "w", md.tensors["w"]), _W)


def test_verify_checks_each_frame(tmp_path):
    from dcp.tools.verify import verify
    w = _value(torch.float32, (64, 64))
    dcp.save({"w": w}, tmp_path / "c", compression=SMALL)
    report = verify(str(tmp_path / "c"))
    assert report.ok and report.checked == 4  # four frames
    path, spans = _frame_spans(tmp_path / "c", "w")
    data = bytearray(path.read_bytes())
    data[spans[1][0]] ^= 1
    path.write_bytes(bytes(data))
    report = verify(str(tmp_path / "c"))
    assert not report.ok and "frame 1" in str(report.damaged)


def test_async_save_compresses(tmp_path):
    w = _value(torch.bfloat16, (64, 128))
    state = {"w": w.clone()}
    response = dcp.async_save(state, str(tmp_path / "a"), compression=SMALL)
    state["w"].add_(1)  # after the call: not in the checkpoint
    response.result(60)
    chunk = dcp.read_metadata(str(tmp_path / "a")).tensors["w"].chunks[0]
    assert chunk.frames is not None and set(chunk.frames.kinds) == {compression.GROUPED}
    out = {"w": torch.empty_like(w)}
    dcp.load(out, str(tmp_path / "a"))
    assert torch.equal(out["w"], w)
    # without coordination: per-rank metadata files, merged on reading
    dcp.async_save({"w": w}, str(tmp_path / "n"), coordination="none",
                   compression=SMALL).result(60)
    assert dcp.read_metadata(str(tmp_path / "n")).tensors["w"].chunks[0].frames is not None
    dcp.load(out, str(tmp_path / "n"))
    assert torch.equal(out["w"], w)


def test_inspect_shows_stored_and_logical_bytes(tmp_path, capsys):
    from dcp.tools.cli import main
    w = _value(torch.bfloat16, (64, 128))
    noise = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator()
                          .manual_seed(0))  # does not shrink: its 2 frames stored raw
    dcp.save({"w": w, "n": torch.arange(10), "r": noise}, tmp_path / "c", compression=SMALL)
    file_bytes = sum(f.stat().st_size for f in (tmp_path / "c").glob("*.data"))
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tensors = doc["tensors"]
    assert tensors["w"]["nbytes"] == 64 * 128 * 2 > tensors["w"]["file_bytes"]
    assert doc["file_bytes"] == sum(t["file_bytes"] for t in tensors.values()) <= file_bytes
    assert doc["stored_bytes"] == 64 * 128 * 2 + 80 + 5000 and tensors["r"]["file_bytes"] == 5000
    assert tensors["w"]["chunks"][0]["frames"] == 4
    assert main(["inspect", str(tmp_path / "c"), "--chunks"]) == 0
    out = capsys.readouterr().out
    ratio = tensors["w"]["nbytes"] / tensors["w"]["file_bytes"]
    assert f"{tensors['w']['file_bytes']} B in files, {ratio:.2f}x zstd" in out
    assert "4 frames (0 stored raw)" in out and "2 frames (2 stored raw)" in out
    assert (f"{doc['stored_bytes']} bytes of chunks (" in out
            and f"{doc['file_bytes']} in data files (" in out)


def test_conversions_decompress(tmp_path):
    from safetensors.torch import load_file

    from dcp.core.storage import open_storage
    from dcp.interop.safetensors_io import checkpoint_to_safetensors
    from dcp.interop.streaming import read_tensor
    w = _value(torch.bfloat16, (40, 300))
    n = torch.arange(3000, dtype=torch.int32)
    dcp.save({"a": w, "n": n}, tmp_path / "d", compression=SMALL)
    checkpoint_to_safetensors(str(tmp_path / "d"), str(tmp_path / "st"))
    exported = {}
    for f in (tmp_path / "st").glob("*.safetensors"):
        exported.update(load_file(f))
    assert torch.equal(exported["a"], w) and torch.equal(exported["n"], n)
    storage = open_storage(str(tmp_path / "d"))
    md = dcp.read_metadata(str(tmp_path / "d"))
    assert torch.equal(read_tensor(storage, "a", md.tensors["a"]), w)


def test_the_manager_saves_compressed_steps(tmp_path):
    w = _value(torch.bfloat16, (64, 128))
    with dcp.CheckpointManager(tmp_path / "run", async_save=False, save_rng=False,
                               compression=SMALL) as mgr:
        assert mgr.save(5, {"w": w}, force=True)
        target = {"w": torch.empty_like(w)}
        assert mgr.load_latest(target) == 5
        path = mgr.step_uri(5)
    assert torch.equal(target["w"], w)
    chunk = dcp.read_metadata(path).tensors["w"].chunks[0]
    assert chunk.frames is not None and len(chunk.frames.stored) == 4


class _Trickle(PosixStorage):
    """POSIX whose reads arrive one view at a time, last request first, on a
    thread of their own (as a streamed GET body does), recording when each
    view was filled; ``fail_after`` views, the read fails instead."""

    def __init__(self, path, fail_after=None):
        super().__init__(path)
        self.filled: list[float] = []
        self.fail_after = fail_after

    def read_streamed(self, name, requests, arrived):
        done = concurrent.futures.Future()

        def run():
            try:
                for i in reversed(range(len(requests))):
                    offset, views = requests[i]
                    for j, view in enumerate(views):
                        if self.fail_after is not None and len(self.filled) == self.fail_after:
                            raise OSError(5, "injected EIO mid-stream", name)
                        self.read_ranges(name, [(offset, view)])
                        offset += len(view)
                        self.filled.append(time.perf_counter())
                        arrived(i, j)
                        time.sleep(0.002)
                done.set_result(None)
            except Exception as e:
                done.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        return done


def test_frames_are_decoded_as_they_arrive(tmp_path, monkeypatch):
    state = {f"w{k}": _value(torch.bfloat16, (64, 256), seed=k) for k in range(4)}
    dcp.save(state, str(tmp_path / "c"), compression=SMALL)
    decoded: list[float] = []
    decode_frames = compression.decode_frames

    def spy(*args, **kwargs):
        decoded.append(time.perf_counter())
        return decode_frames(*args, **kwargs)

    monkeypatch.setattr(compression, "decode_frames", spy)
    storage = _Trickle(str(tmp_path / "c"))
    out = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(out, str(tmp_path / "c"), storage=storage)
    assert all(_same(out[k], v) for k, v in state.items())
    frames = sum(len(c.frames.stored) for t in dcp.read_metadata(str(tmp_path / "c"))
                 .tensors.values() for c in t.chunks)
    assert len(decoded) == frames == len(storage.filled) == 32  # 4 x 32 KiB in 4 KiB frames
    assert decoded[0] < storage.filled[-1]  # the first frame decoded while others were in flight
    rows = torch.empty(3, 256, dtype=torch.bfloat16)  # a partial load, frames out of order too
    dcp.load({"w2": dcp.TensorShard(rows, (64, 256), (30, 0))}, str(tmp_path / "c"),
             storage=_Trickle(str(tmp_path / "c")), strict=False)
    assert _same(rows, state["w2"][30:33])


def test_a_read_failing_mid_stream_names_the_chunk_and_does_not_hang(tmp_path):
    state = {"w": _value(torch.float32, (64, 256))}
    dcp.save(state, str(tmp_path / "c"), compression=SMALL)
    out = {"w": torch.zeros(64, 256)}
    with pytest.raises(dcp.CheckpointError, match=r"'w'.*injected EIO mid-stream"):
        dcp.load(out, str(tmp_path / "c"), storage=_Trickle(str(tmp_path / "c"), fail_after=3))


def test_s3_reports_each_view_once_as_it_fills():
    url = s3_server.fresh_url("streamed")
    options = s3_server.options(s3_server.endpoint())
    data = bytes(range(256)) * 64
    dcp.save({"b": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, url,
             storage_options=options)
    storage = open_storage(url, **options)
    name = next(c.file for c in dcp.read_metadata(url, storage_options=options)
                .tensors["b"].chunks)
    views = [[memoryview(bytearray(n)) for n in sizes] for sizes in ((100, 28), (0, 1000), (1,))]
    requests = [(0, views[0]), (500, views[1]), (16383, views[2])]
    arrived: list[tuple[int, int]] = []
    storage.read_streamed(name, requests, lambda i, j: arrived.append((i, j))).result()
    assert sorted(arrived) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert bytes(views[0][0]) + bytes(views[0][1]) == data[:128]
    assert bytes(views[1][1]) == data[500:1500] and bytes(views[2][0]) == data[16383:]
    failed = storage.read_streamed(name, [(16000, [memoryview(bytearray(1000))])],
                                   lambda i, j: arrived.append((i, j)))
    with pytest.raises(EOFError, match=name):
        failed.result()
