"""The memory tier's decisions without processes: placement of copies
(distinct failure domains, data-parallel replicas left alone), restore
sources (own host, other holders spread, persistent last), the SDC
comparison, at small and at 10,240-rank scale."""

from __future__ import annotations

import time

import numpy as np

from dcp.recovery import placement, sdc
from dcp.recovery.placement import OWN, PEER, PERSISTENT


def _hosts(world: int, per_host: int) -> np.ndarray:
    return np.arange(world, dtype=np.int64) // per_host


def test_replicas_on_two_hosts_cost_nothing_and_single_host_chunks_are_copied() -> None:
    # 4 ranks, hosts {0,1} {2,3}; chunk 0 on every rank (replicated), chunk 1
    # on ranks 0 and 2 (data-parallel pair across hosts), chunk 2 on ranks 0
    # and 1 (both on host 0), chunk 3 on rank 3 only
    hc = np.array([0, 0, 0, 0, 1, 1, 2, 2, 3])
    hr = np.array([0, 1, 2, 3, 0, 2, 0, 1, 3])
    p = placement.place(hc, hr, _hosts(4, 2), np.array([0, 1]), replicas=1)
    writers = sorted(zip(p.own_chunk.tolist(), p.own_host.tolist(), p.own_rank.tolist(),
                         strict=True))
    assert writers == [(0, 0, 0), (0, 1, 2), (1, 0, 0), (1, 1, 2), (2, 0, 0), (3, 1, 3)]
    copies = sorted(zip(p.copy_chunk.tolist(), p.copy_src.tolist(), p.copy_host.tolist(),
                        strict=True))
    assert copies == [(2, 0, 1), (3, 3, 0)]  # only the single-host chunks, once each
    assert set(p.copy_dst.tolist()) <= {0, 1, 2, 3}
    assert all(h != s // 2 for h, s in zip(p.copy_host.tolist(), p.copy_src.tolist(),
                                           strict=True))


def test_copies_land_in_distinct_failure_domains() -> None:
    # 8 hosts in 4 racks of 2 (hosts 2k, 2k+1 share rack k); 2 replicas
    domain = np.arange(8) // 2
    targets = placement.copy_targets(domain, replicas=2)
    for h in range(8):
        ds = {int(domain[h])} | {int(domain[t]) for t in targets[h]}
        assert len(ds) == 3, (h, targets[h])  # own rack and two others
    # only 2 domains: the second copy goes to another host of a used domain
    targets = placement.copy_targets(np.array([0, 0, 1, 1]), replicas=2)
    for h in range(4):
        assert h not in targets[h].tolist() and len(set(targets[h].tolist())) == 2
        assert {int(t) // 2 for t in targets[h]} != {h // 2}


def test_sources_try_own_host_then_each_holder_then_persistent() -> None:
    held = placement.holdings(np.array([0, 1, 2]), np.array([5, 5, 5]), 6)
    rank_host = np.array([0, 1, 2, 3])  # rank r on host r; host 3 holds nothing
    for r, kinds in [(0, [OWN, PEER, PEER, PERSISTENT]), (3, [PEER, PEER, PEER, PERSISTENT])]:
        got = [placement.sources(np.array([r]), np.array([5]), np.array([a]), rank_host, held)
               for a in range(4)]
        assert [int(k[0]) for k, _ in got] == kinds
        peers = [int(h[0]) for k, h in got if int(k[0]) == PEER]
        assert len(set(peers)) == len(peers) and r not in peers  # each other holder once
        assert int(got[0][1][0]) == (0 if r == 0 else int(got[0][1][0]))
    # requesters spread over holders: the first peer differs by requester
    first = placement.sources(np.arange(4) + 0, np.full(4, 5), np.ones(4, np.int64),
                              np.array([3, 3, 3, 3]), held)
    assert len(set(first[1].tolist())) == 3
    # a chunk nobody holds: persistent at once
    kind, host = placement.sources(np.array([0]), np.array([4]), np.array([0]), rank_host, held)
    assert int(kind[0]) == PERSISTENT and int(host[0]) == -1


def test_the_ranks_of_a_host_serve_equal_bytes_in_few_streams() -> None:
    # hosts {0,1} {2,3}: host 1 lost; rank 2 needs the even chunks, rank 3
    # the odd ones (tensor-parallel blocks), all of them on host 0
    rank_host = _hosts(4, 2)
    req = np.repeat([2, 3], 16)
    chunk = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])
    host = np.zeros(32, dtype=np.int64)
    served = placement.server(host, chunk, req, rank_host, np.full(32, 1 << 20))
    # one server per requester, each half of the bytes (not every chunk from
    # rank 0, as a spread by chunk + requester parity gave)
    assert served.tolist() == [0] * 16 + [1] * 16
    # unequal chunks: each server's bytes within one chunk of an equal share
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 100, 32) * 1000
    served = placement.server(host, chunk, req, rank_host, sizes)
    share = [int(sizes[served == r].sum()) for r in (0, 1)]
    assert abs(share[0] - share[1]) <= 2 * sizes.max(), share
    # the rows' order does not change who serves a row
    perm = rng.permutation(32)
    again = placement.server(host[perm], chunk[perm], req[perm], rank_host, sizes[perm])
    assert again.tolist() == served[perm].tolist()
    # two hosts asked at once: each host's rows served by its own ranks
    served = placement.server(np.array([0, 1, 0, 1]), np.array([5, 6, 7, 8]),
                              np.array([2, 0, 3, 1]), rank_host, np.full(4, 10))
    assert [rank_host[s] for s in served] == [0, 1, 0, 1]


