"""S3 and S3-compatible object stores (``s3://bucket/prefix`` URLs), on s3fs.

* Writes: a file of at most ``part_size`` bytes is one PUT.  A larger one is
  a multipart upload whose parts are cut from the tensors' memory one at a
  time, ``max_concurrency`` of them in flight (so a rank holds at most that
  many part copies, never a copy of the whole file), and is aborted on any
  exception, ``KeyboardInterrupt`` included: S3 publishes an object only when
  its upload completes, so a failed or interrupted write leaves no object,
  truncated or otherwise.  (An upload cut off by a killed process is never
  completed and stays invisible; a bucket lifecycle rule
  ``AbortIncompleteMultipartUpload`` reclaims its parts.)  A write returns
  only once S3 has acknowledged the whole object.
* Commit: ``metadata.json`` is written last with ``If-None-Match: *`` unless
  overwriting, so of two committers exactly one wins; the other gets
  ``FileExistsError``.  (A retried create whose first answer was lost finds
  its own object; the stored bytes show the commit is its own.)
* Reads: one ranged GET per request of the core's read planner (byte runs
  coalesced with :attr:`read_cost`: 20 ms to the first byte and 100 MB/s,
  so gaps up to 2 MB are read through and dropped), ``max_concurrency`` in
  flight per call (a new one starts as soon as one ends), none above
  ``part_size``; each response body is streamed straight into its
  destination buffers, never joined into an intermediate ``bytes`` first.
* Listings and existence checks always ask S3 (no listings cache), so a rank
  sees the objects other ranks have just written.
* Transient errors (5xx, throttling, connection resets and timeouts) are
  retried by botocore's ``standard`` retry mode — exponential backoff with
  jitter, at most ``max_attempts`` attempts per request — below s3fs's own
  bounded retries of connection errors.

Options (``storage_options``, all JSON-representable so they can live in a
config file): the :class:`~storage_plugins.fsspec_store.FsspecStorage` ones
(``thread_count``, ``part_size``, ``max_concurrency``), ``max_attempts``
(default 5), and any ``s3fs.S3FileSystem`` argument, e.g. ``endpoint_url``,
``profile``, ``key``/``secret``/``token``, ``client_kwargs``
(``{"region_name": ...}``), ``config_kwargs`` (merged over the retry and
connection-pool defaults).  A name none of these takes is refused when the
plugin is made, with the nearest known name (s3fs would hand it on to
aiobotocore, which fails at the first request).
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import warnings
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future
from functools import cache, partial
from typing import TypeVar

import s3fs  # imported here, so that without s3fs the entry point fails and dcp names the package
from fsspec.asyn import sync
from s3fs.core import _error_wrapper  # s3fs's own retry-and-translate loop of its reads

from storage_plugins.fsspec_store import FsspecStorage, MiB, named

T = TypeVar("T")


class S3Storage(FsspecStorage):
    """A checkpoint under an ``s3://bucket/prefix`` URL (the bucket must exist)."""

    fs: s3fs.S3FileSystem

    def __init__(self, checkpoint_id: str, *, thread_count: int = 4, part_size: int = 16 * MiB,
                 max_concurrency: int = 10, max_attempts: int = 5, **s3_options) -> None:
        unknown = sorted(set(s3_options) - _s3fs_options())
        if unknown:  # s3fs would hand it to aiobotocore at the first request: a TypeError there
            known = sorted(_s3fs_options() | {"thread_count", "part_size", "max_concurrency",
                                              "max_attempts"})
            hints = [f"{name!r}" + (f" (did you mean {close[0]!r}?)"
                                    if (close := difflib.get_close_matches(name, known, 1)) else "")
                     for name in unknown]
            raise TypeError(f"S3Storage got unknown option(s) {', '.join(hints)}: it takes "
                            f"thread_count, part_size, max_concurrency, max_attempts and the "
                            f"arguments of s3fs.S3FileSystem")
        self.max_attempts = int(max_attempts)
        super().__init__(checkpoint_id, thread_count=thread_count, part_size=part_size,
                         max_concurrency=max_concurrency, **s3_options)

    def filesystem_options(self, options: dict) -> dict:
        config = {"retries": {"total_max_attempts": self.max_attempts, "mode": "standard"},
                  "max_pool_connections": self.thread_count * self.max_concurrency,
                  **options.get("config_kwargs", {})}
        return {**super().filesystem_options(options), "config_kwargs": config,
                "max_concurrency": self.max_concurrency}

    def write_file(self, name: str, buffers: Sequence[memoryview | bytes]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        size = sum(len(v) for v in views)
        try:
            if size <= self.part_size:
                self.fs.pipe_file(self.path(name), b"".join(views))
            else:
                self._multipart(name, views, size)
        except OSError as e:
            raise named(e, self.url(name)) from e

    def _multipart(self, name: str, views: list[memoryview], size: int) -> None:
        """Upload ``views`` as one object in parts; abort on any failure."""
        bucket, key, _ = self.fs.split_path(self.path(name))
        upload = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        try:
            parts = sync(self.fs.loop, self._upload_parts, bucket, key, upload, views, size)
            self.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                            MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            except Exception as abort_error:  # the upload stays invisible; the first error wins
                warnings.warn(f"aborting multipart upload {upload} of {self.url(name)} failed "
                              f"({abort_error}); its parts stay until a lifecycle rule removes "
                              f"them", stacklevel=2)
            raise

    async def _bounded(self, calls: list[Callable[[], Awaitable[T]]]) -> list[T]:
        """Await every call, ``max_concurrency`` at a time, results in order;
        on a failure cancel the others before raising."""
        slots = asyncio.Semaphore(self.max_concurrency)

        async def run(call: Callable[[], Awaitable[T]]) -> T:
            async with slots:
                return await call()

        tasks = [asyncio.ensure_future(run(call)) for call in calls]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _upload_parts(self, bucket: str, key: str, upload: str,
                            views: list[memoryview], size: int) -> list[dict]:
        """Send every part (cut from ``views`` only once its turn comes)."""
        async def send(number: int, start: int) -> dict:
            body = _slice(views, start, min(start + self.part_size, size))
            out = await self.fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload,
                                         PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": out["ETag"]}

        return await self._bounded([partial(send, n, start)
                                    for n, start in enumerate(range(0, size, self.part_size), 1)])

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        self.read_requests(name, [(offset, [view]) for offset, view in self._pieces(ranges)])

    def read_requests(self, name: str,
                      requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self.read_streamed(name, requests, lambda i, j: None).result()

    def read_streamed(self, name: str, requests: Sequence[tuple[int, Sequence[memoryview]]],
                      arrived: Callable[[int, int], None]) -> Future[None]:
        """The GETs started on s3fs's event loop; each view is reported as
        soon as the body streamed into it has filled it (once, even where a
        GET is retried)."""
        bucket, key, _ = self.fs.split_path(self.path(name))
        reported: set[tuple[int, int]] = set()

        def report(i: int, j: int) -> None:
            if (i, j) not in reported:
                reported.add((i, j))
                arrived(i, j)

        calls: list[Callable[[], Awaitable[None]]] = []
        for i, (offset, views) in enumerate(requests):
            if any(len(v) for v in views):
                calls.append(partial(_error_wrapper, self._get_into,
                                     args=(name, bucket, key, offset,
                                           [memoryview(v).cast("B") for v in views],
                                           partial(report, i)),
                                     retries=self.fs.retries))
            else:
                for j in range(len(views)):
                    report(i, j)
        return asyncio.run_coroutine_threadsafe(self._reads(name, calls), self.fs.loop)

    async def _reads(self, name: str, calls: list[Callable[[], Awaitable[None]]]) -> None:
        """Await ``calls`` (:meth:`_bounded`), an ``OSError`` naming the
        object's URL."""
        try:
            await self._bounded(calls)
        except OSError as e:
            raise named(e, self.url(name)) from e

    async def _get_into(self, name: str, bucket: str, key: str, offset: int,
                        views: list[memoryview], filled: Callable[[int], None]) -> None:
        """One ranged GET, its body read into ``views`` one after another as
        it arrives, ``filled(j)`` once view ``j`` is full."""
        size = sum(len(v) for v in views)
        out = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                     Range=f"bytes={offset}-{offset + size - 1}")
        body, pos = out["Body"], 0
        try:
            for j, view in enumerate(views):
                done = 0
                while done < len(view):
                    n = await body.readinto(view[done:])
                    if n == 0:
                        raise EOFError(f"{self.url(name)} ends at byte {offset + pos + done}, "
                                       f"before {size - pos - done} more bytes it should hold")
                    done += n
                pos += done
                filled(j)
        finally:
            body.close()

    def delete(self, names: Iterable[str]) -> None:
        paths = [self.path(n) for n in names]
        if paths:
            try:
                self.fs.rm(paths)  # DeleteObjects, 1000 keys a request; missing keys are no error
            except FileNotFoundError:  # no such bucket: nothing to delete
                pass


@cache
def _s3fs_options() -> frozenset[str]:
    """The keyword arguments an ``s3fs.S3FileSystem`` takes: its own, the
    listing-cache ones it hands to fsspec, and those of the aiobotocore
    session it hands the rest to."""
    from aiobotocore.session import AioSession

    names = set()
    for fn in (s3fs.S3FileSystem.__init__, AioSession.__init__):
        names |= {p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
    return frozenset(names - {"self"} | {"use_listings_cache", "listings_expiry_time",
                                         "max_paths", "skip_instance_cache"})


def _slice(views: list[memoryview], start: int, stop: int) -> bytes:
    """Bytes ``start:stop`` of the concatenation of ``views``."""
    pieces, pos = [], 0
    for view in views:
        end = pos + len(view)
        if end > start and pos < stop:
            pieces.append(view[max(start - pos, 0):min(stop, end) - pos])
        pos = end
    return b"".join(pieces)
