"""MindSpore ``.ckpt`` files in and out (dcp.interop.mindspore_ckpt), checked
against MindSpore itself.

MindSpore runs in two subprocesses per module (its import costs ~3 s and it
is kept out of the pytest process): one writes the reference files with
``mindspore.save_checkpoint`` and dumps what ``mindspore.load_checkpoint``
and MindSpore's generated protobuf parser read from them; one reads every
file our exports wrote.  Tests needing MindSpore skip where it is not
installed; those on files our writer makes run everywhere.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest
import torch

import dcp
from dcp.core.read_cost import ReadCost
from dcp.core.storage import open_storage
from dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from dcp.interop import mindspore_ckpt as msc
from dcp.interop.safetensors_io import checkpoint_to_safetensors, safetensors_to_checkpoint
from dcp.tools.cli import main
from dist_harness import dist_scenario
from helpers import HAVE_MINDSPORE, needs_mindspore, raw_bytes
from storage_plugins.posix import PosixStorage

ROOT = Path(__file__).resolve().parents[1]

#: The MindSpore side: ``write DIR`` saves the reference files into DIR and
#: dumps MindSpore's reading of them; ``read DIR FILE...`` dumps MindSpore's
#: reading of each file (``FILE`` or ``FILE:crc`` for ``crc_check=True``).
#: A dump is ``{file: {tag: {"str": s} | {"shape", "dtype", "b64"}}}``.
MINDSPORE_SIDE = r'''
import base64, json, sys
from pathlib import Path
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn
import mindspore.train.serialization as ser
from mindspore.train.checkpoint_pb2 import Checkpoint

def read(path, crc=False):
    fmt = "safetensors" if path.endswith(".safetensors") else "ckpt"
    out = {}
    for tag, v in ms.load_checkpoint(path, format=fmt, crc_check=crc).items():
        out[tag] = {"str": v} if isinstance(v, str) else {
            "shape": list(v.shape), "dtype": str(v.dtype),
            "b64": base64.b64encode(v.get_bytes()).decode()}
    return out

def parse(path):
    data = Path(path).read_bytes()
    if data[-17:-10] == b"crc_num":
        data = data[:-17]
    c = Checkpoint()
    c.ParseFromString(data)
    return [[v.tag, list(v.tensor.dims), v.tensor.tensor_type,
             base64.b64encode(v.tensor.tensor_content).decode()] for v in c.value]

def write(d):
    rng = np.random.default_rng(0)
    def bits(shape, dtype):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)
    net = nn.SequentialCell([nn.Dense(8, 16), nn.ReLU(), nn.Dense(16, 4)])
    ms.save_checkpoint(net, str(d / "net.ckpt"),
                       append_dict={"step": 7, "epoch": 2, "lr": 0.125, "run": "héllo wörld ✓"})
    params = {}
    for t in ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float16", "float32", "float64"]:
        params["t_" + t] = Parameter(Tensor(bits((3, 5), t)))
    params["t_bool"] = Parameter(Tensor(rng.integers(0, 2, (4, 3)).astype(np.bool_)))
    params["t_bfloat16"] = Parameter(Tensor(rng.standard_normal((2, 7)).astype(np.float32),
                                            ms.bfloat16))
    params["t_scalar"] = Parameter(Tensor(np.float32(-2.5)))
    params["t_empty"] = Parameter(Tensor(np.zeros((0, 3), np.float32)))
    ms.save_checkpoint(params, str(d / "dtypes.ckpt"))
    ms.save_checkpoint(params, str(d / "crc.ckpt"), crc_check=True)
    ms.save_checkpoint(params, str(d / "enc.ckpt"), enc_key=b"0123456789abcdef")
    ms.save_checkpoint({k: v for k, v in params.items() if k != "t_empty"},
                       str(d / "ms.safetensors"), format="safetensors")
    ser.SLICE_SIZE = 1  # KiB: values over 1 KiB go as records of 1024 bytes
    ms.save_checkpoint({"big": Parameter(Tensor(bits((1000, 3), "float32"))),
                        "half": Parameter(Tensor(bits((777,), "float16"))),
                        "small": Parameter(Tensor(bits((5,), "int32")))},
                       str(d / "split.ckpt"))
    ser.SLICE_SIZE = 512 * 1024
    q = Parameter(Tensor(np.array([1, 2, 3, 4], np.int8), ms.qint4x2))
    ms.save_checkpoint({"q": q}, str(d / "int4.ckpt"))
    ms.save_checkpoint({"q": q}, str(d / "int4.safetensors"), format="safetensors")
    c = Checkpoint()  # a MapParameter's record, through MindSpore's own classes
    v = c.value.add()
    v.tag = "table"
    for arr in (np.arange(3, dtype=np.int64), np.ones((3, 2), np.float32),
                np.zeros(3, np.int32)):
        t = v.maptensor.tensor.add()
        t.dims.extend(arr.shape)
        t.tensor_type = str(arr.dtype)
        t.tensor_content = arr.tobytes()
    (d / "maptensor.ckpt").write_bytes(c.SerializeToString())
    files = ["net.ckpt", "dtypes.ckpt", "crc.ckpt", "split.ckpt"]
    dump = {"load": {f: read(str(d / f), crc=f == "crc.ckpt") for f in files + ["ms.safetensors"]},
            "parse": {f: parse(str(d / f)) for f in files}}
    (d / "mindspore.json").write_text(json.dumps(dump))

if sys.argv[1] == "write":
    write(Path(sys.argv[2]))
else:
    out = {}
    for spec in sys.argv[3:]:
        path, _, crc = spec.partition(":")
        try:
            out[path] = read(path, crc == "crc")
        except Exception as e:
            out[path] = {"error": f"{type(e).__name__}: {e}"}
    Path(sys.argv[2]).write_text(json.dumps(out))
'''


def _mindspore(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-c", MINDSPORE_SIDE, *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def ms_files(tmp_path_factory) -> tuple[Path, dict]:
    """The reference files MindSpore wrote, and its reading of them."""
    if not HAVE_MINDSPORE:
        pytest.skip("mindspore is not installed")
    d = tmp_path_factory.mktemp("mindspore")
    _mindspore("write", str(d))
    return d, json.loads((d / "mindspore.json").read_text())


def _ours(ckpt: str) -> dict:
    """Every tensor and value of a checkpoint of ours: raw bytes, shape and
    dtype name, or the value."""
    md = dcp.read_metadata(ckpt)
    state: dict = {f: torch.full(t.shape, 1, dtype=getattr(torch, t.dtype))
                   for f, t in md.tensors.items()}
    state.update({f: None for f in md.objects})
    dcp.load(state, ckpt)
    return {f: (v if f in md.objects else (list(v.shape), md.tensors[f].dtype, raw_bytes(v)))
            for f, v in state.items()}


#: MindSpore's dtype names as ``str(Tensor.dtype)`` prints them.
_MS_PRINTED = {ours: ms for ms, ours in msc.MINDSPORE_DTYPES.items()}


def _as_ms_dump(ours: dict) -> dict:
    return {f: ({"str": v} if isinstance(v, str) else
                {"shape": v[0], "dtype": _MS_PRINTED[v[1]], "b64": base64.b64encode(v[2]).decode()})
            for f, v in ours.items()}


def _records(path: Path) -> list:
    """``[tag, dims, type, content]`` of every record, as our reader finds
    them (content read from the byte ranges it recorded)."""
    storage = PosixStorage(str(path.parent))
    found = msc.records(storage, path.name, path.stat().st_size, str(path))
    data = path.read_bytes()
    return [[r.tag, r.dims, r.type,
             base64.b64encode(data[r.content[0]:r.content[0] + r.content[1]]).decode()]
            for r in found]


REFERENCE = ["net.ckpt", "dtypes.ckpt", "crc.ckpt", "split.ckpt"]


# ---- reading MindSpore's files ----------------------------------------------

@needs_mindspore
@pytest.mark.parametrize("name", REFERENCE)
def test_reader_finds_what_mindspores_parser_finds(ms_files, name):
    d, ms = ms_files
    assert _records(d / name) == ms["parse"][name]


@needs_mindspore
@pytest.mark.parametrize("name", REFERENCE)
def test_import_is_byte_identical_to_mindspores_load(ms_files, name, tmp_path):
    d, ms = ms_files
    md = msc.mindspore_ckpt_to_checkpoint(str(d / name), str(tmp_path / "ckpt"))
    assert all(c.checksum is not None for t in md.tensors.values() for c in t.chunks)
    ours = _ours(str(tmp_path / "ckpt"))
    assert _as_ms_dump(ours) == ms["load"][name]
    if name == "net.ckpt":  # append_dict: ints and floats are 0-dim tensors, strings values
        assert ours["run"] == "héllo wörld ✓" and ours["step"][:2] == ([], "int64")
        assert md.tensors["2.weight"].shape == (4, 16)
    if name == "split.ckpt":  # 12 records of 1024 bytes and one of 736 make one tensor
        assert [r[0] for r in ms["parse"][name]].count("big") == 12
        assert md.tensors["big"].shape == (1000, 3)


@needs_mindspore
def test_every_dtype_scalar_and_empty_tensor_as_mindspore_has_them(ms_files, tmp_path):
    d, ms = ms_files
    view = msc.MindSporeCkpt(str(d / "dtypes.ckpt"))
    got = {f: (t.dtype, t.shape) for f, t in view.metadata.tensors.items()}
    assert got == {**{f"t_{n}": (n, (3, 5)) for n in [
        "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
        "float32", "float64"]}, "t_bool": ("bool", (4, 3)), "t_bfloat16": ("bfloat16", (2, 7)),
        "t_scalar": ("float32", ())}
    assert "t_empty" not in ms["load"]["dtypes.ckpt"]  # MindSpore writes no record for it


@needs_mindspore
def test_dcp_load_of_the_import_gives_exact_torch_tensors(ms_files, tmp_path):
    d, ms = ms_files
    msc.mindspore_ckpt_to_checkpoint(str(d / "dtypes.ckpt"), str(tmp_path / "ckpt"))
    state = {"t_float16": torch.zeros(3, 5, dtype=torch.float16),
             "t_bfloat16": torch.zeros(2, 7, dtype=torch.bfloat16),
             "t_uint64": torch.zeros(3, 5, dtype=torch.uint64),
             "t_scalar": torch.zeros((), dtype=torch.float32)}
    dcp.load(state, str(tmp_path / "ckpt"), strict=False)
    for fqn, tensor in state.items():
        assert raw_bytes(tensor) == base64.b64decode(ms["load"]["dtypes.ckpt"][fqn]["b64"]), fqn
    assert state["t_scalar"].item() == -2.5


@needs_mindspore
def test_dcp_load_reads_the_ckpt_straight_through_the_view(ms_files):
    d, ms = ms_files
    view = msc.MindSporeCkpt(str(d / "split.ckpt"))
    state = {"big": torch.zeros(1000, 3), "half": torch.zeros(777, dtype=torch.float16),
             "small": torch.zeros(5, dtype=torch.int32)}
    dcp.load(state, str(d / "split.ckpt"), storage=view, verify="none")
    for fqn, tensor in state.items():
        assert raw_bytes(tensor) == base64.b64decode(ms["load"]["split.ckpt"][fqn]["b64"]), fqn


# ---- writing files MindSpore reads --------------------------------------------

@pytest.fixture(scope="module")
def exported(ms_files, tmp_path_factory) -> tuple[Path, dict]:
    """Our conversions of the reference files, exported back to .ckpt (and
    safetensors) in several ways, and MindSpore's reading of each."""
    d, _ = ms_files
    out = tmp_path_factory.mktemp("exported")
    specs = []
    for name in REFERENCE:
        ckpt = str(out / name.replace(".ckpt", ""))
        msc.mindspore_ckpt_to_checkpoint(str(d / name), ckpt)
        msc.checkpoint_to_mindspore_ckpt(
            ckpt, str(out / f"back-{name}"), crc_check=name == "crc.ckpt",
            slice_bytes=1024 if name == "split.ckpt" else msc.SLICE_BYTES)
        specs.append(f"{out}/back-{name}" + (":crc" if name == "crc.ckpt" else ""))
    msc.checkpoint_to_mindspore_ckpt(str(out / "dtypes"), str(out / "bf16.ckpt"), dtype="bfloat16",
                                     prefix="t_")
    msc.checkpoint_to_mindspore_ckpt(str(out / "dtypes"), str(out / "pieces.ckpt"),
                                     slice_bytes=7)  # pieces that cut elements
    mixed = {"model": {"w": torch.arange(91, dtype=torch.float32).reshape(7, 13),
                       "e": torch.zeros(0, 4, dtype=torch.int16),
                       "s": torch.tensor(3, dtype=torch.uint8)},
             "step": 12, "lr": 0.375, "flag": False, "name": "run-1", "blank": "", "sizes": [1, 2]}
    dcp.save(mixed, str(out / "mixed"))
    msc.checkpoint_to_mindspore_ckpt(str(out / "mixed"), str(out / "mixed.ckpt"), slice_bytes=100)
    checkpoint_to_safetensors(str(out / "dtypes"), str(out / "st"), metadata={"format": "ms"})
    specs += [f"{out}/bf16.ckpt", f"{out}/pieces.ckpt", f"{out}/mixed.ckpt",
              f"{out}/st/model.safetensors"]
    _mindspore("read", str(out / "read.json"), *specs)
    return out, json.loads((out / "read.json").read_text())


