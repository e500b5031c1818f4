"""The phases of a memory save (a *memory step*), in order:

1. **Layout** (caller's thread, once per layout): the ranks' chunk boxes
   gathered; :func:`dcp.recovery.placement.place` says which rank writes
   each chunk on each host and where the copies of single-host chunks go.
   Later steps of the same layout agree on it in one small all-reduce.
2. **Staging** (caller's thread, the stall): the chunks this rank writes
   are copied into its data file in host shared memory, reserved whole
   first (a host without the memory refuses the save, never crashes);
   holders that do not write a chunk compute its CRC-32C in the same pass
   (for the SDC check); raw blobs go to a small file of their own.
3. In the background, on the tier's own gloo group: the writers' CRC-32C;
   one gather of every rank's checksums, blobs and JSON values; the SDC
   comparison (:mod:`dcp.recovery.sdc`); the copies sent to their target
   hosts (:mod:`dcp.recovery.replicate`), received straight into the
   target's copies file and checked against the writer's CRC-32C; each
   rank's ``held`` list; an agreement that every rank succeeded; then each
   host's leader writes the step's metadata and ``COMMITTED`` and drops
   the host's older steps.  Optionally the step is then persisted: written
   from host memory (:func:`persist_view`) to the persistent tier with
   :func:`dcp.save`, each chunk once, on the tier's second gloo group
   (``persist_group``), so the next memory steps stage, replicate and commit
   while it runs.  One persist runs at a time (a later one waits for it),
   and the step it reads is pinned on its host until it ends
   (:meth:`HostStore.pin`); while a pinned step is older than the previous
   one, the previous step gives way before a new one is staged (it stops
   counting on the host, then its files go), so a host holds at most two
   steps' own bytes and one set of copies (docs/recovery.md, Memory).
"""

from __future__ import annotations

import io
import json
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dcp.core import tensors
from dcp.core.metadata import BlobRef, ChunkMeta, Metadata, ObjectMeta, TensorMeta, checksum
from dcp.core.tensors import TensorShard
from dcp.errors import CheckpointError, MemoryTierError
from dcp.orchestration.save import SaveState, describe_state, split_raw
from dcp.recovery import placement, replicate, sdc
from dcp.recovery.host_store import Staged
from dcp.recovery.hosts import TierGroup


def own_file(rank: int) -> str:
    return f"r{rank:05d}.data"


def copies_file(rank: int) -> str:
    return f"r{rank:05d}-copies.data"


def blobs_file(rank: int) -> str:
    return f"r{rank:05d}-blobs.data"


def blob_copies_file(rank: int) -> str:
    return f"r{rank:05d}-blob-copies.data"


