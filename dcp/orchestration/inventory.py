"""What lies under a checkpoint or a root of checkpoints: which are
complete, which were left incomplete, and which files no checkpoint uses.

A save deletes what it wrote when it fails or is interrupted
(:meth:`dcp.orchestration.save._Save.discard`), but a process killed with
``SIGKILL`` (or a lost node) cannot: its data files, exchange files and
commit temporaries stay behind.  They are *orphans*: files named as hyperdcp
names them, at the top of a checkpoint folder, that its committed metadata
does not use (all of them, where no metadata was committed).  Files hyperdcp
does not name are never counted or removed.

``hyperdcp list`` (:func:`scan`) shows each checkpoint under a root with its
state, size and age; ``hyperdcp verify`` lists a checkpoint's orphans;
``hyperdcp prune`` (:func:`prune`) deletes orphans older than a minimum age,
since a save still in flight looks exactly like an interrupted one.  The
next save that commits to a checkpoint id deletes that id's orphaned data
files itself (:func:`dcp.orchestration.save.delete_stale`).  The state of
each step is what a checkpoint manager needs too.

A memory-tier step (:mod:`dcp.recovery`, one host's part of a step in its
shared memory) is a checkpoint folder too, but not a whole one: its
metadata names the other hosts' files, which live on those hosts, and its
``-copies`` files hold other hosts' chunks.  It is recognised by its held
lists (``held.r<rank>.json``) and reported as :data:`MEMORY`: none of its
files is an orphan, and :func:`prune` never touches it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from dcp.coordination.file_flag import EXCHANGE_PREFIX
from dcp.core.metadata import METADATA_FILE, Metadata, decode
from dcp.core.storage import StoragePlugin, open_storage, storage_errors
from dcp.errors import CheckpointError, NotACheckpointError
from dcp.orchestration.save import is_data_file

#: The per-rank metadata files of a ``coordination="none"`` save.
_RANK_METADATA = re.compile(r"metadata\.rank\d{5}\.json")
#: What a POSIX commit writes before its atomic rename or link.
_COMMIT_TEMP = re.compile(r"\.metadata[^/]*\.tmp")
#: The data files a conversion (dcp.interop) writes: ``convert-K.<save id>.data``.
_CONVERT_DATA = re.compile(r"convert-[^/]*\.data")
#: What each rank of a memory-tier step holds (:mod:`dcp.recovery.host_store`).
_HELD_LIST = re.compile(r"held\.r\d{5}\.json")

COMPLETE, INCOMPLETE, DAMAGED, MEMORY = "complete", "incomplete", "damaged", "memory step"


def file_kind(name: str) -> str | None:
    """What hyperdcp file ``name`` (relative to a checkpoint) is:
    ``"metadata"``, ``"data"``, ``"exchange"``, ``"commit-temp"``, or
    ``None`` for a file hyperdcp does not write there."""
    if name == METADATA_FILE or _RANK_METADATA.fullmatch(name):
        return "metadata"
    if is_data_file(name) or _CONVERT_DATA.fullmatch(name):
        return "data"
    if name.startswith(EXCHANGE_PREFIX) and "/" not in name:
        return "exchange"
    if _COMMIT_TEMP.fullmatch(name):
        return "commit-temp"
    return None


@dataclass
class Inventory:
    """One checkpoint folder: ``name`` (relative to the scanned root, ``""``
    for the root itself), its ``uri``, ``state`` (:data:`COMPLETE`,
    :data:`INCOMPLETE`: hyperdcp files but no committed metadata — an
    interrupted save or one in flight —, :data:`DAMAGED`: its metadata
    does not decode, or :data:`MEMORY`: one host's part of a memory-tier
    step, which has no orphans), ``detail`` (why), the bytes of its hyperdcp files
    (``nbytes``; ``None`` where the storage does not say), ``age_s`` (since
    its newest file was written; ``None`` if unknown), its ``orphans``
    (name -> (bytes, age in seconds), ``None`` where unknown) and, when
    complete, its ``metadata``."""

    name: str
    uri: str
    state: str
    detail: str = ""
    nbytes: int | None = None
    age_s: float | None = None
    orphans: dict[str, tuple[int | None, float | None]] = field(default_factory=dict)
    metadata: Metadata | None = None

    @property
    def orphan_bytes(self) -> int:
        return sum(size or 0 for size, _ in self.orphans.values())


def inspect_checkpoint(storage: StoragePlugin, name: str = "",
                       stats: dict[str, tuple[int | None, float | None]] | None = None,
                       now: float | None = None) -> Inventory:
    """The :class:`Inventory` of the checkpoint folder ``storage`` holds
    (``stats``: its :meth:`~dcp.core.storage.StoragePlugin.file_stats`,
    read if not given)."""
    from dcp.coordination.independent import read_metadata_bytes

    now = time.time() if now is None else now
    if stats is None:
        with storage_errors(f"listing {storage.checkpoint_id!r}"):
            stats = storage.file_stats()
    ours = {n: st for n, st in stats.items() if file_kind(n) is not None}
    ages = [now - mtime for _, mtime in ours.values() if mtime is not None]
    sizes = [size for size, _ in ours.values()]
    entry = Inventory(name, storage.checkpoint_id, INCOMPLETE,
                      nbytes=None if None in sizes else sum(s for s in sizes if s is not None),
                      age_s=min(ages) if ages and len(ages) == len(ours) else None)
    if any(_HELD_LIST.fullmatch(n) for n in stats):
        entry.state = MEMORY
        entry.detail = ("one host's part of a memory-tier step (dcp.MemoryTier): the other hosts' "
                        "files live on those hosts and its -copies files hold their chunks; "
                        "load_latest checks every chunk's CRC-32C as it restores, and the "
                        "CheckpointManager that wrote it drops it")
        return entry
    try:
        md = decode(read_metadata_bytes(storage), f"{storage.checkpoint_id}/{METADATA_FILE}")
    except NotACheckpointError as e:
        entry.detail = str(e)
        used: set[str] = set()
    except CheckpointError as e:
        entry.state, entry.detail = DAMAGED, str(e)
        return entry  # nothing is an orphan of a checkpoint that cannot be read
    else:
        entry.state, entry.metadata = COMPLETE, md
        used = md.files() | {n for n in ours if file_kind(n) == "metadata"}
    entry.orphans = {n: (size, None if mtime is None else now - mtime)
                     for n, (size, mtime) in ours.items() if n not in used}
    return entry


def scan(root: str, storage_options: dict | None = None) -> list[Inventory]:
    """Every checkpoint folder under ``root`` (``root`` itself included,
    when it is one), by name: each folder holding a file hyperdcp names."""
    options = storage_options or {}
    storage = open_storage(root, **options)
    now = time.time()
    folders: dict[str, dict[str, tuple[int | None, float | None]]] = {}
    with storage_errors(f"listing {storage.checkpoint_id!r}"):
        listed = storage.file_stats()
    for path, st in listed.items():
        folder, _, base = path.rpartition("/")
        folders.setdefault(folder, {})[base] = st
    found = []
    for folder, stats in sorted(folders.items()):
        if not any(file_kind(n) for n in stats):
            continue
        sub = storage if not folder else open_storage(
            f"{storage.checkpoint_id.rstrip('/')}/{folder}", **options)
        found.append(inspect_checkpoint(sub, folder, stats, now))
    return found


@dataclass
class PruneResult:
    """What :func:`prune` did: the files it ``removed`` (uri -> bytes, ``None``
    if unknown), and the orphans it ``kept`` because they are younger than
    the minimum age (or of unknown age)."""

    removed: dict[str, int | None] = field(default_factory=dict)
    kept: dict[str, int | None] = field(default_factory=dict)


def prune(root: str, min_age_s: float, storage_options: dict | None = None) -> PruneResult:
    """Delete the orphans of every checkpoint folder under ``root`` written
    at least ``min_age_s`` seconds ago (a file of unknown age only with
    ``min_age_s=0``).  A save in flight looks like an interrupted one:
    ``min_age_s`` must exceed the longest save's duration to spare it."""
    options = storage_options or {}
    result = PruneResult()
    for entry in scan(root, options):
        old = [n for n, (_, age) in entry.orphans.items()
               if min_age_s <= 0 or (age is not None and age >= min_age_s)]
        where = entry.uri.rstrip("/")
        for n, (size, _) in entry.orphans.items():
            (result.removed if n in old else result.kept)[f"{where}/{n}"] = size
        if old:
            storage = open_storage(entry.uri, **options)
            with storage_errors(f"{entry.uri!r}: deleting orphaned files"):
                storage.delete(old)
            if entry.name:  # an interrupted save's folder, emptied; never the root given
                storage.remove_if_empty()
    return result


def remove_empty_folder(uri: str, storage_options: dict | None = None) -> None:
    """Remove the folder ``uri`` if nothing is left in it (a filesystem keeps
    an emptied folder; an object store has none to remove:
    :meth:`~dcp.core.storage.StoragePlugin.remove_if_empty`)."""
    open_storage(uri, **(storage_options or {})).remove_if_empty()