@needs_mindspore
@pytest.mark.parametrize("name", REFERENCE)
def test_mindspore_loads_our_export_byte_identical(ms_files, exported, name):
    (_, ms), (out, read) = ms_files, exported
    assert read[f"{out}/back-{name}"] == ms["load"][name]


@needs_mindspore
@pytest.mark.parametrize("name", REFERENCE)
def test_export_is_the_file_mindspore_wrote(ms_files, exported, name):
    """Same records in the same order, split alike, the same crc_num."""
    (d, _), (out, _) = ms_files, exported
    assert (out / f"back-{name}").read_bytes() == (d / name).read_bytes()


@needs_mindspore
def test_cast_prefix_pieces_and_values_as_mindspore_reads_them(ms_files, exported):
    (_, ms), (out, read) = ms_files, exported
    source = ms["load"]["dtypes.ckpt"]
    bf16 = read[f"{out}/bf16.ckpt"]
    assert set(bf16) == {k.removeprefix("t_") for k in source}
    for k, v in source.items():
        got = bf16[k.removeprefix("t_")]
        if v["dtype"] in ("Float16", "Float32", "Float64", "BFloat16"):
            dtype = getattr(torch, msc.MINDSPORE_DTYPES[v["dtype"]])
            raw = bytearray(base64.b64decode(v["b64"]))
            want = torch.frombuffer(raw, dtype=dtype).reshape(v["shape"]).to(torch.bfloat16)
            assert (got["dtype"], base64.b64decode(got["b64"])) == ("BFloat16", raw_bytes(want)), k
        else:
            assert got == v, k
    assert read[f"{out}/pieces.ckpt"] == source
    assert (out / "pieces.ckpt").stat().st_size > (out / "back-dtypes.ckpt").stat().st_size
    mixed = read[f"{out}/mixed.ckpt"]
    assert mixed["model.w"] == {"shape": [7, 13], "dtype": "Float32", "b64": base64.b64encode(
        raw_bytes(torch.arange(91, dtype=torch.float32))).decode()}
    assert mixed["model.e"] == {"shape": [0, 4], "dtype": "Int16", "b64": ""}
    assert mixed["model.s"] == {"shape": [], "dtype": "UInt8", "b64": "Aw=="}
    assert mixed["step"] == {"shape": [], "dtype": "Int64",
                             "b64": base64.b64encode((12).to_bytes(8, "little")).decode()}
    assert mixed["lr"]["dtype"] == "Float64" and mixed["flag"]["b64"] == "AA=="
    assert mixed["name"] == {"str": "run-1"} and "sizes" not in mixed
    assert mixed["blank"] == {"str": ""}  # written as MindSpore writes "": 4 NUL bytes
    blank = next(r for r in _records(out / "mixed.ckpt") if r[0] == "blank")
    assert blank == ["blank", [0], "str", base64.b64encode(bytes(4)).decode()]
    back = out / "mixed-back"
    msc.mindspore_ckpt_to_checkpoint(str(out / "mixed.ckpt"), str(back))
    assert dcp.read_metadata(str(back)).objects["blank"].value == ""


