"""Reusing save plans while the state dict's structure stays the same.

The key of a rank's plan is a SHA-256 over everything that shapes it: every
chunk's fqn, global shape, dtype, offsets and sizes (in state-dict order),
the world size, the rank, and the planner (class and attributes).  Keying by
fqns alone, as the reference design does, reuses a stale plan after a
resharding that keeps the names; here any change of layout misses.

A cache holds the plans of up to :data:`MAX_ENTRIES` structures (a job may
save a model and, less often, a larger state with its optimizer; a
benchmark alternates layouts), each marked with the *token* of the exchange
that made it: the id of the save that exchanged its local plans, the same
on every rank.  Only planners whose ``cacheable`` is true take part
(:class:`~dcp.core.planner.SavePlanner`); others plan every save.

A save with the cache runs as *one* step when every rank hits: each rank
looks its key up locally (no communication), checks that the target may be
written, writes the chunks its cached final plan gives it, and sends the
coordinator its key, its entry's token and its write results — only what
the coordinator's copy of every rank's plans lacks
(:class:`~dcp.coordination.wire.CachedWriteResult`: per chunk its plan row,
file, byte offset and checksum; fingerprints by plan row); the
coordinator checks that every key is the one its own entry was planned with
and every token is its entry's (so no rank writes by a plan made for
another structure of the others), and commits.  A rank whose part is the
same in several cached structures (structures that differ on other ranks
only) does not guess: it sends the tokens it holds, the coordinator names
the one of its entry, and the ranks write in a second step — still without
planning.  When every rank misses, they send their local plans in that same
step and the save goes on as an uncached one.  When some hit and some miss
(a layout changed on some ranks), the coordinator asks all for their local
plans in a second step, in which ranks that wrote speculatively delete
those files.  A changed layout costs an exchange, never a stale plan.
Every rank's part of that first step also carries its checkpoint id
(:func:`~dcp.core.storage.location_key`), hit or miss, and the coordinator
refuses the save if they differ (the ranks would write into several
folders, and the metadata would name files of the others): what ranks
wrote speculatively is deleted, nothing is committed.  Any failure empties
the cache (on every rank, since failures reach every rank), so the next
save exchanges.

Save ids: a caller may name the save (the async saver does:
``<job token><save number>``).  Otherwise an exchange save gets a fresh
random id ``<16 hex digits>00000000`` and the ``n``-th cached save of the
same entry ``<those 16 digits><n as 8 hex digits>``: unique, and the same on
every rank with no exchange.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from dcp.coordination import wire
from dcp.coordination.collectives import PerRank
from dcp.core.metadata import Metadata
from dcp.core.planner import SavePlan, SavePlanner, TensorDecl
from dcp.core.storage import location_key, refuse_differing_locations

#: The most structures one cache keeps plans for; the least recently used
#: goes first.
MAX_ENTRIES = 8


def structure_key(chunks: dict, world_size: int, rank: int, planner: SavePlanner) -> str:
    """The hex digest of everything that shapes this rank's plan;
    ``chunks`` maps ``(fqn, offsets)`` to the rank's local chunks
    (``SaveState.chunks``)."""
    settings = sorted(getattr(planner, "__dict__", {}).items())
    digest = hashlib.sha256(repr((world_size, rank, type(planner).__module__,
                                  type(planner).__qualname__, settings)).encode())
    for (fqn, offsets), chunk in chunks.items():
        digest.update(repr((fqn, chunk.global_shape, chunk.dtype, offsets, chunk.sizes)).encode())
    return digest.hexdigest()


@dataclass
class CacheEntry:
    """One cached plan: this rank's ``key``, final ``plan`` and ``local``
    plan (what it offered), the ``token`` of the exchange that made it and
    how many ``saves`` reused it; on the coordinator also every rank's key,
    the tensor declarations, and every rank's final and local plans
    (``plans``, ``locals``: what a cached save's write results refer to)."""

    key: str
    plan: SavePlan
    token: str
    saves: int = 0
    keys: list[str] | None = None
    decls: dict[str, TensorDecl] | None = None
    local: SavePlan | None = None
    plans: list[SavePlan] | None = None
    locals: list[SavePlan] | None = None

    def next_id(self) -> str:
        """The id of the next save that reuses this plan."""
        return f"{self.token[:16]}{self.saves + 1:08x}"


@dataclass
class CachedSaveResult:
    """What :meth:`PlanCache.save` did: the committed ``metadata``; whether
    plans were exchanged (``exchanged``, and then ``entry`` is the new
    cache entry, ``None`` if the planner is not cacheable); ``planning_s``,
    the seconds spent deciding the plan (the key check on a hit; the
    planning steps on a miss)."""

    metadata: Metadata
    exchanged: bool
    planning_s: float
    entry: CacheEntry | None = None


class PlanCache:
    """The cached plans of one rank for the saves of one group, by key and
    token (least recently used first).  Entries are plain data, so a
    process can hand them to another (the trainer keeps copies for the next
    worker)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[str, str], CacheEntry] = OrderedDict()

    def add(self, entry: CacheEntry) -> None:
        """Keep ``entry``, dropping the least recently used beyond
        :data:`MAX_ENTRIES`."""
        self.entries[(entry.key, entry.token)] = entry
        while len(self.entries) > MAX_ENTRIES:
            self.entries.popitem(last=False)

    def _used(self, entry: CacheEntry) -> None:
        entry.saves += 1
        self.entries.move_to_end((entry.key, entry.token))

    def save(self, job, save_id: str | None = None) -> CachedSaveResult:
        """Run ``job`` (a :class:`dcp.orchestration.save._Save` not yet started) with the
        cache, as save ``save_id`` (by default named as in the module doc).
        A planner whose ``cacheable`` is false plans every save.

        Raises :class:`CheckpointError` on every rank if the save fails; the
        cache is emptied then and the files this rank wrote are deleted
        (``job.discard()``).
        """
        try:
            return self._save(job, save_id)
        except BaseException:  # any failure, a timeout or an interrupt: clean up, re-raise
            self.entries.clear()
            job.discard()
            raise

    def _save(self, job, save_id: str | None) -> CachedSaveResult:
        start = time.perf_counter()
        coord, cacheable = job.coord, job.planner.cacheable
        mine: dict = {"planning_s": 0.0}

        def write(entry: CacheEntry) -> tuple:
            name = save_id or entry.next_id()
            mine.update(planning_s=time.perf_counter() - start, used=entry)
            result = job.write(name, entry.plan)
            if entry.local is not None:  # only what the coordinator's copy of the plan lacks
                result = wire.relative_result(result, entry.plan, entry.local,
                                              coord.rank) or result
            mine["result"] = result
            return (entry.token, name), result

        def local():
            where = location_key(job.storage.checkpoint_id)
            offered = job.offered()
            key = structure_key(job.state.chunks, coord.world_size, coord.rank, job.planner)
            found = [e for (k, _), e in self.entries.items() if k == key] if cacheable else []
            mine.update(key=key, offered=offered, found=found)
            if not found:
                mine["local"] = job.planner.create_local_plan(offered)
                return "plan", key, None, mine["local"], where
            if len(found) > 1:  # this part belongs to several structures: the coordinator picks
                return "choose", key, [e.token for e in found], None, where
            job.check_target()  # before writing: a refusal costs no I/O
            return ("written", key) + write(found[0]) + (where,)

        def plan_all(plans: list[SavePlan]) -> PerRank:
            final = job.plan_all(plans, save_id)
            mine.update(decls=dict(job.decls), plans=[plan for _, plan in final],
                        locals=list(plans))
            return PerRank(final)

        def whole(entry: CacheEntry, results: list) -> list:
            """The write results made whole by the entry's plans."""
            if entry.plans is None or entry.locals is None:
                return results
            return [wire.absolute_result(r, entry.plans[rank], entry.locals[rank], rank)
                    if isinstance(r, wire.CachedWriteResult) else r
                    for rank, r in enumerate(results)]

        # each part: (kind, key, marks or tokens, plan or write result, location), by kind
        def decide(located: list[tuple[str, str, Any, Any, str]]):
            refuse_differing_locations(
                [where for *_, where in located], "one save",
                "a per-rank part of the path (the rank, a per-process timestamp or run name) "
                "would split one checkpoint into folders none of which loads; nothing was "
                "committed, and what the ranks wrote is deleted")
            parts = [part[:4] for part in located]
            keys = [key for _, key, _, _ in parts]
            mine["keys"] = keys
            for own in mine["found"]:
                if own.keys != keys:
                    continue
                marks = (own.token, save_id or own.next_id())
                if all(kind == "written" and m == marks for kind, _, m, _ in parts):
                    job.decls = own.decls
                    job.check_target()
                    return job.commit(marks[1], whole(own, [result for _, _, _, result in parts]))
                if all((kind == "written" and m == marks) or (kind == "choose" and own.token in m)
                       for kind, _, m, _ in parts):
                    job.check_target()
                    return "write", own.token
            if all(kind == "plan" for kind, _, _, _ in parts):
                return plan_all([plan for _, _, _, plan in parts])
            return "replan"

        answer = coord.step("save (planning or cached writing)", local, decide)
        if isinstance(answer, Metadata):
            self._used(mine["used"])
            return CachedSaveResult(answer, False, mine["planning_s"])
        if isinstance(answer, tuple) and answer[0] == "write":  # some ranks were told which plan
            chosen = next(e for e in mine["found"] if e.token == answer[1])
            name = save_id or chosen.next_id()

            def commit(results: list) -> Metadata:
                job.decls = chosen.decls
                return job.commit(name, whole(chosen, results))

            metadata = coord.gather_broadcast(
                "save writing/commit",
                lambda: mine["result"] if "used" in mine else write(chosen)[1], commit)
            self._used(chosen)
            return CachedSaveResult(metadata, False, mine["planning_s"])
        if answer == "replan":
            def replan() -> SavePlan:
                job.storage.retrying(job.storage.delete, job.written)  # speculative files
                job.written = []
                mine["local"] = job.planner.create_local_plan(mine["offered"])
                return mine["local"]
            answer = coord.gather_scatter("save planning", replan,
                                          lambda plans: plan_all(plans).values)
        planning_s = time.perf_counter() - start
        name, plan = answer
        metadata = job.persist(name, plan)
        entry = CacheEntry(mine["key"], plan, token=name, keys=mine.get("keys"),
                           decls=mine.get("decls"), local=mine.get("local"),
                           plans=mine.get("plans"), locals=mine.get("locals"))
        if cacheable:
            self.add(entry)
        return CachedSaveResult(metadata, True, planning_s, entry if cacheable else None)
