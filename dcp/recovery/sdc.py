"""Silent data corruption caught at a memory save: every chunk held by two
or more ranks (data-parallel replicas, replicated tensors) is compared by
the CRC-32C of all its bytes across its holders.  The writer's checksum is
the one the step records anyway; the other holders compute theirs while the
writer stages.  Holders that disagree mean a bit flipped in some rank's
memory or arithmetic (Megatron-LM hashes weights across replicas at
intervals for this; public reports put SDC at a few of every few hundred
job interruptions).  With three or more holders the odd one out is the rank
whose checksum no other holder shares, where the others agree.
"""

from __future__ import annotations

import numpy as np

from dcp.errors import SilentDataCorruptionError

#: Chunks named in full in the message; the rest are counted.
_NAMED = 8


def compare(chunk: np.ndarray, rank: np.ndarray, crc: np.ndarray, names: list[str],
            boxes: list[tuple], step: int) -> SilentDataCorruptionError | None:
    """The error for the chunks whose holders disagree, or ``None``.

    Args:
        chunk, rank, crc: int64 ``[n]``: rank ``rank[i]`` computed
            ``crc[i]`` over its bytes of chunk ``chunk[i]``.
        names, boxes: each chunk's fqn and ``(offsets, sizes)`` (``()``
            for a raw blob).
    """
    chunk, rank, crc = (np.asarray(a, np.int64) for a in (chunk, rank, crc))
    order = np.lexsort((rank, chunk))
    chunk, rank, crc = chunk[order], rank[order], crc[order]
    if not len(chunk):
        return None
    n = int(chunk.max()) + 1
    lo = np.full(n, np.iinfo(np.int64).max)
    hi = np.full(n, np.iinfo(np.int64).min)
    np.minimum.at(lo, chunk, crc)
    np.maximum.at(hi, chunk, crc)
    present = np.bincount(chunk, minlength=n) > 0
    bad = np.nonzero(present & (lo != hi))[0]
    if not len(bad):
        return None
    mismatches = []
    lines: list[str] = []
    for c in bad.tolist():
        sel = chunk == c
        by_rank = dict(zip(rank[sel].tolist(), crc[sel].tolist(), strict=True))
        values, counts = np.unique(crc[sel], return_counts=True)
        odd = None
        if len(by_rank) >= 3 and len(values) == 2 and counts.min() == 1:
            lone = int(values[np.argmin(counts)])
            odd = next(r for r, v in by_rank.items() if v == lone)
        box = boxes[c]
        where = f"chunk at offsets {list(box[0])} sizes {list(box[1])}" if box else "raw blob"
        mismatches.append((names[c], tuple(box[0]) if box else (), by_rank, odd))
        if len(lines) < _NAMED:
            held = ", ".join(f"rank {r}: {v:#010x}" for r, v in sorted(by_rank.items()))
            blame = (f"; rank {odd} is the odd one out" if odd is not None else
                     "; no majority names the odd one out" if len(by_rank) >= 3 else
                     "; two holders: which one is wrong is unknown")
            lines.append(f"{names[c]!r} {where} ({held}){blame}")
    more = f" (and {len(bad) - _NAMED} more chunks)" if len(bad) > _NAMED else ""
    err = SilentDataCorruptionError(
        f"memory step {step}: silent data corruption: the holders of {len(bad)} chunk(s) hold "
        f"different bytes: " + "; ".join(lines) + more + f". Step {step} is untrusted: it is "
        f"neither kept in memory nor persisted nor restored; recovery uses the newest "
        f"trusted step")
    err.mismatches = mismatches
    return err