@needs_mindspore
def test_mindspore_safetensors_both_ways(ms_files, exported, tmp_path):
    (d, ms), (out, read) = ms_files, exported
    safetensors_to_checkpoint(str(d / "ms.safetensors"), str(tmp_path / "from-ms"))
    assert _as_ms_dump(_ours(str(tmp_path / "from-ms"))) == ms["load"]["ms.safetensors"]
    header = (out / "st" / "model.safetensors").read_bytes()
    assert b'"__metadata__":{"format":"ms"}' in header[:4096]
    assert read[f"{out}/st/model.safetensors"] == ms["load"]["dtypes.ckpt"]


@needs_mindspore
def test_int4_is_refused_naming_the_tensor(ms_files, tmp_path):
    d, _ = ms_files
    with pytest.raises(CheckpointError, match=r"int4.ckpt'.*value 'q'.*Int4"):
        msc.mindspore_ckpt_to_checkpoint(str(d / "int4.ckpt"), str(tmp_path / "a"))
    with pytest.raises(CheckpointError, match=r"int4.safetensors: tensor 'q' is MindSpore's Int4"):
        safetensors_to_checkpoint(str(d / "int4.safetensors"), str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- malformed files ----------------------------------------------------------

@pytest.fixture
def small_ckpt(tmp_path) -> Path:
    """A .ckpt our writer made: two tensors and a string."""
    dcp.save({"a": torch.arange(6, dtype=torch.int32), "b": torch.ones(2, 2), "s": "x"},
             str(tmp_path / "src"))
    msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "src"), str(tmp_path / "small.ckpt"))
    return tmp_path / "small.ckpt"


