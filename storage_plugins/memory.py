"""In-process memory storage (``memory://name`` URLs), for tests and notebooks.

Files live in fsspec's process-wide memory filesystem (the one
``fsspec.filesystem("memory")`` returns), so every rank must be a thread of
one process: a spawned process sees none of them, a forked one a snapshot —
nor do the background processes of ``dcp.async_save``.
Lifetime: until deleted or until the process exits.  Clean-up:
``storage.delete(storage.list_files())`` (or ``fsspec.filesystem("memory")
.rm("/name", recursive=True)``).  For ranks in several processes on one host,
use ``shm://`` (:mod:`storage_plugins.shm`).
"""

from __future__ import annotations

import threading

from dcp.core.read_cost import ReadCost
from storage_plugins.fsspec_store import FsspecStorage


class MemoryStorage(FsspecStorage):
    """A checkpoint in this process's memory.  Options as for
    :class:`~storage_plugins.fsspec_store.FsspecStorage`.

    fsspec's memory filesystem checks for an existing file and then writes,
    so exclusive commits are serialized by a process-wide lock (the whole
    scope of this storage) to make them atomic.
    """

    _commit_lock = threading.Lock()

    def default_read_cost(self) -> ReadCost:
        """Memory of this process: ~2 µs a call, ~8 GB/s, not shared
        between processes."""
        return ReadCost(latency_s=2e-6, bandwidth_bps=8e9, concurrency=1,
                        max_request_bytes=self.part_size, shared_cache=False)

    def commit_file(self, name: str, data: bytes, *, overwrite: bool) -> None:
        with self._commit_lock:
            super().commit_file(name, data, overwrite=overwrite)
