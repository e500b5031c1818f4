"""The memory tier's failure matrix (docs/recovery.md), on real gloo ranks.

Hosts are simulated on one machine: a host is a group of ranks with its own
shared-memory folder (``MemoryTier(host=..., namespace=...)``).  Losing a
host means killing all its processes and deleting its folder; a replacement
host is new processes with an empty folder.  Every job is separate
processes (tests/recovery_job.py), so ranks can be killed with SIGKILL; a
restored state is compared element-exact with what an uninterrupted run
holds at that step (every value is a pure function of the fqn and step).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dcp
from dcp.recovery.host_store import chunk_table
from dist_harness import dist_scenario

HERE = Path(__file__).resolve().parent
# bytes of one rank's chunks in the 4-rank layout of recovery_job.py
REP, TP_BLOCK, DP_BLOCK = 512 * 1024, 256 * 1024, 256 * 1024


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(tmp: Path, name: str, hosts: list[str], *args: str, kill: bool = False,
        timeout: float = 240) -> list[list[dict]]:
    """Run one job of ``len(hosts)`` ranks; returns each rank's records.
    With ``kill``, once any rank died the others are killed (as torchrun
    tears a job down)."""
    port, out = _port(), tmp / name
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "recovery_job.py"), str(r), str(len(hosts)), str(port),
         str(tmp / "root"), str(tmp / "shm"), str(out), "--hosts", ",".join(hosts), *args],
        env=env) for r in range(len(hosts))]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"job {name} did not finish in {timeout} s")
            if kill and any(p.poll() is not None for p in procs):
                time.sleep(0.5)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if not kill:
        assert [p.returncode for p in procs] == [0] * len(procs), f"job {name} failed"
    records = []
    for r in range(len(hosts)):
        path = Path(f"{out}.{r}")
        records.append([json.loads(line) for line in path.read_text().splitlines()]
                       if path.exists() else [])
    return records


def event(records: list[dict], name: str) -> dict:
    found = [r for r in records if r["event"] == name]
    assert found, f"no {name!r} record in {records}"
    return found[-1]


def wipe(tmp: Path, host: str) -> None:
    shutil.rmtree(tmp / "shm" / host, ignore_errors=True)


@pytest.fixture
def tmp(tmp_path):
    yield tmp_path
    shutil.rmtree(tmp_path / "shm", ignore_errors=True)


def _held_at(step_dir: Path, fqn: str, offsets: list[int]) -> tuple[Path, int, int]:
    """Where a host's copy of chunk ``(fqn, offsets)`` lies: its copies
    file, byte offset and size (from the step's metadata and held lists)."""
    md = dcp.read_metadata(str(step_dir))
    names, nbytes, _, boxes = chunk_table(md)
    cid = next(i for i, (n, b) in enumerate(zip(names, boxes, strict=True))
               if n == fqn and b and list(b[0]) == offsets)
    for held in step_dir.glob("held.r*.json"):
        for file, ids, offs in json.loads(held.read_text())["files"]:
            if file.endswith("-copies.data") and cid in ids:
                return step_dir / file, offs[ids.index(cid)], int(nbytes[cid])
    raise AssertionError(f"no copy of {fqn} {offsets} in {step_dir}")


@pytest.mark.timeout(1200)  # four jobs of 2-4 ranks: about a minute on an idle 2-core machine
def test_failure_matrix(tmp: Path) -> None:
    """Rows 1 with 5, 2 with 8, 4 with 6, 9, 10, 11 and 12 of the matrix, the
    host memory bound, a refused memory save and a step that fails to
    restore twice, in four jobs: 4 ranks on hosts h0, h1 (then 2)."""
    two = ["h0", "h0", "h1", "h1"]
    # job 1: steps 1..6, persistent step 4; row 5: rank 1 SIGKILLed as memory
    # step 6 sends its copies (h0's copies of step 5 released already)
    rec = job(tmp, "j1", two, "--steps", "1", "6", "--kill-in-replication", "6", kill=True)
    assert event(rec[1], "killing")["memory"] == [5]
    assert (tmp / "shm" / "h1" / "job" / "step-6").is_dir()  # half-written, not committed

    # rows 1 and 5: a rank killed, host memory intact: the previous committed
    # step (5, never a mix with 6), every byte from the own host.
    # row 12: a bit flipped on rank 1 before step 6's save, raised (named) by
    # the next save call, step 7's; step 6 is never kept, 8 and 9 are.
    # memory bound: h0's namespace sampled while steps 6..9 are saved
    rec = job(tmp, "j2", two, "--resume", "--steps", "6", "9", "--flip-at", "6",
              "--sample-memory")
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 5 and res["bad"] == [], (r, res)
        assert res["source"]["peer"] == 0 and res["source"]["persistent"] == 0, res
        assert res["source"]["own"] >= REP + TP_BLOCK + DP_BLOCK, res
        sdc = event(ranks, "sdc")
        assert sdc["step"] == 7, sdc
        assert "'model.rep'" in sdc["error"] and "rank 1 is the odd one out" in sdc["error"]
        assert sdc["mismatches"] == [["model.rep", [0, 0], [0, 1, 2, 3], 1]], sdc
        done = event(ranks, "trained")
        assert done["memory"] == [9] and done["persistent"] == [4, 8], done
        assert done["errors"] == [], done
    # h0 holds rep once, its ranks' tp and dp blocks (unique: 1.5 MiB) and
    # copies of h1's tp blocks (0.5 MiB); small files (metadata, held lists,
    # the manager's records) are a few pages; the ranks' spares (the dropped
    # steps' own files, for the next staging copies) fill the room to 2.0x
    unique, copies, small = REP + 2 * TP_BLOCK + 2 * DP_BLOCK, 2 * TP_BLOCK, 64 << 10
    mem = event(rec[0], "memory")
    assert unique + copies + (1 << 18) <= mem["steady"] <= 2.0 * unique, mem
    # during a save: the old step's own bytes, the new step's and one set of
    # copies (the old step's released before the new ones are reserved)
    assert 2 * unique + copies <= mem["peak"] <= 2 * unique + copies + 2 * small, mem
    assert mem["peak"] <= 3.0 * unique, mem

    # row 2 with row 8: host h1 lost, replaced by an empty one, and ranks 1
    # and 2 trade hosts; all from memory.  Steps 10..12 (12 persisted).
    wipe(tmp, "h1")
    moved = ["h0", "h1", "h0", "h1"]
    rec = job(tmp, "j3", moved, "--resume", "--steps", "10", "12")
    total = {"own": 0, "peer": 0, "persistent": 0}
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 9 and res["bad"] == [], (r, res)
        for k in total:
            total[k] += res["source"][k]
        if moved[r] == "h1":
            assert res["source"]["own"] == 0 and res["source"]["peer"] > 0, (r, res)
        assert event(ranks, "trained")["persistent"] == [4, 8, 12]
    assert total["persistent"] == 0, total
    assert total["own"] + total["peer"] >= 4 * (REP + TP_BLOCK + DP_BLOCK), total

    # row 9: back on 2 ranks, one per host, resharded from memory step 12.
    # row 4: every copy of tp rows 768..1024 is lost (rank 3's own file on
    # h1 deleted, every copies file on h0 truncated): that chunk, and only
    # it, from the persistent tier.  row 6: h1's copy of rows 512..768
    # flipped, h0's copies truncated: each goes to its next source.
    step = tmp / "shm" / "h1" / "job" / "step-12"
    os.remove(step / "r00003.data")
    path, offset, _ = _held_at(step, "model.tp", [512, 0])
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        b = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([b[0] ^ 0x10]))
    for f in (tmp / "shm" / "h0" / "job" / "step-12").glob("*-copies.data"):
        os.truncate(f, 1)
    # row 11: then a persistent step (13) newer than every memory step wins;
    # row 10: SIGTERM on rank 0 persists step 14 on every rank at once; and
    # a memory save over MemoryTier(host_bytes=...) is refused
    rec = job(tmp, "j4", ["h0", "h1"], "--resume", "--extra", "newer-persistent")
    lost = 0
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 12 and res["bad"] == [], (r, res)
        lost += res["source"]["persistent"]
        assert res["source"]["refetched"] >= 1, (r, res)
        newer = event(ranks, "newer-persistent")
        assert newer == {"event": "newer-persistent", "step": 13, "bad": [],
                         "from_memory": False}, newer
        term = event(ranks, "sigterm")
        assert term["saved"] and term["preempted"] and term["step"] == 14, term
        assert term["bad"] == [] and term["persistent"][-1] == 14, term
        refused = event(ranks, "refused")
        assert refused["memory"] == [] and any(
            "host_bytes=4096" in e for e in refused["errors"]), refused
        # a memory step that fails to restore twice is marked bad; each time
        # the next older step (persistent 14) is loaded, whole
        unrestorable = event(ranks, "unrestorable")
        assert unrestorable["saved"] == [15], unrestorable
        first, second = unrestorable["loads"]
        for load in (first, second):
            assert load["step"] == 14 and load["bad"] == [] and load["warned"], load
            assert not load["from_memory"], load
        assert first["failures"] == 1 and first["memory"] == [15], first
        assert second["failures"] == 2 and second["memory"] == [], second
    assert lost == TP_BLOCK, lost


