"""Where the chunks of a memory step live, and where a restore takes them
from: pure functions over numpy columns, no processes (fast at 10,240
ranks, as :mod:`dcp.core.plan_columns` is for save plans).

**Save** (:func:`place`).  Chunk ``c`` is held by some ranks; their hosts
hold it.  On each holding host one rank writes it to the host's memory (the
lowest holding rank there): data-parallel replicas on one host are stored
once.  A chunk held on two or more hosts has its copies already.  A chunk
whose every holder is on one host is copied to ``replicas`` other hosts,
each in a failure domain of its own: hosts are laid on a ring interleaving
the domains, and a host's copies go to the next hosts of the ring whose
domains are not used yet (NVRx places its copies a node apart; Gemini
groups machines for its replicas).  On a target host the chunks are spread
over its ranks by chunk id, so the receive work is shared.

**Restore** (:func:`sources`).  Each chunk a rank needs comes from the
cheapest source that has not failed it yet: its own host's memory, then the
other hosts holding it (a different one first for each requester, so the
load is spread over holders), then the persistent tier (``PERSISTENT``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: ``sources()``'s kinds.
OWN, PEER, PERSISTENT = 0, 1, 2


@dataclass
class Placement:
    """A memory step's placement (columns of equal length within a group).

    ``own_*``: each (chunk, host) holding, with its writer rank.
    ``copy_*``: each copy sent off a host: the chunk, the rank sending it
    (its writer), the target host and the rank receiving it there.
    """

    own_chunk: np.ndarray
    own_host: np.ndarray
    own_rank: np.ndarray
    copy_chunk: np.ndarray
    copy_src: np.ndarray
    copy_host: np.ndarray
    copy_dst: np.ndarray


def _host_ranks(rank_host: np.ndarray, n_hosts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of the ranks of each host: ``(ranks sorted by host, start, count)``."""
    order = np.argsort(rank_host, kind="stable")
    count = np.bincount(rank_host, minlength=n_hosts)
    start = np.concatenate(([0], np.cumsum(count)[:-1]))
    return order.astype(np.int64), start.astype(np.int64), count.astype(np.int64)


def ring(host_domain: np.ndarray) -> np.ndarray:
    """Hosts in ring order, the domains interleaved: the ``i``-th host of
    every domain, then the ``i+1``-th, so neighbours differ in domain
    wherever domains are of equal size."""
    n = len(host_domain)
    order = np.lexsort((np.arange(n), host_domain))  # by domain, then host
    sorted_dom = host_domain[order]
    first = np.searchsorted(sorted_dom, sorted_dom, side="left")
    within = np.arange(n) - first  # index of the host within its domain
    return order[np.lexsort((sorted_dom, within))]


def copy_targets(host_domain: np.ndarray, replicas: int) -> np.ndarray:
    """``[n_hosts, k]`` target hosts of each host's copies (``k`` =
    ``replicas``, or fewer where there are fewer other hosts; ``-1`` pads):
    the next hosts of the :func:`ring` in domains not used yet, then, where
    the domains run out, in other hosts of used domains."""
    n = len(host_domain)
    k = min(replicas, n - 1)
    out = np.full((n, max(k, 0)), -1, dtype=np.int64)
    if k <= 0:
        return out
    order = ring(host_domain)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    for h in range(n):
        used = {int(host_domain[h])}
        chosen: list[int] = []
        later: list[int] = []
        for step in range(1, n):
            t = int(order[(pos[h] + step) % n])
            if int(host_domain[t]) in used:
                later.append(t)
                continue
            used.add(int(host_domain[t]))
            chosen.append(t)
            if len(chosen) == k:
                break
        chosen += later[:k - len(chosen)]
        out[h, :len(chosen)] = chosen
    return out


def place(holder_chunk: np.ndarray, holder_rank: np.ndarray, rank_host: np.ndarray,
          host_domain: np.ndarray, replicas: int) -> Placement:
    """The placement of a memory step.

    Args:
        holder_chunk, holder_rank: int64 ``[n]``: rank ``holder_rank[i]``
            holds chunk ``holder_chunk[i]`` (chunks numbered ``0..C-1``).
        rank_host: int64 ``[world]``: each rank's host (``0..H-1``).
        host_domain: int64 ``[H]``: each host's failure domain.
        replicas: copies of each single-host chunk on other hosts.
    """
    hc = np.asarray(holder_chunk, dtype=np.int64)
    hr = np.asarray(holder_rank, dtype=np.int64)
    rank_host = np.asarray(rank_host, dtype=np.int64)
    host_domain = np.asarray(host_domain, dtype=np.int64)
    hh = rank_host[hr]
    order = np.lexsort((hr, hh, hc))  # by chunk, host, rank
    hc, hh, hr = hc[order], hh[order], hr[order]
    first = np.ones(len(hc), dtype=bool)
    first[1:] = (hc[1:] != hc[:-1]) | (hh[1:] != hh[:-1])
    own_chunk, own_host, own_rank = hc[first], hh[first], hr[first]
    n_chunks = int(own_chunk.max()) + 1 if len(own_chunk) else 0
    hosts_per_chunk = np.bincount(own_chunk, minlength=n_chunks)
    single = hosts_per_chunk[own_chunk] == 1
    s_chunk, s_host, s_rank = own_chunk[single], own_host[single], own_rank[single]
    targets = copy_targets(host_domain, replicas)
    members, start, count = _host_ranks(rank_host, len(host_domain))
    k = targets.shape[1]
    c_chunk = np.repeat(s_chunk, k)
    c_src = np.repeat(s_rank, k)
    c_host = targets[s_host].reshape(-1)
    keep = c_host >= 0
    c_chunk, c_src, c_host = c_chunk[keep], c_src[keep], c_host[keep]
    c_dst = members[start[c_host] + c_chunk % count[c_host]]
    return Placement(own_chunk, own_host, own_rank, c_chunk, c_src, c_host, c_dst)


