"""From the byte runs a rank needs to the requests it sends to storage.

A resharded load needs, from each chunk of a data file, the rows (or
blocks) that its target box cuts out of it: byte runs, often thousands of
a few KiB each.  Sent one request per run, they cost an object store one
round trip each (a 64 MiB checkpoint loaded Shard(0) -> Shard(1) made
~65,000 GETs).  Two decisions turn them into few requests, both made with
the storage's :class:`~dcp.core.read_cost.ReadCost`:

* :func:`whole_chunk_cheaper` — read a chunk whole, into a buffer, rather
  than only its needed runs: when every gap the runs leave (the leading and
  trailing ones included) is cheaper to read through than to skip, and the
  chunk fits in one request.  The load then checks the chunk's CRC-32C,
  whatever part of it the rank needed.
* :func:`coalesce` — merge the runs of one file (and whole chunks) whose
  gap is at most :attr:`~dcp.core.read_cost.ReadCost.hole_bytes` into one
  request, the gap bytes read and dropped, up to
  :attr:`~dcp.core.read_cost.ReadCost.max_request_bytes` per request; a run
  longer than that is cut.

Both are Apache Arrow's coalescing of ranged reads (``ReadRangeCache``),
applied per file; they see offsets and lengths only, never tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dcp.core.read_cost import ReadCost


@dataclass(frozen=True)
class Run:
    """``length`` bytes at ``offset`` of a file, needed at byte ``pos`` of
    the caller's buffer number ``sink``."""

    offset: int
    length: int
    sink: int
    pos: int


@dataclass(frozen=True)
class Request:
    """One storage request: ``length`` bytes at ``offset`` of a file, of
    which ``runs`` (in file order, not overlapping) are kept; the bytes
    between them are read and dropped."""

    offset: int
    length: int
    runs: tuple[Run, ...]

    @property
    def kept(self) -> int:
        """Bytes of the request that some buffer needs."""
        return sum(r.length for r in self.runs)


def whole_chunk_cheaper(chunk_nbytes: int, extents: Iterable[tuple[int, int, int]],
                        cost: ReadCost) -> bool:
    """Whether reading a chunk of ``chunk_nbytes`` whole costs no more
    requests than reading only the byte runs it is needed for: one request,
    and no gap of more than ``cost.hole_bytes`` between the runs or at
    either end.  ``extents`` describe the runs of each needed region,
    chunk-relative (:func:`dcp.core.boxes.run_extent`: first byte, end, the
    longest gap between its runs); regions that interleave count as if they
    did not (a gap can only shrink)."""
    if chunk_nbytes > cost.max_request_bytes:
        return False
    hole, pos = cost.hole_bytes, 0
    for start, end, gap in sorted(extents):
        if gap > hole or start - pos > hole:
            return False
        pos = max(pos, end)
    return chunk_nbytes - pos <= hole


def _cut(runs: Iterable[Run], limit: int) -> list[Run]:
    """The runs in file order, each cut into pieces of at most ``limit``."""
    out = []
    for run in runs:
        for start in range(0, run.length, limit):
            n = min(limit, run.length - start)
            out.append(Run(run.offset + start, n, run.sink, run.pos + start))
    out.sort(key=lambda r: r.offset)
    return out


def coalesce(runs: Iterable[Run], cost: ReadCost) -> list[Request]:
    """The requests that read ``runs`` (of one file) at the least cost.

    Consecutive runs join one request while the gap to the next is at most
    ``cost.hole_bytes`` and the request stays within
    ``cost.max_request_bytes``; overlapping runs (two buffers needing the
    same bytes) go to separate requests.  Empty runs are dropped.
    """
    requests: list[Request] = []
    current: list[Run] = []
    start = end = 0
    hole, limit = cost.hole_bytes, cost.max_request_bytes
    for run in _cut((r for r in runs if r.length > 0), limit):
        gap = run.offset - end
        if current and 0 <= gap <= hole and run.offset + run.length - start <= limit:
            current.append(run)
        else:
            if current:
                requests.append(Request(start, end - start, tuple(current)))
            current, start = [run], run.offset
        end = run.offset + run.length
    if current:
        requests.append(Request(start, end - start, tuple(current)))
    return requests


def join_adjacent(requests: Iterable[Request], limit: int) -> list[Request]:
    """``requests`` (of one file) with each run of requests that follow one
    another byte for byte joined into one, within ``limit`` bytes: fewer
    requests for the same bytes (the requests of separately planned
    chunks that lie end to end)."""
    out: list[Request] = []
    for r in sorted(requests, key=lambda r: r.offset):
        last = out[-1] if out else None
        if last is not None and last.offset + last.length == r.offset and (
                last.length + r.length <= limit):
            out[-1] = Request(last.offset, last.length + r.length, last.runs + r.runs)
        else:
            out.append(r)
    return out


def largest_gap(requests: Sequence[Request]) -> int:
    """The longest stretch of dropped bytes in ``requests`` (the size of
    the scratch buffer that receives them)."""
    gap = 0
    for request in requests:
        pos = request.offset
        for run in request.runs:
            gap = max(gap, run.offset - pos)
            pos = run.offset + run.length
    return gap
