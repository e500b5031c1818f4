"""The storage interface, and finding a plugin for a checkpoint id.

A :class:`StoragePlugin` stores the files of one checkpoint under a root (a
directory, a bucket prefix, ...).  Names passed to it are relative,
``/``-separated paths.  Plugins are found through the ``dcp.storage_plugins``
entry-point group, which maps a URI scheme to a class — the built-in ones are
registered there exactly like a third party's (the lazy registry is modelled
on fsspec's, install hints included).  A plain path means ``file``; any
other URL fsspec understands falls back to the generic ``fsspec`` plugin.

Plugins raise ``OSError`` (or any exception) on failure; the core turns it
into a :class:`~dcp.errors.CheckpointError` naming the rank and file.
"""

from __future__ import annotations

import abc
import functools
import struct
from importlib.metadata import entry_points
from typing import Iterable, Sequence
from urllib.parse import urlsplit

import fsspec

from dcp.core import retry
from dcp.core.metadata import checksum
from dcp.core.read_cost import ReadCost
from dcp.errors import CheckpointError

ENTRY_POINT_GROUP = "dcp.storage_plugins"
#: The entry-point name of the generic plugin for any other fsspec URL.
FSSPEC_FALLBACK = "fsspec"

# Schemes served by optional packages: what to install when one is missing.
INSTALL_HINTS = {
    "s3": "s3fs (pip install 'hyperdcp[s3]')",
    "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "az": "adlfs",
}

#: Chunks of at least this many bytes start at a multiple of the plugin's
#: :attr:`StoragePlugin.alignment` in data files (the save pads before them)
#: and at a page boundary in staging buffers, so that a direct-I/O plugin
#: writes them without a copy.
ALIGNED_CHUNK_BYTES = 1 << 20

_EXCHANGE_MAGIC = b"DCPX"
_EXCHANGE_TRAILER = struct.Struct("<4sQI")  # magic, payload length, CRC-32C