@dist_scenario(world_size=2)
def test_more_replicas_than_other_hosts_is_warned_and_the_step_restores(ctx):
    """Two ranks on one simulated host with ``replicas=1``, then on two hosts
    with ``replicas=2``: each manager warns on every rank how many copies a
    chunk gets (none, then one) and where a lost host's chunks come from; the
    memory step restores exactly all the same."""
    import torch

    for hosts, replicas, copies in ((["h0", "h0"], 1, "0 copies"), (["h0", "h1"], 2, "1 copy")):
        host = hosts[ctx.rank]
        tier = dcp.MemoryTier(host=host, namespace=str(ctx.dir / f"shm-{replicas}" / host),
                              run_id="job", replicas=replicas, timeout=60)
        with pytest.warns(dcp.CheckpointWarning) as caught:
            mgr = dcp.CheckpointManager(str(ctx.dir / f"root-{replicas}"), interval=100,
                                        save_rng=False, memory=tier)
        (message,) = [str(w.message) for w in caught]
        assert f"MemoryTier(replicas={replicas})" in message and copies in message, message
        assert f"spans {len(set(hosts))} host" in message, message
        mine = torch.arange(8, dtype=torch.float32) + 10 * ctx.rank + replicas
        assert mgr.save(1, {"w": dcp.TensorShard(mine.clone(), (16,), (8 * ctx.rank,))})
        mgr.wait()
        target = {"w": dcp.TensorShard(torch.zeros(8), (16,), (8 * ctx.rank,))}
        assert mgr.load_latest(target) == 1
        assert mgr.last_restore is not None and mgr.last_restore.bytes_persistent == 0
        assert torch.equal(target["w"].data, mine), (target, mine)
        mgr.close()


