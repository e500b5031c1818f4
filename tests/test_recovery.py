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

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
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


def test_failure_matrix(tmp: Path) -> None:
    """Rows 1, 2 with 8, 4 with 6, 9, 11 and 12 of the matrix, and a
    refused memory save, in five jobs (4 ranks on hosts h0, h1, then 2)."""
    two = ["h0", "h0", "h1", "h1"]
    # job 1: steps 1..5, persistent step 4; rank 1 SIGKILLed after memory step 5
    rec = job(tmp, "j1", two, "--steps", "1", "5", "--kill-at", "5", kill=True)
    assert event(rec[0], "killing")["memory"] == [5]

    # row 1: a rank killed, host memory intact: every byte from the own host
    # row 12: a bit flipped on rank 1 before step 6's save, raised (named) by
    # the next save call, step 7's; step 6 is never kept, 8 and 9 are
    rec = job(tmp, "j2", two, "--resume", "--steps", "6", "9", "--flip-at", "6")
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 5 and res["bad"] == [], (r, res)
        assert res["source"]["peer"] == 0 and res["source"]["persistent"] == 0, res
        assert res["source"]["own"] >= REP, res
        sdc = event(ranks, "sdc")
        assert sdc["step"] == 7, sdc
        assert "'model.rep'" in sdc["error"] and "rank 1 is the odd one out" in sdc["error"]
        assert sdc["mismatches"] == [["model.rep", [0, 0], [0, 1, 2, 3], 1]], sdc
        done = event(ranks, "trained")
        assert done["memory"] == [9] and done["persistent"] == [4, 8], done
        assert done["errors"] == [], done

    # row 2 with row 8: host h1 lost, replaced by an empty one, and ranks 1
    # and 2 trade hosts: what h0 lost nothing of comes from h0, the rest too
    wipe(tmp, "h1")
    moved = ["h0", "h1", "h0", "h1"]
    rec = job(tmp, "j3", moved, "--resume", "--steps", "10", "10")
    total = {"own": 0, "peer": 0, "persistent": 0}
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 9 and res["bad"] == [], (r, res)
        for k in total:
            total[k] += res["source"][k]
        if moved[r] == "h1":
            assert res["source"]["own"] == 0 and res["source"]["peer"] > 0, (r, res)
    assert total["persistent"] == 0, total
    assert total["own"] + total["peer"] >= 4 * (REP + TP_BLOCK + DP_BLOCK), total

    # rows 4 and 6: h0 lost; on h1 one copy flipped and one truncated: those
    # chunks, and only those, from the persistent tier (step 10 is not
    # persisted: the restore falls back to step 8, whole, never a mix)
    wipe(tmp, "h0")
    copies = sorted((tmp / "shm" / "h1" / "job" / "step-10").glob("*-copies.data"),
                    key=lambda f: -f.stat().st_size)
    assert copies and copies[0].stat().st_size > 100, "no copies kept on h1"
    data = bytearray(copies[0].read_bytes())
    data[100] ^= 0x10
    copies[0].write_bytes(bytes(data))
    rec = job(tmp, "j4", two, "--resume")
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 8 and res["bad"] == [], (r, res)
        assert any("memory step 10" in w for w in res["warnings"]), res


def test_layout_changes(tmp: Path) -> None:
    """Row 9 (restart at another world size, resharded from memory), row 4
    (every copy of some chunk lost: exactly those chunks from the persistent
    tier) and row 11 (a newer persistent step wins); a save over the
    tier's memory cap is refused."""
    two = ["h0", "h0", "h1", "h1"]
    job(tmp, "j1", two, "--steps", "1", "4")  # memory and persistent step 4
    # every copy of rank 3's tensor-parallel block is lost: h1 keeps rank 3's
    # own file, which is deleted, and h0 the copies, whose file is truncated
    os.remove(tmp / "shm" / "h1" / "job" / "step-4" / "r00003.data")
    for f in (tmp / "shm" / "h0" / "job" / "step-4").glob("*-copies.data"):
        with open(f, "r+b") as fh:
            fh.truncate(1)
    rec = job(tmp, "j2", ["h0", "h1"], "--resume", "--extra", "newer-persistent")
    lost = 0
    for r, ranks in enumerate(rec):
        res = event(ranks, "resume")
        assert res["step"] == 4 and res["bad"] == [], (r, res)
        lost += res["source"]["persistent"]
        newer = event(ranks, "newer-persistent")
        assert newer == {"event": "newer-persistent", "step": 12, "bad": [],
                         "from_memory": False}, newer
        refused = event(ranks, "refused")
        assert refused["memory"] == [] and any(
            "host_bytes=4096" in e for e in refused["errors"]), refused
    # rank 3 held rows 768..1024 of tp and the per-rank record blob of rank 3
    assert TP_BLOCK <= lost <= 1.05 * TP_BLOCK + 64 * 1024, lost
