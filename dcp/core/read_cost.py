"""What one read request costs on a storage, as the load's read planner sees it.

Every storage plugin describes its reads with a :class:`ReadCost`: the
latency of one request (time to first byte), the bandwidth of one request
stream, how many requests one read call keeps in flight, the largest
request worth making, and whether the ranks of one host share a cache of
its data (a filesystem's page cache; an object store shares nothing).  The
read planner (:mod:`dcp.core.read_plan`) turns byte runs into requests with
it, and the load planner picks each replica group's path with
:attr:`ReadCost.shared_cache`.

The model is Apache Arrow's for ranged reads (``CacheOptions``): a gap
between two needed byte runs is read through, and dropped, when reading it
costs less than starting a new request, i.e. when it is at most
``latency_s * bandwidth_bps`` bytes (:attr:`ReadCost.hole_bytes`); requests
are capped at ``max_request_bytes``.  Arrow's defaults (8 KiB holes, 32 MiB
ranges) are one point of it; here each plugin states its own numbers and
users override them through ``storage_options={"read_cost": {...}}``.

Reading a compressed chunk (:mod:`dcp.core.compression`) costs a reader
thread the decoding of its covering frames too: :attr:`ReadCost.decode_bps`
and :meth:`ReadCost.seconds` price a region's read, latency, transfer and
decoding together, so that the load planner balances readers by seconds and
decides whether a region several ranks of a host need is decoded by each of
them or once and passed on (``planners.load``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dcp.errors import CheckpointError

#: Each numeric field of :class:`ReadCost`: integer or not, its least value
#: and whether that value is allowed, its unit.
_RULES = (("latency_s", False, 0, True, "seconds"),
          ("bandwidth_bps", False, 0, False, "bytes per second"),
          ("concurrency", True, 1, True, "requests"),
          ("max_request_bytes", True, 1, True, "bytes"),
          ("decode_bps", False, 0, False, "bytes per second"))


@dataclass(frozen=True)
class ReadCost:
    """The cost of reads from one storage.

    Attributes:
        latency_s: seconds before the first byte of one request arrives
            (a local disk ~1e-4, an object store 1e-2 to 5e-2).
        bandwidth_bps: bytes per second one request stream delivers.
        concurrency: requests one ``read_requests`` call keeps in flight.
        max_request_bytes: the largest request made (bytes); larger runs
            are cut.
        shared_cache: whether ranks of one host share a cache of the
            storage's data (the page cache of a filesystem), so that bytes
            one rank has read cost the others a memory copy, not a read.
        decode_bps: logical bytes per second one reader thread decodes from
            compressed frames (zstd, then un-grouping the bytes of floats).
            The default, 1.5e9, is measured on this project's 2-core host
            (2026-12): zstd ~3 GB/s and un-grouping ~3.3 GB/s, one after
            the other.  A property of the host's CPU, not of the storage:
            plugins keep the default.
    """

    latency_s: float = 1e-3
    bandwidth_bps: float = 1e9
    concurrency: int = 1
    max_request_bytes: int = 32 << 20
    shared_cache: bool = False
    decode_bps: float = 1.5e9

    def __post_init__(self) -> None:
        for name, integer, least, allowed, unit in _RULES:
            value = getattr(self, name)
            typed = isinstance(value, int if integer else (int, float)) and not isinstance(
                value, bool)
            if not (typed and (value >= least if allowed else value > least)):
                raise CheckpointError(
                    f"read_cost {name}={value!r}: {'an integer' if integer else 'a number'} "
                    f"{'>=' if allowed else '>'} {least} ({unit})")
        if not isinstance(self.shared_cache, bool):
            raise CheckpointError(f"read_cost shared_cache={self.shared_cache!r}: True or False")

    def seconds(self, stored_bytes: int, decoded_bytes: int = 0,
                requests: int | None = None) -> float:
        """Estimated seconds one reader thread spends reading a region of
        ``stored_bytes`` (as the storage holds them) and decoding
        ``decoded_bytes`` logical bytes of it from compressed frames:
        ``latency_s`` per request, plus the stored bytes over
        ``bandwidth_bps``, plus the decoded bytes over ``decode_bps``.
        ``requests``: one per ``max_request_bytes`` (at least one) unless
        given."""
        if requests is None:
            requests = max(1, -(-stored_bytes // self.max_request_bytes))
        return (requests * self.latency_s + stored_bytes / self.bandwidth_bps
                + decoded_bytes / self.decode_bps)

    @property
    def hole_bytes(self) -> int:
        """The largest gap between two needed runs that is cheaper to read
        through than to skip with a new request (bytes)."""
        return int(self.latency_s * self.bandwidth_bps)

    def replace(self, overrides: Mapping[str, Any], where: str) -> ReadCost:
        """This cost with the fields of ``overrides`` (a ``storage_options``
        ``read_cost`` mapping) replaced.

        Raises:
            CheckpointError: an unknown field or a bad value, naming
                ``where`` (the checkpoint id).
        """
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise CheckpointError(f"{where!r}: unknown read_cost field(s) {unknown} "
                                  f"(known: {sorted(fields)})")
        try:
            return dataclasses.replace(self, **overrides)
        except CheckpointError as e:
            raise CheckpointError(f"{where!r}: {e}") from e