@dist_scenario(world_size=2)
def test_the_next_memory_saves_commit_while_the_previous_step_persists(ctx):
    """Hosts h0 and h1, one rank each.  Step 2 is persisted to a root whose
    every file write first waits 1 s (``faulty://``: a timeout fault, then
    the retry goes through; the data files, then the records file: at least
    2 s in a row); memory step 3 is saved and commits while that
    persist still runs, step 2 staying pinned in host memory beside it; step
    4 too, step 3 giving way (dropped: two steps on a host); ``wait`` waits
    for the persist.  Then memory step 4 and persistent step 2 load
    element-exact."""
    import torch

    host = f"h{ctx.rank}"
    tier = dcp.MemoryTier(host=host, namespace=str(ctx.dir / "shm" / host), run_id="job",
                          timeout=60)
    root = ctx.dir / "root"
    slow = {"faults": ["timeout"], "rate": 1.0, "max_consecutive": 1, "delay_s": 1.0}
    mgr = dcp.CheckpointManager(f"faulty://{root}", save_policy=dcp.SpecificSteps([2]),
                                async_save=False, save_rng=False, memory=tier,
                                storage_options=slow)

    def values(step: int):
        return torch.arange(8, dtype=torch.float32) + 10 * ctx.rank + step

    def state(step: int) -> dict:
        return {"w": dcp.TensorShard(values(step), (16,), (8 * ctx.rank,))}

    assert mgr.save(1, state(1)) and mgr.save(2, state(2))
    persisting = mgr.last_memory_save
    assert persisting is not None and persisting.step == 2 and persisting.persist
    assert mgr.save(3, state(3))
    third = mgr.last_memory_save
    assert third is not None and third.step == 3
    assert third.committed.wait(30) and third.error is None, third.error
    # step 3 committed, step 2's persist (2 s of writes at least) still running
    assert not persisting.done.is_set() and persisting.committed.is_set()
    assert mgr.memory_steps() == [2, 3], mgr.memory_steps()  # 2 pinned
    assert 2 not in mgr.persistent_steps()
    # step 4 while 2 still persists: step 3 gives way (the host holds two steps)
    assert mgr.save(4, state(4))
    fourth = mgr.last_memory_save
    assert fourth is not None and fourth.committed.wait(30) and fourth.error is None
    assert not persisting.done.is_set()
    assert mgr.memory_steps() == [2, 4], mgr.memory_steps()
    assert not (Path(tier.namespace) / "job" / "step-3").exists()
    mgr.wait()
    assert persisting.done.is_set() and persisting.persist_error is None, persisting
    assert mgr.errors == [], mgr.errors
    assert mgr.persistent_steps() == [2] and mgr.memory_steps() == [4]
    target = {"w": dcp.TensorShard(torch.zeros(8), (16,), (8 * ctx.rank,))}
    assert mgr.load_latest(target) == 4
    assert mgr.last_restore is not None and mgr.last_restore.bytes_persistent == 0
    assert torch.equal(target["w"].data, values(4)), target
    persisted = {"w": dcp.TensorShard(torch.zeros(8), (16,), (8 * ctx.rank,))}
    dcp.load(persisted, str(root / "step-2"))
    assert torch.equal(persisted["w"].data, values(2)), persisted
    mgr.close()