class StoragePlugin(abc.ABC):
    """Where a checkpoint's bytes live.

    ``checkpoint_id`` is the URI or path the user passed; ``options`` are the
    plugin's own settings (``storage_options`` of the public API).
    ``thread_count`` is how many data files a rank writes (and reads) in
    parallel.  ``alignment`` (bytes) is where large chunks should start in
    a data file for the plugin's fastest write path: the save pads before
    each chunk of at least :data:`ALIGNED_CHUNK_BYTES` so that it starts at a
    multiple of it (1: no padding).
    """

    thread_count: int = 1
    alignment: int = 1
    #: What a read request costs (latency, bandwidth, concurrency, shared
    #: cache): the load's read planner coalesces byte runs with it and picks
    #: each replica group's path.  Plugins set their own; users override
    #: fields through ``storage_options={"read_cost": {...}}``.
    read_cost: ReadCost = ReadCost()
    #: How the core retries this plugin's calls that fail transiently (see
    #: :meth:`is_transient`): every data-file write of a save and every
    #: exchange-file write.
    retry_policy: retry.RetryPolicy = retry.RetryPolicy()

    def __init__(self, checkpoint_id: str, **options) -> None:
        self.checkpoint_id = checkpoint_id

    def is_transient(self, error: BaseException) -> bool:
        """Whether a call that raised ``error`` may succeed if attempted
        again (then the core retries it under :attr:`retry_policy`).  The
        default: timeouts, connection errors and ``OSError`` numbers such as
        ``EIO``, ``ENOSPC``, ``ETIMEDOUT`` (:data:`dcp.core.retry.TRANSIENT_ERRNOS`).
        A plugin whose backend retries by itself returns ``False`` for the
        failures it has already retried."""
        return retry.is_transient(error)

    def retrying(self, fn, *args):
        """``fn(*args)`` (a call of this plugin) under :attr:`retry_policy`."""
        return self.retry_policy.call(lambda: fn(*args), self.is_transient)

    @abc.abstractmethod
    def write_file(self, name: str, buffers: Sequence[memoryview | bytes]) -> None:
        """Create the file ``name`` holding the concatenation of ``buffers``.

        Called concurrently from several threads for different names.  Must
        return only once the bytes are fully written (and durable, if the
        plugin promises that); on failure it raises, and a partial file may
        remain only under ``name`` (the core deletes it).
        """

    @abc.abstractmethod
    def read_ranges(self, name: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each writable buffer with the bytes of ``name`` starting at
        its offset (``(offset, buffer)`` pairs, in bytes).  Raises if the file
        is missing or shorter than a range."""

    def read_requests(self, name: str,
                      requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """Scatter reads: each request ``(offset, views)`` is one contiguous
        byte range of ``name`` starting at ``offset``, its bytes filling the
        writable ``views`` one after another (as ``preadv`` does).  The core
        sends a request per coalesced range (gap bytes go to a scratch
        view), so a plugin should make each one request to its backend.

        The default reads each multi-view request into one buffer through
        :meth:`read_ranges` and copies it out; plugins that can read into
        the views directly (POSIX ``preadv``, a streamed GET body) override
        it.  Raises if the file is missing or shorter than a request.
        """
        ranges, staged = [], []
        for offset, views in requests:
            if len(views) == 1:
                ranges.append((offset, views[0]))
            else:
                buf = memoryview(bytearray(sum(len(v) for v in views)))
                ranges.append((offset, buf))
                staged.append((buf, views))
        self.read_ranges(name, ranges)
        for buf, views in staged:
            pos = 0
            for view in views:
                view[:] = buf[pos:pos + len(view)]
                pos += len(view)

    @abc.abstractmethod
    def read_file(self, name: str) -> bytes:
        """The whole file ``name``; ``FileNotFoundError`` if there is none."""

    @abc.abstractmethod
    def commit_file(self, name: str, data: bytes, *, overwrite: bool) -> None:
        """Publish ``name`` atomically: readers see the old state or all of
        ``data``, never a part.  With ``overwrite=False`` it must fail with
        ``FileExistsError`` if ``name`` exists (so two committers cannot both
        win)."""

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """Whether ``name`` exists."""

    @abc.abstractmethod
    def list_files(self) -> list[str]:
        """Names of every file under the root (recursively)."""

    @abc.abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Delete files; names that do not exist are ignored."""

    # ---- exchange files of the file-flag coordination protocol -----------

    def write_exchange(self, name: str, payload: bytes) -> None:
        """Write a small exchange file that ends with a completion flag (a
        trailer holding a magic number, the payload length and its CRC-32C),
        retrying transient failures under :attr:`retry_policy`."""
        trailer = _EXCHANGE_TRAILER.pack(_EXCHANGE_MAGIC, len(payload), checksum(payload))
        self.retrying(self.write_file, name, [payload, trailer])

    def read_exchange(self, name: str) -> bytes | None:
        """The payload of a complete exchange file, or ``None`` if the file
        does not exist yet or is incomplete (torn, or still being written)."""
        try:
            data = self.read_file(name)
        except FileNotFoundError:
            return None
        if len(data) < _EXCHANGE_TRAILER.size:
            return None
        magic, length, crc = _EXCHANGE_TRAILER.unpack_from(data, len(data) - _EXCHANGE_TRAILER.size)
        payload = data[:-_EXCHANGE_TRAILER.size]
        if magic != _EXCHANGE_MAGIC or length != len(payload) or crc != checksum(payload):
            return None
        return payload


def scheme_of(checkpoint_id: str) -> str:
    """The URI scheme of a checkpoint id; ``file`` for a plain path."""
    scheme = urlsplit(checkpoint_id).scheme if "://" in checkpoint_id else ""
    return scheme or "file"


@functools.cache
def installed_schemes() -> dict[str, object]:
    """Scheme -> entry point of every installed storage plugin (scanned once
    per process)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def open_storage(checkpoint_id: str, **options) -> StoragePlugin:
    """Instantiate the plugin registered for ``checkpoint_id``'s scheme.

    A scheme without a plugin of its own that fsspec knows (``gs``, ``abfs``,
    ...) goes to the plugin registered under the name ``fsspec``, the
    generic one.  Raises :class:`CheckpointError` for an unknown scheme,
    listing the installed schemes and, for known optional backends, what to
    install, and for options the plugin refuses (an unknown name, a bad
    value), naming them.
    """
    scheme = scheme_of(str(checkpoint_id))
    plugins = installed_schemes()
    if scheme not in plugins and FSSPEC_FALLBACK in plugins and scheme in fsspec.available_protocols():
        scheme = FSSPEC_FALLBACK
    if scheme not in plugins:
        hint = f"; install {INSTALL_HINTS[scheme]} for it" if scheme in INSTALL_HINTS else ""
        raise CheckpointError(
            f"no storage plugin for scheme {scheme!r} of {checkpoint_id!r}{hint} "
            f"(installed: {', '.join(sorted(plugins)) or 'none'}; plugins register in the "
            f"{ENTRY_POINT_GROUP!r} entry-point group)")
    try:
        cls = plugins[scheme].load()
    except ImportError as e:
        hint = INSTALL_HINTS.get(scheme, e.name or "its dependencies")
        raise CheckpointError(f"storage plugin for {scheme!r} cannot be imported ({e}); install {hint}") from e
    read_cost = options.pop("read_cost", None)
    try:
        storage = cls(str(checkpoint_id), **options)
    except (TypeError, ValueError) as e:  # an option the plugin does not take, or a bad value
        raise CheckpointError(
            f"storage plugin {scheme!r} refused the options {sorted(options)} for "
            f"{checkpoint_id!r}: {e}") from e
    if read_cost is not None:
        if not isinstance(read_cost, dict):
            raise CheckpointError(f"{checkpoint_id!r}: read_cost must be a mapping of "
                                  f"ReadCost fields, not {type(read_cost).__name__}")
        storage.read_cost = storage.read_cost.replace(read_cost, str(checkpoint_id))
    return storage