def _import_fails(path: Path, error=CorruptCheckpointError, match: str | None = None) -> str:
    with pytest.raises(error, match=match) as e:
        msc.mindspore_ckpt_to_checkpoint(str(path), str(path.parent / "never"))
    assert str(path) in str(e.value)
    assert not (path.parent / "never").exists()
    return str(e.value)


def test_our_small_file_reads_back(small_ckpt):
    view = msc.MindSporeCkpt(str(small_ckpt))
    assert {f: t.shape for f, t in view.metadata.tensors.items()} == {"a": (6,), "b": (2, 2)}
    assert view.metadata.objects["s"].value == "x"
    msc.mindspore_ckpt_to_checkpoint(str(small_ckpt), str(small_ckpt.parent / "back"))
    assert torch.equal(_read(small_ckpt.parent / "back", "a"), torch.arange(6, dtype=torch.int32))


def _read(ckpt: Path, fqn: str) -> torch.Tensor:
    md = dcp.read_metadata(str(ckpt))
    out = {fqn: torch.empty(md.tensors[fqn].shape, dtype=getattr(torch, md.tensors[fqn].dtype))}
    dcp.load(out, str(ckpt), strict=False)
    return out[fqn]


def test_truncated_file(small_ckpt):
    data = small_ckpt.read_bytes()
    for cut in (5, len(data) // 2, len(data) - 1):
        small_ckpt.chmod(0o644)
        small_ckpt.write_bytes(data[:cut])
        message = _import_fails(small_ckpt, match="runs past|ends")
        assert "at byte" in message


def test_bad_varint(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"\x0a" + b"\xff" * 11 + b"\x01" + b"\x00" * 20)
    assert "a varint longer than 10 bytes at byte 1" in _import_fails(bad)


def test_not_a_ckpt_and_an_empty_file(tmp_path):
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\x0f" * 64)
    assert "wire type 7" in _import_fails(junk)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    _import_fails(empty, NotACheckpointError, "holds no MindSpore values")
    _import_fails(tmp_path / "missing.ckpt", NotACheckpointError, "no such file")


def test_wrong_crc_trailer(tmp_path):
    big = torch.randn(300, 300)  # past the reader's blocks: its bytes are read only for the CRC
    dcp.save({"a": torch.arange(6), "big": big, "z": torch.ones(3)}, str(tmp_path / "src"))
    path = tmp_path / "crc.ckpt"
    msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "src"), str(path), crc_check=True)
    msc.mindspore_ckpt_to_checkpoint(str(path), str(tmp_path / "fine"))  # right: converts
    assert torch.equal(_read(tmp_path / "fine", "big"), big)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert "its crc_num trailer says" in _import_fails(path)
    data[-1] ^= 1
    data[len(data) // 2] ^= 0x10  # a byte of big's content: only the CRC catches it
    path.write_bytes(bytes(data))
    assert f"CRC-32 of bytes 0..{len(data) - 17} is" in _import_fails(path)


def test_repeated_tag_and_wrong_content_size(tmp_path):
    def record(tag, dims, content):
        return msc.value_header(tag, dims, "Int8", len(content)) + content
    twice = tmp_path / "twice.ckpt"
    twice.write_bytes(record("a", [2], b"xy") + record("b", [1], b"z") + record("a", [2], b"xy"))
    assert "tag 'a' again at byte" in _import_fails(twice)
    short = tmp_path / "short.ckpt"
    short.write_bytes(record("a", [3], b"xy"))
    assert "Int8[3] needs 3 bytes, its tensor_content holds 2" in _import_fails(short)


@needs_mindspore
def test_encrypted_and_maptensor_files_are_refused(ms_files, tmp_path):
    d, _ = ms_files
    for name in ("enc.ckpt", "maptensor.ckpt"):
        shutil.copy(d / name, tmp_path / name)
    assert "is encrypted (AES-GCM" in _import_fails(tmp_path / "enc.ckpt", CheckpointError)
    _import_fails(tmp_path / "maptensor.ckpt", CheckpointError,
                  r"value 'table' \(byte \d+\) is a maptensor")


def test_dims_zero_reads_as_mindspore_reads_it_and_is_not_written(tmp_path):
    """dims ``[0]``: a 0-dim tensor where the content holds one element (as
    MindSpore's loader reads it), an empty 1-D one where it holds none; an
    export skips ``(0,)`` tensors, which MindSpore would read as 0-dim."""
    path = tmp_path / "zero.ckpt"
    path.write_bytes(msc.value_header("s", [0], "Int16", 2) + b"\x05\x01"
                     + msc.value_header("e", [0], "Int16", 0))
    msc.mindspore_ckpt_to_checkpoint(str(path), str(tmp_path / "out"))
    md = dcp.read_metadata(str(tmp_path / "out"))
    assert (md.tensors["s"].shape, md.tensors["e"].shape) == ((), (0,))
    assert _read(tmp_path / "out", "s").item() == 0x105
    result = msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "out"), str(tmp_path / "back.ckpt"))
    assert (result.tensors, result.skipped) == (1, ["e"])
    assert _records(tmp_path / "back.ckpt") == [["s", [], "Int16", "BQE="]]


