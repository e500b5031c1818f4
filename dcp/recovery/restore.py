"""Restore from the memory tier, with the persistent tier behind it.

**Agreement** (:func:`find`, one gather): each host's leader reports the
memory steps its host holds (committed, not bad) with the chunks it holds of
each; every rank then picks alike the newest step not passed over that is
complete: every chunk held by some surviving host, or the same step
complete in the persistent tier.  The caller compares it with the newest
persistent step, which wins when newer.  Identity is the step's save id
(run id, step, layout fingerprint): hosts holding another save id of the
same step are not used for it.

**Reading** (:func:`read_into`): each rank intersects the boxes of its
target (any layout, any world size: the planner's box intersection) with the
step's chunks; each chunk it needs comes from the cheapest source left
(:func:`dcp.recovery.placement.sources`): its own host's memory, another
host's memory (served by one of that host's ranks over the tier's group,
batched), then the persistent tier for that chunk only (a :func:`dcp.load`
of just those boxes).  Every chunk is checked against its CRC-32C before a
byte of it is used; a copy that fails the check or is truncated, or whose
holder has not sent it within ``MemoryTier.restore_timeout``, sends the
chunk to its next source.  A step that cannot be restored raises
:class:`StepUnavailable` on every rank and counts one failure on every host
holding it (two mark it bad): the caller moves on to the next older step, so
a state is never a mix of two steps.
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from dcp.core import metadata as md_codec
from dcp.core import tensors
from dcp.core.boxes import intersect_many
from dcp.core.metadata import Metadata, checksum
from dcp.core.state_dict import flatten, shaped_like
from dcp.core.tensors import TensorShard
from dcp.errors import CheckpointError, CorruptCheckpointError
from dcp.orchestration.load import load
from dcp.orchestration.targets import Targets
from dcp.recovery import placement, replicate
from dcp.recovery.host_store import chunk_table
from dcp.recovery.hosts import TierGroup


class StepUnavailable(CheckpointError):
    """A memory step found complete could not be restored (every source of
    some chunk failed its checksum or answered short)."""


@dataclass
class Found:
    """The memory step a restore uses: its metadata, the chunks each
    surviving host holds (:func:`placement.holdings`), and whether the
    persistent tier holds the same step complete."""

    step: int
    md: Metadata
    held: tuple[np.ndarray, np.ndarray, np.ndarray]
    persisted: bool


@dataclass
class RestoreReport:
    """Where a restore's bytes came from (``bytes_own_host``,
    ``bytes_other_hosts``, ``bytes_persistent``: chunk bytes, checked), how
    long it took (``seconds``, wall clock on this rank), and the ranks of
    the tier's group that did not send this rank its chunks within
    ``MemoryTier.restore_timeout`` (``late_holders``, once per round: those
    chunks came from their next source)."""

    step: int
    bytes_own_host: int = 0
    bytes_other_hosts: int = 0
    bytes_persistent: int = 0
    chunks_refetched: int = 0
    seconds: float = 0.0
    late_holders: list[int] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    materialized: list[str] = field(default_factory=list)


def find(g: TierGroup, persistent: list[int], passed: set[int]) -> Found | None:
    """The newest memory step every rank can restore complete (module doc),
    or ``None``.  Collective over the tier's group; ``persistent`` is the
    complete persistent steps (the same list on every rank)."""
    report: dict[int, tuple[str, np.ndarray, int]] = {}
    decoded: dict[int, tuple[bytes, Metadata]] = {}  # each step's metadata read and decoded once
    if g.leader:
        for step in g.store.steps():
            if step in passed:
                continue
            try:
                raw = g.store.metadata_bytes(step)
                md = md_codec.decode(raw, f"{g.store.where(step)}: metadata.json")
            except CheckpointError:
                continue
            decoded[step] = (raw, md)
            ids = np.array(sorted(g.store.held(step)), dtype=np.int64)
            report[step] = (md.save_id, ids, len(chunk_table(md)[0]))
    everyone = g.all_gather(report)
    steps = sorted({s for rep in everyone for s in rep}, reverse=True)
    for step in steps:
        ranks = [r for r, rep in enumerate(everyone) if step in rep]
        save_id, _, n = everyone[ranks[0]][step]
        ranks = [r for r in ranks if everyone[r][step][0] == save_id]
        hosts = np.concatenate([np.full(len(everyone[r][step][1]), g.rank_host[r], np.int64)
                                for r in ranks])
        chunks = np.concatenate([everyone[r][step][1] for r in ranks])
        held = placement.holdings(hosts, chunks, n)
        if int((held[2] > 0).sum()) < n and step not in persistent:
            continue
        # the step's metadata as its first holder's leader read it: the file's
        # bytes broadcast, decoded once on each other rank
        src = dist.get_global_rank(g.group, ranks[0])
        payload = [decoded[step][0] if g.rank == ranks[0] else None]
        dist.broadcast_object_list(payload, src=src, group=g.group)
        assert payload[0] is not None
        md = decoded[step][1] if g.rank == ranks[0] else md_codec.decode(
            payload[0], f"memory step {step} (from rank {ranks[0]})")
        return Found(step, md, held, step in persistent)
    return None


def _plan(md: Metadata, leaves: dict, where: str):
    """This rank's needs: ``tasks`` ``(chunk id, target view, offsets in
    the chunk, sizes)``, ``blobs`` ``(chunk id, leaf, fqn, raw type)``, the
    plain ``values`` ``(leaf, fqn, value)`` and the fqns missing.  Nothing
    of the target is changed here: the caller sets everything once every
    chunk arrived, so a restore that fails leaves the target as it was."""
    fqns, nbytes, crcs, boxes = chunk_table(md)
    by_fqn: dict[str, list[int]] = {}
    for cid, fqn in enumerate(fqns):
        by_fqn.setdefault(fqn, []).append(cid)
    same = {(fqn, tuple(box[0]), tuple(box[1])): cid
            for cid, (fqn, box) in enumerate(zip(fqns, boxes, strict=True)) if box}
    tasks, blobs, values, missing = [], [], [], []
    for fqn, leaf in leaves.items():
        if tensors.is_tensor(leaf.value):
            saved = md.tensors.get(fqn)
            if saved is None:
                missing.append(fqn)
                continue
            ids = by_fqn[fqn]
            offs = np.array([boxes[c][0] for c in ids], dtype=np.int64).reshape(len(ids), -1)
            szs = np.array([boxes[c][1] for c in ids], dtype=np.int64).reshape(len(ids), -1)
            for box in tensors.load_chunks(fqn, leaf.value):  # a ShardedTensor: several
                if tuple(box.global_shape) != tuple(saved.shape) or box.dtype != saved.dtype:
                    raise CheckpointError(f"{where}: {fqn!r} is saved as {list(saved.shape)} "
                                          f"{saved.dtype}, the target is "
                                          f"{list(box.global_shape)} {box.dtype}")
                if 0 in box.sizes:
                    continue
                exact = same.get((fqn, tuple(box.offsets), tuple(box.sizes)))
                if exact is not None:  # the box is a chunk (a restore in the saved layout)
                    tasks.append((exact, box.data, [0] * len(box.sizes), list(box.sizes)))
                    continue
                rows, lo, size = intersect_many(offs, szs, box.offsets, box.sizes)
                for row, low, sz in zip(rows, lo, size, strict=True):
                    cid = ids[row]
                    rel_t = [a - b for a, b in zip(low, box.offsets, strict=True)]
                    rel_c = [a - b for a, b in zip(low, boxes[cid][0], strict=True)]
                    tasks.append((cid, tensors.region(box.data, rel_t, sz), rel_c, sz))
        elif fqn in md.objects:
            obj = md.objects[fqn]
            if obj.raw is not None:
                blobs.append((by_fqn[fqn][0], leaf, fqn, obj.raw_type))
            elif obj.pickled is None:
                values.append((leaf, fqn, shaped_like(leaf.value, obj.value)))
        else:
            missing.append(fqn)
    return tasks, blobs, values, missing, (fqns, nbytes, crcs, boxes)


def _uninitialized(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` not zeroed first (every byte of it
    is overwritten, or the chunk fails its CRC-32C)."""
    return memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy().data).cast("B")


