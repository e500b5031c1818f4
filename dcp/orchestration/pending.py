"""Saves in flight in this process, so that nothing overtakes them.

:func:`dcp.async_save` registers each save here until it is committed or
has failed.  A new :func:`dcp.async_save` or :func:`dcp.save` first waits for
the save in flight (one save in flight per job), and :func:`dcp.load` waits
for a save in flight to the checkpoint it reads (:func:`wait` with its id).
Other processes never see a partial checkpoint anyway: the metadata is
committed last.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

_lock = threading.Lock()
_in_flight: dict[int, tuple[str, threading.Event]] = {}
_count = 0


def _normalize(checkpoint_id: str) -> str:
    checkpoint_id = str(checkpoint_id)
    if checkpoint_id.startswith("file://"):
        checkpoint_id = checkpoint_id[len("file://"):]
    return os.path.abspath(checkpoint_id) if "://" not in checkpoint_id else checkpoint_id


def begin(checkpoint_id: str) -> Callable[[], None]:
    """Register a save to ``checkpoint_id``; returns the function that marks
    it finished (call it once, whatever the outcome)."""
    global _count
    done = threading.Event()
    with _lock:
        key, _count = _count, _count + 1
        _in_flight[key] = (_normalize(checkpoint_id), done)

    def finish() -> None:
        with _lock:
            _in_flight.pop(key, None)
        done.set()

    return finish


def wait(checkpoint_id: str | None = None) -> None:
    """Block until every save in flight (only those to ``checkpoint_id`` if
    given) has finished.  Saves end on their own: each is bounded by its
    coordination timeout."""
    target = None if checkpoint_id is None else _normalize(checkpoint_id)
    with _lock:
        events = [done for cid, done in _in_flight.values() if target in (None, cid)]
    for done in events:
        done.wait()
