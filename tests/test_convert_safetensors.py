"""Hugging Face safetensors <-> checkpoint, and loading straight from a
safetensors folder (single process).  Inputs are written and outputs read
back with the ``safetensors`` library itself, so both directions are checked
against the reference implementation; every comparison is bitwise."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dcp
from dcp.interop.safetensors_io import (
    SAFETENSORS_DTYPES,
    SafetensorsFolder,
    checkpoint_to_safetensors,
    load_safetensors,
    parse_size,
    safetensors_to_checkpoint,
)
from dcp.tools.diff import diff
from dcp.tools.verify import verify
from helpers import assert_bitwise_equal, assert_names, random_tensor

# every dtype of safetensors that torch can hold
ST_DTYPES = [getattr(torch, name) for name in SAFETENSORS_DTYPES.values()]


def _every_dtype() -> dict[str, torch.Tensor]:
    """One 2-D tensor per dtype, 0-dim tensors, and several zero-element
    tensors in one dict (random bit patterns: NaNs, infinities, -0.0)."""
    sd = {}
    for i, dtype in enumerate(ST_DTYPES):
        name = str(dtype).removeprefix("torch.")
        sd[f"t.{name}"] = random_tensor((3, 5), dtype, seed=i)
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                               torch.float8_e4m3fn)):
        sd[f"scalar.{i}"] = random_tensor((), dtype, seed=100 + i)
    for i, (shape, dtype) in enumerate((((0,), torch.float32), ((3, 0), torch.int64),
                                        ((0, 4, 2), torch.bfloat16), ((0,), torch.bool),
                                        ((2, 0), torch.float8_e5m2))):
        sd[f"empty.{i}"] = torch.empty(shape, dtype=dtype)
    return sd


def _zeros_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for k in expected:
        assert_bitwise_equal(actual[k], expected[k], k)


def _save_sharded(sd: dict, folder: Path, shards: int) -> None:
    """A Hugging Face style sharded folder, written by the safetensors library."""
    folder.mkdir(parents=True)
    keys = list(sd)
    weight_map = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: sd[key] for key in keys[k::shards]}
        save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_every_dtype_scalars_and_empty_tensors_round_trip(tmp_path):
    sd = _every_dtype()
    save_file(sd, tmp_path / "model.safetensors")
    md = safetensors_to_checkpoint(str(tmp_path / "model.safetensors"), str(tmp_path / "ckpt"))
    assert {k: (t.shape, t.dtype) for k, t in md.tensors.items()} == {
        k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
    assert all(len(md.tensors[k].chunks) == (1 if v.numel() else 0) for k, v in sd.items())
    assert verify(str(tmp_path / "ckpt")).checked == sum(1 for v in sd.values() if v.numel())

    target = _zeros_like(sd)
    dcp.load(target, str(tmp_path / "ckpt"))
    _assert_same(target, sd)

    result = checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert result.files == ["model.safetensors"] and result.tensors == len(sd)
    assert result.nbytes == sum(v.numel() * v.element_size() for v in sd.values())
    _assert_same(load_file(tmp_path / "out" / "model.safetensors"), sd)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = struct.unpack("<Q", (tmp_path / "out" / "model.safetensors").read_bytes()[:8])[0]
    assert header_len % 8 == 0


def test_sharded_export_follows_max_shard_size_and_imports_back(tmp_path):
    sd = {f"layer.{i}.w": random_tensor((64, 16), torch.float32, seed=i)  # 4 KiB each
          for i in range(6)}
    sd["big"] = random_tensor((40, 64), torch.float32, seed=9)  # 10 KiB: over the limit, alone
    sd["pos"] = torch.arange(7)
    safetensors_to_checkpoint(str(_write(tmp_path / "in", sd)), str(tmp_path / "ckpt"))

    result = checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                       max_shard_size="9KiB", metadata={"origin": "test"})
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert result.files[-1] == "model.safetensors.index.json"
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                      for k in range(1, len(shards) + 1)]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
    assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(shards)
    loaded = {}
    for shard in shards:
        part = load_file(tmp_path / "out" / shard)
        size = sum(v.numel() * v.element_size() for v in part.values())
        assert size <= 9 * 1024 or len(part) == 1, f"{shard} holds {size} bytes"
        assert all(index["weight_map"][k] == shard for k in part)
        with safe_open(tmp_path / "out" / shard, "pt") as f:
            assert f.metadata() == {"format": "pt", "origin": "test"}
        loaded.update(part)
    _assert_same(loaded, sd)

    # a sharded folder with its index imports back (through the index)
    safetensors_to_checkpoint(str(tmp_path / "out"), str(tmp_path / "again"))
    report = diff(str(tmp_path / "ckpt"), str(tmp_path / "again"))
    assert report.same and report.identical == len(sd)


def _write(folder: Path, sd: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "model.safetensors")
    return folder


def test_folder_written_by_the_library_with_index_imports(tmp_path):
    sd = _every_dtype()
    _save_sharded(sd, tmp_path / "hf", shards=3)
    safetensors_to_checkpoint(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    target = _zeros_like(sd)
    dcp.load(target, str(tmp_path / "ckpt"))
    _assert_same(target, sd)


def test_rename_map_both_ways_and_its_errors(tmp_path):
    sd = {"bert.embeddings.weight": random_tensor((4, 3), seed=1),
          "bert.pooler.bias": random_tensor((3,), seed=2)}
    folder = _write(tmp_path / "in", sd)
    md = safetensors_to_checkpoint(str(folder), str(tmp_path / "ckpt"),
                                   rename={"bert.embeddings.weight": "emb.w"})
    assert sorted(md.tensors) == ["bert.pooler.bias", "emb.w"]
    checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"),
                              rename={"emb.w": "bert.embeddings.weight"})
    _assert_same(load_file(tmp_path / "out" / "model.safetensors"), sd)

    with pytest.raises(dcp.CheckpointError) as e:
        safetensors_to_checkpoint(str(folder), str(tmp_path / "c2"), rename={"bert.typo": "x"})
    assert_names(str(e.value), "bert.typo")
    with pytest.raises(dcp.CheckpointError) as e:
        safetensors_to_checkpoint(str(folder), str(tmp_path / "c3"),
                                  rename={"bert.embeddings.weight": "bert.pooler.bias"})
    assert_names(str(e.value), "bert.embeddings.weight", "bert.pooler.bias")
    assert not (tmp_path / "c2").exists() and not (tmp_path / "c3" / "metadata.json").exists()


def test_load_straight_from_safetensors_reads_only_the_shard(tmp_path):
    w = random_tensor((10, 6), torch.bfloat16, seed=3)
    sd = {"w": w, "b": random_tensor((6,), torch.float32, seed=4), "extra": torch.arange(3)}
    folder = _write(tmp_path / "in", sd)
    shard = torch.zeros(4, 6, dtype=torch.bfloat16)
    target = {"w": dcp.TensorShard(shard, (10, 6), (3, 0)), "b": torch.zeros(6)}
    # no latency: no gap is worth reading through, so only what is held is read
    report = load_safetensors(target, str(folder),
                              storage_options={"read_cost": {"latency_s": 0}})
    assert_bitwise_equal(shard, w[3:7])
    assert_bitwise_equal(target["b"], sd["b"])
    assert report.unexpected_keys == ["extra"]
    assert report.bytes_read == shard.numel() * 2 + 6 * 4  # ranged reads: only what is held
    # whole chunks are copied out of the page cache's mapping, as from a checkpoint
    name = next(p.name for p in folder.iterdir() if p.suffix == ".safetensors")
    with SafetensorsFolder(str(folder)).mapped(name) as mapping:
        assert mapping is not None and bytes(mapping) == (folder / name).read_bytes()

    bad = {"w": torch.zeros(10, 6, dtype=torch.float32)}
    with pytest.raises(dcp.CheckpointError) as e:
        load_safetensors(bad, str(folder), strict=False)
    assert_names(str(e.value), "'w'", "bfloat16", "float32")
    with pytest.raises(dcp.CheckpointError) as e:
        load_safetensors({"missing": torch.zeros(1)}, str(folder))
    assert_names(str(e.value), "missing")
    renamed = {"weight": torch.zeros(10, 6, dtype=torch.bfloat16)}
    load_safetensors(renamed, str(folder), rename={"w": "weight"}, strict=False)
    assert_bitwise_equal(renamed["weight"], w)


def _raw_safetensors(path: Path, header: dict, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_malformed_and_unsupported_inputs_name_the_file_and_tensor(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    cases = [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8,  # short file
         "'w'"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12,
         "data_offsets"),
        ({"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "X9"),
        ({"q": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", "F4"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "shape"),
    ]
    for i, (header, data, needle) in enumerate(cases):
        path = _raw_safetensors(folder / f"bad{i}.safetensors", header, data)
        with pytest.raises(dcp.CheckpointError) as e:
            safetensors_to_checkpoint(str(path), str(tmp_path / f"ckpt{i}"))
        assert_names(str(e.value), f"bad{i}.safetensors", needle)
        assert not (tmp_path / f"ckpt{i}" / "metadata.json").exists()

    path = folder / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(dcp.CorruptCheckpointError, match="huge.safetensors.*header length"):
        _ = SafetensorsFolder(str(path)).metadata

    hf = _write(tmp_path / "hf", {"a": torch.ones(2)})
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002.safetensors"}}))
    with pytest.raises(dcp.CorruptCheckpointError) as e:
        _ = SafetensorsFolder(str(hf)).metadata
    assert_names(str(e.value), "model-00002.safetensors")
    with pytest.raises(dcp.NotACheckpointError):
        safetensors_to_checkpoint(str(tmp_path / "empty-dir"), str(tmp_path / "x"))


def test_export_refuses_a_used_destination_and_overwrite_replaces_every_shard(tmp_path):
    sd = {f"w{i}": random_tensor((256,), torch.float32, seed=i) for i in range(4)}  # 1 KiB each
    safetensors_to_checkpoint(str(_write(tmp_path / "in", sd)), str(tmp_path / "ckpt"))
    out = tmp_path / "out"
    first = checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(out), max_shard_size=1024)
    assert len(first.files) == 5
    (out / "config.json").write_text("{}")
    with pytest.raises(dcp.CheckpointError) as e:
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(out))
    assert_names(str(e.value), "model-00001-of-00004.safetensors", "overwrite")
    checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    _assert_same(load_file(out / "model.safetensors"), sd)
    with pytest.raises(dcp.CheckpointError, match="12XB"):
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(out), max_shard_size="12XB")


def test_parse_size_units():
    assert [parse_size(s) for s in ("5GB", "500MiB", "2kb", "123", 77)] == [
        5 * 10**9, 500 * 2**20, 2000, 123, 77]
    for bad in ("", "5 parsecs", "-3MB", 0):
        with pytest.raises(dcp.CheckpointError):
            parse_size(bad)


_MEMORY_PROBE = textwrap.dedent("""
    import json, re, sys
    from dcp.interop.safetensors_io import checkpoint_to_safetensors, safetensors_to_checkpoint

    def kib(field):
        return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

    def extra(fn):
        open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
        before = kib("VmRSS")
        fn()
        return (kib("VmHWM") - before) * 1024

    src, ckpt, out = sys.argv[1:]
    no_fsync = {"fsync": False}
    print(json.dumps([
        extra(lambda: safetensors_to_checkpoint(src, ckpt, buffer_bytes=8 << 20,
                                                storage_options=no_fsync)),
        extra(lambda: checkpoint_to_safetensors(ckpt, out, max_shard_size="64MiB",
                                                buffer_bytes=8 << 20, dest_options=no_fsync)),
    ]))