def test_packed_dims_and_unknown_fields_are_read(tmp_path):
    """What other protobuf writers may produce: packed dims, an unknown
    field in each message, fields out of order."""
    content = bytes(range(6))
    tensor = (b"\x1a\x06" + content + b"\x0a\x02\x02\x03" + b"\x12\x04Int8" + b"\x28\x05")
    value = b"\x12" + bytes([len(tensor)]) + tensor + b"\x0a\x01t" + b"\x25\x00\x00\x00\x00"
    path = tmp_path / "packed.ckpt"
    path.write_bytes(b"\x0a" + bytes([len(value)]) + value + b"\x10\x01")
    msc.mindspore_ckpt_to_checkpoint(str(path), str(tmp_path / "out"))
    assert raw_bytes(_read(tmp_path / "out", "t")) == content
    assert dcp.read_metadata(str(tmp_path / "out")).tensors["t"].shape == (2, 3)


def _leb(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def test_too_many_packed_dims_are_refused_before_the_field_is_read(tmp_path):
    def ckpt(packed: bytes) -> Path:
        tensor = b"\x0a" + _leb(len(packed)) + packed + b"\x12\x04Int8\x1a\x01\x07"
        value = b"\x0a\x01t\x12" + _leb(len(tensor)) + tensor
        path = tmp_path / f"dims-{len(packed)}.ckpt"
        path.write_bytes(b"\x0a" + _leb(len(value)) + value)
        return path

    big = ckpt(b"\x01" * (4 << 20))  # 4 MiB of dims: refused at its length
    tracemalloc.start()
    started = time.perf_counter()
    try:
        assert "packed dims of 4194304 bytes (more than 64 dims)" in _import_fails(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 1 and peak < 8 << 20, peak
    assert "with more than 64 dims" in _import_fails(ckpt(b"\x01" * 65))  # short, but too many
    assert msc.MindSporeCkpt(str(ckpt(b"\x01" * 64))).metadata.tensors["t"].shape == (1,) * 64


# ---- writing: splits, failures, refusals -------------------------------------

def test_split_records_of_our_writer_read_back_exactly(tmp_path):
    w = torch.randn(7, 13)
    dcp.save({"w": w, "i": torch.arange(50, dtype=torch.int64)}, str(tmp_path / "src"))
    msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "src"), str(tmp_path / "s.ckpt"),
                                     slice_bytes=30)
    found = _records(tmp_path / "s.ckpt")
    assert [r[0] for r in found] == ["w"] * math.ceil(364 / 30) + ["i"] * math.ceil(400 / 30)
    assert {len(base64.b64decode(r[3])) for r in found} == {30, 364 % 30, 400 % 30}
    msc.mindspore_ckpt_to_checkpoint(str(tmp_path / "s.ckpt"), str(tmp_path / "back"))
    assert torch.equal(_read(tmp_path / "back", "w"), w)
    assert torch.equal(_read(tmp_path / "back", "i"), torch.arange(50))
    # parts of tensors straight from the .ckpt: reads that start and end within records
    part = {"w": dcp.TensorShard(torch.zeros(3, 13), (7, 13), (2, 0)),
            "i": dcp.TensorShard(torch.zeros(9, dtype=torch.int64), (50,), (17,))}
    view = msc.MindSporeCkpt(str(tmp_path / "s.ckpt"))
    view.read_cost = ReadCost(latency_s=0.0)  # no gap read through: only the bytes needed
    dcp.load(part, str(tmp_path / "s.ckpt"), storage=view, verify="none")
    assert torch.equal(part["w"].data, w[2:5]) and torch.equal(part["i"].data, torch.arange(17, 26))


