"""kill -9 at a chosen phase of a save, through the public interfaces only: a
save planner and a storage plugin that wrap the real ones and SIGKILL a
process at one call.

The victim is a rank's process for ``dcp.save`` and a rank's background
process for ``dcp.async_save`` (the planner and the storage are pickled to
it); either way the process running the save phases.  Each process records
its pid in ``pid_dir`` when it plans, so the coordinator can kill another
rank's process at the moment only the coordinator sees (global planning,
commit).

Phases (:data:`PHASES`) and who kills whom:

* ``local planning`` — the victim, in its ``create_local_plan``;
* ``global planning`` — the coordinator, in ``create_global_plan``;
* ``mid-write`` — the victim, in ``write_file`` of its first data file,
  after writing half of its bytes (a torn file);
* ``before commit`` — the coordinator, in ``commit_file``, before
  committing: every rank has written and reported;
* ``after commit`` — the coordinator, right after ``commit_file`` returned.

When the coordinator kills another rank it waits until that process is
gone, then carries on.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dcp.core.planner import SavePlanner, default_planner
from dcp.core.storage import StoragePlugin, open_storage

PHASES = ("local planning", "global planning", "mid-write", "before commit", "after commit")


@dataclass(frozen=True)
class Crash:
    """Kill ``victim``'s process at ``phase``; this instance runs on ``rank``."""

    phase: str
    victim: int
    rank: int
    pid_dir: str


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: SIGKILL is not deferred


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _kill_victim(crash: Crash) -> None:
    if crash.victim == crash.rank:
        _die()
    pid = int(Path(crash.pid_dir, f"rank{crash.victim}").read_text())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not _gone(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {crash.victim}'s process {pid} survived SIGKILL for 30 s")
        time.sleep(0.01)


class CrashingPlanner(SavePlanner):
    """The default save planner, killing at the planning phases."""

    def __init__(self, crash: Crash) -> None:
        self.crash = crash
        self.inner = default_planner("save")

    def create_local_plan(self, plan):
        Path(self.crash.pid_dir, f"rank{self.crash.rank}").write_text(str(os.getpid()))
        if self.crash.phase == "local planning" and self.crash.rank == self.crash.victim:
            _die()
        return self.inner.create_local_plan(plan)

    def create_global_plan(self, plans):
        if self.crash.phase == "global planning":
            _kill_victim(self.crash)
        return self.inner.create_global_plan(plans)


class CrashingStorage(StoragePlugin):
    """The plugin of ``checkpoint_id`` (opened with ``options``), killing at
    the writing and commit phases.  Picklable: it reopens the plugin."""

    def __init__(self, checkpoint_id: str, crash: Crash, options: dict) -> None:
        super().__init__(checkpoint_id)
        self.crash, self.options = crash, options
        self.inner = open_storage(checkpoint_id, **options)
        self.thread_count = self.inner.thread_count
        self.retry_policy = self.inner.retry_policy

    def __getstate__(self) -> dict:
        return {"checkpoint_id": self.checkpoint_id, "crash": self.crash, "options": self.options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["checkpoint_id"], state["crash"], state["options"])

    def is_transient(self, error: BaseException) -> bool:
        return self.inner.is_transient(error)

    def write_file(self, name: str, buffers: Sequence[memoryview | bytes]) -> None:
        c = self.crash
        if c.phase == "mid-write" and c.rank == c.victim and name.endswith(".data"):
            data = b"".join(memoryview(b).cast("B") for b in buffers)
            self.inner.write_file(name, [data[:len(data) // 2]])
            _die()
        self.inner.write_file(name, buffers)

    def commit_file(self, name: str, data: bytes, *, overwrite: bool) -> None:
        if self.crash.phase == "before commit":
            _kill_victim(self.crash)
        self.inner.commit_file(name, data, overwrite=overwrite)
        if self.crash.phase == "after commit":
            _kill_victim(self.crash)

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        self.inner.read_ranges(name, ranges)

    def read_file(self, name: str) -> bytes:
        return self.inner.read_file(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def list_files(self) -> list[str]:
        return self.inner.list_files()

    def delete(self, names: Iterable[str]) -> None:
        self.inner.delete(names)
