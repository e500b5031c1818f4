"""The memory tier's policy: how often a memory step is taken, how many
copies leave a host, which hosts count as one failure domain, where a host
keeps its steps and how much memory it may use.

A *host* is the unit that fails together (its processes and its shared
memory); by default it is the machine (``socket.gethostname()``) and its
namespace is ``/dev/shm/hyperdcp-memory``.  Tests and the demo simulate
several hosts on one machine by giving each group of ranks its own ``host``
name and ``namespace`` folder: losing a host is then killing its processes
and deleting its folder.  A failure domain (a rack, a power or network
group) is a set of hosts given by ``domains``; copies of a chunk land in
domains other than its own (as Gemini groups machines for its replicas, and
NVRx places copies a node apart).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dcp.errors import CheckpointError, SilentDataCorruptionError

#: Where a host keeps its memory steps unless ``MemoryTier(namespace=...)`` says.
DEFAULT_NAMESPACE = "/dev/shm/hyperdcp-memory"


@dataclass(frozen=True)
class MemoryTier:
    """Policy of the host-memory tier of :class:`dcp.CheckpointManager`.

    Args:
        interval: take a memory step when ``step % interval == 0`` (every
            step by default).
        replicas: copies, on other hosts, of each chunk whose every holder
            is on one host (chunks held on two or more hosts, such as
            data-parallel replicas, are copies already and cost nothing).
        domains: ``{host: failure domain}`` (a rack, a group of hosts);
            hosts not named are each their own domain.
        host: this rank's host identity (default: the machine's name).
        namespace: the folder in host shared memory holding this host's
            memory steps (default :data:`DEFAULT_NAMESPACE`); one folder per
            run id under it.
        host_bytes: the most bytes the memory steps of this run may hold on
            one host, the step being saved included (``None``: only the
            namespace's free space limits); a save over it is refused: a
            :class:`dcp.errors.MemoryTierError` in the manager's ``errors``,
            warned on every rank as any failed save is, training going on.
        run_id: the run's identity under the namespace (default: derived
            from the manager's root), so a job never restores another
            run's memory steps.
        timeout: seconds a memory save's or a restore's transfers may wait
            for a peer (the tier's own gloo group's timeout).
        bandwidth: bytes per second each rank may send of a memory step's
            copies to other hosts (``None``: as fast as the network goes).
            The copies go in messages of a twentieth of a second's worth,
            each no sooner than the rate allows, so they leave the network
            to training's collectives; a memory step then takes at least its
            copies' bytes / ``bandwidth`` to commit, and the next memory
            save waits for that.  Checksums, restores and persists are not
            throttled (a persist goes at its storage's pace).  Every rank
            must give the same (checked when the manager starts).
        restore_timeout: seconds a restore waits for the chunks another
            host's rank serves it; a holder that has not sent them all by
            then is passed over for those chunks, which come from their
            next source (another holder, then the persistent tier), and is
            named in :attr:`dcp.recovery.restore.RestoreReport.late_holders`
            (warned by the manager).  Its late bytes land in buffers kept
            for them until they arrive or ``timeout`` ends them.
        on_corruption: called with the
            :class:`dcp.errors.SilentDataCorruptionError` of a memory save
            instead of raising it from the next manager call.
    """

    interval: int = 1
    replicas: int = 1
    domains: Mapping[str, str] | None = None
    host: str | None = None
    namespace: str | os.PathLike[str] | None = None
    host_bytes: int | None = None
    run_id: str | None = None
    timeout: float = 60.0
    restore_timeout: float = 10.0
    bandwidth: float | None = None
    on_corruption: Callable[[SilentDataCorruptionError], None] | None = field(
        default=None, compare=False)

    def __post_init__(self) -> None:
        for name, low in (("interval", 1), ("replicas", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise CheckpointError(f"MemoryTier({name}={value!r}): an integer >= {low}")
        for name, unit, optional in (("timeout", "seconds", False),
                                     ("restore_timeout", "seconds", False),
                                     ("bandwidth", "bytes per second", True),
                                     ("host_bytes", "bytes", True)):
            value = getattr(self, name)
            if (value is None and optional) or (
                    isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                continue
            raise CheckpointError(f"MemoryTier({name}={value!r}): {unit}, > 0"
                                  f"{', or None' if optional else ''}")
        for name in ("host", "run_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise CheckpointError(f"MemoryTier({name}={value!r}): a non-empty string, or "
                                      f"None (the default)")
        if self.namespace is not None and not (
                isinstance(self.namespace, (str, os.PathLike)) and os.fspath(self.namespace)):
            raise CheckpointError(f"MemoryTier(namespace={self.namespace!r}): a folder's path, "
                                  f"or None ({DEFAULT_NAMESPACE})")
        if self.domains is not None and not (
                isinstance(self.domains, Mapping) and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in self.domains.items())):
            raise CheckpointError(f"MemoryTier(domains={self.domains!r}): a mapping of host "
                                  f"name to failure domain name (strings), or None")
        if self.on_corruption is not None and not callable(self.on_corruption):
            raise CheckpointError(f"MemoryTier(on_corruption={self.on_corruption!r}): a "
                                  f"callable taking the SilentDataCorruptionError, or None")

    @property
    def host_name(self) -> str:
        return self.host if self.host is not None else socket.gethostname()

    @property
    def folder(self) -> Path:
        return Path(self.namespace if self.namespace is not None else DEFAULT_NAMESPACE)

    def domain(self, host: str) -> str:
        """The failure domain of ``host``."""
        if self.domains is not None and host in self.domains:
            return str(self.domains[host])
        return f"host:{host}"
