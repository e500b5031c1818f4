"""Reusing the save plan while the state dict's structure stays the same.

The key of a rank's plan is a SHA-256 over everything that shapes it: every
chunk's fqn, global shape, dtype, offsets and sizes (in state-dict order),
the world size, the rank, and the planner (class and attributes).  Keying by
fqns alone, as the reference design does, reuses a stale plan after a
resharding that keeps the names; here any change of layout misses.

A save with the cache runs as *one* step when every rank hits: each rank
checks its key locally (no communication), writes the chunks its cached
final plan gives it, and sends the coordinator its key and write results;
the coordinator checks every key against the ones its plan was made from and
commits.  A rank that misses sends its local plan instead, in the same step.
If any rank missed (or a key does not match), the coordinator plans afresh
from the new local plans and its cached local plans of the ranks that hit,
answers each rank its final plan (ranks that wrote speculatively delete
those files) and the save goes on as uncached: a changed layout on some ranks
costs one exchange, never a stale plan.  Any failure drops the cache (on
every rank, since failures reach every rank), so the next save exchanges.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from dcp.coordination import PerRank
from dcp.errors import CheckpointError
from dcp.metadata import Metadata
from dcp.planner import SavePlan, SavePlanner, TensorDecl
from dcp.save import SaveState, _Save


def structure_key(state: SaveState, world_size: int, rank: int, planner: SavePlanner) -> str:
    """The hex digest of everything that shapes this rank's plan."""
    settings = sorted(getattr(planner, "__dict__", {}).items())
    digest = hashlib.sha256(repr((world_size, rank, type(planner).__module__,
                                  type(planner).__qualname__, settings)).encode())
    for (fqn, offsets), chunk in state.chunks.items():
        digest.update(repr((fqn, chunk.global_shape, chunk.dtype, offsets, chunk.sizes)).encode())
    return digest.hexdigest()


@dataclass
class CacheEntry:
    """The cached plan: this rank's key and final plan; on the coordinator
    also every rank's key and local plan, and the tensor declarations."""

    key: str
    plan: SavePlan
    keys: list[str] | None = None
    local_plans: list[SavePlan] | None = None
    decls: dict[str, TensorDecl] | None = None


@dataclass
class CachedSaveResult:
    """What :meth:`PlanCache.save` did: the committed ``metadata``; whether
    plans were exchanged (``exchanged``, and then the cache holds a new
    entry); ``planning_s``, the seconds spent deciding the plan (the key
    check on a hit; the planning step on a miss)."""

    metadata: Metadata
    exchanged: bool
    planning_s: float


class PlanCache:
    """The cached plan of one rank for the saves of one group: ``entry``,
    ``None`` when empty.  The entry is plain data, so a process can hand it
    to another (the trainer keeps a copy for the next worker)."""

    def __init__(self) -> None:
        self.entry: CacheEntry | None = None

    def save(self, job: _Save, save_id: str) -> CachedSaveResult:
        """Run ``job`` (not yet started) with the cache, as save ``save_id``.

        Raises :class:`CheckpointError` on every rank if the save fails; the
        cache is dropped then and the files this rank wrote are deleted
        (:meth:`_Save.discard`).
        """
        try:
            return self._save(job, save_id)
        except Exception:  # any failure, a transport timeout included: clean up, re-raise
            self.entry = None
            job.discard()
            raise

    def _save(self, job: _Save, save_id: str) -> CachedSaveResult:
        start = time.perf_counter()
        coord, cached = job.coord, self.entry
        mine = {"planning_s": 0.0}

        def local():
            offered = job.offered()
            key = structure_key(job.state, coord.world_size, coord.rank, job.planner)
            mine["key"] = key
            if cached is not None and cached.key == key:
                mine["planning_s"] = time.perf_counter() - start
                return "written", key, job.write(save_id, cached.plan)
            return "plan", key, job.planner.create_local_plan(offered)

        def decide(parts: list[tuple[str, str, object]]):
            keys = [key for _, key, _ in parts]
            if cached is not None and cached.keys == keys and all(k == "written" for k, _, _ in parts):
                job.decls = cached.decls
                return job.commit(save_id, [result for _, _, result in parts])
            local_plans = []
            for rank, (kind, key, payload) in enumerate(parts):
                if kind == "plan":
                    local_plans.append(payload)
                elif cached is not None and cached.keys is not None and cached.keys[rank] == key:
                    local_plans.append(cached.local_plans[rank])
                else:
                    raise CheckpointError(
                        f"rank {rank} used a cached save plan that the coordinator does not hold")
            final = job.global_plan(local_plans)
            mine.update(keys=keys, local_plans=local_plans, decls=dict(job.decls))
            return PerRank([("plan", plan) for plan in final])

        answer = coord.step("save (planning or cached writing)", local, decide)
        if isinstance(answer, Metadata):
            return CachedSaveResult(answer, False, mine["planning_s"])
        planning_s = time.perf_counter() - start
        job.storage.delete(job.written)  # speculative files of a cache hit, if any
        job.written = []
        _, plan = answer
        metadata = job.persist(save_id, plan)
        self.entry = CacheEntry(mine["key"], plan, mine.get("keys"), mine.get("local_plans"),
                                mine.get("decls"))
        return CachedSaveResult(metadata, True, planning_s)
