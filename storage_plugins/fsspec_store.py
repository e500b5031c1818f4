"""Generic storage on any fsspec filesystem (``gs://``, ``abfs://``, ... URLs).

The fallback for object stores and remote filesystems that have no dedicated
plugin: fsspec does the I/O, and the guarantees are those of the backend's own
calls — a file is written with one ``pipe_file`` (one PUT on object stores,
so a failed write publishes nothing there), the metadata is committed with
``pipe_file(mode="create")`` (an atomic conditional create where the backend
implements one, an exists-then-write check otherwise) and ranged reads go
through ``cat_ranges``, at most ``max_concurrency`` requests in flight per
call and no request larger than ``part_size`` bytes.

Listing caches are always off (``use_listings_cache=False``): a listing must
show the files other ranks wrote a moment ago, which a cached listing hides.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence

import fsspec

from dcp.core.read_cost import ReadCost
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError

MiB = 1 << 20


def named(error: OSError, url: str) -> OSError:
    """``error`` again, of the same class, with ``url`` leading its message
    (backends' messages often omit the object's name)."""
    return type(error)(f"{url}: {error}")


class FsspecStorage(StoragePlugin):
    """A checkpoint under an fsspec URL.

    Options (``storage_options``): ``thread_count`` (default 4) data files
    written and read in parallel per rank; ``part_size`` (default 16 MiB) the
    largest byte range one request transfers; ``max_concurrency`` (default
    10) requests in flight per file.  Every other option goes to the
    filesystem's constructor (credentials, endpoint, ... as the fsspec
    backend documents them).
    """

    def __init__(self, checkpoint_id: str, *, thread_count: int = 4, part_size: int = 16 * MiB,
                 max_concurrency: int = 10, **fs_options) -> None:
        super().__init__(checkpoint_id)
        self.thread_count = max(1, int(thread_count))
        self.part_size = int(part_size)
        self.max_concurrency = int(max_concurrency)
        if self.part_size < 1 or self.max_concurrency < 1:
            raise CheckpointError(f"{checkpoint_id!r}: part_size and max_concurrency must be "
                                  f"positive (got {part_size}, {max_concurrency})")
        try:
            self.fs, root = fsspec.core.url_to_fs(checkpoint_id,
                                                  **self.filesystem_options(fs_options))
        except ImportError as e:  # the backend's package is missing; fsspec's message names it
            raise CheckpointError(f"cannot open {checkpoint_id!r} with fsspec: {e}") from e
        self.root = root.rstrip("/")
        self.read_cost = self.default_read_cost()

    def default_read_cost(self) -> ReadCost:
        """The read cost of a remote object store reached through fsspec:
        20 ms to the first byte, 100 MB/s a stream, ``max_concurrency``
        requests in flight, ``part_size`` at most each, nothing shared."""
        return ReadCost(latency_s=0.02, bandwidth_bps=1e8, concurrency=self.max_concurrency,
                        max_request_bytes=self.part_size, shared_cache=False)

    def filesystem_options(self, options: dict) -> dict:
        """The keyword arguments of the filesystem's constructor: the user's
        options, with the listings cache off."""
        return {**options, "use_listings_cache": False}

    def is_transient(self, error: BaseException) -> bool:
        """``False``: fsspec's object-store backends retry transient failures
        themselves, per request (s3fs through botocore, gcsfs, adlfs), so a
        failure that reaches the core is final."""
        return False

    def path(self, name: str) -> str:
        """The filesystem path of the checkpoint file ``name``."""
        return f"{self.root}/{name}"

    def url(self, name: str) -> str:
        """``name`` as a full URL, for messages."""
        return self.fs.unstrip_protocol(self.path(name))

    def write_file(self, name: str, buffers: Sequence[memoryview | bytes]) -> None:
        self.fs.pipe_file(self.path(name), b"".join(buffers))

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        path = self.path(name)
        pieces = list(self._pieces(ranges))
        for first in range(0, len(pieces), self.max_concurrency):
            batch = pieces[first:first + self.max_concurrency]
            try:
                datas = self.fs.cat_ranges([path] * len(batch), [o for o, _ in batch],
                                           [o + len(v) for o, v in batch], on_error="raise")
            except OSError as e:
                raise named(e, self.url(name)) from e
            for (offset, view), data in zip(batch, datas, strict=True):
                if len(data) != len(view):
                    raise EOFError(f"{self.url(name)} ends at byte {offset + len(data)}, before "
                                   f"{len(view) - len(data)} more bytes it should hold")
                view[:] = data

    def _pieces(self, ranges: Sequence[tuple[int, memoryview]]) -> Iterator[tuple[int, memoryview]]:
        """The non-empty ranges cut into pieces of at most ``part_size`` bytes."""
        for offset, buf in ranges:
            view = memoryview(buf).cast("B")
            for start in range(0, len(view), self.part_size):
                yield offset + start, view[start:start + self.part_size]

    def read_file(self, name: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(name))
        except OSError as e:
            raise named(e, self.url(name)) from e

    def commit_file(self, name: str, data: bytes, *, overwrite: bool) -> None:
        """Publish ``name``; see :meth:`StoragePlugin.commit_file`.

        An exclusive create that is retried after its first attempt succeeded
        but its answer was lost meets the object it wrote itself; the stored
        bytes tell: if they are ``data`` (a commit's metadata names its own
        save, so no other committer writes the same bytes), the commit is
        ours."""
        path = self.path(name)
        try:
            self.fs.pipe_file(path, data, mode="overwrite" if overwrite else "create")
        except FileExistsError as e:
            if self.fs.cat_file(path) != data:
                raise named(e, self.url(name)) from e
        except OSError as e:
            raise named(e, self.url(name)) from e

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def list_files(self) -> list[str]:
        prefix = self.root + "/"
        return sorted(p[len(prefix):] for p in self.fs.find(self.root) if p.startswith(prefix))

    def file_stats(self) -> dict[str, tuple[int | None, float | None]]:
        prefix = self.root + "/"
        found = self.fs.find(self.root, detail=True)
        return {p[len(prefix):]: (info.get("size"), _mtime(info))
                for p, info in sorted(found.items()) if p.startswith(prefix)}

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                self.fs.rm_file(self.path(name))
            except FileNotFoundError:
                pass


def _mtime(info: dict) -> float | None:
    """The modification time of an fsspec ``info`` entry, in Unix seconds
    (backends name it ``mtime``, ``LastModified``, ``updated``, ...)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None