@dist_scenario(world_size=2)
def test_a_memory_steps_copies_keep_to_the_tiers_bandwidth(ctx):
    """Hosts h0 and h1, one rank each, each rank's 2 MiB chunk held on its
    host only (so copied to the other): with ``MemoryTier(bandwidth=4 MiB/s)``
    the copies go in pieces of 256 KiB, the last one no sooner than 1.75 MiB
    / 4 MiB/s = 0.44 s after the first, and the step restores exact from the
    other host's copy.  A bandwidth that differs across ranks is refused on
    every rank, naming each rank's; so is a namespace one host cannot write,
    naming the rank, host and folder."""
    import torch
    import torch.distributed as dist

    host = f"h{ctx.rank}"
    rate = 4 << 20
    tier = dcp.MemoryTier(host=host, namespace=str(ctx.dir / "shm" / host), run_id="job",
                          timeout=60, bandwidth=rate)
    mgr = dcp.CheckpointManager(str(ctx.dir / "root"), interval=100, save_rng=False,
                                memory=tier)
    mine = torch.arange(1 << 19, dtype=torch.float32) + ctx.rank  # 2 MiB
    assert mgr.save(1, {"w": dcp.TensorShard(mine.clone(), (1 << 20,), ((1 << 19) * ctx.rank,))})
    mgr.wait()
    ms = mgr.last_memory_save
    assert ms is not None and ms.error is None, ms.error
    assert ms.seconds - ms.stall_s >= 7 * (256 << 10) / rate, (ms.seconds, ms.stall_s)
    mgr.close()
    # h1 lost: rank 1's chunk from h0's copy
    if ctx.rank == 1:
        shutil.rmtree(ctx.dir / "shm" / host)
    dist.barrier()
    mgr = dcp.CheckpointManager(str(ctx.dir / "root"), interval=100, save_rng=False,
                                memory=tier)
    target = {"w": dcp.TensorShard(torch.zeros(1 << 19), (1 << 20,), ((1 << 19) * ctx.rank,))}
    assert mgr.load_latest(target) == 1
    r = mgr.last_restore
    assert r is not None and r.bytes_persistent == 0, r
    # the chunk and the manager's small per-rank record
    got, none = (r.bytes_other_hosts, r.bytes_own_host) if ctx.rank else (
        r.bytes_own_host, r.bytes_other_hosts)
    assert none == 0 and 2 << 20 <= got <= (2 << 20) + 4096, r
    assert torch.equal(target["w"].data, mine)
    mgr.close()
    with pytest.raises(dcp.CheckpointError, match=r"bandwidth=...\) differs across ranks "
                       r"\(rank 0: 1000000.0, rank 1: None\)"):
        dcp.CheckpointManager(str(ctx.dir / "root2"), save_rng=False, memory=dcp.MemoryTier(
            host=host, namespace=str(ctx.dir / "shm2" / host), run_id="job",
            bandwidth=1e6 if ctx.rank == 0 else None))
    # a namespace one host cannot write is refused when the manager starts, on every rank
    (ctx.dir / "file").write_text("not a folder")
    spaces = {0: ctx.dir / "shm3" / host, 1: ctx.dir / "file" / "shm"}
    with pytest.raises(dcp.MemoryTierError, match=r"namespace cannot be written on rank 1 "
                       r"\(host h1\): .*file/shm/job: Not a directory"):
        dcp.CheckpointManager(str(ctx.dir / "root3"), save_rng=False, memory=dcp.MemoryTier(
            host=host, namespace=str(spaces[ctx.rank]), run_id="job"))