def test_export_refuses_and_leaves_nothing(small_ckpt, tmp_path):
    src = str(tmp_path / "src")
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        msc.checkpoint_to_mindspore_ckpt(src, str(small_ckpt))
    with pytest.raises(CheckpointError, match="ends in .ckpt"):
        msc.checkpoint_to_mindspore_ckpt(src, str(tmp_path / "x.bin"))
    dcp.save({"f8": torch.zeros(3, dtype=torch.float8_e4m3fn)}, str(tmp_path / "f8"))
    with pytest.raises(CheckpointError, match="'f8': dtype float8_e4m3fn has no MindSpore"):
        msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "f8"), str(tmp_path / "f8.ckpt"))
    md = dcp.read_metadata(src)  # a damaged chunk: the export fails midway
    chunk = md.tensors["b"].chunks[0]
    data = tmp_path / "src" / chunk.file
    raw = bytearray(data.read_bytes())
    raw[chunk.byte_offset] ^= 1
    data.write_bytes(bytes(raw))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="'b': checksum mismatch"):
        msc.checkpoint_to_mindspore_ckpt(src, str(tmp_path / "broken.ckpt"))
    assert sorted(os.listdir(tmp_path)) == before  # no .ckpt, no temporary file


def test_overwrite_replaces_the_file(small_ckpt, tmp_path):
    dcp.save({"z": torch.full((4,), 9, dtype=torch.int8)}, str(tmp_path / "other"))
    msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "other"), str(small_ckpt), overwrite=True)
    assert _records(small_ckpt) == [["z", [4], "Int8", base64.b64encode(b"\x09" * 4).decode()]]
    assert sorted(os.listdir(tmp_path)) == ["other", "small.ckpt", "src"]