def test_transfer_pieces_keep_large_parts_whole_and_pack_runs_of_small_ones() -> None:
    from dcp.recovery.replicate import PACK_BYTES, pieces

    small, big = 1000, 2 * PACK_BYTES + 5
    got = pieces([small, small, 0, big, small, 0], PACK_BYTES)
    # a packed piece of the two small parts, the large part in pieces of its
    # own (never mixed with its neighbours), then the last small part
    assert got == [(0, 2 * small), (2 * small, PACK_BYTES), (2 * small + PACK_BYTES, PACK_BYTES),
                   (2 * small + 2 * PACK_BYTES, 5), (2 * small + big, small)]
    # pieces cover the stream once, in order
    sizes = [7, PACK_BYTES, 3 * PACK_BYTES // 2, 1, 2, PACK_BYTES - 1, 0, 4 * PACK_BYTES]
    got = pieces(sizes, PACK_BYTES)
    assert sum(n for _, n in got) == sum(sizes)
    assert all(a + n == b for (a, n), (b, _) in zip(got, got[1:], strict=False))
    assert max(n for _, n in got) <= PACK_BYTES and pieces([], PACK_BYTES) == []


def test_sdc_names_the_odd_one_out() -> None:
    chunk = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    rank = np.array([0, 1, 2, 0, 1, 0, 1, 2])
    crc = np.array([7, 7, 9, 3, 4, 5, 5, 5])
    names = ["a", "b", "c"]
    boxes = [((0,), (4,)), ((4,), (4,)), ((0,), (8,))]
    err = sdc.compare(chunk, rank, crc, names, boxes, step=3)
    assert err is not None
    assert err.mismatches == [("a", (0,), {0: 7, 1: 7, 2: 9}, 2), ("b", (4,), {0: 3, 1: 4}, None)]
    assert "'a' chunk at offsets [0]" in str(err) and "rank 2 is the odd one out" in str(err)
    assert "two holders" in str(err) and "memory step 3" in str(err)
    assert sdc.compare(chunk[5:], rank[5:], crc[5:], names, boxes, 3) is None


def test_bookkeeping_at_10240_ranks() -> None:
    """Placement and a restore's source plan at 10,240 ranks (8 a host,
    DP8 x TP8 x PP16-like: 64 chunks a rank, each held by the 8 ranks of its
    data-parallel group spread over hosts, plus 8 rank-private ones), one
    host lost: every chunk still has a memory source.  The speed target is
    benchmarks/recovery.py's; here a generous bound catches a quadratic."""
    world, per_host = 10240, 8
    rank = np.arange(world)
    rank_host = _hosts(world, per_host)
    hosts = world // per_host
    # shared chunks: rank r holds chunks of group (r % 1280), 64 of them
    shared_c = (rank[:, None] % 1280) * 64 + np.arange(64)[None, :]
    private_c = 1280 * 64 + rank[:, None] * 8 + np.arange(8)[None, :]
    hc = np.concatenate([shared_c.ravel(), private_c.ravel()])
    hr = np.concatenate([np.repeat(rank, 64), np.repeat(rank, 8)])
    t0 = time.perf_counter()
    p = placement.place(hc, hr, rank_host, np.arange(hosts) // 4, replicas=1)
    n_chunks = int(hc.max()) + 1
    held_host = np.concatenate([p.own_host, p.copy_host])
    held_chunk = np.concatenate([p.own_chunk, p.copy_chunk])
    alive = held_host != 7  # host 7 lost
    held = placement.holdings(held_host[alive], held_chunk[alive], n_chunks)
    kind, host = placement.sources(hr, hc, np.zeros(len(hc), np.int64), rank_host, held)
    elapsed = time.perf_counter() - t0
    assert len(p.copy_chunk) == world * 8  # only the private chunks are copied
    assert not (kind == PERSISTENT).any()
    lost = rank_host[hr] == 7
    assert (kind[lost] == PEER).all() and (kind[~lost] == OWN).all()
    assert elapsed < 30, elapsed