@dist_scenario(world_size=2)
def test_several_chunks_of_one_fqn_a_rank_restore_and_persist(ctx):
    """A ``ShardedTensor`` with two local shards a rank (rows 0-2 and 4-6 of
    8 on rank 0, 2-4 and 6-8 on rank 1; hosts h0 and h1): memory step 2,
    persisted, restores from memory into the same layout, element-exact;
    the persistent step loads exact into a plain tensor."""
    import torch
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    full = torch.arange(80, dtype=torch.float32).reshape(8, 10) + 0.5
    rows = [[(0, 2), (4, 6)], [(2, 4), (6, 8)]][ctx.rank]

    def sharded(source):
        return init_from_local_shards(
            [Shard(source[a:b].clone(), ShardMetadata([a, 0], [b - a, 10], f"rank:{ctx.rank}/cpu"))
             for a, b in rows], 8, 10)

    host = f"h{ctx.rank}"
    tier = dcp.MemoryTier(host=host, namespace=str(ctx.dir / "shm" / host), run_id="job",
                          timeout=60)
    root = ctx.dir / "root"
    mgr = dcp.CheckpointManager(str(root), interval=2, save_rng=False, memory=tier)
    assert mgr.save(2, {"st": sharded(full)})
    mgr.wait()
    assert mgr.errors == [] and mgr.persistent_steps() == [2], mgr.errors
    target = {"st": sharded(torch.zeros(8, 10))}
    assert mgr.load_latest(target) == 2
    r = mgr.last_restore
    assert r is not None and r.bytes_persistent == 0 and r.bytes_own_host > 0, r
    for (a, b), shard in zip(rows, target["st"].local_shards(), strict=True):
        assert torch.equal(shard.tensor, full[a:b]), (a, b, shard.tensor)
    mgr.close()
    plain = {"st": torch.zeros(8, 10)}
    dcp.load(plain, str(root / "step-2"))
    assert torch.equal(plain["st"], full), plain["st"]


@dist_scenario(world_size=2)
def test_an_exchange_of_large_small_and_empty_parts_is_exact(ctx):
    """Both ranks send each other parts of 3 MiB, 10 bytes, 0, 1 MiB + 1 and
    3 bytes (large ones in pieces of their own, small ones packed) into
    receive parts at scattered places of one buffer, at full speed and
    throttled; every byte lands where it belongs and nothing else changes."""
    import torch

    from dcp.recovery import replicate

    sizes = [3 << 20, 10, 0, (1 << 20) + 1, 3]
    peer = 1 - ctx.rank
    for rate in (None, 64 << 20):
        g = torch.Generator().manual_seed(ctx.rank)
        mine = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
        g = torch.Generator().manual_seed(peer)
        theirs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
        space = torch.full((sum(sizes) + 64 * len(sizes),), 7, dtype=torch.uint8)
        starts = [sum(sizes[:k]) + 64 * k + 32 for k in range(len(sizes))]
        recv = [memoryview(space[a:a + n].numpy()).cast("B")
                for a, n in zip(starts, sizes, strict=True)]
        send = [memoryview(t.numpy()).cast("B") for t in mine]
        replicate.exchange({peer: send}, {peer: recv}, None, rate=rate)
        expect = torch.full_like(space, 7)
        for a, t in zip(starts, theirs, strict=True):
            expect[a:a + len(t)] = t
        assert torch.equal(space, expect), rate


