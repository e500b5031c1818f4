"""What lies under a checkpoint manager's root: one folder ``step-<N>`` per
step, the pointer ``latest.json``, the marks of bad steps, and the deletes of
retention.

**Complete** means committed: a step is complete exactly when its
``step-<N>/metadata.json`` exists (it is committed last, atomically), whoever
committed it, a trainer or a background save process that outlived it.

**The pointer** is a hint, never the truth.  Each save of step ``T`` names
``T`` in it *before* its metadata is committed: :class:`NamePointer` is the
save's ``before_commit`` action (:func:`dcp.save`), run by the coordinator of
the save (rank 0's background process for :func:`dcp.async_save`, rank 0's
own process for :func:`dcp.save`), after every rank has written.  It writes
``{"step": T, "save_id": ..., "previous": N}``, ``N`` the newest step
complete at that moment.  So a commit never exists that the pointer does not
name, whether or not the trainer lives on to see it, and a reader
(:func:`newest_step`) takes ``T`` if its metadata exists, else ``N``: two
requests (the pointer and one existence check), three while ``T`` is in
flight or after its save failed, however many steps the root holds
(torchtitan lists every step folder and probes each).  A missing, garbled or
inconsistent pointer (neither step complete; an older hyperdcp's, without
``previous``) falls back to one listing of the root.  If the pointer cannot
be written, the save fails: nothing is committed that no reader could find.

**Forward only.**  The action refuses to commit ``T`` when a step ``>= T`` is
complete already: a background save of an earlier job still running when a
newer job has saved past it, which would otherwise commit an older step
(whose files the newer job's retention may be deleting) and move the
pointer back.  Two saves committing within the same few milliseconds can
still interleave their pointer writes (there is no compare-and-swap on every
storage): the pointer may then name the older of the two, both complete.

**Bad steps.**  A step whose load found it corrupt is *marked bad*
(:func:`mark_bad`): a small ``bad-step.json`` (why, when) is written into
it and its ``metadata.json`` is moved aside to ``metadata.json.bad`` (kept:
rename it back to restore the step), so the step is no longer complete for
anything that asks (``steps()``, ``latest_step()``, retention) and a save
of that step number writes it afresh.  A mark in a folder that holds a
``metadata.json`` (the step saved again) is stale; retention deletes it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dcp.core.metadata import METADATA_FILE, Metadata
from dcp.core.storage import StoragePlugin, open_storage
from dcp.errors import CheckpointError
from dcp.manager.policies import Preservation, StepInfo, to_delete
from dcp.orchestration.inventory import remove_empty_folder
from dcp.orchestration.load import read_metadata

log = logging.getLogger(__name__)

POINTER = "latest.json"
STEP_PREFIX = "step-"
#: The mark :func:`mark_bad` writes into a bad step, and where its metadata goes.
BAD_MARK = "bad-step.json"
BAD_METADATA = f"{METADATA_FILE}.bad"
_STEP_FILE = re.compile(rf"{STEP_PREFIX}(\d+)/(.+)")
#: The manager's own entries in every step: ``_manager.step``, ``.world_size``,
#: ``.dp_degree``, ``.metrics`` and ``.ranks.<rank>`` (one raw blob per rank).
KEY = "_manager"


def step_of(name: str) -> int | None:
    """The step a root-relative file name belongs to, if any."""
    m = _STEP_FILE.fullmatch(name)
    return int(m.group(1)) if m else None


def step_uri(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/{STEP_PREFIX}{step}"


def _files_by_step(names: Iterable[str]) -> dict[int, set[str]]:
    """Each step's files, relative to the step folder."""
    by_step: dict[int, set[str]] = {}
    for n in names:
        m = _STEP_FILE.fullmatch(n)
        if m:
            by_step.setdefault(int(m.group(1)), set()).add(m.group(2))
    return by_step


def complete_steps(names: Iterable[str]) -> list[int]:
    """The committed steps among a root's file names, ascending."""
    return sorted(s for s, files in _files_by_step(names).items() if METADATA_FILE in files)


