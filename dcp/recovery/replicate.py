"""Bytes between ranks of the memory tier's gloo group, batched into large
messages: never one message per tensor (NVRx broadcasts tensor by tensor;
PGTransport pays about 0.1 ms a tensor here).

Between a sender and a receiver the bytes are one stream: parts (chunks)
one after the other, in an order both know, of sizes both know.  Both cut
it alike (:func:`pieces`): a part of :data:`PACK_BYTES` or more goes in
pieces of its own (of :data:`PIECE_BYTES` at most), runs of smaller parts
in packed pieces.  The receiver posts every receive first, straight into
where each part belongs (a memory step's copies file, a restore's
buffer), so no exchange can deadlock; a packed piece lands in a buffer and
is copied out to its parts.  The sender sends a piece of one part as it is
and packs a packed piece into one of two reused buffers (the 64 MiB of
transfer buffers of the memory bound).  Checksums are the callers' (every
received chunk is checked against its CRC-32C before it counts).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

#: Bytes of one message; two send buffers of this size at most per rank.
PIECE_BYTES = 32 << 20
#: The smallest message of a throttled exchange.
MIN_PIECE_BYTES = 256 << 10
#: Parts at least this large go in pieces of their own (smaller ones packed).
PACK_BYTES = 1 << 20


def piece_bytes(rate: float | None) -> int:
    """Bytes of one message: :data:`PIECE_BYTES`, or at a ``rate`` (bytes
    per second) a twentieth of a second's worth (at least
    :data:`MIN_PIECE_BYTES`), so a throttled stream goes in even steps."""
    if rate is None:
        return PIECE_BYTES
    return max(MIN_PIECE_BYTES, min(PIECE_BYTES, int(rate / 20)))


def pieces(sizes: Sequence[int], piece: int) -> list[tuple[int, int]]:
    """The pieces ``(stream offset, bytes)`` of a stream of parts of
    ``sizes``: each part of :data:`PACK_BYTES` or more cut into pieces of
    ``piece`` bytes at most, each run of smaller parts between them into
    packed pieces of ``piece`` bytes at most."""
    out: list[tuple[int, int]] = []
    offset = run_start = run = 0

    def cut(start: int, n: int) -> None:
        out.extend((start + o, min(piece, n - o)) for o in range(0, n, piece))

    for n in sizes:
        if n < PACK_BYTES:
            run_start, run = (offset, n) if not run else (run_start, run + n)
        else:
            cut(run_start, run)
            run = 0
            cut(offset, n)
        offset += n
    cut(run_start, run)
    return out


class _Stream:
    """The parts of one side of a stream, located by stream offset."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self.parts = list(parts)
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))

    def within(self, offset: int, n: int) -> memoryview | None:
        """The bytes ``[offset, offset + n)`` as a view of one part, if they
        lie in one, else ``None``."""
        k = bisect.bisect_right(self.starts, offset) - 1  # the last part starting at or before
        if k >= len(self.parts):
            return None
        rel = offset - self.starts[k]
        return self.parts[k][rel:rel + n] if rel + n <= len(self.parts[k]) else None

    def spans(self, offset: int, n: int) -> list[tuple[int, memoryview]]:
        """``(offset in the piece, view)`` of each part's share of
        ``[offset, offset + n)``."""
        out = []
        k = bisect.bisect_right(self.starts, offset) - 1
        pos = offset
        while pos < offset + n:
            part, rel = self.parts[k], pos - self.starts[k]
            take = min(len(part) - rel, offset + n - pos)
            if take > 0:
                out.append((pos - offset, part[rel:rel + take]))
                pos += take
            k += 1
        return out


def post_receives(recvs: Mapping[int, Sequence[memoryview]], group, tag: int = 0,
                  rate: float | None = None) -> dict[int, list]:
    """Post every receive of ``recvs`` (peer ``q`` -> its parts, filled in
    stream order) with ``tag``, in the pieces a sender at ``rate`` sends
    (:func:`pieces`, :func:`piece_bytes`); returns each peer's pending
    pieces, for :func:`wait_receives`."""
    piece = piece_bytes(rate)
    posted: dict[int, list] = {}
    for src in sorted(recvs):
        stream = _Stream(recvs[src])
        pending: list[tuple[Any, tuple | None]] = []
        for off, n in pieces([len(p) for p in stream.parts], piece):
            view = stream.within(off, n)
            if view is not None:
                pending.append((dist.irecv(torch.frombuffer(view, dtype=torch.uint8),
                                           group=group, group_src=src, tag=tag), None))
            else:  # a packed piece: into a buffer, then out to its parts
                buf = torch.empty(n, dtype=torch.uint8)
                pending.append((dist.irecv(buf, group=group, group_src=src, tag=tag),
                                (buf, stream.spans(off, n))))
        posted[src] = pending
    return posted