""")


def test_conversions_stream_with_memory_bounded_by_the_largest_tensor(tmp_path):
    """128 MiB of 4 MiB tensors: each direction's peak memory (RSS high-water
    mark, measured in a fresh process) stays far below the model's size
    (measured: 10-20 MiB)."""
    count, largest = 32, 4 << 20
    _save_sharded({f"layer.{i}": torch.full((largest // 4,), float(i)) for i in range(count)},
                  tmp_path / "hf", shards=2)
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(tmp_path / "hf"),
                          str(tmp_path / "ckpt"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import_extra, export_extra = json.loads(out.stdout)
    model = count * largest
    for what, extra in (("import", import_extra), ("export", export_extra)):
        # streaming needs ~12 MiB (a tensor and the 8 MiB buffer) plus first-use overheads;
        # holding the model would need 128 MiB
        assert extra < model / 2, (
            f"{what} grew RSS by {extra / 2**20:.1f} MiB for a {model >> 20} MiB model")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 2
    with safe_open(tmp_path / "out" / "model-00002-of-00002.safetensors", "pt") as f:
        assert math.isclose(float(f.get_tensor("layer.31")[0]), 31.0)


def test_export_starts_the_data_at_the_destination_alignment_and_checks_mapped_bytes(tmp_path):
    """A direct-I/O destination gets a header padded with spaces so that the
    tensors start at its 4096-byte alignment (one without, at 8); both read
    back bitwise.  The tensors written from the mapped checkpoint files have
    their checksums verified: a flipped byte fails the export, naming the
    tensor and file."""
    sd = {"big": random_tensor((1024, 300), torch.float32, seed=1),  # over 1 MiB: aligned chunk
          "odd": random_tensor((7, 3), torch.bfloat16, seed=2),
          "ids": torch.arange(11)}
    safetensors_to_checkpoint(str(_write(tmp_path / "in", sd)), str(tmp_path / "ckpt"))
    for folder, options, alignment in (("direct", None, 4096), ("cached", {"fsync": False}, 8)):
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / folder),
                                  dest_options=options)
        path = tmp_path / folder / "model.safetensors"
        header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
        assert (8 + header_len) % alignment == 0 and header_len < alignment + 4096
        _assert_same(load_file(path), sd)

    md = dcp.read_metadata(str(tmp_path / "ckpt"))
    chunk = md.tensors["big"].chunks[0]
    data = tmp_path / "ckpt" / chunk.file
    raw = bytearray(data.read_bytes())
    raw[chunk.byte_offset + 12345] ^= 0xFF
    data.write_bytes(raw)
    with pytest.raises(dcp.CorruptCheckpointError,
                       match=rf"'big': checksum mismatch .* file '{chunk.file}'"):
        checkpoint_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "bad"))
    assert not list((tmp_path / "bad").glob("*.safetensors"))


def test_buffer_pool_waits_rather_than_keep_more_than_its_capacity():
    """A free mapping larger than asked is handed out whole (cut to size);
    while it is in use a request that no longer fits waits for it to come
    back instead of mapping more (the import's RSS stays within the pool's
    capacity)."""
    import threading

    from dcp.interop.parallel import BufferPool

    pool = BufferPool(10 << 20)
    a = pool.take(6 << 20)
    mapping = a.obj
    pool.give(a)
    b = pool.take(3 << 20)  # the 6 MiB mapping: 6 MiB kept, in use
    assert b.obj is mapping
    got: list[memoryview] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(5 << 20)), daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # 6 + 5 MiB would exceed 10
    pool.give(b)
    waiter.join(10)
    assert len(got) == 1 and got[0].obj is mapping and len(got[0]) == 5 << 20
    assert pool._kept == 6 << 20