def bad_steps(names: Iterable[str]) -> list[int]:
    """The steps marked bad among a root's file names, ascending."""
    return sorted(s for s, files in _files_by_step(names).items()
                  if BAD_MARK in files and METADATA_FILE not in files)


def read_pointer(storage: StoragePlugin) -> dict | None:
    """The decoded ``latest.json`` of a root storage, or ``None``."""
    try:
        doc = json.loads(storage.read_file(POINTER))
    except (FileNotFoundError, ValueError):
        return None
    except Exception as e:  # an unreadable pointer is a reason to list, not to fail
        log.warning("hyperdcp: reading %s failed (%s); listing the root", POINTER, e)
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("step"), int) else None


def is_complete(storage: StoragePlugin, step: int) -> bool:
    """Whether ``step`` is committed under the root ``storage`` (one
    existence check)."""
    return storage.exists(f"{STEP_PREFIX}{step}/{METADATA_FILE}")


def newest_step(storage: StoragePlugin, exclude: Iterable[int] = ()) -> int | None:
    """The newest complete step under the root ``storage`` that is not in
    ``exclude``, or ``None``: the pointer's step if complete, else the one
    it names as previous, else (no pointer, neither complete, a failure
    asking, a pointer without ``previous``: an older hyperdcp's, moved after
    each commit by the trainer, which may lag) one listing (module doc).
    Raises :class:`CheckpointError` when the root cannot be listed."""
    skip = set(exclude)
    pointer = read_pointer(storage)
    if pointer is not None and "previous" in pointer:  # else moved after a commit: may lag
        try:
            for step in (pointer["step"], pointer.get("previous")):
                if isinstance(step, int) and step not in skip and is_complete(storage, step):
                    return step
        except Exception as e:  # a failed check is a reason to list, not to fail
            log.warning("hyperdcp: checking the step %s names failed (%s); listing the root",
                        POINTER, e)
    try:
        names = storage.list_files()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{storage.checkpoint_id!r}: listing the root failed: "
                              f"{type(e).__name__}: {e}") from e
    steps = [s for s in complete_steps(names) if s not in skip]
    return steps[-1] if steps else None


@dataclass(frozen=True)
class NamePointer:
    """The ``before_commit`` action of a manager's save of ``step`` under
    ``root`` (module doc): refuses the commit if a step ``>= step`` is
    complete, else names ``step`` in the pointer, the newest complete step
    as its previous.  Picklable: it travels to the background process of
    :func:`dcp.async_save`.  Raises :class:`CheckpointError` (the save then
    fails on every rank, nothing committed)."""

    root: str
    step: int
    storage_options: dict = field(default_factory=dict)

    def __call__(self, md: Metadata) -> None:
        storage = open_storage(self.root, **self.storage_options)
        newest = newest_step(storage)
        if newest is not None and newest >= self.step:
            raise CheckpointError(
                f"step {self.step}: not committed: step {newest} under {self.root!r} is "
                f"complete already, and a step must be newer than the newest (a background "
                f"save of an earlier job that outlived its trainers, or another job saving "
                f"under the same root)")
        doc = json.dumps({"step": self.step, "save_id": md.save_id, "previous": newest})
        try:
            storage.retrying(lambda: storage.commit_file(POINTER, doc.encode(), overwrite=True))
        except Exception as e:
            raise CheckpointError(
                f"step {self.step}: not committed: writing {self.root.rstrip('/')}/{POINTER} "
                f"failed ({type(e).__name__}: {e}), and a step the pointer does not name could "
                f"be missed by load_latest") from e


def mark_bad(storage: StoragePlugin, step: int, reason: str) -> None:
    """Mark ``step`` under the root ``storage`` bad (module doc): its mark
    first, then its metadata moved aside, so that an interruption leaves it
    complete (the next load finds it corrupt again) or marked, never
    half-way.  Raises what the storage raises."""
    folder = f"{STEP_PREFIX}{step}/"
    try:
        data: bytes | None = storage.read_file(folder + METADATA_FILE)
    except FileNotFoundError:
        data = None
    mark = {"step": step, "reason": reason, "marked_at": time.time(),
            "metadata": BAD_METADATA if data is not None else None}
    storage.commit_file(folder + BAD_MARK, json.dumps(mark).encode(), overwrite=True)
    if data is not None:
        storage.commit_file(folder + BAD_METADATA, data, overwrite=True)
    storage.delete([folder + METADATA_FILE])


