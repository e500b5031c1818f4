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
import contextlib
import functools
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from importlib.metadata import entry_points
from typing import Any
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

    def read_streamed(self, name: str, requests: Sequence[tuple[int, Sequence[memoryview]]],
                      arrived: Callable[[int, int], None]) -> Future[None]:
        """:meth:`read_requests`, started, with word of each view as it is
        filled: ``arrived(i, j)`` once view ``j`` of request ``i`` holds its
        bytes, called at most once per view, from any thread (it must be
        quick: a queue's ``put``), and before the returned future completes.
        The future completes when every request has; it holds the error if
        one failed (some views may then never arrive).

        The load decodes the frames of compressed chunks as they arrive,
        while the rest are still in flight.  The default runs
        :meth:`read_requests` on the calling thread and reports every view
        at its end; plugins whose requests arrive over time (a streamed GET
        body) report views as they fill.
        """
        done: Future[None] = Future()
        try:
            self.read_requests(name, requests)
        except Exception as e:
            done.set_exception(e)
            return done
        for i, (_, views) in enumerate(requests):
            for j in range(len(views)):
                arrived(i, j)
        done.set_result(None)
        return done

    @contextlib.contextmanager
    def mapped(self, name: str) -> Iterator[memoryview | None]:
        """The bytes of the whole file ``name`` as memory shared with the
        storage's cache (a memory mapping of the page cache), valid inside
        the context only, or ``None`` where the plugin has no such view (the
        default).  A load copies the parts of chunks it needs straight out of
        it: one memory copy, no read into a buffer first.  The view is
        writable but writing to it never changes the file.  Raises if the
        file is missing."""
        yield None

    def read_cached(self, name: str, ranges: Sequence[tuple[int, memoryview]]) -> list[int]:
        """Fill what of each buffer the host's shared cache of ``name``
        holds now, without waiting on storage and without starting a read
        of what it lacks (``(offset, buffer)`` pairs as for
        :meth:`read_ranges`); returns, per buffer, how many of its leading
        bytes were filled: 0 where its first byte is not cached.

        A load calls it for the regions another rank of the host pulls into
        the cache (:attr:`~dcp.core.read_cost.ReadCost.shared_cache`), so
        that it copies what has arrived while its own reads wait on storage,
        instead of after them.  Optional: the default fills nothing, and the
        load reads those regions once its own reads are done.
        """
        return [0] * len(ranges)

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

    def replace(self, src: str, dst: str) -> None:
        """Rename file ``src`` to ``dst`` atomically, replacing ``dst`` if it
        exists: readers see the old ``dst`` or all of ``src``, never a part
        or nothing, and the new name is durable when it returns.  For a
        writer that publishes a whole file under a temporary name (an
        export).  Optional: the default raises ``NotImplementedError`` (an
        object store has no atomic rename); :func:`can_replace` tells
        whether a plugin has it, and callers without it must never write
        over an existing file."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace a file atomically")

    def remove_if_empty(self) -> None:
        """Remove the root itself if nothing is under it: the folder of a
        failed save that made it and deleted what it wrote.  Never raises
        (a root still holding anything stays).  Optional: the default does
        nothing (an object store's prefix ends with its last object)."""
        return None

    def location_exists(self) -> bool | None:
        """Whether the root itself exists (a directory), for messages about
        a missing path; ``None`` where the backend has no such notion (an
        object store's prefix exists once an object is under it)."""
        return None

    def file_stats(self) -> dict[str, tuple[int | None, float | None]]:
        """``name -> (size in bytes, modification time in Unix seconds)`` of
        every file under the root, ``None`` where the backend does not say;
        for ``hyperdcp list`` and ``prune`` (sizes, ages), never on a save's
        or load's path.  The default knows neither."""
        return {name: (None, None) for name in self.list_files()}

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


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Inside it, an exception of a storage plugin's own (its backend's: a
    ``FileNotFoundError`` for a missing bucket, botocore's
    ``EndpointConnectionError`` for an unreachable endpoint, a refused
    permission) becomes a :class:`CheckpointError` saying that ``what``
    failed and why; a :class:`CheckpointError` passes as it is.  For the
    library's calls that touch storage outside a save's or load's steps
    (which report such failures themselves)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{what} failed: {type(e).__name__}: {e}") from e


