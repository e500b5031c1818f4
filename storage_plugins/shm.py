"""Shared-memory storage for the ranks of one host (``shm://name/path`` URLs).

A checkpoint is a directory under ``/dev/shm/hyperdcp`` (a tmpfs: RAM, not
disk), written and read exactly like a POSIX checkpoint — it *is* one, by
:class:`~storage_plugins.posix.PosixStorage` — so every process of the host
sees it: fast in-memory checkpoints, and fast multi-process tests.

Lifetime: the files outlive the processes that wrote them — a training job
that crashes or restarts finds its checkpoint again — and are lost when the
host reboots (or the container whose ``/dev/shm`` it is stops).  They occupy
RAM until deleted, counted as shared memory (``Shmem`` in
``/proc/meminfo``), and a full tmpfs fails writes with ``ENOSPC``.

Clean-up: ``overwrite=True`` saves delete the data files they replace;
``storage.delete(storage.list_files())`` removes a checkpoint's files, and
``rm -r /dev/shm/hyperdcp/<name>`` the whole tree.

Options: ``root`` (default ``/dev/shm/hyperdcp``, any tmpfs directory) and
``thread_count`` (default 4).  Nothing is ``fsync``-ed: tmpfs has no disk to
sync to, and a reboot loses the files anyway.  Read cost: memory, ~5 µs a
call and ~8 GB/s, shared by the host's ranks like a page cache.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from dcp.core.read_cost import ReadCost
from dcp.errors import CheckpointError
from storage_plugins.posix import PosixStorage

DEFAULT_ROOT = "/dev/shm/hyperdcp"


class ShmStorage(PosixStorage):
    """A checkpoint in shared memory: ``shm://name/path`` is the directory
    ``<root>/name/path``."""

    def __init__(self, checkpoint_id: str, *, root: str = DEFAULT_ROOT,
                 thread_count: int = 4) -> None:
        super().__init__(checkpoint_id, thread_count=thread_count, fsync=False)
        relative = PurePosixPath(checkpoint_id.removeprefix("shm://"))
        if not checkpoint_id.startswith("shm://") or relative.is_absolute() \
                or not relative.parts or ".." in relative.parts:
            raise CheckpointError(f"{checkpoint_id!r} is not a shared-memory checkpoint id: write "
                                  f"shm://name[/path] (a relative path without '..')")
        self.root = Path(root) / relative
        self.read_cost = ReadCost(latency_s=5e-6, bandwidth_bps=8e9, concurrency=1,
                                  max_request_bytes=64 << 20, shared_cache=True)