# ---- safety ------------------------------------------------------------------

def test_reading_never_unpickles(small_ckpt, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")
    for name in ("loads", "load"):
        monkeypatch.setattr(pickle, name, refuse)
    msc.mindspore_ckpt_to_checkpoint(str(small_ckpt), str(small_ckpt.parent / "safe"))
    assert dcp.read_metadata(str(small_ckpt.parent / "safe")).objects["s"].value == "x"


def test_conversion_needs_no_mindspore(small_ckpt):
    code = ("import sys; from dcp.interop import mindspore_ckpt as m; "
            f"m.mindspore_ckpt_to_checkpoint({str(small_ckpt)!r}, "
            f"{str(small_ckpt.parent / 'n')!r}); "
            f"m.checkpoint_to_mindspore_ckpt({str(small_ckpt.parent / 'n')!r}, "
            f"{str(small_ckpt.parent / 'n.ckpt')!r}); "
            "print(sorted(k for k in sys.modules if k.split('.')[0] in "
            "('mindspore', 'google')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert (small_ckpt.parent / "n.ckpt").read_bytes() == small_ckpt.read_bytes()


# ---- command line ------------------------------------------------------------

def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_both_ways(small_ckpt, tmp_path, capsys):
    weights = tmp_path / "weights.bin"  # no suffix: found by its first bytes
    shutil.copy(small_ckpt, weights)
    proc = subprocess.run([sys.executable, "-m", "dcp", "convert", str(weights),
                           str(tmp_path / "in")], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "converted 2 tensors (40 bytes) from mindspore" in proc.stdout
    assert torch.equal(_read(tmp_path / "in", "b"), torch.ones(2, 2))
    dcp.save({"model": {"w": torch.randn(3, 4), "i": torch.arange(3)},
              "optim": {"m": torch.ones(2)}, "step": 3}, str(tmp_path / "train"))
    code, out, err = _cli(capsys, "convert", str(tmp_path / "train"), str(tmp_path / "out.ckpt"),
                          "--dtype", "bfloat16", "--model-only", "--crc-check")
    assert code == 0, err
    assert "converted 2 tensors (48 bytes) from hyperdcp" in out
    found = _records(tmp_path / "out.ckpt")
    assert sorted((r[0], r[1], r[2]) for r in found) == [("i", [3], "Int64"),
                                                         ("w", [3, 4], "BFloat16")]
    assert (tmp_path / "out.ckpt").read_bytes()[-17:-10] == b"crc_num"
    code, out, _ = _cli(capsys, "inspect", str(tmp_path / "out.ckpt"))
    assert code == 0 and "mindspore (no checksums), 2 tensors" in out
    code, _, _ = _cli(capsys, "convert", str(tmp_path / "train"), str(tmp_path / "p.ckpt"),
                      "--to", "mindspore", "--prefix", "optim.")
    assert code == 0 and [r[0] for r in _records(tmp_path / "p.ckpt")] == ["m"]
    code, _, err = _cli(capsys, "convert", str(tmp_path / "enc.ckpt"), str(tmp_path / "never"))
    assert code == 1 and "is not a checkpoint" in err and "does not exist" in err


def test_convert_help_names_mindspore(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "MindSpore .ckpt file, by its suffix or first bytes" in text
    assert "{hyperdcp,safetensors,torch-dcp,mindspore}" in text and "--crc-check" in text


def test_a_folder_is_refused_naming_it_and_first_bytes_want_a_plausible_record(small_ckpt,
                                                                                tmp_path):
    folder = tmp_path / "run.ckpt"
    folder.mkdir()
    _import_fails(folder, CheckpointError, "is a folder, not a MindSpore .ckpt file")
    assert msc.is_mindspore_ckpt(small_ckpt.read_bytes()[:msc.HEAD_BYTES])
    assert msc.is_mindspore_ckpt(small_ckpt.read_bytes()[:40])
    for text in (b"\n\n\nheading\n\n\nsome text\n", b"\n\x05\n\x01a\n\n", b"\n", b"\n\x80"):
        assert not msc.is_mindspore_ckpt(text), text


def _damaged(tmp_path: Path) -> str:
    """A checkpoint whose second tensor fails its checksum: an export fails midway."""
    src = tmp_path / "damaged"
    dcp.save({"a": torch.arange(6, dtype=torch.int32), "b": torch.ones(2, 2)}, str(src))
    chunk = dcp.read_metadata(str(src)).tensors["b"].chunks[0]
    raw = bytearray((src / chunk.file).read_bytes())
    raw[chunk.byte_offset] ^= 1
    (src / chunk.file).write_bytes(bytes(raw))
    return str(src)


@pytest.mark.parametrize("scheme", ["path", "shm"])
def test_a_failed_overwrite_keeps_the_previous_file(small_ckpt, tmp_path, scheme):
    folder = tmp_path / "out"
    folder.mkdir()
    good = small_ckpt.read_bytes()
    (folder / "model.ckpt").write_bytes(good)
    dest, options = (str(folder / "model.ckpt"), {}) if scheme == "path" else (
        "shm://out/model.ckpt", {"root": str(tmp_path)})
    with pytest.raises(CorruptCheckpointError, match="'b': checksum mismatch"):
        msc.checkpoint_to_mindspore_ckpt(_damaged(tmp_path), dest, overwrite=True,
                                         dest_options=options)
    assert os.listdir(folder) == ["model.ckpt"] and (folder / "model.ckpt").read_bytes() == good
    msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "src"), dest, overwrite=True,
                                     dest_options=options)
    assert os.listdir(folder) == ["model.ckpt"] and (folder / "model.ckpt").read_bytes() == good


def test_without_atomic_replace_an_existing_file_is_refused_and_a_failure_leaves_nothing(
        small_ckpt, tmp_path):
    root = f"memory://ms-{uuid.uuid4().hex}"
    msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "src"), f"{root}/model.ckpt")
    dest = open_storage(root)
    assert dest.list_files() == ["model.ckpt"]
    assert dest.read_file("model.ckpt") == small_ckpt.read_bytes()
    with pytest.raises(CheckpointError, match="cannot replace a file atomically; delete it first"):
        msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "src"), f"{root}/model.ckpt",
                                         overwrite=True)
    with pytest.raises(CorruptCheckpointError, match="'b': checksum mismatch"):
        msc.checkpoint_to_mindspore_ckpt(_damaged(tmp_path), f"{root}/other.ckpt")
    assert dest.list_files() == ["model.ckpt"]