def can_read_cached(storage: StoragePlugin) -> bool:
    """Whether ``storage`` implements :meth:`StoragePlugin.read_cached`."""
    return type(storage).read_cached is not StoragePlugin.read_cached


def can_replace(storage: StoragePlugin) -> bool:
    """Whether ``storage`` implements :meth:`StoragePlugin.replace`."""
    return type(storage).replace is not StoragePlugin.replace


def checkpoint_uri(checkpoint_id: str) -> str:
    """``checkpoint_id`` as the plugins get it, or :class:`CheckpointError`
    if it looks like a mistyped URI.  Every entry point (the API, the command
    line, the plugins that wrap others) reaches a plugin through
    :func:`open_storage`, which calls this, so an id means the same
    everywhere.

    Normalised: a path starting with ``~`` is expanded; ``file:///abs``,
    ``file://localhost/abs`` and ``file:/abs`` become ``/abs``.  Refused,
    naming what was probably meant, because each would otherwise write to a
    relative local folder (node-local disk, on a cluster): one slash
    (``s3:/bucket``), no colon (``s3//bucket``), a host-less ``file://tmp/x``
    (``file://`` names a host; three slashes start an absolute path), and an
    unknown scheme close to an installed one (``S3://``, ``s4://``, ``fiel://``).
    """
    uri = str(checkpoint_id)
    if not uri:
        raise CheckpointError("the checkpoint id is empty: pass a path or a URI")
    if uri.startswith("~"):
        return os.path.expanduser(uri)
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)(:/?(?!/)|//|://)(.*)", uri, re.S)
    if match is None:
        return uri
    scheme, sep, rest = match.groups()
    known = _known_schemes()
    if sep == "://":
        if scheme == "file":
            host, slash, path = rest.partition("/")
            if host in ("", "localhost"):
                return "/" + path
            raise CheckpointError(
                f"checkpoint id {uri!r}: a file:// URI names a host ({host!r}) before its path; "
                f"an absolute path takes three slashes: did you mean 'file:///{rest}' (or the "
                f"plain path '/{rest}')?")
        if scheme in known:
            return uri
        meant = _meant_scheme(scheme, known)
        if meant is not None:
            why = "schemes are lowercase" if meant == scheme.lower() else "a near-miss"
            raise CheckpointError(
                f"checkpoint id {uri!r}: unknown scheme {scheme!r} ({why}); did you mean "
                f"'{meant}://{rest}'? (installed storage plugins: "
                f"{', '.join(sorted(installed_schemes()))})")
        return uri  # open_storage names the missing plugin
    meant = scheme.lower() if scheme.lower() in known else None
    if meant is None or (meant == "file" and sep == ":"):
        return uri  # a relative path such as "run:1/ckpt" or "file:ckpt"
    if meant == "file" and sep == ":/":
        return "/" + rest
    raise CheckpointError(
        f"checkpoint id {uri!r} looks like a mistyped {meant}:// URI (it would be a relative "
        f"local folder); did you mean '{meant}://{rest.lstrip('/')}'? Write './{uri}' for a "
        f"local folder of that name")


def location_key(checkpoint_id: str) -> str:
    """What the ranks of one save or load compare their checkpoint ids by:
    the id as :func:`checkpoint_uri` gives it (itself where it refuses
    it), a plain path made absolute and normal (``ckpt/``, ``./ckpt`` and
    ``$PWD/ckpt`` are one folder), a URI without trailing slashes."""
    try:
        uri = checkpoint_uri(checkpoint_id)
    except CheckpointError:
        uri = str(checkpoint_id)
    if "://" not in uri:
        return os.path.normpath(os.path.abspath(uri))
    return uri.rstrip("/") or uri


def refuse_differing_locations(locations: list[str], call: str, why: str) -> None:
    """Raise :class:`CheckpointError` if the ranks' ``locations`` (their
    :func:`location_key`, index = rank) are not all one, naming each id
    and the ranks that passed it: every rank of the group must pass the
    same id to ``call``; ``why`` says what would happen otherwise and what
    happened instead, for the message."""
    ranks: dict[str, list[int]] = {}
    for rank, location in enumerate(locations):
        ranks.setdefault(location, []).append(rank)
    if len(ranks) < 2:
        return
    shown = [f"{location!r} (rank{'s' if len(r) > 1 else ''} {_ranks(r)})"
             for location, r in list(ranks.items())[:4]]
    more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
    raise CheckpointError(
        f"the ranks passed {len(ranks)} different checkpoint ids to {call}: {', '.join(shown)}"
        f"{more}; every rank of the group must pass the same one: {why}")


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``; at most 8 runs, then ``...``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:8]]
    return ", ".join(text) + (", ..." if len(runs) > 8 else "")


