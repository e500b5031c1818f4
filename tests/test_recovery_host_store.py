"""One host's memory steps without processes: a step counts only once
committed (a save killed before ``COMMITTED`` leaves the previous step the
newest: row 5 of the matrix by construction), a step failing twice is
marked bad, damaged held lists count as holding nothing, and a host without
the memory refuses a step instead of crashing."""

from __future__ import annotations

import json
import re
import resource
import signal

import pytest

from dcp.core.metadata import Metadata
from dcp.errors import CorruptCheckpointError, MemoryTierError
from dcp.recovery.host_store import HostStore


def test_only_committed_steps_count(tmp_path) -> None:
    store = HostStore(tmp_path, "run", "h0")
    for step in (3, 4):
        store.begin(step)
        store.write_metadata(step, Metadata(save_id=f"s{step}", world_size=1))
        staged = store.stage(step, "r00000.data", 16)
        staged.view[:] = bytes(range(16))
        staged.close()
        store.write_held(step, 0, {"files": [["r00000.data", [0], [0]]]})
    store.commit(3)  # step 4 was killed before its commit
    assert store.steps() == [3] and store.steps(committed=False) == [3, 4]
    assert store.held(3) == {0: ("r00000.data", 0)}
    view = store.mapped(3, "r00000.data")
    assert view is not None and bytes(view[8:40]) == bytes(range(8, 16))  # short: the file ends
    view[0] = 99  # private pages: the host's bytes stay
    assert bytes(store.mapped(3, "r00000.data")) == bytes(range(16))
    assert store.mapped(3, "r00009.data") is None
    (store.step_dir(3) / "held.r00001.json").write_text("{not json")
    (store.step_dir(3) / "held.r00002.json").write_text(json.dumps(
        {"files": [["../escape.data", [1], [0]]]}))
    assert store.held(3) == {0: ("r00000.data", 0)}  # damaged lists hold nothing
    assert store.record_failure(3, "copies damaged") == 1 and store.steps() == [3]
    assert store.record_failure(3, "copies damaged") == 2 and store.steps() == []
    store.begin(4)  # a new save of a step clears its old marks
    store.drop_except({4})
    assert store.steps(committed=False) == [4]


