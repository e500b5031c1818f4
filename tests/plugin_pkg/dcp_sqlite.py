"""A complete hyperdcp storage plugin: a checkpoint in one SQLite database.

``sqlite:///path/to/ckpt.db`` keeps every file of the checkpoint as a row of
the database's ``files`` table.  Each write is one SQLite transaction, so a
failed write publishes nothing; SQLite's locking makes it safe for the ranks
of one host (several processes) and the ``PRIMARY KEY`` makes an exclusive
commit atomic.  An example for plugin authors, not a production backend
(SQLite caps a value at 1 GB and serializes writers).
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from dcp.core.storage import StoragePlugin


class SqliteStorage(StoragePlugin):
    """Options: ``thread_count`` (default 2) files written in parallel per
    rank; ``timeout`` (default 60) seconds to wait for another writer's lock."""

    def __init__(self, checkpoint_id: str, *, thread_count: int = 2, timeout: float = 60.0) -> None:
        super().__init__(checkpoint_id)
        self.thread_count = thread_count
        self.timeout = timeout
        self.database = Path(checkpoint_id.removeprefix("sqlite://"))
        self.database.parent.mkdir(parents=True, exist_ok=True)
        with self._transaction() as db:
            db.execute("CREATE TABLE IF NOT EXISTS files (name TEXT PRIMARY KEY, data BLOB NOT NULL)")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A connection (one per call: connections are not shared between
        threads) whose work is committed on success, rolled back on error."""
        db = sqlite3.connect(self.database, timeout=self.timeout)
        try:
            with db:
                yield db
        finally:
            db.close()

    def write_file(self, name: str, buffers: Sequence[memoryview | bytes]) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO files VALUES (?, ?)", (name, b"".join(buffers)))

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        with self._transaction() as db:
            for offset, buf in ranges:
                view = memoryview(buf).cast("B")
                row = db.execute("SELECT substr(data, ?, ?) FROM files WHERE name = ?",
                                 (offset + 1, len(view), name)).fetchone()
                if row is None:
                    raise FileNotFoundError(f"{self.database}: no file {name!r}")
                if len(row[0]) != len(view):
                    raise EOFError(f"{self.database}: file {name!r} ends at byte "
                                   f"{offset + len(row[0])}, before {offset + len(view)}")
                view[:] = row[0]

    def read_file(self, name: str) -> bytes:
        with self._transaction() as db:
            row = db.execute("SELECT data FROM files WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise FileNotFoundError(f"{self.database}: no file {name!r}")
        return row[0]

    def commit_file(self, name: str, data: bytes, *, overwrite: bool) -> None:
        verb = "INSERT OR REPLACE" if overwrite else "INSERT"
        try:
            with self._transaction() as db:
                db.execute(f"{verb} INTO files VALUES (?, ?)", (name, data))
        except sqlite3.IntegrityError as e:
            raise FileExistsError(f"{self.database}: file {name!r} exists") from e

    def exists(self, name: str) -> bool:
        with self._transaction() as db:
            return db.execute("SELECT 1 FROM files WHERE name = ?", (name,)).fetchone() is not None

    def list_files(self) -> list[str]:
        with self._transaction() as db:
            return [name for (name,) in db.execute("SELECT name FROM files ORDER BY name")]

    def delete(self, names: Iterable[str]) -> None:
        with self._transaction() as db:
            db.executemany("DELETE FROM files WHERE name = ?", [(n,) for n in names])