@dist_scenario(world_size=2)
def test_two_rank_export_takes_rank_0s_look_at_the_destination(ctx):
    import torch.distributed as dist

    src, dest = ctx.dir / "src", ctx.dir / "model.ckpt"
    dcp.save({"a": torch.arange(6, dtype=torch.int32)}, str(src))  # collective
    real = PosixStorage.exists
    if ctx.rank == 1:  # a stale view of the destination on rank 1 (say, a cached listing)
        PosixStorage.exists = lambda self, name: name == "model.ckpt" or real(self, name)
    try:
        result = msc.checkpoint_to_mindspore_ckpt(str(src), str(dest),
                                                  process_group=dist.group.WORLD)
    finally:
        PosixStorage.exists = real
    assert result.files == ["model.ckpt"] and _records(dest)[0][:3] == ["a", [6], "Int32"]
    ctx.barrier()
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        msc.checkpoint_to_mindspore_ckpt(str(src), str(dest), process_group=dist.group.WORLD)
    assert sorted(os.listdir(ctx.dir)) == ["model.ckpt", "src"]


def test_one_file_sources_split_alike_into_folder_and_name(small_ckpt, monkeypatch):
    from dcp.interop.safetensors_io import SafetensorsFolder
    from dcp.interop.streaming import split_file

    assert split_file("s3://bucket/run/m.ckpt") == ("s3://bucket/run", "m.ckpt")
    assert split_file("m.ckpt") == (".", "m.ckpt") and split_file("d/m.ckpt/") == ("d", "m.ckpt")
    monkeypatch.chdir(small_ckpt.parent)  # bare names: the current folder
    checkpoint_to_safetensors("src", "st")
    view = SafetensorsFolder("st/model.safetensors")
    assert (view.inner.checkpoint_id, view._single) == ("st", "model.safetensors")
    assert set(msc.MindSporeCkpt("small.ckpt").metadata.tensors) == {"a", "b"}


def test_crc_num_bytes_ending_the_last_tensor_are_its_bytes_not_a_trailer(tmp_path):
    content = b"ab" + msc.CRC_MARK + bytes(range(10))
    dcp.save({"t": torch.frombuffer(bytearray(content), dtype=torch.uint8)}, str(tmp_path / "src"))
    for crc_check in (False, True):
        path = tmp_path / f"crc-{crc_check}.ckpt"
        msc.checkpoint_to_mindspore_ckpt(str(tmp_path / "src"), str(path), crc_check=crc_check)
        if not crc_check:
            assert path.read_bytes()[-17:] == content[2:]  # what a trailer looks like
        msc.mindspore_ckpt_to_checkpoint(str(path), str(tmp_path / f"back-{crc_check}"))
        assert raw_bytes(_read(tmp_path / f"back-{crc_check}", "t")) == content
    path = tmp_path / "crc-True.ckpt"  # a real trailer is still checked
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 1
    path.write_bytes(bytes(raw))
    assert "the file is damaged" in _import_fails(path)
