"""The one retry policy of storage calls: bounded attempts, exponential
backoff with full jitter.

The core runs every data-file write of a save, and every exchange-file write
of the file-flag protocol, through :meth:`RetryPolicy.call` of the storage
plugin's ``retry_policy``; the plugin says which failures are worth another
attempt (:meth:`dcp.core.storage.StoragePlugin.is_transient`).  A plugin whose
backend already retries below the plugin interface (the S3 plugin: botocore
retries each request) reports those failures as final, so no fault is ever
retried by two layers.

The jitter comes from a generator of its own, never Python's global one: a
save in the training process (:func:`dcp.save`, an async save before its
background process is up) must not move the job's random streams, which
the checkpoint manager saves and a resume restores exactly.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

_JITTER = random.Random()  # not the global generator: module doc

#: ``OSError`` numbers that a later attempt may not meet: a full or failing
#: device on a shared filesystem (space is freed, a server fails over), an
#: interrupted or timed-out call, a stale NFS handle, a busy resource.
TRANSIENT_ERRNOS = frozenset({
    errno.EIO, errno.ENOSPC, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.EBUSY,
    errno.ESTALE, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ENETUNREACH,
    errno.EHOSTUNREACH, errno.EDQUOT,
})


def is_transient(error: BaseException) -> bool:
    """The default classification: timeouts, connection errors and
    ``OSError`` with an errno in :data:`TRANSIENT_ERRNOS`."""
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    return isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``max_attempts`` attempts of a call; before attempt ``k``
    (from 2) a sleep drawn uniformly from ``[0, min(max_delay_s,
    base_delay_s * 2 ** (k - 2))]`` seconds ("full jitter", so ranks that
    failed together do not retry together).  With the defaults a call that
    keeps failing gives up after at most 0.05 + 0.1 + 0.2 + 0.4 = 0.75 s of
    sleeping."""

    max_attempts: int = 5
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError(f"invalid retry policy {self}")

    def delay_s(self, attempt: int) -> float:
        """Seconds to sleep before attempt ``attempt`` (2, 3, ...)."""
        return _JITTER.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 2)))

    def call(self, fn: Callable[[], T], transient: Callable[[BaseException], bool]) -> T:
        """``fn()``, attempted again while it raises an exception for which
        ``transient`` holds, at most ``max_attempts`` times in all.  Raises
        the last exception (a non-transient one at once), its ``attempts``
        attribute set to the number of attempts made."""
        attempt = 1
        while True:
            try:
                return fn()
            except Exception as e:  # classified below; anything else propagates unchanged
                if attempt >= self.max_attempts or not transient(e):
                    tagged: Any = e  # any exception type: the count is a foreign attribute
                    tagged.attempts = attempt
                    raise
            attempt += 1
            time.sleep(self.delay_s(attempt))