@pytest.mark.timeout(1200)  # six jobs of 4 ranks: about 40 s on an idle 2-core machine
def test_failure_matrix_kills_hangs_and_racks(tmp: Path) -> None:
    """Rows 5 (at staging and at commit), 7 and 3 of the matrix, in six jobs
    of 4 ranks: on hosts h0, h1 (two ranks each), then on four hosts in
    two racks."""
    two = ["h0", "h0", "h1", "h1"]
    everything = REP + TP_BLOCK + DP_BLOCK  # one rank's tensor bytes

    def whole(nbytes: int) -> bool:  # a rank's tensors and its few small blobs
        return everything <= nbytes <= everything + 4096
    # row 5 at staging: rank 1 SIGKILLed while it stages step 3 (its
    # tensors copied, its blobs not): step 2 is the newest whole step
    rec = job(tmp, "s1", two, "--steps", "1", "3", "--kill-in-staging", "3", kill=True)
    assert event(rec[1], "killing")["memory"] == [2]
    # every byte from the own host; then row 5 at commit: rank 0 (h0's
    # leader) SIGKILLed as it commits step 5, after h1 committed it
    rec = job(tmp, "s2", two, "--resume", "--steps", "3", "5", "--kill-at-commit", "5",
              kill=True)
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 2 and res["bad"] == [], (r, res)
        assert whole(res["source"]["own"]), (r, res)
        assert res["source"]["peer"] == res["source"]["persistent"] == 0, (r, res)
    assert event(rec[0], "killing")["memory"] == [4]
    assert (tmp / "shm" / "h1" / "job" / "step-5" / "COMMITTED").exists()
    assert not (tmp / "shm" / "h0" / "job" / "step-5" / "COMMITTED").exists()
    # step 5 committed on h1 alone, which holds it whole (its own chunks,
    # the data-parallel replicas and copies of h0's tensor-parallel blocks):
    # h0's ranks take all of it from h1, none from h0's uncommitted files
    rec = job(tmp, "s3", two, "--resume", "--steps", "6", "8")
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 5 and res["bad"] == [], (r, res)
        src = res["source"]
        assert src["persistent"] == 0 and whole(src["own"] + src["peer"]), (r, res)
        assert src["own"] == 0 if two[r] == "h0" else whole(src["own"]), (r, res)
        assert event(ranks, "trained")["persistent"] == [4, 8]
    # row 7: h0 lost and replaced; h1 hangs while it serves (its sends stall
    # 12 s; its own restore and the agreement go on).  h0's ranks wait 2 s
    # (restore_timeout) for h1, then take those chunks from the persistent
    # tier's step 8, and only those; the late bytes land after the restore
    # in buffers kept for them, while steps 9 and 10 are saved
    wipe(tmp, "h0")
    rec = job(tmp, "s4", two, "--resume", "--steps", "9", "10", "--restore-timeout", "2",
              "--stall-serving", "h1", "12")
    from_storage, late = 0, set()
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 8 and res["bad"] == [], (r, res)
        src = res["source"]
        from_storage += src["persistent"]
        if two[r] == "h0":
            assert src["own"] == src["peer"] == 0 and src["late"], (r, res)
            late |= set(src["late"])
            assert src["seconds"] < 10, (r, res)  # not the 12 s stall
            assert any("did not send their chunks within MemoryTier(restore_timeout=2.0)"
                       in w and f"{src['late'][0]} (host h1)" in w for w in res["warnings"]), res
        else:
            assert whole(src["own"]) and src["late"] == [], (r, res)
            assert event(ranks, "stalling")["seconds"] == 12
        done = event(ranks, "trained")
        assert done["memory"] == [10] and done["errors"] == [], done
    assert late == {2, 3}, late  # h0's ranks each passed over the h1 rank serving them
    # what h0 holds, each byte read once on the host (rep shared by its ranks)
    unique = REP + 2 * TP_BLOCK + 2 * DP_BLOCK
    assert unique <= from_storage <= unique + 4096, from_storage
    # row 3: four hosts in two racks (h0, h1 in a; h2, h3 in b): the copies
    # of each host's tensor-parallel block go to the other rack; both hosts
    # of rack a lost (two hosts holding different data-parallel replicas):
    # every byte from memory
    racks, four = tmp / "racks", ["h0", "h1", "h2", "h3"]
    domains = ("--domains", "h0=a,h1=a,h2=b,h3=b")
    racks.mkdir()
    job(racks, "r1", four, "--steps", "1", "3", *domains)
    for host in ("h0", "h1"):
        wipe(racks, host)
    rec = job(racks, "r2", four, "--resume", *domains)
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 3 and res["bad"] == [], (r, res)
        src = res["source"]
        assert src["persistent"] == 0 and src["own"] + src["peer"] > 0, (r, res)
        assert (src["own"] == 0) == (four[r] in ("h0", "h1")), (r, res)
    shutil.rmtree(racks / "shm", ignore_errors=True)
