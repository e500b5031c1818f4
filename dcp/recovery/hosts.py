"""The ranks of a job as the memory tier sees them: its own gloo groups (the
memory saves' transfers run in the background on one, apart from training's
collectives; a persist of a memory step to the persistent tier on the
other, so it runs beside the next memory saves), the host of every rank,
each host's failure domain and this host's
:class:`~dcp.recovery.host_store.HostStore`.

Identity is the run id and the hosts' names, never process ids or rank
numbers: a restarted job may put other ranks on a host, or come back at
another world size, and still finds the memory steps its hosts hold.
"""

from __future__ import annotations

import datetime
import hashlib
import threading

import numpy as np
import torch.distributed as dist

from dcp.errors import CheckpointError, MemoryTierError
from dcp.recovery.host_store import HostStore
from dcp.recovery.tier import MemoryTier


def run_id_of(root: str) -> str:
    """The run id of a manager's root, when the tier names none."""
    return "run-" + hashlib.sha256(root.encode()).hexdigest()[:16]


class TierGroup:
    """Collective: every rank of ``process_group`` (the default group if
    ``None``) constructs it, in the same order as its other groups."""

    def __init__(self, tier: MemoryTier, root: str, process_group=None) -> None:
        self.tier = tier
        self.run_id = tier.run_id if tier.run_id is not None else run_id_of(root)
        self.host = tier.host_name
        ranks = (dist.get_process_group_ranks(process_group) if process_group is not None
                 else list(range(dist.get_world_size())))
        timeout = datetime.timedelta(seconds=tier.timeout)
        self.group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        #: the persists' group: a persist never interleaves with a memory step
        self.persist_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.store = HostStore(tier.folder, self.run_id, self.host,
                               spares=tier.host_bytes is None)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (self.host, tier.bandwidth, self.store.unwritable()),
                               group=self.group)
        names = [h for h, _, _ in gathered]
        rates = {b for _, b, _ in gathered}
        if len(rates) > 1:
            raise CheckpointError(
                f"MemoryTier(bandwidth=...) differs across ranks ("
                f"{', '.join(f'rank {r}: {b}' for r, (_, b, _) in enumerate(gathered))}): every "
                f"rank sends and receives a memory step's copies in the same pieces")
        unwritable = [f"rank {r} (host {h}): {why}" for r, (h, _, why) in enumerate(gathered)
                      if why]
        if unwritable:
            raise MemoryTierError(f"the memory tier's namespace cannot be written on "
                                  f"{'; '.join(unwritable)}")
        #: host names in order of first rank; ``rank_host[r]`` indexes them
        self.hosts: list[str] = list(dict.fromkeys(names))
        index = {h: i for i, h in enumerate(self.hosts)}
        self.rank_host = np.array([index[h] for h in names], dtype=np.int64)
        domains = [tier.domain(h) for h in self.hosts]
        dindex = {d: i for i, d in enumerate(dict.fromkeys(domains))}
        self.host_domain = np.array([dindex[d] for d in domains], dtype=np.int64)
        self.my_host = int(self.rank_host[self.rank])
        #: the lowest rank of this host: it commits the host's steps
        self.leader = int(np.flatnonzero(self.rank_host == self.my_host)[0]) == self.rank
        #: the last tag a restore's transfers used (memory saves use 0)
        self._tag = 0
        #: a restore's transfers still in flight (late holders, slow sends)
        self.transfers: list[threading.Thread] = []

    def next_tag(self) -> int:
        """A tag no earlier transfer of this group used (collective order:
        every rank calls it alike), so bytes a late holder sends land in the
        buffers kept for them, never in a later exchange's."""
        self._tag += 1
        return self._tag

    def drain(self) -> None:
        """Wait for the restores' transfers still in flight (each ends when
        its bytes land, or at the group's timeout)."""
        for t in self.transfers:
            t.join()
        self.transfers.clear()

    def all_gather(self, value) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out
