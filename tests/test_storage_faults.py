"""Storage faults (issue #8.4), injected by the ``faulty://`` plugin
(storage_plugins/faulty.py) around the real POSIX and S3 plugins: transient
faults are retried (dcp.core.retry) and the save succeeds; persistent faults fail
the save on every rank with nothing committed and the previous checkpoint
intact, for dcp.save and dcp.async_save."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import dcp
import s3_server
from dcp.core.storage import open_storage
from dcp.orchestration.save import commit_metadata
from dcp.tools.verify import verify
from dist_harness import dist_scenario
from helpers import assert_bitwise_equal, random_tensor
from storage_plugins.faulty import FaultyStorage

TRANSIENT = {"rate": 1.0, "max_consecutive": 2}  # every write fails twice, then succeeds
PERSISTENT = {"rate": 1.0}


def _state(seed: int) -> dict:
    return {f"t{i}": random_tensor((64, 16), torch.float32, seed + i) for i in range(6)}


def _assert_holds(checkpoint_id: str, seed: int, options: dict) -> None:
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    dcp.load(target, checkpoint_id, storage_options=options)
    for k, v in _state(seed).items():
        assert_bitwise_equal(target[k], v, k)


def _location(kind: str, tmp_path) -> tuple[str, dict]:
    if kind == "posix":
        return str(tmp_path / "ckpt"), {"thread_count": 3}
    return s3_server.fresh_url("faults"), s3_server.options(s3_server.endpoint(), thread_count=3)


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_transient_faults_are_retried_and_the_save_succeeds(kind, tmp_path):
    url, options = _location(kind, tmp_path)
    for seed, faults in ((1, TRANSIENT), (2, {"rate": 0.5, "max_consecutive": 3, "seed": 7})):
        storage = open_storage(f"faulty://{url}", **faults, options=options)
        drawn = random.getstate()
        md = dcp.save(_state(seed), url, storage=storage, overwrite=True)
        # the retries' jitter leaves the job's random stream (saved by the manager) as it was
        assert random.getstate() == drawn
        expected = {"ENOSPC", "EIO"} if kind == "posix" else {"timeout", "503", "slowdown", "500"}
        assert set(storage.injected) <= expected, storage.injected
        if faults is TRANSIENT:  # (the other draws depend on the save's random id)
            assert sum(storage.injected.values()) == 2 * len(md.files()), storage.injected
        _assert_holds(url, seed, options)
        assert verify(url, storage_options=options).ok
        listed = sorted(open_storage(url, **options).list_files())
        assert listed == sorted(md.files() | {"metadata.json"})


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_persistent_faults_fail_cleanly_and_keep_the_previous_checkpoint(kind, tmp_path):
    url, options = _location(kind, tmp_path)
    dcp.save(_state(1), url, storage_options=options)
    plain = open_storage(url, **options)
    before = plain.list_files(), plain.read_file("metadata.json")
    storage = open_storage(f"faulty://{url}", **PERSISTENT, options=options)
    with pytest.raises(dcp.CheckpointError,
                       match=r"rank 0: writing '.*\.data' failed \(5 attempts\)"):
        dcp.save(_state(2), url, storage=storage, overwrite=True)
    assert (plain.list_files(), plain.read_file("metadata.json")) == before
    _assert_holds(url, 1, options)


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_transient_faults_on_the_commit_are_retried(kind, tmp_path):
    """The metadata's commit is retried as the data files' writes are (the
    soak's transient faults on commits): two faults, then it commits."""
    url, options = _location(kind, tmp_path)
    storage = open_storage(f"faulty://{url}", **TRANSIENT, methods=["commit_file"],
                           options=options)
    md = dcp.save(_state(3), url, storage=storage)
    assert sum(storage.injected.values()) == 2, storage.injected
    _assert_holds(url, 3, options)
    assert sorted(open_storage(url, **options).list_files()) == sorted(
        md.files() | {"metadata.json"})


class _LostAnswer(FaultyStorage):
    """Its first commit lands, then fails as if the answer were lost
    (a reset connection after the server stored the object)."""

    lost = False

    def commit_file(self, name: str, data: bytes, *, overwrite: bool) -> None:
        self.inner.commit_file(name, data, overwrite=overwrite)
        if not self.lost:
            self.lost = True
            raise ConnectionResetError(f"{name}: connection reset (injected)")


def test_a_commit_whose_answer_was_lost_is_not_reported_failed(tmp_path):
    """The retry finds the metadata committed with its own bytes: the save
    succeeded.  A retry that finds another save's metadata fails, naming it."""
    url = str(tmp_path / "ckpt")
    storage = _LostAnswer(f"faulty://{url}", rate=0.0)
    md = dcp.save(_state(4), url, storage=storage)
    assert storage.lost
    _assert_holds(url, 4, {})
    other = tmp_path / "other"
    open_storage(str(other)).commit_file("metadata.json", b"another save's", overwrite=False)
    flaky = open_storage(f"faulty://{other}", **TRANSIENT, methods=["commit_file"])
    with pytest.raises(dcp.CheckpointError, match="another save committed a checkpoint here"):
        commit_metadata(flaky, "metadata.json", md, overwrite=False)
    assert flaky.injected and (other / "metadata.json").read_bytes() == b"another save's"


def test_a_failed_save_into_a_new_folder_leaves_no_folder(tmp_path):
    """The save deletes what it wrote, then the folder it made; a folder
    that was there before stays."""
    url = str(tmp_path / "run" / "step-1")
    with pytest.raises(dcp.CheckpointError, match="failed"):
        dcp.save(_state(1), url, storage=open_storage(f"faulty://{url}", **PERSISTENT))
    assert not (tmp_path / "run" / "step-1").exists()
    (tmp_path / "made").mkdir()
    with pytest.raises(dcp.CheckpointError, match="failed"):
        dcp.save(_state(1), str(tmp_path / "made"),
                 storage=open_storage(f"faulty://{tmp_path / 'made'}", **PERSISTENT))
    assert (tmp_path / "made").is_dir() and not list((tmp_path / "made").iterdir())


def test_invalid_fault_options_are_refused(tmp_path):
    with pytest.raises(dcp.CheckpointError, match="invalid fault options"):
        open_storage(f"faulty://{tmp_path}", faults=["EPERM"])
    with pytest.raises(dcp.CheckpointError, match="invalid fault options"):
        open_storage(f"faulty://{tmp_path}", rate=2)


@dist_scenario(world_size=2, phase=0)
def test_faults_on_one_rank_sync_and_async_w2(ctx):
    """Rank 1's writes fault: transiently, the save (sync and async, the
    plugin named by URL alone) succeeds; persistently, it fails on both
    ranks naming rank 1, nothing is committed, the previous checkpoint
    loads."""
    def faulty(path, faults):
        return f"faulty://{path}", {**(faults if ctx.rank == 1 else {"rate": 0.0}),
                                    "options": {"thread_count": 3}}

    for mode in ("sync", "async"):
        path = ctx.dir / mode
        dcp.save(_state(10), str(path))
        for seed, faults in ((11, TRANSIENT), (12, PERSISTENT)):
            url, options = faulty(path, faults)
            try:
                if mode == "sync":
                    dcp.save(_state(seed), url, storage_options=options, overwrite=True)
                else:
                    dcp.async_save(_state(seed), url, storage_options=options,
                                   overwrite=True).result(120)
                outcome = None
            except dcp.CheckpointError as e:
                outcome = str(e)
            dist.barrier()
            if faults is TRANSIENT:
                assert outcome is None, outcome
                _assert_holds(str(path), seed, {})
            else:
                assert (outcome is not None and "rank 1" in outcome
                        and "5 attempts" in outcome), outcome
                _assert_holds(str(path), 11, {})
                listed = sorted(p.name for p in path.iterdir())
                assert listed == sorted(dcp.read_metadata(str(path)).files()
                                        | {"metadata.json"}), listed
            dist.barrier()
