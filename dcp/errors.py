"""The one exception family of hyperdcp.

Every failure the library reports is a :class:`CheckpointError` (a plain
``Exception`` subclass, so ``except Exception`` catches it, unlike PyTorch
DCP's ``CheckpointException``).  Messages name what is at fault: the fqn,
chunk, rank, file or key.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Raised for every checkpoint failure: bad input, I/O errors, corrupt or
    incomplete checkpoints, and failures on other ranks (the message names the
    failing rank)."""

    #: Set on the failure of a coordinated step: each failing rank's traceback text.
    tracebacks: dict[int, str]


class NotACheckpointError(CheckpointError):
    """The location holds no committed metadata: it was never a checkpoint,
    or its save did not finish (an interrupted save is never loadable)."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their recorded checksum, or a data file is
    missing or truncated, or the metadata cannot be decoded."""


class UnsupportedDtypeError(CheckpointError):
    """A tensor's dtype has no counterpart on the other side: a dtype the
    checkpoint format lacks (MindSpore's ``hifloat8`` or ``int4``, torch's
    ``float4_e2m1fn_x2``), or one a framework adapter cannot load into.
    Raised before anything is written or read; the message names the fqn
    and the dtype."""


class MemoryTierError(CheckpointError):
    """A memory-tier save that cannot get its host memory (the namespace's
    free space or the tier's ``host_bytes`` cap; the message names the host,
    the step and the bytes), or a replicated copy that arrived damaged.  The
    save is refused before it takes the memory; the host and the newest
    memory step are untouched."""


class SilentDataCorruptionError(CheckpointError):
    """Holders of one chunk hold different bytes at a memory save: the
    message names the fqn, the chunk's offsets, the ranks and, with three
    or more holders, the odd one out.  The step is untrusted: never
    persisted, never restored (:mod:`dcp.recovery.sdc`).

    ``mismatches``: ``(fqn, offsets, {rank: crc32c}, odd rank or None)``
    for each chunk found."""

    mismatches: list[tuple[str, tuple[int, ...], dict[int, int], int | None]]