def _known_schemes() -> set[str]:
    """The schemes an id may use: the installed plugins' and fsspec's."""
    return set(installed_schemes()) | set(fsspec.available_protocols())


def _meant_scheme(scheme: str, known: set[str]) -> str | None:
    """The known scheme ``scheme`` is a near-miss of (another case, one
    character off), the installed plugins' first, or ``None``."""
    lower = scheme.lower()
    if lower in known:
        return lower
    for pool in (sorted(installed_schemes()), sorted(known)):
        close = [k for k in pool if _one_edit_apart(lower, k)]
        if close:
            return close[0]
    return None


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether ``b`` is ``a`` with one character replaced, inserted, deleted
    or two neighbours swapped, and long enough for that to be a typo."""
    if min(len(a), len(b)) < 2 or abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def scheme_of(checkpoint_id: str) -> str:
    """The URI scheme of a checkpoint id (after :func:`checkpoint_uri`);
    ``file`` for a plain path."""
    uri = checkpoint_uri(checkpoint_id)
    scheme = urlsplit(uri).scheme if "://" in uri else ""
    return scheme or "file"


@functools.cache
def installed_schemes() -> dict[str, Any]:
    """Scheme -> entry point of every installed storage plugin (scanned once
    per process)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def plugin_name(checkpoint_id: str) -> str:
    """The name of the storage plugin that serves ``checkpoint_id``: its
    scheme, or the generic fsspec plugin's for a scheme only fsspec knows
    (the scheme itself, not installed, if none serves it)."""
    scheme = scheme_of(checkpoint_id)
    plugins = installed_schemes()
    if (scheme not in plugins and FSSPEC_FALLBACK in plugins
            and scheme in fsspec.available_protocols()):
        return FSSPEC_FALLBACK
    return scheme


def open_storage(checkpoint_id: str, **options) -> StoragePlugin:
    """Instantiate the plugin registered for ``checkpoint_id``'s scheme
    (the id normalised, or refused, by :func:`checkpoint_uri`).

    A scheme without a plugin of its own that fsspec knows (``gs``, ``abfs``,
    ...) goes to the plugin registered under the name ``fsspec``, the
    generic one.  Raises :class:`CheckpointError` for an unknown scheme,
    listing the installed schemes and, for known optional backends, what to
    install, and for options the plugin refuses (an unknown name, a bad
    value), naming them.
    """
    checkpoint_id = checkpoint_uri(checkpoint_id)
    scheme = plugin_name(checkpoint_id)
    plugins = installed_schemes()
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
        raise CheckpointError(
            f"storage plugin for {scheme!r} cannot be imported ({e}); install {hint}") from e
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