def _segments(group_key: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Byte offset of each row within its group (rows sorted by group):
    the exclusive running sum of ``nbytes`` restarting at each group."""
    if not len(nbytes):
        return np.zeros(0, dtype=np.int64)
    total = np.cumsum(nbytes) - nbytes
    start = np.ones(len(group_key), dtype=bool)
    start[1:] = group_key[1:] != group_key[:-1]
    base = np.maximum.accumulate(np.where(start, total, 0))
    return total - base


@dataclass
class Layout:
    """The chunks of every rank and their placement, for one layout of the
    state (the same for every step until a box changes)."""

    key: tuple  # this rank's descriptors
    chunks: list[tuple[str, tuple[int, ...], tuple[int, ...]]]  # (fqn, offsets, sizes) by id
    shapes: dict[str, tuple[tuple[int, ...], str]]
    nbytes: np.ndarray
    holder_chunk: np.ndarray
    holder_rank: np.ndarray
    primary: np.ndarray  # each chunk's first writer rank
    primary_offset: np.ndarray
    mine: dict[tuple[str, tuple[int, ...]], int]  # this rank's chunks -> id
    own_ids: np.ndarray
    own_offsets: np.ndarray
    own_bytes: int
    copy_in: dict[int, tuple[np.ndarray, np.ndarray]]  # src -> ids, offsets in copies file
    copies_bytes: int
    copy_out: dict[int, np.ndarray]  # dst -> ids (in the receiver's order)
    host_bytes: int  # bytes this host's ranks write for one step


def _descriptors(state: SaveState) -> tuple:
    return tuple(sorted((fqn, c.global_shape, c.dtype, c.offsets, c.sizes)
                        for (fqn, _), c in state.chunks.items()))


def build_layout(g: TierGroup, key: tuple, gathered: list[tuple]) -> Layout:
    """The :class:`Layout` from every rank's descriptors (``gathered[r]``)."""
    index: dict[tuple[str, tuple[int, ...]], tuple] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    pairs: list[tuple[tuple[str, tuple[int, ...]], int]] = []
    for r, descs in enumerate(gathered):
        for fqn, shape, dtype, offsets, sizes in descs:
            k = (fqn, offsets)
            seen = shapes.setdefault(fqn, (shape, dtype))
            if seen != (shape, dtype):
                raise CheckpointError(f"{fqn!r}: rank {r} holds it with shape {list(shape)} "
                                      f"{dtype}, another rank with {list(seen[0])} {seen[1]}")
            if index.setdefault(k, sizes) != sizes:
                raise CheckpointError(f"{fqn!r}: ranks hold chunks at offsets {list(offsets)} "
                                      f"of different sizes (rank {r}: {list(sizes)})")
            pairs.append((k, r))
    keys = sorted(index)
    ids = {k: i for i, k in enumerate(keys)}
    itemsize = {f: tensors.DTYPE_ITEMSIZE[d] for f, (_, d) in shapes.items()}
    nbytes = np.array([int(np.prod(index[k], dtype=np.int64)) * itemsize[k[0]] for k in keys],
                      dtype=np.int64)
    hc = np.array([ids[k] for k, _ in pairs], dtype=np.int64)
    hr = np.array([r for _, r in pairs], dtype=np.int64)
    p = placement.place(hc, hr, g.rank_host, g.host_domain, g.tier.replicas)
    # each writer's file: its chunks by id, one after the other
    order = np.lexsort((p.own_chunk, p.own_rank))
    w_rank, w_chunk = p.own_rank[order], p.own_chunk[order]
    w_off = _segments(w_rank, nbytes[w_chunk])
    primary = np.full(len(keys), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(primary, w_chunk, w_rank)
    primary_offset = np.zeros(len(keys), dtype=np.int64)
    first = w_rank == primary[w_chunk]
    primary_offset[w_chunk[first]] = w_off[first]
    mine_sel = w_rank == g.rank
    own_ids, own_offsets = w_chunk[mine_sel], w_off[mine_sel]
    own_bytes = int(nbytes[own_ids].sum())
    # each receiver's copies file: by sender, then chunk id
    order = np.lexsort((p.copy_chunk, p.copy_src, p.copy_dst))
    c_chunk, c_src, c_dst = p.copy_chunk[order], p.copy_src[order], p.copy_dst[order]
    c_off = _segments(c_dst, nbytes[c_chunk])
    copy_in = {}
    sel = c_dst == g.rank
    for src in np.unique(c_src[sel]).tolist():
        s = sel & (c_src == src)
        copy_in[int(src)] = (c_chunk[s], c_off[s])
    copy_out = {}
    sel = c_src == g.rank
    for dst in np.unique(c_dst[sel]).tolist():
        copy_out[int(dst)] = c_chunk[sel & (c_dst == dst)]
    on_host = g.rank_host == g.my_host
    host_bytes = int(nbytes[w_chunk[on_host[w_rank]]].sum() + nbytes[c_chunk[on_host[c_dst]]].sum())
    mine = {(fqn, offsets): ids[(fqn, offsets)] for fqn, _, _, offsets, _ in key}
    return Layout(key, [(k[0], k[1], index[k]) for k in keys], shapes, nbytes, hc, hr, primary,
                  primary_offset, mine, own_ids, own_offsets, own_bytes, copy_in,
                  int(nbytes[c_chunk[c_dst == g.rank]].sum()), copy_out, host_bytes)


@dataclass
class MemorySave:
    """One memory step in flight: ``committed`` is set once it committed or
    failed (``error``); ``done`` once its background work ended, its
    persist included (``persist_error``: the persist failed).
    ``stall_s`` is what the caller waited for (seconds), ``seconds`` the
    time from the call to ``committed``."""

    step: int
    persist: bool = False
    committed: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: CheckpointError | None = None
    persist_error: CheckpointError | None = None
    stall_s: float = 0.0
    seconds: float = 0.0
    thread: threading.Thread | None = None

    def wait(self) -> None:
        """Until ``done``."""
        if self.thread is not None:
            self.thread.join()


class _Skip(Exception):
    """Staging skipped: the step failed before it (reported in the gather)."""


class Snapshotter:
    """Takes the memory steps of one manager (module doc)."""

    def __init__(self, g: TierGroup) -> None:
        self.g = g
        self.layout: Layout | None = None
        self._persisting: MemorySave | None = None  # the newest step with a persist

    # -------------------------------------------------------- caller's thread
    def start(self, step: int, state: dict,
              after_commit: Callable[[int, dict], None] | None = None) -> MemorySave:
        """Stage ``state`` as memory step ``step`` and commit it in the
        background; ``after_commit(step, persist_state)`` runs there once it
        committed (persisting it), after the previous persist ended.  The
        caller must wait for the previous step's ``committed`` first.
        Collective over the tier's group."""
        t0 = time.perf_counter()
        g = self.g
        ms = MemorySave(step, persist=after_commit is not None)
        previous_persist = self._persisting
        if after_commit is not None:
            self._persisting = ms
        failure: str | None = None
        key: tuple | None = None
        try:
            described = describe_state(state, allow_pickle=False, rank=g.rank,
                                       world_size=g.world_size)
            key = _descriptors(described)
        except CheckpointError as e:
            failure = f"rank {g.rank}: {e}"
        same = torch.tensor([int(key is not None and self.layout is not None
                                 and self.layout.key == key)])
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=g.group)
        if not int(same.item()):
            gathered = g.all_gather(key)
            self.layout = None
            if all(k is not None for k in gathered):
                try:
                    self.layout = build_layout(g, key, gathered)  # type: ignore[arg-type]
                except CheckpointError as e:
                    failure = failure or str(e)
            else:
                failure = failure or (f"rank(s) {[r for r, k in enumerate(gathered) if k is None]}"
                                      f" could not describe their state")
        layout = self.layout
        staged: list[Staged] = []
        held_crc: dict[int, int] = {}
        blobs: list[tuple[str, int, str, int]] = []  # fqn, nbytes, raw type, offset
        try:
            if failure is not None or layout is None:
                raise _Skip
            store = g.store
            if g.tier.host_bytes is not None:
                have = store.usage_committed(exclude=step)
                if have + layout.host_bytes > g.tier.host_bytes:
                    raise MemoryTierError(
                        f"{store.where(step)}: the host's memory steps would hold "
                        f"{have + layout.host_bytes} bytes ({have} held, {layout.host_bytes} "
                        f"for this step) over MemoryTier(host_bytes={g.tier.host_bytes}); the "
                        f"save is refused, the newest memory step is kept")
            self._give_way(step)
            store.begin(step)
            own = store.stage(step, own_file(g.rank), layout.own_bytes)
            staged.append(own)
            writes = {int(i): int(o) for i, o in zip(layout.own_ids.tolist(),
                                                     layout.own_offsets.tolist(), strict=True)}
            for (fqn, offsets), chunk in described.chunks.items():
                cid = layout.mine[(fqn, offsets)]
                src = chunk.data
                if cid in writes:
                    off, n = writes[cid], int(layout.nbytes[cid])
                    dest = tensors.from_bytes(tensors.bytes_of(own.view[off:off + n]),
                                              chunk.dtype, chunk.sizes)
                    tensors.copy_into(dest, src)
                else:  # a replica another rank of this host writes: its checksum only
                    host = tensors.contiguous_copy(src.detach().cpu()) if (
                        not src.is_contiguous() or src.device.type != "cpu") else src.detach()
                    held_crc[cid] = checksum(tensors.byte_view(host))
            raw: list[tuple[str, str, bytes]] = []
            for fqn in sorted(described.pickled):
                tagged = split_raw(described.pickled[fqn])
                assert tagged is not None  # describe_state(allow_pickle=False): raw blobs only
                raw.append((fqn, tagged[0], tagged[1]))
            bf = store.stage(step, blobs_file(g.rank), sum(len(d) for _, _, d in raw))
            staged.append(bf)
            off = 0
            for fqn, kind, blob in raw:
                bf.view[off:off + len(blob)] = blob
                blobs.append((fqn, len(blob), kind, off))
                off += len(blob)
        except _Skip:
            failure = failure or "the layout could not be agreed"
        except CheckpointError as e:
            failure = f"rank {g.rank}: {e}"
        except OSError as e:
            failure = f"rank {g.rank}: {g.store.where(step)}: {type(e).__name__}: {e}"
        ms.stall_s = time.perf_counter() - t0
        json_values = dict(described.json_values)
        ms.thread = threading.Thread(
            target=self._background, name=f"dcp-memory-step-{step}", daemon=True,
            args=(ms, layout, staged, held_crc, blobs, json_values, failure, after_commit,
                  previous_persist, t0))
        ms.thread.start()
        return ms

    def _give_way(self, step: int) -> None:
        """While a persist pins a step older than the previous committed one,
        the previous step gives way before ``step`` is staged: it stops
        counting on this host, then this rank's files of it are released.
        The host then holds the pinned step, the new one and no third (the
        memory bound); until ``step`` commits the pinned step is this host's
        newest complete one (and stays so if ``step`` fails)."""
        store, rank = self.g.store, self.g.rank
        pinned = store.pinned
        if not pinned:
            return
        # every folder: a rank of this host may have retracted it already
        older = [s for s in store.steps(committed=False) if s < step and s not in pinned]
        if older and older[-1] > max(pinned):
            store.retract(older[-1])
            store.release(older[-1], rank, (own_file(rank), copies_file(rank), blobs_file(rank),
                                            blob_copies_file(rank)))

    # ------------------------------------------------------------ background
    def _background(self, ms: MemorySave, layout: Layout | None, staged: list[Staged],
                    held_crc: dict[int, int], blobs: list, json_values: dict[str, str],
                    failure: str | None, after_commit, previous_persist: MemorySave | None,
                    t0: float) -> None:
        g, step = self.g, ms.step
        persist_state: dict | None = None
        try:
            persist_state = self._commit(ms, layout, staged, held_crc, blobs, json_values,
                                         failure)
            if after_commit is not None:
                g.store.pin(step)  # before the next step may commit and drop it
        except CheckpointError as e:
            ms.error = e
        except Exception as e:  # a peer gone, a timeout: the step does not count
            ms.error = CheckpointError(f"{g.store.where(step)}: {type(e).__name__}: {e}")
        finally:
            for s in staged:
                s.close()
            ms.seconds = time.perf_counter() - t0
            ms.committed.set()
        try:
            if after_commit is not None and persist_state is not None:
                self._persist(ms, after_commit, persist_state, previous_persist)
        finally:
            ms.done.set()

    def _persist(self, ms: MemorySave, after_commit: Callable[[int, dict], None],
                 persist_state: dict, previous: MemorySave | None) -> None:
        """``after_commit`` once the previous persist ended; the step is
        unpinned after (and dropped by the leader if a newer one committed)."""
        g, step = self.g, ms.step
        try:
            if previous is not None:
                previous.done.wait()
            after_commit(step, persist_state)
        except CheckpointError as e:
            ms.persist_error = e
        except Exception as e:  # a peer gone, a timeout: the persistent step does not count
            ms.persist_error = CheckpointError(f"{g.store.where(step)}: persisting it: "
                                               f"{type(e).__name__}: {e}")
        finally:
            g.store.unpin(step, drop=g.leader)

    def _commit(self, ms: MemorySave, layout: Layout | None, staged: list[Staged],
                held_crc: dict[int, int], blobs: list, json_values: dict[str, str],
                failure: str | None) -> dict | None:
        g, step, store = self.g, ms.step, self.g.store
        own = staged[0] if staged else None
        crc = dict(held_crc)
        if failure is None and own is not None and layout is not None:
            for cid, off in zip(layout.own_ids.tolist(), layout.own_offsets.tolist(),
                                strict=True):
                crc[cid] = checksum(own.view[off:off + int(layout.nbytes[cid])])
        bf = staged[1] if len(staged) > 1 else None
        blob_crc = [checksum(bf.view[o:o + n]) if bf is not None else 0
                    for _, n, _, o in blobs]
        mine = (failure, np.array(sorted(crc), dtype=np.int64),
                np.array([crc[c] for c in sorted(crc)], dtype=np.int64),
                [(f, n, k, o, c) for (f, n, k, o), c in zip(blobs, blob_crc, strict=True)],
                json_values)
        everyone = g.all_gather(mine)
        failures = [f for f, *_ in everyone if f is not None]
        if failures or layout is None:
            store.drop(step)
            raise MemoryTierError(f"memory step {step} not taken: " + "; ".join(failures))
        assert own is not None
        # blobs: numbered after the tensor chunks, by fqn
        blob_names = sorted({b[0] for *_, bl, _ in everyone for b in bl})
        bid = {f: len(layout.chunks) + i for i, f in enumerate(blob_names)}
        ch, rk, cr = [layout.holder_chunk], [layout.holder_rank], []
        crc_by = {}
        for r, (_, ids, vals, _, _) in enumerate(everyone):
            crc_by[r] = dict(zip(ids.tolist(), vals.tolist(), strict=True))
        # every holding's checksum: the ranks' own, in holder order
        cr.append(np.array([crc_by[r][c] for c, r in zip(layout.holder_chunk.tolist(),
                                                         layout.holder_rank.tolist(),
                                                         strict=True)], dtype=np.int64))
        blob_rows = [(bid[f], r, n, k, o, c) for r, e in enumerate(everyone)
                     for f, n, k, o, c in e[3]]
        ch.append(np.array([b[0] for b in blob_rows], dtype=np.int64))
        rk.append(np.array([b[1] for b in blob_rows], dtype=np.int64))
        cr.append(np.array([b[5] for b in blob_rows], dtype=np.int64))
        all_chunk, all_rank, all_crc = np.concatenate(ch), np.concatenate(rk), np.concatenate(cr)
        names = [c[0] for c in layout.chunks] + blob_names
        boxes: list[tuple] = [(c[1], c[2]) for c in layout.chunks] + [()] * len(blob_names)
        corrupt = sdc.compare(all_chunk, all_rank, all_crc, names, boxes, step)
        if corrupt is not None:
            store.drop(step)
            raise corrupt
        chunk_crc = np.zeros(len(names), dtype=np.int64)
        chunk_crc[all_chunk] = all_crc  # holders agree
        # copies of tensor chunks, then of single-host blobs
        sends = {dst: [own.view[o:o + int(layout.nbytes[c])]
                       for c, o in self._offsets(layout, ids)]
                 for dst, ids in layout.copy_out.items()}
        copies = self._stage_copies(step, layout.copies_bytes)
        staged.append(copies)
        recvs = {src: [copies.view[o:o + int(layout.nbytes[c])]
                       for c, o in zip(ids.tolist(), offs.tolist(), strict=True)]
                 for src, (ids, offs) in layout.copy_in.items()}
        replicate.exchange(sends, recvs, g.group, rate=g.tier.bandwidth)
        bad = [int(c) for ids, offs in layout.copy_in.values()
               for c, o in zip(ids.tolist(), offs.tolist(), strict=True)
               if checksum(copies.view[o:o + int(layout.nbytes[c])]) != chunk_crc[c]]
        held_files = [[own_file(g.rank), layout.own_ids.tolist(), layout.own_offsets.tolist()]]
        if layout.copy_in:
            ids = np.concatenate([v[0] for v in layout.copy_in.values()])
            offs = np.concatenate([v[1] for v in layout.copy_in.values()])
            held_files.append([copies_file(g.rank), ids.tolist(), offs.tolist()])
        blob_hold = self._blob_copies(step, blob_rows, blob_names, bid, bf, chunk_crc, bad,
                                      held_files)
        store.write_held(step, g.rank, {"files": held_files})
        outcome = g.all_gather([f"rank {g.rank}: copies of chunk(s) {bad[:8]} arrived damaged "
                                f"(CRC-32C mismatch)"] if bad else [])
        errs = [m for o in outcome for m in o]
        if errs:
            store.drop(step)
            raise MemoryTierError(f"memory step {step} not taken: " + "; ".join(errs))
        md = self._metadata(step, layout, chunk_crc, blob_rows, blob_names, bid, everyone)
        if g.leader:
            store.write_metadata(step, md)
            store.commit(step)
            store.drop_except({step})
        dist.barrier(group=g.group)
        return self._persist_state(layout, blob_hold, everyone, own)

    def _stage_copies(self, step: int, nbytes: int) -> Staged:
        """This rank's copies file of ``step``, reserved once the previous
        committed step has released its copies on this rank (memory bound:
        a host holds one step's copies at a time, so a save peaks at the old
        step's own bytes, the new step's and one set of copies; the old step
        stays complete wherever its holders' hosts survive, and a host lost
        now sends its single-host chunks of it to the persistent tier)."""
        g = self.g
        older = [s for s in g.store.steps() if s < step]
        if older:
            g.store.release(older[-1], g.rank, (copies_file(g.rank), blob_copies_file(g.rank)))
        return g.store.stage(step, copies_file(g.rank), nbytes)

    @staticmethod
    def _offsets(layout: Layout, ids: np.ndarray) -> list[tuple[int, int]]:
        where = dict(zip(layout.own_ids.tolist(), layout.own_offsets.tolist(), strict=True))
        return [(int(c), where[int(c)]) for c in ids.tolist()]

    def _blob_copies(self, step: int, blob_rows: list, blob_names: list[str], bid: dict,
                     bf: Staged | None, chunk_crc: np.ndarray, bad: list[int],
                     held_files: list) -> dict[str, tuple[str, int, int, str]]:
        """Send the blobs held on one host only to other hosts (as tensor
        chunks are); returns this rank's own blobs ``fqn -> (file, offset,
        nbytes, raw type)``."""
        g = self.g
        n_tensor = len(chunk_crc) - len(blob_names)
        mine = {b: (o, n, k) for b, r, n, k, o, _ in blob_rows if r == g.rank}
        hold: dict[str, tuple[str, int, int, str]] = {
            blob_names[b - n_tensor]: (blobs_file(g.rank), o, n, k)
            for b, (o, n, k) in mine.items()}
        if mine:
            held_files.append([blobs_file(g.rank), list(mine), [v[0] for v in mine.values()]])
        if not blob_rows:
            return hold
        rows = np.array([(b, r) for b, r, *_ in blob_rows], dtype=np.int64)
        p = placement.place(rows[:, 0], rows[:, 1], g.rank_host, g.host_domain,
                            g.tier.replicas)
        size = {b: n for b, r, n, *_ in blob_rows}
        order = np.lexsort((p.copy_chunk, p.copy_src, p.copy_dst))
        c_chunk, c_src, c_dst = p.copy_chunk[order], p.copy_src[order], p.copy_dst[order]
        sel = c_dst == g.rank
        incoming = [(int(c), int(s)) for c, s in zip(c_chunk[sel], c_src[sel], strict=True)]
        total = sum(size[c] for c, _ in incoming)
        target = g.store.stage(step, blob_copies_file(g.rank), total)
        try:
            recvs: dict[int, list[memoryview]] = {}
            offsets: list[int] = []
            off = 0
            for src in sorted({s for _, s in incoming}):
                for c, s in incoming:
                    if s == src:
                        offsets.append(off)
                        recvs.setdefault(src, []).append(target.view[off:off + size[c]])
                        off += size[c]
            incoming.sort(key=lambda cs: cs[1])  # the order offsets were given in
            sends: dict[int, list[memoryview]] = {}
            sel = c_src == g.rank
            for c, d in zip(c_chunk[sel].tolist(), c_dst[sel].tolist(), strict=True):
                o, n, _ = mine[c]
                assert bf is not None
                sends.setdefault(d, []).append(bf.view[o:o + n])
            replicate.exchange(sends, recvs, g.group, rate=g.tier.bandwidth)
            for (c, _), o in zip(incoming, offsets, strict=True):
                if checksum(target.view[o:o + size[c]]) != chunk_crc[c]:
                    bad.append(c)
            if incoming:
                held_files.append([blob_copies_file(g.rank), [c for c, _ in incoming], offsets])
        finally:
            target.close()
        return hold

    def _metadata(self, step: int, layout: Layout, chunk_crc: np.ndarray, blob_rows: list,
                  blob_names: list[str], bid: dict, everyone: list) -> Metadata:
        g = self.g
        md = Metadata(save_id=f"{g.run_id}-step{step}-{self.fingerprint(layout)}",
                      world_size=g.world_size)
        for cid, (fqn, offsets, sizes) in enumerate(layout.chunks):
            if fqn not in md.tensors:
                shape, dtype = layout.shapes[fqn]
                md.tensors[fqn] = TensorMeta(shape, dtype)
            w = int(layout.primary[cid])
            md.tensors[fqn].chunks.append(ChunkMeta(
                offsets, sizes, own_file(w), int(layout.primary_offset[cid]),
                int(layout.nbytes[cid]), int(chunk_crc[cid]), w))
        first: dict[int, tuple] = {}
        for b, r, n, k, o, c in blob_rows:
            if b not in first or r < first[b][0]:
                first[b] = (r, n, k, o, c)
        for name in blob_names:
            r, n, k, o, c = first[bid[name]]
            md.objects[name] = ObjectMeta(raw=BlobRef(blobs_file(r), o, n, c), raw_type=k)
        for r in reversed(range(len(everyone))):  # the lowest rank's value wins
            for fqn, text in everyone[r][4].items():
                md.objects[fqn] = ObjectMeta(value=json.loads(text))
        md.objects = dict(sorted(md.objects.items()))
        md.tensors = dict(sorted(md.tensors.items()))
        md.version = max(md.version, 2)
        return md

    def fingerprint(self, layout: Layout) -> str:
        """The layout's identity: a CRC-32C of every chunk's fqn and box."""
        text = json.dumps([layout.chunks, sorted(layout.shapes.items())])
        return f"{checksum(text.encode()):08x}"

    def _persist_state(self, layout: Layout, hold: dict, everyone: list,
                       own: Staged | None) -> dict:
        """What :func:`dcp.save` writes to persist this step: this rank's
        chunks as :class:`TensorShard` views of the host's memory step (no
        copy), its JSON values and raw blobs, under their fqns."""
        return {"layout": layout, "blobs": hold, "json": everyone[self.g.rank][4]}


def persist_view(g: TierGroup, step: int, info: dict) -> dict:
    """A flat state dict over memory step ``step`` on this host holding this
    rank's chunks (read-only views of the host's files, no copy), JSON values
    and raw blobs: what a persistent save of the step writes.  The mappings
    close once the state dict is dropped."""
    layout: Layout = info["layout"]
    held = g.store.held(step)
    state: dict[str, Any] = {}
    opened: dict[str, memoryview] = {}

    def view(file: str) -> memoryview:
        if file not in opened:
            with open(g.store.step_dir(step) / file, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if \
                    (g.store.step_dir(step) / file).stat().st_size else None
            opened[file] = memoryview(m) if m is not None else memoryview(b"")
        return opened[file]

    pieces: dict[str, list[TensorShard]] = {}
    for (fqn, offsets), cid in layout.mine.items():
        file, off = held[cid]
        sizes = layout.chunks[cid][2]
        shape, dtype = layout.shapes[fqn]
        data = tensors.readonly_view(view(file)[off:off + int(layout.nbytes[cid])], dtype, sizes)
        pieces.setdefault(fqn, []).append(TensorShard(data, shape, offsets))
    for fqn, shards in pieces.items():
        state[fqn] = shards[0] if len(shards) == 1 else _several_shards(g, layout, fqn, shards)
    for fqn, text in info["json"].items():
        state[fqn] = json.loads(text)
    for fqn, (file, off, n, kind) in info["blobs"].items():
        blob = bytes(view(file)[off:off + n])
        state[fqn] = io.BytesIO(blob) if kind == "BytesIO" else blob
    return state


def _several_shards(g: TierGroup, layout: Layout, fqn: str, shards: list[TensorShard]) -> Any:
    """This rank's several chunks of ``fqn`` as one leaf a save describes
    chunk by chunk: a ``ShardedTensor`` of those local shards (no copy),
    over the global metadata of every chunk of ``fqn`` in the layout (each
    placed on this rank if it holds it, else on another rank).  Built
    locally: no collective."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    here = {tuple(s.global_offsets) for s in shards}
    other = (g.rank + 1) % g.world_size

    def placed(offsets, sizes) -> ShardMetadata:
        rank = g.rank if tuple(offsets) in here else other
        return ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/cpu")

    local = [Shard(s.data, placed(s.global_offsets, s.data.shape)) for s in shards]
    every = [placed(o, z) for f, o, z in layout.chunks if f == fqn and 0 not in z]
    shape = tuple(shards[0].global_shape)
    meta = ShardedTensorMetadata(every, torch.Size(shape),
                                 TensorProperties(dtype=shards[0].data.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, meta, process_group=g.persist_group)