def send(sends: Mapping[int, Sequence[memoryview]], group, tag: int = 0,
         rate: float | None = None) -> None:
    """Send to each peer ``p`` the bytes of ``sends[p]`` (its parts, in
    stream order) with ``tag``, and wait until every piece is sent.  At a
    ``rate`` (bytes per second, all peers together) each piece leaves no
    sooner than the bytes before it allow."""
    piece = piece_bytes(rate)
    start, sent = time.monotonic(), 0
    buffers = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
    pending: list = [None, None]
    direct: list = []  # sends straight from the callers' buffers, alive until the end
    k = 0
    for dst in sorted(sends):
        stream = _Stream(sends[dst])
        for off, n in pieces([len(p) for p in stream.parts], piece):
            if rate is not None:
                time.sleep(max(0.0, start + sent / rate - time.monotonic()))
                sent += n
            view = stream.within(off, n)
            if view is not None:  # the piece lies in one part: sent as it is
                direct.append(dist.isend(torch.frombuffer(view, dtype=torch.uint8),
                                         group=group, group_dst=dst, tag=tag))
                continue
            slot = k % 2
            if pending[slot] is not None:
                pending[slot].wait()
            if buffers[slot].numel() < n:
                buffers[slot] = torch.empty(piece, dtype=torch.uint8)
            buf = buffers[slot][:n]
            for at, part in stream.spans(off, n):
                buf[at:at + len(part)].copy_(torch.frombuffer(part, dtype=torch.uint8))
            pending[slot] = dist.isend(buf, group=group, group_dst=dst, tag=tag)
            k += 1
    for w in [*pending, *direct]:
        if w is not None:
            w.wait()


def _wait_all(pending: list, errors: dict[int, BaseException], src: int) -> None:
    try:
        for work, packed in pending:
            work.wait()
            if packed is not None:
                buf, spans = packed
                for at, part in spans:
                    torch.frombuffer(part, dtype=torch.uint8).copy_(buf[at:at + len(part)])
    except BaseException as e:  # handed to the caller (a peer gone, gloo's timeout)
        errors[src] = e


def wait_receives(posted: dict[int, list], timeout: float | None = None,
                  keep: list | None = None) -> list[int]:
    """Wait for the receives :func:`post_receives` posted (packed pieces
    copied out to their parts); returns the peers whose bytes did not all
    arrive within ``timeout`` seconds (all of them are waited for when
    ``None``).  Raises what gloo raises for a peer that did answer (a peer
    gone).

    gloo's own bounded wait (``Work.wait(timeout)``) closes every pair of
    the group when it expires, so each peer's receives are waited for on a
    thread of their own and the caller waits for the threads: a late peer's
    thread goes on (appended to ``keep``), its buffers alive, until its
    bytes land or the group's timeout ends it."""
    errors: dict[int, BaseException] = {}
    if timeout is None:
        for src, pending in posted.items():
            _wait_all(pending, errors, src)
            if src in errors:
                raise errors[src]
        return []
    threads = {src: threading.Thread(target=_wait_all, args=(pending, errors, src), daemon=True,
                                     name=f"dcp-receive-from-{src}")
               for src, pending in posted.items()}
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


def exchange(sends: Mapping[int, Sequence[memoryview]],
             recvs: Mapping[int, Sequence[memoryview]], group, tag: int = 0,
             rate: float | None = None) -> None:
    """Send to each peer ``p`` (a rank of ``group``) the parts ``sends[p]``
    and receive from each peer ``q`` its parts into ``recvs[q]`` (each
    exactly as long as the sender's part), sending at most ``rate`` bytes
    per second (``None``: as fast as gloo goes; every rank of the exchange
    passes the same).  Collective over the ranks named; raises what gloo
    raises (a peer gone, a timeout)."""
    posted = post_receives(recvs, group, tag, rate)
    send(sends, group, tag, rate)
    wait_receives(posted)
