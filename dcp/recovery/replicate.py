"""Bytes between ranks of the memory tier's gloo group, batched into large
messages: never one message per tensor (NVRx broadcasts tensor by tensor;
PGTransport pays about 0.1 ms a tensor here).

Between a sender and a receiver the bytes are one stream (the chunks one
after the other, in an order both know) cut into pieces of
:data:`PIECE_BYTES`.  The receiver posts every receive first, straight into
where the bytes belong (a memory step's copies file, a restore buffer), so
no exchange can deadlock; the sender sends a piece that lies within one of
its buffers as it is, and packs a piece that spans several (small chunks)
into one of two reused buffers (the 64 MiB of transfer buffers of the
memory bound).  Checksums are the callers' (every received chunk is checked
against its CRC-32C before it counts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

#: Bytes of one message; two send buffers of this size at most per rank.
PIECE_BYTES = 32 << 20
#: The smallest message of a throttled exchange.
MIN_PIECE_BYTES = 256 << 10


def piece_bytes(rate: float | None) -> int:
    """Bytes of one message: :data:`PIECE_BYTES`, or at a ``rate`` (bytes
    per second) a twentieth of a second's worth (at least
    :data:`MIN_PIECE_BYTES`), so a throttled stream goes in even steps."""
    if rate is None:
        return PIECE_BYTES
    return max(MIN_PIECE_BYTES, min(PIECE_BYTES, int(rate / 20)))


def _pieces(total: int, piece: int) -> list[tuple[int, int]]:
    return [(o, min(piece, total - o)) for o in range(0, total, piece)]


def post_receives(recvs: Mapping[int, memoryview], group, tag: int = 0,
                  rate: float | None = None) -> dict[int, list]:
    """Post every receive of ``recvs`` (peer ``q`` -> exactly ``len(recvs[q])``
    bytes into ``recvs[q]``) with ``tag``, in the pieces a sender at ``rate``
    sends (:func:`piece_bytes`); returns each peer's works, for
    :func:`wait_receives`."""
    piece = piece_bytes(rate)
    posted: dict[int, list] = {}
    for src in sorted(recvs):
        dest = recvs[src]
        flat = torch.frombuffer(dest, dtype=torch.uint8) if len(dest) else None
        posted[src] = [dist.irecv(flat[off:off + n], group=group, group_src=src, tag=tag)
                       for off, n in _pieces(len(dest), piece) if flat is not None]
    return posted


def send(sends: Mapping[int, Sequence[memoryview]], group, tag: int = 0,
         rate: float | None = None) -> None:
    """Send to each peer ``p`` the bytes of ``sends[p]`` (buffers
    concatenated) with ``tag``, and wait until every piece is sent.  At a
    ``rate`` (bytes per second, all peers together) each piece leaves no
    sooner than the bytes before it allow."""
    piece = piece_bytes(rate)
    start, sent = time.monotonic(), 0
    buffers = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
    pending: list = [None, None]
    direct: list = []  # sends straight from the callers' buffers, alive until the end
    k = 0
    for dst in sorted(sends):
        parts = [p for p in sends[dst] if len(p)]
        total = sum(len(p) for p in parts)
        cursor = [0, 0]  # part index, offset in it
        for _off, n in _pieces(total, piece):
            if rate is not None:
                time.sleep(max(0.0, start + sent / rate - time.monotonic()))
                sent += n
            part = parts[cursor[0]] if cursor[0] < len(parts) else memoryview(b"")
            if len(part) - cursor[1] >= n:  # the piece lies in one part: sent as it is
                direct.append(dist.isend(torch.frombuffer(part[cursor[1]:cursor[1] + n],
                                                          dtype=torch.uint8),
                                         group=group, group_dst=dst, tag=tag))
                cursor = [cursor[0] + 1, 0] if cursor[1] + n == len(part) else \
                    [cursor[0], cursor[1] + n]
                continue
            slot = k % 2
            if pending[slot] is not None:
                pending[slot].wait()
            if buffers[slot].numel() < n:
                buffers[slot] = torch.empty(min(piece, max(n, total)), dtype=torch.uint8)
            buf = buffers[slot][:n]
            filled = 0
            while filled < n:
                part = parts[cursor[0]]
                take = min(n - filled, len(part) - cursor[1])
                buf[filled:filled + take].copy_(torch.frombuffer(
                    part[cursor[1]:cursor[1] + take], dtype=torch.uint8))
                filled += take
                cursor[1] += take
                if cursor[1] == len(part):
                    cursor = [cursor[0] + 1, 0]
            pending[slot] = dist.isend(buf, group=group, group_dst=dst, tag=tag)
            k += 1
    for w in [*pending, *direct]:
        if w is not None:
            w.wait()


def _wait_all(works: list, errors: dict[int, BaseException], src: int) -> None:
    try:
        for w in works:
            w.wait()
    except BaseException as e:  # handed to the caller (a peer gone, gloo's timeout)
        errors[src] = e


def wait_receives(posted: dict[int, list], timeout: float | None = None,
                  keep: list | None = None) -> list[int]:
    """Wait for the receives :func:`post_receives` posted; returns the peers
    whose bytes did not all arrive within ``timeout`` seconds (all of them
    are waited for when ``None``).  Raises what gloo raises for a peer that
    did answer (a peer gone).

    gloo's own bounded wait (``Work.wait(timeout)``) closes every pair of
    the group when it expires, so each peer's receives are waited for on a
    thread of their own and the caller waits for the threads: a late peer's
    thread goes on (appended to ``keep``), its buffers alive, until its
    bytes land or the group's timeout ends it."""
    if timeout is None:
        for works in posted.values():
            for w in works:
                w.wait()
        return []
    errors: dict[int, BaseException] = {}
    threads = {src: threading.Thread(target=_wait_all, args=(works, errors, src), daemon=True,
                                     name=f"dcp-receive-from-{src}")
               for src, works in posted.items()}
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + timeout
    late = []
    for src, t in threads.items():
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            late.append(src)
            if keep is not None:
                keep.append(t)
        elif src in errors:
            raise errors[src]
    return late


def exchange(sends: Mapping[int, Sequence[memoryview]], recvs: Mapping[int, memoryview],
             group, tag: int = 0, rate: float | None = None) -> None:
    """Send to each peer ``p`` (a rank of ``group``) the bytes of
    ``sends[p]`` (buffers concatenated) and receive from each peer ``q``
    exactly ``len(recvs[q])`` bytes into ``recvs[q]``, sending at most
    ``rate`` bytes per second (``None``: as fast as gloo goes; every rank
    of the exchange passes the same).  Collective over the ranks named;
    raises what gloo raises (a peer gone, a timeout)."""
    posted = post_receives(recvs, group, tag, rate)
    send(sends, group, tag, rate)
    wait_receives(posted)