def _transfer(g: TierGroup, step: int, sends: dict[int, list[memoryview]],
              recvs: dict[int, list[memoryview]]) -> set[int]:
    """One round of a restore's peer transfers, under a tag of its own:
    the receives posted, this rank's sends on a thread of their own (a rank
    whose sends are slow still goes on to the round's agreement), then each
    peer's bytes waited for at most ``restore_timeout`` seconds.  Returns
    the peers that did not send all in time; their receives, and sends not
    done by then, go on in :attr:`TierGroup.transfers`."""
    tag = g.next_tag()
    deadline = time.monotonic() + g.tier.restore_timeout
    posted = replicate.post_receives(recvs, g.group, tag)
    serving = threading.Thread(target=replicate.send, args=(sends, g.group, tag), daemon=True,
                               name=f"dcp-restore-serve-{step}")
    serving.start()
    late = set(replicate.wait_receives(posted, g.tier.restore_timeout, keep=g.transfers))
    serving.join(max(0.0, deadline - time.monotonic()))
    if serving.is_alive():
        g.transfers.append(serving)
    return late


def read_into(g: TierGroup, found: Found, target: dict, persistent_uri: str | None,
              storage_options: dict | None = None) -> RestoreReport:
    """Fill ``target`` (as :func:`dcp.load` does: tensors in place, plain
    values replaced, Statefuls loaded last) from memory step ``found``.
    Collective over the tier's group.

    Raises:
        CheckpointError: on every rank, for a key of ``target`` the step
            lacks or a shape/dtype that differs (naming them).
        StepUnavailable: on every rank, when some chunk has no source left.
    """
    t0 = time.perf_counter()
    step, md = found.step, found.md
    where = f"memory step {step}"
    report = RestoreReport(step)
    targets = Targets(target)
    error: str | None = None
    tasks: list = []
    blobs: list = []
    values: list = []
    table: tuple = ([], np.zeros(0, np.int64), np.zeros(0, np.int64), [])
    try:
        targets.before_planning(md)
        leaves = flatten(targets.state_dict, tensors.is_tensor)
        tasks, blobs, values, missing, table = _plan(md, leaves, where)
        if missing:
            raise CheckpointError(f"{where}: keys of the target it does not hold: "
                                  f"{sorted(missing)}")
    except CheckpointError as e:
        error = f"rank {g.rank}: {e}"
    fqns, nbytes, crcs, boxes = table
    mine = np.array(sorted({t[0] for t in tasks} | {b[0] for b in blobs}), dtype=np.int64)
    everyone = g.all_gather((error, mine))
    errors = [e for e, _ in everyone if e is not None]
    if errors:
        raise CheckpointError("; ".join(errors))
    need_rank = np.concatenate([np.full(len(ids), r, np.int64) for r, (_, ids) in
                                enumerate(everyone)]) if everyone else np.zeros(0, np.int64)
    need_chunk = np.concatenate([ids for _, ids in everyone])
    attempt = np.zeros(len(need_chunk), dtype=np.int64)
    done = np.zeros(len(need_chunk), dtype=bool)
    got: dict[int, torch.Tensor] = {}
    held_here = g.store.held(step) if step in g.store.steps() else {}

    maps: dict[str, memoryview | None] = {}

    def read_local(cid: int) -> memoryview | None:
        """Chunk ``cid`` as this host holds it, a view of its mapped file
        (no copy: checked, then copied into the target or sent from there),
        or ``None`` (not held, or its file truncated or gone)."""
        n = int(nbytes[cid])
        if not n:
            return memoryview(b"")
        file, off = held_here.get(cid, ("", 0))
        if not file:
            return None
        if file not in maps:
            maps[file] = g.store.mapped(step, file)
        whole = maps[file]
        return whole[off:off + n] if whole is not None and len(whole) >= off + n else None

    while True:
        idx = np.flatnonzero(~done)
        kind, host = placement.sources(need_rank[idx], need_chunk[idx], attempt[idx],
                                       g.rank_host, found.held)
        active = kind != placement.PERSISTENT
        if not active.any():
            break
        idx, kind, host = idx[active], kind[active], host[active]
        failed: list[int] = []
        accepted: list[tuple[int, memoryview | None, str]] = []
        for i in idx[(kind == placement.OWN) & (need_rank[idx] == g.rank)].tolist():
            accepted.append((int(need_chunk[i]), read_local(int(need_chunk[i])), "own"))
        peer = kind == placement.PEER
        p_idx = idx[peer]
        servers = placement.server(host[peer], need_chunk[p_idx], need_rank[p_idx],
                                   g.rank_host, nbytes[need_chunk[p_idx]]) if len(p_idx) else \
            np.zeros(0, np.int64)
        sends: dict[int, list[memoryview]] = {}
        for i, s in zip(p_idx.tolist(), servers.tolist(), strict=True):
            if s == g.rank:  # a chunk not held here is sent as zeros: its CRC-32C fails
                held = read_local(int(need_chunk[i]))
                sends.setdefault(int(need_rank[i]), []).append(
                    held if held is not None else memoryview(bytearray(int(nbytes[need_chunk[i]]))))
        incoming: dict[int, list[int]] = {}
        for i, s in zip(p_idx.tolist(), servers.tolist(), strict=True):
            if need_rank[i] == g.rank:
                incoming.setdefault(int(s), []).append(int(need_chunk[i]))
        recvs = {}
        for s, ids in incoming.items():
            scratch = _uninitialized(int(nbytes[ids].sum()))
            ends = np.cumsum(nbytes[ids]).tolist()
            recvs[s] = [scratch[e - int(nbytes[c]):e] for c, e in zip(ids, ends, strict=True)]
        late = _transfer(g, step, sends, recvs)
        for s, ids in incoming.items():
            if s in late:  # passed over for these chunks: their next source
                report.late_holders.append(s)
                failed.extend(ids)
                continue
            accepted += [(cid, part, "peer") for cid, part in zip(ids, recvs[s], strict=True)]
        for cid, buf, source in accepted:
            if buf is None or checksum(buf) != int(crcs[cid]):
                failed.append(cid)
                continue
            got[cid] = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(
                0, dtype=torch.uint8)
            if source == "own":
                report.bytes_own_host += len(buf)
            else:
                report.bytes_other_hosts += len(buf)
        report.chunks_refetched += len(failed)
        all_failed = g.all_gather(failed)
        bad = {(r, c) for r, cs in enumerate(all_failed) for c in cs}
        for i in idx.tolist():
            if (int(need_rank[i]), int(need_chunk[i])) in bad:
                attempt[i] += 1
            else:
                done[i] = True
    left = np.flatnonzero(~done)
    if len(left):
        if not found.persisted or persistent_uri is None:
            names = sorted({fqns[int(c)] for c in need_chunk[left]})[:8]
            reason = (f"{where}: no source left for {len(left)} chunk(s) (of {names}): every "
                      f"memory copy failed its CRC-32C or is gone, and the persistent tier "
                      f"does not hold step {step}")
            if g.leader and step in g.store.steps():
                g.store.record_failure(step, reason)
            raise StepUnavailable(reason)
        report.bytes_persistent = _from_persistent(
            g, md, step, persistent_uri, storage_options,
            need_rank[left], need_chunk[left], (fqns, nbytes, crcs, boxes), got)
    for cid, view, rel_c, sz in tasks:
        fqn = fqns[cid]
        chunk = tensors.from_bytes(got[cid], md.tensors[fqn].dtype, boxes[cid][1])
        tensors.copy_into(view, tensors.region(chunk, rel_c, sz))
    for cid, leaf, fqn, kind in blobs:
        data = got[cid].numpy().tobytes()
        leaf.replace(fqn, io.BytesIO(data) if kind == "BytesIO" else data)
    for leaf, fqn, value in values:
        leaf.replace(fqn, value)
    targets.finish(report)
    report.seconds = time.perf_counter() - t0
    return report


