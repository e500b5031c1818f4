"""Corruption (issue #8.2): a byte flipped at a random position of each data
file, a truncated data file, a deleted data file, a truncated or garbled
metadata file — each fails ``dcp.load`` with a ``CheckpointError`` naming
the fqn, chunk and file (or the metadata problem) and is reported by
``hyperdcp verify`` (exit code 3)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

import dcp
from dcp.tools.cli import main
from dcp.tools.verify import verify
from helpers import random_tensor


def _state(zero: bool = False) -> dict:
    make = (lambda shape, dtype, seed: torch.zeros(shape, dtype=dtype)) if zero else random_tensor
    return {"emb": make((64, 32), torch.float32, 1), "layers": {
        "0": {"w": make((32, 32), torch.bfloat16, 2), "b": make((32,), torch.int64, 3)},
        "1": {"w": make((32, 32), torch.float16, 4), "b": make((33,), torch.uint8, 5)}},
        "step": 7}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("pristine") / "ckpt"
    md = dcp.save(_state(), str(ckpt), storage_options={"thread_count": 3})
    assert len(md.files()) == 3
    return ckpt, md


@pytest.fixture
def ckpt(pristine, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(pristine[0], copy)
    return copy


def _chunk_at(md, file: str, position: int):
    """(fqn, chunk) whose bytes in ``file`` hold ``position``."""
    for fqn, t in md.tensors.items():
        for c in t.chunks:
            if c.file == file and c.byte_offset <= position < c.byte_offset + c.nbytes:
                return fqn, c
    raise AssertionError(f"no chunk holds byte {position} of {file}")


def _verify_cli(ckpt, capsys) -> tuple[int, str]:
    code = main(["verify", str(ckpt)])
    out = capsys.readouterr()
    return code, out.out + out.err


def _load_error(ckpt) -> str:
    with pytest.raises(dcp.CheckpointError) as info:
        dcp.load(_state(zero=True), str(ckpt))
    return str(info.value)


@pytest.mark.parametrize("seed", range(3))
def test_a_flipped_byte_anywhere_in_each_data_file(pristine, ckpt, capsys, seed):
    md = pristine[1]
    rng = random.Random(seed)
    for file in sorted(md.files()):
        path = ckpt / file
        data = bytearray((pristine[0] / file).read_bytes())
        position = rng.randrange(len(data))
        fqn, chunk = _chunk_at(md, file, position)
        data[position] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        message = _load_error(ckpt)
        assert isinstance(message, str) and "checksum mismatch" in message, message
        assert (f"{fqn!r}" in message and f"offsets {list(chunk.offsets)}" in message
                and file in message)
        report = verify(str(ckpt))
        assert [(d.what, d.file) for d in report.damaged] == [
            (f"tensor {fqn!r} chunk at offsets {list(chunk.offsets)}", file)]
        assert "checksum mismatch" in report.damaged[0].problem
        code, text = _verify_cli(ckpt, capsys)
        assert code == 3 and fqn in text and file in text, text
        shutil.copy(pristine[0] / file, path)  # one damaged file at a time
    assert verify(str(ckpt)).ok


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_or_deleted_data_file(pristine, ckpt, capsys, damage):
    md = pristine[1]
    file = sorted(md.files())[1]
    last = max((c for t in md.tensors.values() for c in t.chunks if c.file == file),
               key=lambda c: c.byte_offset)
    fqn = next(f for f, t in md.tensors.items() if last in t.chunks)
    if damage == "truncate":
        (ckpt / file).write_bytes((ckpt / file).read_bytes()[:last.byte_offset + last.nbytes - 1])
        damaged = [f"tensor {fqn!r} chunk at offsets {list(last.offsets)}"]
    else:
        (ckpt / file).unlink()
        damaged = sorted(f"tensor {f!r} chunk at offsets {list(c.offsets)}"
                         for f, t in md.tensors.items() for c in t.chunks if c.file == file)
    message = _load_error(ckpt)
    assert file in message and "offsets" in message, message
    assert any(f"{f!r}" in message for f, t in md.tensors.items()
               if any(c.file == file for c in t.chunks)), message
    report = verify(str(ckpt))
    assert sorted(d.what for d in report.damaged) == damaged
    assert all(d.file == file and "cannot be read" in d.problem for d in report.damaged)
    code, text = _verify_cli(ckpt, capsys)
    assert code == 3 and file in text, text


@pytest.mark.parametrize("damage", ["truncate", "garble", "empty"])
def test_a_truncated_or_garbled_metadata_file(ckpt, capsys, damage):
    path = ckpt / "metadata.json"
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:len(raw) // 2])
    elif damage == "garble":
        garbled = bytearray(raw)
        garbled[raw.index(b'"tensors"') + 2] = ord("X")  # a key renamed: valid JSON, wrong schema
        path.write_bytes(bytes(garbled))
    else:
        path.write_bytes(b"")
    problem = {"truncate": "not JSON", "garble": "tensors must be an object",
               "empty": "not JSON"}[damage]
    message = _load_error(ckpt)
    assert ("metadata.json" in message and "invalid metadata" in message
            and problem in message), message
    with pytest.raises(dcp.CorruptCheckpointError, match=problem):
        verify(str(ckpt))
    code, text = _verify_cli(ckpt, capsys)
    assert code == 3 and "metadata.json" in text and problem in text, text
