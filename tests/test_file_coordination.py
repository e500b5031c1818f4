"""The file-flag protocol under concurrency: many simulated ranks on threads
(:class:`dcp.coordination.file_flag.FileCoordinator` over the POSIX plugin),
the one-answer format read by ranged reads, torn files, late ranks, a
coordinator gone between steps, a rank that never arrives, and saves that
load bit-exact at several world sizes (the second one through the plan
cache: only write results move)."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import dcp
from dcp.coordination import wire
from dcp.coordination.file_flag import (
    ENTRY_BYTES,
    EXCHANGE_PREFIX,
    FileCoordinator,
    answer_first_poll,
    pack_answer,
    poll_times,
    read_part,
)
from dcp.coordination.plan_cache import PlanCache
from dcp.core.planner import default_planner
from dcp.orchestration.save import _Save, describe_state
from helpers import RecordingKinds, assert_bitwise_equal, random_tensor
from storage_plugins.posix import PosixStorage


def polls_within(seconds: float, world: int) -> int:
    """How many polls for an answer a wait of ``seconds`` makes at most."""
    return sum(1 for _ in itertools.takewhile(lambda at: at < seconds,
                                              poll_times(answer_first_poll(world))))


def exchange_files(root) -> list[str]:
    return sorted(p.name for p in root.rglob(f"{EXCHANGE_PREFIX}*"))


def run_ranks(root, key, world, body, ranks=None, timeout=20.0, delay=None):
    """``body(coord)`` on a thread per rank of ``ranks`` (default all);
    ``delay(rank)`` seconds before a rank starts.  Returns (results or
    exceptions, coordinators) by rank."""
    results, coords = {}, {}

    def one(rank):
        if delay:
            time.sleep(delay(rank))
        coords[rank] = coord = FileCoordinator(PosixStorage(str(root)), key, rank, world, timeout)
        try:
            results[rank] = body(coord)
        except dcp.CheckpointError as e:
            results[rank] = e
        coord.close()

    threads = [threading.Thread(target=one, args=(r,))
               for r in (range(world) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank hangs"
    return results, coords


def two_steps(coord):
    mine = coord.gather_scatter("planning", lambda: coord.rank * 10,
                                lambda parts: [p + 1 for p in parts])
    total = coord.gather_broadcast("commit", lambda: mine, sum)
    return mine, total


def test_64_ranks_one_answer_per_step_and_o1_requests_per_rank(tmp_path):
    world = 64
    results, coords = run_ranks(tmp_path, "ok", world, two_steps)
    expected_total = sum(r * 10 + 1 for r in range(world))
    assert results == {r: (r * 10 + 1, expected_total) for r in range(world)}
    assert not exchange_files(tmp_path)
    for rank in range(1, world):
        req = coords[rank].requests
        # per step: one write, entry + part reads, one delete; polls back off
        assert (req["write"], req["read"], req["delete"]) == (2, 4, 2), (rank, req)
        # polls that miss: within the schedule's bound for a wait of the timeout
        assert req["miss"] <= 2 * polls_within(2 * 20.0, world), (rank, req)
    coordinator = coords[0].requests
    assert coordinator["read"] == 2 * (world - 1) and coordinator["write"] == 2, coordinator


def test_answer_file_is_read_by_ranged_reads_and_damage_is_never_decoded(tmp_path):
    storage = PosixStorage(str(tmp_path))
    parts = [b"", *(wire.encode(("p", r)) for r in range(1, 5))]
    storage.commit_file("a", pack_answer(parts, False, 5), overwrite=True)
    requests: Counter = Counter()
    assert wire.decode(read_part(storage, "a", 3, 5, requests), "a") == ("p", 3)
    assert requests["read"] == 2
    assert read_part(storage, "missing", 3, 5) is None
    assert read_part(storage, "a", 3, 6) is None  # another world size
    data = (tmp_path / "a").read_bytes()
    for at in (3 * ENTRY_BYTES + 9, len(data) - 1):  # an entry's offset; a part's last byte
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        (tmp_path / "a").write_bytes(bytes(damaged))
        assert read_part(storage, "a", 4 if at > ENTRY_BYTES * 5 else 3, 5) is None
    shared = pack_answer([wire.encode("all")], True, 5)
    storage.commit_file("s", shared, overwrite=True)
    assert all(wire.decode(read_part(storage, "s", r, 5), "s") == "all" for r in range(1, 5))


def test_torn_input_is_never_taken_and_its_rank_is_named(tmp_path):
    world, torn_rank = 8, 5
    key = "torn"
    torn = tmp_path / f"{EXCHANGE_PREFIX}{key}.000.in.r{torn_rank:05d}"
    complete = PosixStorage(str(tmp_path))
    complete.write_exchange(torn.name, wire.encode((1, None)))
    torn.write_bytes(torn.read_bytes()[:-3])  # the trailer cut short
    results, _ = run_ranks(tmp_path, key, world, two_steps,
                           ranks=[r for r in range(world) if r != torn_rank], timeout=1.0)
    for rank, result in results.items():
        assert isinstance(result, dcp.CheckpointError), (rank, result)
        assert f"rank {torn_rank} never arrived" in str(result), str(result)


def test_late_ranks_still_meet(tmp_path):
    world = 24
    results, _ = run_ranks(tmp_path, "late", world, two_steps,
                           delay=lambda r: 0.4 if r % 5 == 0 else 0.0)
    assert all(not isinstance(v, Exception) for v in results.values()), results
    assert not exchange_files(tmp_path)


def test_a_rank_that_never_arrives_is_named_on_every_rank(tmp_path):
    world = 16
    results, _ = run_ranks(tmp_path, "missing", world, two_steps,
                           ranks=[r for r in range(world) if r != 11], timeout=1.0)
    assert len(results) == world - 1
    for result in results.values():
        assert isinstance(result, dcp.CheckpointError) and "rank 11 never arrived" in str(result)


def test_coordinator_gone_between_steps_fails_every_rank_in_time(tmp_path):
    world = 12

    def body(coord):
        coord.gather_scatter("planning", lambda: coord.rank, lambda parts: parts)
        if coord.is_coordinator:
            return "killed"  # the coordinator stops here: no second answer
        return coord.gather_broadcast("commit", lambda: 1, sum)

    start = time.monotonic()
    results, _ = run_ranks(tmp_path, "gone", world, body, timeout=0.5)
    assert time.monotonic() - start < 30
    assert results[0] == "killed"
    for rank in range(1, world):
        assert isinstance(results[rank], dcp.CheckpointError)
        assert "no answer from the coordinator (rank 0)" in str(results[rank])


def test_at_a_timeout_every_missing_rank_is_asked_before_any_is_blamed(tmp_path):
    """Ranks 1..398 never arrive; rank 399 reports a failure, which the
    bounded sweeps of the wait never reach (they stop after 4 x 64 misses):
    the last sweep reads it, so it is reported as what it is, not as "never
    arrived"."""
    world = 400

    def body(coord):
        def local():
            if coord.rank == 399:
                raise OSError("disk on fire")
            return coord.rank
        return coord.run_all("writing", local)

    results, _ = run_ranks(tmp_path, "blame", world, body, ranks=[0, 399], timeout=1.0)
    for result in results.values():
        assert isinstance(result, dcp.CheckpointError), result
        text = str(result)
        assert "rank 399: " in text and "disk on fire" in text, text[-300:]
        assert "rank 399 never arrived" not in text and "rank 398 never arrived" in text