def test_a_host_without_the_memory_refuses_the_step(tmp_path) -> None:
    store = HostStore(tmp_path, "run", "h0")
    store.begin(1)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(MemoryTierError) as info:
            store.stage(1, "r00000.data", 64 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert "cannot reserve 67108864 bytes" in str(info.value) and "h0" in str(info.value)
    assert not (store.step_dir(1) / "r00000.data").exists()
    staged = store.stage(1, "r00000.data", 1 << 20)  # reserved whole, not a sparse file
    assert (store.step_dir(1) / "r00000.data").stat().st_blocks * 512 >= 1 << 20
    staged.close()


def test_a_new_save_of_a_step_leaves_nothing_of_an_earlier_one_counting(tmp_path) -> None:
    """Step 5 half-written by a killed 4-rank save (held lists of ranks 0-3,
    metadata, a failure record), then begun again by a 2-rank job: only what
    the new save writes is held; the old lists and metadata are gone."""
    store = HostStore(tmp_path, "run", "h0")
    store.begin(5)
    for rank in range(4):
        staged = store.stage(5, f"r{rank:05d}.data", 8)
        staged.view[:] = bytes([rank]) * 8
        staged.close()
        store.write_held(5, rank, {"files": [[f"r{rank:05d}.data", [rank], [0]]]})
    store.write_metadata(5, Metadata(save_id="old", world_size=4))
    store.commit(5)
    assert store.record_failure(5, "copies damaged") == 1
    assert store.held(5) == {r: (f"r{r:05d}.data", 0) for r in range(4)}
    store.begin(5)  # the 2-rank job's save of step 5
    assert store.steps() == [] and store.held(5) == {}
    with pytest.raises(CorruptCheckpointError, match="no metadata.json"):
        store.metadata(5)
    staged = store.stage(5, "r00000.data", 8)
    staged.view[:] = b"newbytes"
    staged.close()
    store.write_held(5, 0, {"files": [["r00000.data", [0], [0]]]})
    store.write_metadata(5, Metadata(save_id="new", world_size=2))
    store.commit(5)
    assert store.steps() == [5] and store.held(5) == {0: ("r00000.data", 0)}
    assert store.metadata(5).save_id == "new"
    assert store.record_failure(5, "copies damaged") == 1  # the old failure was cleared
    assert bytes(store.mapped(5, "r00000.data")) == b"newbytes"


@pytest.mark.parametrize("option, value, said", [
    ("interval", 0, "an integer >= 1"),
    ("replicas", 1.5, "an integer >= 0"),
    ("timeout", 0, "seconds, > 0"),
    ("restore_timeout", "10", "seconds, > 0"),
    ("bandwidth", "1GB", "bytes per second, > 0, or None"),
    ("bandwidth", True, "bytes per second"),
    ("host_bytes", -1, "bytes, > 0, or None"),
    ("host", "", "a non-empty string"),
    ("host", 3, "a non-empty string"),
    ("run_id", "", "a non-empty string"),
    ("namespace", "", "a folder's path"),
    ("domains", ["a"], "a mapping of host name to failure domain name"),
    ("domains", {"h0": 1}, "a mapping of host name to failure domain name"),
    ("on_corruption", 5, "a callable"),
])
def test_a_memory_tier_refuses_bad_values_naming_the_option(option, value, said) -> None:
    import dcp

    with pytest.raises(dcp.CheckpointError,
                       match=re.escape(f"MemoryTier({option}={value!r}): {said}")):
        dcp.MemoryTier(**{option: value})


def test_a_manager_refuses_a_memory_tier_that_is_not_one(tmp_path) -> None:
    import dcp

    with pytest.raises(dcp.CheckpointError, match=r"memory='yes': a dcp.MemoryTier \(or None\), "
                                                  r"not a str"):
        dcp.CheckpointManager(str(tmp_path), memory="yes")  # type: ignore[arg-type]


def _held_bytes(folder) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def test_a_dropped_steps_own_files_are_the_next_steps_spares(tmp_path) -> None:
    """Host h0 with ranks 0 and 1, 1 MiB each: once step 1 is dropped, its
    own data files wait as spares, cut so that the host stays within 2.0x
    its own bytes; step 3's own files are those spares (pages reused) and
    hold exactly step 3's bytes.  Copies for other hosts as large as the own
    bytes leave no room for spares; ``spares=False`` keeps none."""
    own = 1 << 20

    def save(store: HostStore, step: int, copies: int = 0) -> list[bool]:
        store.begin(step)
        reused = []
        for r in (0, 1):
            staged = store.stage(step, f"r{r:05d}.data", own)
            staged.view[:] = bytes([step, r]) * (own // 2)
            reused.append(staged.reused)
            staged.close()
        if copies:
            staged = store.stage(step, "r00001-copies.data", copies)
            staged.view[:] = bytes(copies)
            staged.close()
        store.write_metadata(step, Metadata(save_id=f"s{step}", world_size=2))
        store.commit(step)
        store.drop_except({step})
        return reused

    store = HostStore(tmp_path, "run", "h0")
    assert save(store, 1) == [False, False] and save(store, 2) == [False, False]
    spares = sorted(p.name for p in (store.root / "spare").iterdir())
    assert spares == ["r00000.data", "r00001.data"]
    small = _held_bytes(store.step_dir(2)) - 2 * own  # metadata, COMMITTED
    assert all(own - small - 4096 <= (store.root / "spare" / n).stat().st_size <= own - small
               for n in spares)
    assert _held_bytes(store.root) <= 2 * 2 * own
    assert save(store, 3) == [True, True]
    for r in (0, 1):
        data = (store.step_dir(3) / f"r{r:05d}.data").read_bytes()
        assert data == bytes([3, r]) * (own // 2)
    assert store.steps() == [3] and _held_bytes(store.root) <= 2 * 2 * own

    copying = HostStore(tmp_path, "copying", "h0")
    for step in (1, 2, 3):
        assert save(copying, step, copies=own) == [False, False]
    assert not (copying.root / "spare").exists() or not list((copying.root / "spare").iterdir())

    capped = HostStore(tmp_path, "capped", "h0", spares=False)
    for step in (1, 2, 3):
        assert save(capped, step) == [False, False]
    assert not (capped.root / "spare").exists()
