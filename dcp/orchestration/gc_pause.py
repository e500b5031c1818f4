"""Python's cyclic garbage collector paused for the length of a call.

A save or load of many small tensors allocates tens of thousands of plan
objects; each burst of allocations triggers the collector, whose full
collections walk every object of the process — with torch imported, hundreds
of thousands — again and again.  Measured on 4,000 x 1 KiB tensors over 2
ranks: save 0.7-1.2 s with the collector, 0.29-0.36 s without; load 0.9-1.3 s
against 0.45-0.61 s.  The objects of a save or load form no reference cycles
that need collecting while it runs, so the collector is paused during the
call and restored afterwards (a common remedy for allocation-heavy phases,
e.g. Instagram's "Dismissing Python Garbage Collection").
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block if it was enabled
    (reference counting still frees memory as usual); re-enable it after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
