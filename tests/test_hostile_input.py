"""Hostile input (issue #8.3): crafted metadata and exchange files cannot run
code, allocate absurd memory or name files outside the checkpoint; the
metadata and exchange-file decoders, fuzzed with hypothesis, return a valid
object or raise CheckpointError for any input, never another exception.
(Pickle payloads in metadata are tests/test_errors.py's.)"""

from __future__ import annotations

import json
import resource

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcp
from dcp.coordination import wire
from dcp.core.metadata import ChunkMeta, Metadata, TensorMeta, decode, encode
from dcp.core.storage import open_storage
from dcp.interop.safetensors_io import checkpoint_to_safetensors
from helpers import assert_bitwise_equal, random_tensor

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_metadata() -> bytes:
    md = Metadata(save_id="abc", world_size=2)
    md.tensors["w"] = TensorMeta((4, 6), "float32", [
        ChunkMeta((0, 0), (2, 6), "r00000-0.abc.data", 0, 48, 123, 0),
        ChunkMeta((2, 0), (2, 6), "r00001-0.abc.data", 0, 48, 456, 1)])
    md.tensors["e"] = TensorMeta((0,), "int64", [])
    return encode(md)


def _json_values():
    return st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
        lambda inner: (st.lists(inner, max_size=5)
                       | st.dictionaries(st.text(max_size=12), inner, max_size=5)),
        max_leaves=30)


def _mutations(doc: dict):
    """A valid document with one field replaced by an arbitrary JSON value."""
    paths = [("format",), ("version",), ("checksum",), ("save_id",), ("world_size",), ("files",),
             ("files", 0), ("tensors",), ("tensors", "w"), ("tensors", "w", "shape"),
             ("tensors", "w", "dtype"), ("tensors", "w", "rows"), ("chunk_table",),
             ("chunk_table", "rows"), ("chunk_table", "codec"), ("chunk_table", "offsets"),
             ("chunk_table", "sizes"), ("chunk_table", "file"), ("chunk_table", "checksum"),
             ("objects",)]

    def mutate(path, value):
        out = json.loads(json.dumps(doc))
        node = out
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return json.dumps(out).encode()

    return st.builds(mutate, st.sampled_from(paths), _json_values())


VALID = _valid_metadata()


def _decoded_or_checkpoint_error(fn, data):
    try:
        fn(data)
    except dcp.CheckpointError:
        pass


@FUZZ
@given(st.binary(max_size=400) | _mutations(json.loads(VALID))
       | st.builds(lambda data, cut: data[:cut], st.just(VALID), st.integers(0, len(VALID))))
def test_metadata_decoder_fuzzed(data):
    try:
        md = decode(data)
    except dcp.CheckpointError:
        return
    # a document that decodes is a whole one: every chunk inside its tensor
    for t in md.tensors.values():
        for c in t.chunks:
            assert all(o + s <= d for o, s, d in zip(c.offsets, c.sizes, t.shape, strict=True))
            assert ".." not in c.file.split("/") and not c.file.startswith("/")


EXCHANGE = wire.encode(("plan", "key", {("w", (0, 1)): [1, 2.5, None, b"x"]}))


@FUZZ
@given(st.binary(max_size=300) | _json_values().map(lambda v: json.dumps(v).encode())
       | st.builds(lambda c, f: json.dumps({"c": c, "f": f}).encode(),
                   st.sampled_from(["ChunkMeta", "SavePlan", "TensorDecl", "WriteItem",
                                    "Metadata", "WriteResult", "_Failure", "os.system", "Nope"]),
                   _json_values())
       | st.builds(lambda cut: EXCHANGE[:cut], st.integers(0, len(EXCHANGE))))
def test_exchange_payload_decoder_fuzzed(data):
    _decoded_or_checkpoint_error(lambda d: wire.decode(d, "fuzzed exchange file"), data)


@FUZZ
@given(st.binary(max_size=200))
def test_exchange_file_reader_fuzzed(tmp_path_factory, data):
    """Any bytes in an exchange file read as a payload only when the trailer
    matches, else as None: never an exception."""
    storage = open_storage(str(tmp_path_factory.getbasetemp() / "exchange"))
    storage.write_file("x", [data])
    payload = storage.read_exchange("x")
    assert payload is None or len(payload) == len(data) - 16


def test_exchange_file_cannot_name_a_class_that_runs_code(tmp_path):
    for doc in ({"c": "posix.system", "f": ["touch x"]}, {"c": "Path", "f": {"args": ["/"]}},
                {"py/reduce": [{"py/function": "os.system"}, {"py/tuple": ["touch x"]}]}):
        with pytest.raises(dcp.CheckpointError, match="malformed exchange payload"):
            wire.decode(json.dumps(doc).encode(), "crafted")
    assert not (tmp_path / "x").exists()


def _crafted_huge(path, with_data: bool) -> None:
    """A checkpoint declaring a float32 tensor of 10**15 elements (4 PB) in
    one chunk; its data file holds 64 bytes."""
    path.mkdir()
    (path / "x.data").write_bytes(bytes(64) if with_data else b"")
    md = Metadata(save_id="s", world_size=1)
    md.tensors["w"] = TensorMeta((10**15,), "float32",
                                 [ChunkMeta((0,), (10**15,), "x.data", 0, 4 * 10**15, 0, 0)])
    (path / "metadata.json").write_bytes(encode(md))


def test_a_declared_shape_of_1e15_elements_raises_before_allocating(tmp_path):
    ckpt = tmp_path / "huge"
    _crafted_huge(ckpt, with_data=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert dcp.read_metadata(str(ckpt)).tensors["w"].shape == (10**15,)
    # a part of the tensor with every byte checked: the whole chunk would be read
    target = {"w": dcp.TensorShard(torch.zeros(10), (10**15,), (0,))}
    with pytest.raises(dcp.CorruptCheckpointError, match=r"'w'.*offsets \[0\].*x\.data.*truncated"):
        dcp.load(target, str(ckpt), verify="all")
    # export streams whole tensors
    with pytest.raises(dcp.CorruptCheckpointError, match=r"'w'.*x\.data"):
        checkpoint_to_safetensors(str(ckpt), str(tmp_path / "out"))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 512 * 1024, "RSS grew > 512 MiB"
    # the 10 elements the target asks for are read (and exist)
    dcp.load(target, str(ckpt))
    assert_bitwise_equal(target["w"].data, torch.zeros(10))


@pytest.mark.parametrize("bad", ["../outside.data", "/etc/passwd", "a/../../x.data", "..", "./x",
                                 "a//b", "C:\\x.data", "x\\..\\y", "x\0y", ""])
def test_metadata_file_names_cannot_leave_the_checkpoint(tmp_path, bad):
    doc = json.loads(VALID)
    doc["files"][0] = bad
    with pytest.raises(dcp.CorruptCheckpointError, match="not a plain relative path"):
        decode(json.dumps(doc).encode())


def test_pickled_value_reference_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    sd = {"w": random_tensor((4,), torch.float32, 1), "cfg": 1}
    dcp.save(sd, str(ckpt))
    doc = json.loads((ckpt / "metadata.json").read_bytes())
    doc["files"].append("../../etc/passwd")
    doc["objects"]["cfg"] = {"pickled": [len(doc["files"]) - 1, 0, 10, 0]}
    (ckpt / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(dcp.CorruptCheckpointError, match="not a plain relative path"):
        dcp.load({"w": torch.zeros(4), "cfg": 0}, str(ckpt), allow_pickle=True)
