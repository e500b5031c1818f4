"""Single-process error paths: pickling policy, strictness, dtype/shape checks,
corruption, incomplete checkpoints, overwrite, injected I/O errors and crafted
metadata.  Every error must be a ``dcp.CheckpointError`` whose message names
what is at fault."""

from __future__ import annotations

import json
import pathlib
import pickle
import re

import pytest
import torch

import dcp
from dcp.core.metadata import checksum
from helpers import (
    FailingStorage,
    assert_bitwise_equal,
    assert_names,
    mentions_shape,
    randn,
    random_tensor,
)


# ----------------------------------------------------------- pickling policy
class Custom:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Custom) and other.x == self.x


class TouchOnUnpickle:
    """Unpickling this creates ``path``: proof that a pickle was executed."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


@pytest.mark.parametrize(
    "value", [{1, 2, 3}, Custom(3), bytearray(b"raw"), torch.device("cpu")],
    ids=["set", "custom", "bytearray", "device"],  # bytes are stored raw
)
def test_non_json_value_raises_on_save_without_allow_pickle(tmp_path, value):
    ckpt = tmp_path / "ckpt"
    sd = {"w": randn((2, 2)), "extra": {"odd_value": value}}
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.save(sd, str(ckpt))
    assert_names(str(ei.value), "extra.odd_value")
    assert not (ckpt / "metadata.json").exists(), "a refused save committed a checkpoint"


def test_pickled_values_round_trip_only_with_allow_pickle_on_load(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    w = randn((3, 2), seed=1)
    dcp.save({"w": w, "obj": Custom(5), "tags": {"a", "b"}}, ckpt, allow_pickle=True)

    target = {"w": torch.zeros(3, 2), "obj": None, "tags": None}
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.load(target, ckpt)
    msg = str(ei.value)
    assert "obj" in msg or "tags" in msg, f"error does not name a pickled fqn: {msg!r}"
    assert target["obj"] is None and target["tags"] is None

    # a class of the user's own is not on the unpickler's allow-list until added
    with pytest.raises(dcp.CheckpointError, match="'test_errors.Custom'"):
        dcp.load(target, ckpt, allow_pickle=True)
    target = {"w": torch.zeros(3, 2), "obj": None, "tags": None}
    with torch.serialization.safe_globals([Custom]):
        dcp.load(target, ckpt, allow_pickle=True)
    assert target["obj"] == Custom(5)
    assert target["tags"] == {"a", "b"}
    assert_bitwise_equal(target["w"], w)


def test_pickle_payload_in_checkpoint_not_executed_without_allow_pickle(tmp_path):
    marker = tmp_path / "PWNED"
    ckpt = str(tmp_path / "ckpt")
    dcp.save({"w": randn((2,)), "evil": TouchOnUnpickle(marker)}, ckpt, allow_pickle=True)
    assert not marker.exists()

    dcp.read_metadata(ckpt)
    assert not marker.exists(), "read_metadata unpickled a value"
    with pytest.raises(dcp.CheckpointError, match="evil"):
        dcp.load({"w": torch.zeros(2), "evil": None}, ckpt)
    assert not marker.exists(), "load without allow_pickle executed a pickle payload"
    # Non-strict loads of the other keys must not unpickle it either.
    target = {"w": torch.zeros(2)}
    dcp.load(target, ckpt, strict=False)
    assert not marker.exists(), "non-strict load of other keys executed a pickle payload"

    # With allow_pickle=True the restricted unpickler refuses its global ...
    with pytest.raises(dcp.CheckpointError, match=r"'evil'.*'pathlib\.Path\.touch'"):
        dcp.load({"w": torch.zeros(2), "evil": None}, ckpt, allow_pickle=True)
    assert not marker.exists(), "load with allow_pickle executed a pickle payload"
    # ... and the payload is live: plain pickle runs it (so the asserts above can fail).
    pickle.loads(pickle.dumps(TouchOnUnpickle(marker)))
    assert marker.exists()


# ------------------------------------------------------------------ strictness
def _layers(n: int, seed: int = 0, zeros: bool = False) -> dict:
    make = (lambda shape, s: torch.zeros(shape)) if zeros else (lambda shape, s: randn(shape, s))
    return {
        "model": {"layers": [{"w": make((4, 4), seed + 2 * i), "b": make((4,), seed + 2 * i + 1)}
                             for i in range(n)]},
        "epoch": 0 if zeros else 3,
    }


def test_strict_load_with_missing_keys_raises_listing_them(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dcp.save(_layers(2), ckpt)
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.load(_layers(3, zeros=True), ckpt)
    assert_names(str(ei.value), "model.layers.2.w", "model.layers.2.b")


def test_strict_load_into_smaller_model_loads_and_reports_unexpected_keys(tmp_path):
    """strict covers keys the target needs; keys only the checkpoint has are
    always reported, never an error (the issue's rule)."""
    ckpt = str(tmp_path / "ckpt")
    saved = _layers(2)
    dcp.save(saved, ckpt)
    target = _layers(1, zeros=True)
    report = dcp.load(target, ckpt)
    assert sorted(report.unexpected_keys) == ["model.layers.1.b", "model.layers.1.w"]
    assert report.missing_keys == []
    for k in ("w", "b"):
        assert_bitwise_equal(target["model"]["layers"][0][k], saved["model"]["layers"][0][k], k)


def test_non_strict_load_into_bigger_model_reports_missing_and_loads_rest(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = _layers(2)
    dcp.save(saved, ckpt)
    target = _layers(3, zeros=True)
    target["model"]["layers"][2]["w"].fill_(7.0)
    report = dcp.load(target, ckpt, strict=False)
    assert sorted(report.missing_keys) == ["model.layers.2.b", "model.layers.2.w"]
    assert report.unexpected_keys == []
    for i in range(2):
        for k in ("w", "b"):
            assert_bitwise_equal(target["model"]["layers"][i][k], saved["model"]["layers"][i][k],
                                 f"layers.{i}.{k}")
    assert target["epoch"] == 3
    assert torch.all(target["model"]["layers"][2]["w"] == 7.0), (
        "a missing key's target was modified")
    assert torch.all(target["model"]["layers"][2]["b"] == 0.0), (
        "a missing key's target was modified")


def test_non_strict_load_into_smaller_model_reports_unexpected_and_loads_rest(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = _layers(2)
    dcp.save(saved, ckpt)
    target = _layers(1, zeros=True)
    report = dcp.load(target, ckpt, strict=False)
    assert sorted(report.unexpected_keys) == ["model.layers.1.b", "model.layers.1.w"]
    assert report.missing_keys == []
    assert_bitwise_equal(target["model"]["layers"][0]["w"], saved["model"]["layers"][0]["w"])
    assert_bitwise_equal(target["model"]["layers"][0]["b"], saved["model"]["layers"][0]["b"])
    assert target["epoch"] == 3
    assert len(target["model"]["layers"]) == 1


def test_strict_load_of_matching_keys_reports_nothing(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dcp.save(_layers(2), ckpt)
    report = dcp.load(_layers(2, zeros=True), ckpt)
    assert report.missing_keys == [] and report.unexpected_keys == []


# ---------------------------------------------------------- dtype and shape
def test_dtype_mismatch_raises_unless_cast_allowed(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    w = randn((16, 8), seed=4) * 3.3
    dcp.save({"layer": {"w": w}}, ckpt)
    target = {"layer": {"w": torch.zeros(16, 8, dtype=torch.bfloat16)}}
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.load(target, ckpt)
    assert_names(str(ei.value), "layer.w")
    msg = str(ei.value)
    assert "float32" in msg and "bfloat16" in msg, f"error does not name both dtypes: {msg!r}"
    assert torch.all(target["layer"]["w"] == 0)

    dcp.load(target, ckpt, allow_dtype_cast=True)
    assert_bitwise_equal(target["layer"]["w"], w.to(torch.bfloat16))


def test_shape_mismatch_raises_naming_both_shapes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dcp.save({"proj": randn((4, 6))}, ckpt)
    for bad_shape in [(8, 3), (4, 7), (24,)]:  # (8, 3) and (24,): same numel
        with pytest.raises(dcp.CheckpointError) as ei:
            dcp.load({"proj": torch.zeros(bad_shape)}, ckpt)
        msg = str(ei.value)
        assert_names(msg, "proj")
        assert mentions_shape(msg, (4, 6)), f"saved shape (4, 6) not named: {msg!r}"
        assert mentions_shape(msg, bad_shape), f"target shape {bad_shape} not named: {msg!r}"
        with pytest.raises(dcp.CheckpointError):
            dcp.load({"proj": torch.zeros(bad_shape)}, ckpt, allow_dtype_cast=True, strict=False)


# ------------------------------------------------------------- corruption
def _two_tensor_ckpt(tmp_path):
    ckpt = tmp_path / "ckpt"
    sd = {"alpha": {"weight": random_tensor((64, 64), torch.float32, 1)},
          "beta": {"weight": random_tensor((32, 16), torch.int32, 2)}}
    md = dcp.save(sd, str(ckpt))
    return ckpt, sd, md


def _target(sd):
    return {k: {"weight": torch.zeros_like(v["weight"])} for k, v in sd.items()}


def test_flipped_byte_is_detected_naming_fqn_and_file(tmp_path):
    ckpt, sd, md = _two_tensor_ckpt(tmp_path)
    (chunk,) = md.tensors["beta.weight"].chunks
    path = ckpt / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset + chunk.nbytes // 2] ^= 0x10
    path.write_bytes(bytes(data))

    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.load(_target(sd), str(ckpt))
    assert_names(str(ei.value), "beta.weight", pathlib.Path(chunk.file).name)


def test_flipped_byte_is_detected_when_loading_part_of_a_chunk(tmp_path):
    """A resharded load reads part of a saved chunk; with verify="all" the
    whole chunk is read and checked, so corrupt bytes inside that part are
    not returned silently."""
    ckpt, sd, md = _two_tensor_ckpt(tmp_path)
    (chunk,) = md.tensors["alpha.weight"].chunks
    assert chunk.sizes == (64, 64)
    path = ckpt / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset + 10 * 64 * 4 + 8] ^= 0x10  # row 10, column 2
    path.write_bytes(bytes(data))

    target = {"alpha": {"weight": dcp.TensorShard(torch.zeros(32, 64), (64, 64), (0, 0))}}
    try:
        dcp.load(target, str(ckpt), strict=False, verify="all")
    except dcp.CheckpointError as e:
        assert_names(str(e), "alpha.weight", pathlib.Path(chunk.file).name)
    else:
        same = torch.equal(target["alpha"]["weight"].data.view(torch.int32),
                           sd["alpha"]["weight"][:32].view(torch.int32))
        pytest.fail(f"corrupted chunk loaded without error "
                    f"(values equal to the saved ones: {same})")


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_missing_data_file_is_detected(tmp_path, damage):
    ckpt, sd, md = _two_tensor_ckpt(tmp_path)
    (chunk,) = md.tensors["alpha.weight"].chunks
    path = ckpt / chunk.file
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: chunk.byte_offset + chunk.nbytes // 2])
    else:
        path.unlink()
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.load(_target(sd), str(ckpt))
    assert_names(str(ei.value), pathlib.Path(chunk.file).name)


@pytest.mark.parametrize("how", ["metadata_deleted", "empty_dir", "no_dir"])
def test_load_without_metadata_says_not_a_checkpoint(tmp_path, how):
    ckpt = tmp_path / "ckpt"
    sd = {"w": randn((3,))}
    if how == "metadata_deleted":
        dcp.save(sd, str(ckpt))
        (ckpt / "metadata.json").unlink()
        assert list(ckpt.glob("*.data")), "precondition: data files remain"
    elif how == "empty_dir":
        ckpt.mkdir()
    for call in (lambda: dcp.load({"w": torch.zeros(3)}, str(ckpt)),
                 lambda: dcp.read_metadata(str(ckpt))):
        with pytest.raises(dcp.CheckpointError) as ei:
            call()
        assert re.search(r"not a (complete |committed |valid )?checkpoint|incomplete",
                         str(ei.value), re.I), (
            f"message does not say it is not a (complete) checkpoint: {str(ei.value)!r}"
        )


# ----------------------------------------------------------------- overwrite
def test_save_to_existing_checkpoint_requires_overwrite(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = {"w": randn((5, 5), seed=1)}
    second = {"w": randn((5, 5), seed=2)}
    dcp.save(first, str(ckpt))
    before = (ckpt / "metadata.json").read_bytes()
    listing = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.save(second, str(ckpt))
    assert "overwrite" in str(ei.value), (
        f"error does not point at overwrite=True: {str(ei.value)!r}")
    assert (ckpt / "metadata.json").read_bytes() == before
    assert sorted(p.name for p in ckpt.iterdir()) == listing, "a refused save left files behind"
    target = {"w": torch.zeros(5, 5)}
    dcp.load(target, str(ckpt))
    assert_bitwise_equal(target["w"], first["w"])

    dcp.save(second, str(ckpt), overwrite=True)
    dcp.load(target, str(ckpt))
    assert_bitwise_equal(target["w"], second["w"])


# ------------------------------------------------------- injected I/O error
def _many_tensors(seed: int) -> dict:
    return {f"block{i}": {"w": random_tensor((128, 64), torch.float32, seed + i)} for i in range(8)}


def test_io_error_in_writer_thread_fails_save_and_keeps_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _many_tensors(0)
    dcp.save(first, str(ckpt))
    before = (ckpt / "metadata.json").read_bytes()

    storage = FailingStorage(str(ckpt), thread_count=4, fail_on=2)
    with pytest.raises(dcp.CheckpointError) as ei:
        dcp.save(_many_tensors(100), str(ckpt), storage=storage, overwrite=True)
    assert storage.failed_name is not None, (
        "precondition: the save made at least 2 write_file calls")
    assert storage.failed_in_thread != "MainThread", (
        "precondition: the error starts in a writer thread")
    assert "injected" in str(ei.value) or storage.failed_name in str(ei.value), (
        f"error names neither the I/O error nor the file: {str(ei.value)!r}"
    )
    assert (ckpt / "metadata.json").read_bytes() == before, "a failed save changed metadata.json"

    target = {k: {"w": torch.zeros(128, 64)} for k in first}
    dcp.load(target, str(ckpt))
    for k in first:
        assert_bitwise_equal(target[k]["w"], first[k]["w"], k)


def test_io_error_on_first_save_commits_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    storage = FailingStorage(str(ckpt), fail_on=1)
    with pytest.raises(dcp.CheckpointError):
        dcp.save(_many_tensors(0), str(ckpt), storage=storage)
    assert not (ckpt / "metadata.json").exists()
    with pytest.raises(dcp.CheckpointError):
        dcp.load(_many_tensors(0), str(ckpt))


# --------------------------------------------------------- crafted metadata
def _valid_ckpt(tmp_path):
    ckpt = tmp_path / "ckpt"
    sd = {"w": randn((4, 4), seed=1), "cfg": {"lr": 0.5}}
    dcp.save(sd, str(ckpt))
    return ckpt, sd


def _crafted_payloads(marker: pathlib.Path) -> dict[str, bytes]:
    evil = TouchOnUnpickle(marker)
    return {
        "pickle_protocol_5": pickle.dumps(evil, protocol=5),
        "pickle_protocol_0": pickle.dumps(evil, protocol=0),
        "jsonpickle_reduce": json.dumps(
            {"py/reduce": [{"py/function": "pathlib.Path.touch"}, {"py/tuple": [str(marker)]}]}
        ).encode(),
        "dunder_reduce": json.dumps(
            {"__reduce__": ["pathlib.Path.touch", [str(marker)]], "format": "hyperdcp",
             "version": 1}
        ).encode(),
        "garbage": bytes(range(256)) * 4,
        "empty": b"",
        "json_list": b"[]",
        "json_wrong_schema": json.dumps({"tensors": 5, "objects": "x"}).encode(),
        "deep_nesting": b"[" * 100000 + b"]" * 100000,
    }


@pytest.mark.parametrize("payload", list(_crafted_payloads(pathlib.Path("x"))))
def test_crafted_metadata_cannot_execute_code(tmp_path, payload):
    ckpt, sd = _valid_ckpt(tmp_path)
    marker = tmp_path / "PWNED"
    (ckpt / "metadata.json").write_bytes(_crafted_payloads(marker)[payload])
    target = {"w": torch.zeros(4, 4), "cfg": {"lr": 0.0}}
    with pytest.raises(dcp.CheckpointError):
        dcp.load(target, str(ckpt))
    with pytest.raises(dcp.CheckpointError):
        dcp.load(target, str(ckpt), allow_pickle=True)
    with pytest.raises(dcp.CheckpointError):
        dcp.read_metadata(str(ckpt))
    assert not marker.exists(), "decoding crafted metadata executed code"


def test_truncated_metadata_is_a_checkpoint_error(tmp_path):
    ckpt, sd = _valid_ckpt(tmp_path)
    raw = (ckpt / "metadata.json").read_bytes()
    (ckpt / "metadata.json").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(dcp.CheckpointError):
        dcp.load({"w": torch.zeros(4, 4), "cfg": {"lr": 0.0}}, str(ckpt))


def test_crafted_metadata_turning_json_value_into_pickle_is_refused(tmp_path):
    """An attacker edits metadata.json so a JSON value points at a pickle blob:
    a load that did not opt into pickle must refuse it, not run it."""
    ckpt, sd = _valid_ckpt(tmp_path)
    marker = tmp_path / "PWNED"
    blob = pickle.dumps(TouchOnUnpickle(marker))
    (ckpt / "evil.data").write_bytes(blob)
    doc = json.loads((ckpt / "metadata.json").read_bytes())
    # Format documented in dcp/metadata.py (version 1).
    assert doc.get("version") == 1 and "cfg.lr" in doc.get("objects", {}), (
        f"metadata format changed, update this test: {sorted(doc)}"
    )
    doc["files"].append("evil.data")
    doc["objects"]["cfg.lr"] = {"pickled": [len(doc["files"]) - 1, 0, len(blob), checksum(blob)]}
    (ckpt / "metadata.json").write_text(json.dumps(doc))

    with pytest.raises(dcp.CheckpointError, match="cfg.lr"):
        dcp.load({"w": torch.zeros(4, 4), "cfg": {"lr": 0.0}}, str(ckpt))
    assert not marker.exists(), "load without allow_pickle executed a crafted pickle"
    with pytest.raises(dcp.CheckpointError, match="cfg.lr"):
        dcp.load({"w": torch.zeros(4, 4), "cfg": {"lr": 0.0}}, str(ckpt), strict=False)
    assert not marker.exists(), "non-strict load without allow_pickle executed a crafted pickle"

    # The crafted metadata is otherwise valid: opting in reaches the pickle,
    # whose global the restricted unpickler refuses, so the refusal above is
    # the allow_pickle guard, not some other error; plain pickle runs it.
    with pytest.raises(dcp.CheckpointError, match=r"'cfg.lr'.*'pathlib\.Path\.touch'"):
        dcp.load({"w": torch.zeros(4, 4), "cfg": {"lr": 0.0}}, str(ckpt), allow_pickle=True)
    assert not marker.exists(), "load with allow_pickle executed a crafted pickle"
    pickle.loads(blob)
    assert marker.exists()


@pytest.mark.parametrize("bad_name", ["../outside.data", "/etc/passwd", "sub/../../x.data"])
def test_crafted_metadata_file_names_cannot_escape_the_checkpoint(tmp_path, bad_name):
    ckpt, sd = _valid_ckpt(tmp_path)
    doc = json.loads((ckpt / "metadata.json").read_bytes())
    assert doc.get("version") == 1 and isinstance(doc.get("files"), list), "metadata format changed"
    doc["files"] = [bad_name for _ in doc["files"]]
    (ckpt / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(dcp.CheckpointError):
        dcp.load({"w": torch.zeros(4, 4), "cfg": {"lr": 0.0}}, str(ckpt))


# ------------------------------------------------------------- fqn collisions
def test_two_paths_with_the_same_fqn_raise_instead_of_losing_data(tmp_path):
    """{"a.b": x, "a": {"b": y}} both flatten to "a.b": saving must not keep
    one silently."""
    ckpt = tmp_path / "ckpt"
    sd = {"a.b": randn((2,), seed=1), "a": {"b": randn((2,), seed=2)}}
    with pytest.raises(dcp.CheckpointError, match=r"a\.b"):
        dcp.save(sd, str(ckpt))
    assert not (ckpt / "metadata.json").exists()