def holdings(held_host: np.ndarray, held_chunk: np.ndarray, n_chunks: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of the hosts holding each chunk: ``(hosts sorted by chunk, start,
    count)`` from ``(host, chunk)`` pairs (duplicates dropped)."""
    key = np.unique(np.asarray(held_chunk, np.int64) * (1 << 32) + np.asarray(held_host, np.int64))
    chunk, host = key >> 32, key & ((1 << 32) - 1)
    count = np.bincount(chunk, minlength=n_chunks).astype(np.int64)
    start = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
    return host, start, count


def sources(need_rank: np.ndarray, need_chunk: np.ndarray, attempt: np.ndarray,
            rank_host: np.ndarray, held: tuple[np.ndarray, np.ndarray, np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray]:
    """The source of each needed chunk at its ``attempt`` (0 first, one more
    after each failed try): ``(kind, host)``, kind :data:`OWN` (the
    requester's host), :data:`PEER` (``host``, another host holding it) or
    :data:`PERSISTENT` (``host`` ``-1``).  Attempt 0 is the own host where it
    holds the chunk; then each other holder once, starting at a holder that
    depends on the requester, so requesters spread over holders.

    ``held``: :func:`holdings` of the surviving hosts; ``rank_host``: the
    host of each rank of the restoring world.
    """
    hosts, start, count = held
    need_rank = np.asarray(need_rank, np.int64)
    need_chunk = np.asarray(need_chunk, np.int64)
    attempt = np.asarray(attempt, np.int64)
    own = np.asarray(rank_host, np.int64)[need_rank]
    n = count[need_chunk]
    s = start[need_chunk]
    # position of the own host among the chunk's holders (hosts sorted per chunk)
    if len(hosts):
        key = need_chunk * (1 << 32) + own
        all_key = np.repeat(np.arange(len(count), dtype=np.int64), count) * (1 << 32) + hosts
        at = np.minimum(np.searchsorted(all_key, key), len(hosts) - 1)
        has_own = all_key[at] == key
        own_pos = at - s
    else:
        has_own = np.zeros(len(need_chunk), dtype=bool)
        own_pos = np.zeros(len(need_chunk), dtype=np.int64)
    own_flag = has_own.astype(np.int64)
    peers = n - own_flag
    p = attempt - own_flag  # index among the peers, for attempts past the own host
    kind = np.full(len(need_chunk), PERSISTENT, dtype=np.int64)
    host = np.full(len(need_chunk), -1, dtype=np.int64)
    is_own = has_own & (attempt == 0)
    kind[is_own] = OWN
    host[is_own] = own[is_own]
    is_peer = ~is_own & (p >= 0) & (p < peers)
    j = np.where(is_peer, (need_rank + np.maximum(p, 0)) % np.maximum(peers, 1), 0)
    j = np.where(has_own & (j >= own_pos), j + 1, j)  # skip the own host in the list
    kind[is_peer] = PEER
    host[is_peer] = hosts[(s + j)[is_peer]] if len(hosts) else -1
    return kind, host


def server(host: np.ndarray, chunk: np.ndarray, requester: np.ndarray,
           rank_host: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The rank of ``host`` that serves ``chunk`` to ``requester`` (int64
    columns of equal length; ``nbytes[i]``: row ``i``'s bytes): the rows
    asked of each host, ordered by requester and chunk, cut into one
    contiguous run of about equal bytes per rank of the host.  Each rank
    serves about ``1/count`` of its host's bytes, in few streams (a
    requester's chunks from one or two servers, not a message per chunk
    from each).  The same on every rank for the same columns."""
    rank_host = np.asarray(rank_host, np.int64)
    host = np.asarray(host, np.int64)
    nbytes = np.asarray(nbytes, np.int64)
    n_hosts = int(max(rank_host.max(initial=-1), np.max(host, initial=-1))) + 1
    members, start, count = _host_ranks(rank_host, n_hosts)
    out = np.empty(len(host), dtype=np.int64)
    if not len(host):
        return out
    order = np.lexsort((np.asarray(chunk), np.asarray(requester), host))
    h, b = host[order], nbytes[order].astype(np.float64)
    first = np.ones(len(h), dtype=bool)
    first[1:] = h[1:] != h[:-1]
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    csum = np.cumsum(b)
    before = csum - b - np.concatenate(([0.0], csum))[starts][group]  # bytes earlier in the host
    total = np.add.reduceat(b, starts)[group]
    k = count[h]
    mid = before + b / 2
    slot = np.where(total > 0, np.floor(mid * k / np.maximum(total, 1)), np.arange(len(h)) % k)
    slot = np.minimum(slot.astype(np.int64), k - 1)
    out[order] = members[start[h] + slot]
    return out
