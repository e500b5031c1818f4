"""Load errors that say what is wrong: what a key holds, and which
checkpoint key is nearest to a missing one (single process)."""

from __future__ import annotations

import warnings

import pytest
import torch

import dcp
from helpers import assert_names


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"model.w": torch.ones(2, 3), "step": 3, "note": "x" * 100}, path)
    return path


def test_a_tensor_target_on_a_plain_value_says_what_the_key_holds(ckpt):
    for strict in (True, False):
        with pytest.raises(dcp.CheckpointError) as e:
            dcp.load({"step": torch.zeros(1)}, ckpt, strict=strict)
        assert_names(str(e.value), "'step'", "tensor", "an int value (3)")
        assert "not in the checkpoint" not in str(e.value)
    with pytest.raises(dcp.CheckpointError, match=r"'note'.*a str value \('xxx.*\.\.\.\)"):
        dcp.load({"note": torch.zeros(1)}, ckpt)


def test_a_plain_target_on_a_tensor_says_its_shape_and_dtype(ckpt):
    with pytest.raises(dcp.CheckpointError) as e:
        dcp.load({"model.w": 0}, ckpt, strict=False)
    assert_names(str(e.value), "'model.w'", "plain value", "[2, 3]", "float32")


def test_missing_keys_name_the_nearest_key_and_its_prefix(ckpt):
    with pytest.raises(dcp.CheckpointError, match=r"w; the checkpoint has 'model.w': its keys "
                                                  r"carry the prefix 'model.'"):
        dcp.load({"w": torch.zeros(2, 3)}, ckpt)
    with pytest.raises(dcp.CheckpointError, match=r"the target's keys carry the prefix 'module.'"):
        dcp.load({"module.model.w": torch.zeros(2, 3)}, ckpt)
    with pytest.raises(dcp.CheckpointError, match=r"nearest key in the checkpoint to 'stepp': "
                                                  r"'step'"):
        dcp.load({"stepp": 0}, ckpt)


def test_a_lenient_load_that_matched_nothing_warns(ckpt):
    target = {"module.model.w": torch.zeros(2, 3)}
    with pytest.warns(UserWarning, match=r"matched none of the target's 1 key.*nothing was "
                                         r"loaded.*prefix 'module.'"):
        report = dcp.load(target, ckpt, strict=False)
    assert report.missing_keys == ["module.model.w"] and report.bytes_read == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a load that matched something does not warn
        dcp.load({"model.w": torch.zeros(2, 3), "other": 1}, ckpt, strict=False)


def test_a_save_over_an_uncoordinated_checkpoint_needs_overwrite(tmp_path):
    """A checkpoint committed by coordination="none" (per-rank metadata
    files) is not replaced silently by a coordinated save; replaced with
    overwrite=True, its ranks' metadata files go with its data files."""
    path = str(tmp_path / "c")
    dcp.async_save({"w": torch.ones(4)}, path, coordination="none").result(120)
    for save in (lambda: dcp.save({"w": torch.full((4,), 2.0)}, path),
                 lambda: dcp.async_save({"w": torch.full((4,), 2.0)}, path).result(120)):
        with pytest.raises(dcp.CheckpointError, match=r"already holds a committed checkpoint "
                                                      r"\(metadata.rank00000.json\)"):
            save()
    target = {"w": torch.zeros(4)}
    dcp.load(target, path)
    assert torch.equal(target["w"], torch.ones(4))
    dcp.save({"w": torch.full((4,), 2.0)}, path, overwrite=True)
    assert not list((tmp_path / "c").glob("metadata.rank*.json"))
    dcp.load(target, path)
    assert torch.equal(target["w"], torch.full((4,), 2.0))