def test_failure_on_one_rank_reaches_all_by_the_shared_answer(tmp_path):
    world = 20

    def body(coord):
        def local():
            if coord.rank == 13:
                raise OSError("disk on fire")
            return coord.rank
        return coord.run_all("writing", local)

    results, _ = run_ranks(tmp_path, "fail", world, body)
    for result in results.values():
        assert isinstance(result, dcp.CheckpointError)
        assert "writing failed on rank 13" in str(result) and "disk on fire" in str(result)
    assert not exchange_files(tmp_path)


class _Recording(RecordingKinds, FileCoordinator):
    """FileCoordinator keeping the kinds of the write results it gathered."""


@pytest.mark.parametrize("world", [3, 8, 17])
def test_saves_load_bit_exact_and_a_cached_save_moves_only_results(tmp_path, world):
    rows, cols = 4 * world + 3, 6
    full = random_tensor((rows, cols), torch.float32, seed=world)
    bias = random_tensor((5,), torch.bfloat16, seed=world + 1)
    step = -(-rows // world)
    boxes = [(min(r * step, rows), max(0, min(step, rows - r * step))) for r in range(world)]
    caches = [PlanCache() for _ in range(world)]
    files_written: list[Counter] = [Counter() for _ in range(world)]
    gathered: list[set[str]] = []  # the kinds of write results the coordinator got

    def save(ckpt, scale: float):
        key = uuid.uuid4().hex[:16]

        def rank(r):
            offset, length = boxes[r]
            state = {"w": dcp.TensorShard(full[offset:offset + length] * scale, (rows, cols),
                                          (offset, 0)), "bias": bias * scale, "step": world}
            storage = PosixStorage(ckpt, thread_count=1)
            coord = _Recording(storage, key, r, world, timeout=60.0)
            coord.kinds = gathered
            job = _Save(lambda: describe_state(state, False, r, world), storage,
                        default_planner("save"), coord, True)
            done = caches[r].save(job)
            coord.close()
            files_written[r] = coord.requests
            return done

        with ThreadPoolExecutor(world) as pool:
            return list(pool.map(rank, range(world)))

    ckpt = str(tmp_path / "ckpt")
    first = save(ckpt, 1.0)
    assert all(d.exchanged for d in first)
    gathered.clear()
    second = save(ckpt, 2.0)  # same structure: the plan cache hits on every rank
    assert not any(d.exchanged for d in second)
    # results relative to the cached plans: no chunk's box travels
    assert gathered == [{"CachedWriteResult"}], gathered
    assert all(req["write"] == 1 for req in files_written[1:]), files_written  # one step
    assert not exchange_files(tmp_path)

    for scale in (2.0,):
        target = {"w": torch.zeros(rows, cols), "bias": torch.zeros(5, dtype=torch.bfloat16),
                  "step": 0}
        dcp.load(target, ckpt)
        assert_bitwise_equal(target["w"], full * scale, f"w at world size {world}")
        assert_bitwise_equal(target["bias"], bias * scale, "bias")
        assert target["step"] == world


def test_a_sweep_asks_in_vain_a_bounded_number_of_times(tmp_path):
    coord = FileCoordinator(PosixStorage(str(tmp_path)), "s", 0, 4000, 1.0, read_threads=4)
    names = [f"n{i}" for i in range(4000)]
    asked: list[str] = []
    lock = threading.Lock()

    def ask(present):
        def one(name):
            with lock:
                asked.append(name)
            return 1 if present(name) else None
        return one

    with ThreadPoolExecutor(4) as pool:
        # every input there: all asked once, yielded in order
        got = list(coord._sweep(pool, ask(lambda n: True), names))
        assert [i for i, _ in got] == list(range(4000)) and sorted(asked) == sorted(names)
        # none there: the sweep stops after 16 misses and what was in flight (8 tasks of 32)
        asked.clear()
        got = list(coord._sweep(pool, ask(lambda n: False), names))
        assert 16 <= len(got) == len(asked) <= 16 + 8 * 32, len(asked)
        # the first half there: read on until the misses add up
        asked.clear()
        got = list(coord._sweep(pool, ask(lambda n: int(n[1:]) < 2000), names))
        assert 2016 <= len(got) <= 2000 + 16 + 8 * 32 and [i for i, _ in got][:2000] == list(
            range(2000))