def _from_persistent(g: TierGroup, md: Metadata, step: int, uri: str,
                     storage_options: dict | None, need_rank: np.ndarray,
                     need_chunk: np.ndarray, table: tuple, got: dict[int, torch.Tensor]) -> int:
    """The chunks no memory copy could give, from the persistent tier's
    same step: one :func:`dcp.load` of just their boxes per round (a rank
    needing several chunks of one fqn takes one per round).  Each is checked
    against the memory step's CRC-32C too, so the step is one step."""
    fqns, nbytes, crcs, boxes = table
    rounds: list[dict[str, int]] = []
    for r, c in zip(need_rank.tolist(), need_chunk.tolist(), strict=True):
        if r != g.rank:
            continue
        fqn = fqns[c]
        for rd in rounds:
            if fqn not in rd:
                rd[fqn] = c
                break
        else:
            rounds.append({fqn: c})
    n_rounds = torch.tensor([len(rounds)])
    dist.all_reduce(n_rounds, op=dist.ReduceOp.MAX, group=g.group)
    total = 0
    for k in range(int(n_rounds.item())):
        picks = rounds[k] if k < len(rounds) else {}
        part: dict = {}
        for fqn, c in picks.items():
            if boxes[c]:
                meta = md.tensors[fqn]
                part[fqn] = TensorShard(tensors.empty_host(boxes[c][1], meta.dtype), meta.shape,
                                        boxes[c][0])
            else:
                part[fqn] = b""
        rep = load(part, uri, process_group=g.group, storage_options=storage_options,
                   verify="all")
        total += rep.bytes_read
        for fqn, c in picks.items():
            value = part[fqn]
            flat = (torch.frombuffer(bytearray(value), dtype=torch.uint8) if not boxes[c]
                    else tensors.flat_bytes([value.data]))
            if checksum(tensors.byte_view(flat)) != int(crcs[c]):
                raise CorruptCheckpointError(
                    f"persistent step {step} ({uri}): {fqn!r} chunk "
                    f"{list(boxes[c][0]) if boxes[c] else 'blob'} differs from memory step "
                    f"{step}'s CRC-32C: the tiers do not hold the same step")
            got[c] = flat
    return total
