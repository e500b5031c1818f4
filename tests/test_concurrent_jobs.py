"""Concurrent jobs (issue #8.5), on the POSIX and S3 plugins: two jobs saving
to one checkpoint id at once — both past the "already a checkpoint here"
check, both writing — commit exactly once; the other fails naming the race
and removes its files; the committed checkpoint loads bit-exact.  Loads of
the previous checkpoint while a save runs in the same root see it whole.
(The jobs are threads with storage instances of their own: the storage sees
two independent writers, as with two processes.)"""

from __future__ import annotations

import threading

import pytest
import torch

import dcp
import s3_server
from dcp.core.planner import SavePlanner, default_planner
from dcp.core.storage import open_storage
from dcp.tools.verify import verify
from helpers import assert_bitwise_equal, random_tensor


class MeetingPlanner(SavePlanner):
    """The default planner; both jobs' global planning (after the check for
    a committed checkpoint) waits for the other's, so both go on to write."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier, self.inner = barrier, default_planner("save")

    def create_global_plan(self, plans):
        self.barrier.wait(60)
        return self.inner.create_global_plan(plans)


def _state(seed: int) -> dict:
    return {"w": random_tensor((128, 64), torch.float32, seed),
            "b": random_tensor((33,), torch.int64, seed + 1), "step": seed}


def _load(checkpoint_id: str, options: dict) -> dict:
    target = {"w": torch.zeros(128, 64), "b": torch.zeros(33, dtype=torch.int64), "step": 0}
    dcp.load(target, checkpoint_id, storage_options=options)
    return target


def _assert_state(actual: dict, seed: int) -> None:
    expected = _state(seed)
    assert_bitwise_equal(actual["w"], expected["w"], "w")
    assert_bitwise_equal(actual["b"], expected["b"], "b")
    assert actual["step"] == seed


def _location(kind: str, tmp_path) -> tuple[str, dict]:
    if kind == "posix":
        return str(tmp_path / "root"), {}
    return s3_server.fresh_url("concurrent"), s3_server.options(s3_server.endpoint())


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_two_jobs_saving_to_one_checkpoint_id_commit_once(kind, tmp_path):
    root, options = _location(kind, tmp_path)
    url = f"{root}/step100"
    barrier = threading.Barrier(2)
    outcomes: dict[int, object] = {}

    def job(seed: int) -> None:
        try:
            outcomes[seed] = dcp.save(_state(seed), url, planner=MeetingPlanner(barrier),
                                      storage=open_storage(url, **options))
        except dcp.CheckpointError as e:
            outcomes[seed] = e

    threads = [threading.Thread(target=job, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = {s: o for s, o in outcomes.items() if isinstance(o, dcp.CheckpointError)}
    winners = {s: o for s, o in outcomes.items() if isinstance(o, dcp.Metadata)}
    assert len(errors) == 1 and len(winners) == 1, outcomes
    (error,), ((winner, md),) = errors.values(), winners.items()
    assert "another save committed a checkpoint here first" in str(error) and url in str(error)
    _assert_state(_load(url, options), winner)
    assert verify(url, storage_options=options).ok
    listed = sorted(open_storage(url, **options).list_files())
    assert listed == sorted(md.files() | {"metadata.json"})


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_loads_of_the_previous_checkpoint_during_a_save_in_the_same_root(kind, tmp_path):
    root, options = _location(kind, tmp_path)
    dcp.save(_state(1), f"{root}/step1", storage_options=options)
    saving = threading.Event()
    done = threading.Event()

    class SlowPlanner(SavePlanner):
        def __init__(self):
            self.inner = default_planner("save")

        def create_global_plan(self, plans):
            saving.set()
            return self.inner.create_global_plan(plans)

    def save():
        try:
            for seed in (2, 3, 4):
                dcp.save(_state(seed), f"{root}/step2", planner=SlowPlanner(), overwrite=True,
                         storage_options=options)
        finally:
            done.set()

    thread = threading.Thread(target=save)
    thread.start()
    assert saving.wait(60)
    loads = 0
    while not done.is_set() or loads < 3:
        _assert_state(_load(f"{root}/step1", options), 1)
        loads += 1
    thread.join(60)
    _assert_state(_load(f"{root}/step2", options), 4)