def read_bad_mark(storage: StoragePlugin, folder: str = "") -> dict | None:
    """The mark of a bad step (``folder``: the step's folder relative to
    ``storage``, ``""`` where ``storage`` is the step's own), or ``None``
    where the step is not marked bad (no mark, or a committed metadata)."""
    try:
        if storage.exists(folder + METADATA_FILE):
            return None
        mark = json.loads(storage.read_file(folder + BAD_MARK))
    except (FileNotFoundError, ValueError):
        return None
    return mark if isinstance(mark, dict) else {"reason": "unreadable mark"}


def prune_steps(root: str, preservation: Preservation, storage_options: dict | None = None,
                in_flight: int | None = None,
                metrics: dict[int, dict] | None = None) -> list[int]:
    """Delete the committed steps under ``root`` that ``preservation`` lets
    go (never the newest, never ``in_flight``), the files of incomplete
    steps older than the newest complete one (bad steps among them) and
    stale marks; returns the steps deleted.  ``metrics``: known metrics by
    step (others are read from the metadata when the policy asks for
    metrics)."""
    options = storage_options or {}
    storage = open_storage(root, **options)
    names = storage.list_files()
    by_step = _files_by_step(names)
    complete = complete_steps(names)
    known = dict(metrics or {})
    infos = []
    for s in complete:
        if s not in known and _needs_metrics(preservation):
            known[s] = _metrics_of(read_metadata(step_uri(storage.checkpoint_id, s),
                                                 storage_options=options))
        infos.append(StepInfo(s, known.get(s, {})))
    doomed = set(to_delete(preservation, infos, in_flight))
    newest = complete[-1] if complete else None
    incomplete = {s for s in by_step if s not in complete and s != in_flight
                  and newest is not None and s < newest}
    for s in sorted(doomed | incomplete):
        _delete_step(storage, s, by_step[s], options)
    stale = [f"{STEP_PREFIX}{s}/{n}" for s in complete if s not in doomed
             for n in (BAD_MARK, BAD_METADATA) if n in by_step[s]]
    storage.delete(stale)
    return sorted(doomed | incomplete)


def delete_bad_steps(root: str, storage_options: dict | None = None) -> tuple[list[int], list[int]]:
    """``hyperdcp prune``'s last part: delete the marks (and the kept
    metadata) of the bad steps under ``root`` that hold nothing else, and
    their folders.  A bad step's data files are orphans (no metadata uses
    them), deleted before by :func:`dcp.orchestration.inventory.prune` once
    old enough; a bad step still holding any other file may be saved
    afresh right now, and is left.  Returns the steps deleted and those left."""
    options = storage_options or {}
    storage = open_storage(root, **options)
    names = storage.list_files()
    by_step = _files_by_step(names)
    deleted, left = [], []
    for s in bad_steps(names):
        if by_step[s] <= {BAD_MARK, BAD_METADATA}:
            _delete_step(storage, s, by_step[s], options)
            deleted.append(s)
        else:
            left.append(s)
    return deleted, left


def _delete_step(storage: StoragePlugin, step: int, files: set[str], options: dict) -> None:
    """Delete the files of ``step`` (relative to its folder), its metadata
    first: from then on the step is not complete; then its emptied folder."""
    folder = f"{STEP_PREFIX}{step}/"
    storage.delete([folder + METADATA_FILE] if METADATA_FILE in files else [])
    storage.delete(folder + n for n in files if n != METADATA_FILE)
    remove_empty_folder(step_uri(storage.checkpoint_id, step), options)


def _needs_metrics(policy: Any) -> bool:
    inner = getattr(policy, "policies", None)
    if inner is not None:
        return any(_needs_metrics(p) for p in inner)
    return hasattr(policy, "metric")


def _metrics_of(md: Metadata) -> dict:
    prefix = f"{KEY}.metrics."
    return {k[len(prefix):]: o.value for k, o in md.objects.items() if k.startswith(prefix)}
