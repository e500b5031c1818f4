"""The checkpoint layer of a training loop: one folder per step under a
root, resume from the newest *complete* step, retention, preemption, RNG
and per-rank state.

The phases, in order, and where each decision lives:

* **Save** (:meth:`CheckpointManager.save`): one small all-reduce over a
  CPU gloo group agrees on a SIGTERM seen by any rank (and on ``force``);
  the save-decision policy (:mod:`dcp.manager.policies`) says whether the
  step is saved; the step goes to ``<root>/step-<N>`` with
  :func:`dcp.async_save` (one save in flight: a new save waits for the
  previous one) or, after a preemption, with :func:`dcp.save` at once.
  Each rank adds its per-rank record (RNG states, :class:`PerRank` values;
  :mod:`dcp.manager.per_rank`) as a raw blob under a key of its own.
* **Commit**: the coordinator of the save (rank 0's background process, or
  rank 0 itself for a synchronous save) names the step in the pointer
  ``<root>/latest.json`` right before it commits the step's metadata
  (:class:`dcp.manager.steps.NamePointer`, the save's ``before_commit``),
  so a step committed after its trainer died is found like any other.
  Once the trainer learns of the commit, rank 0 deletes, on a background
  thread, the steps the preservation policy lets go: never the newest
  complete step (the one just committed), never the step in flight (a
  newer one, whose metadata does not exist yet), and the metadata of a
  step first, so a half-deleted step is never complete.
* **Memory tier** (``memory=MemoryTier(...)``, :mod:`dcp.recovery`): every
  ``memory.interval`` steps the state is staged into host shared memory and
  committed there in the background (copies on other hosts, SDC check); the
  steps the save policy picks are then persisted from host memory, while
  the next memory steps go on (a memory save waits for the previous one's
  commit, never for a persist; :meth:`CheckpointManager.wait` for both).  A
  resume first restores the newest memory step every rank can get complete
  (:mod:`dcp.recovery.restore`), unless a persistent step is newer; a step
  that cannot be restored on some rank sends every rank to an older one.
* **Resume** (:meth:`CheckpointManager.load_latest`): rank 0 finds the
  newest complete step through the pointer (two requests in the common
  case, whatever the number of steps; a listing of the root when the
  pointer cannot say: :func:`dcp.manager.steps.newest_step`) and reads its
  metadata.  The step and its metadata are broadcast; every rank loads the
  state (a step found corrupt, there or in the load, is marked bad and
  passed over by every rank alike), its own per-rank record (or, after a
  change of the data-parallel degree, every record, to apply
  :class:`PerRank`'s rule) and restores its RNG states: its own rank's when
  the layout is the same, else the first saved rank's of the same
  data-parallel rank, and after a change of the data-parallel degree those
  the declared ``rng_on_resize`` rule makes of every old data-parallel
  rank's (:mod:`dcp.manager.rng`), or it raises before loading anything.
"""

from __future__ import annotations

import functools
import logging
import numbers
import os
import signal
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dcp.asynchronous.async_save import AsyncSaveResponse, async_save, prestart_async_worker
from dcp.coordination.collectives import coordination_group
from dcp.core.compression import Compression, resolve
from dcp.core.metadata import Metadata
from dcp.core.storage import checkpoint_uri, open_storage
from dcp.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotACheckpointError,
    SilentDataCorruptionError,
)
from dcp.manager import per_rank, rng
from dcp.manager.per_rank import PerRank
from dcp.manager.policies import (
    AnyOf,
    EveryNSteps,
    FixedInterval,
    Forced,
    LatestN,
    OnPreemption,
    Preservation,
    SaveContext,
    SaveDecision,
)
from dcp.manager.steps import (
    KEY,
    NamePointer,
    complete_steps,
    mark_bad,
    newest_step,
    prune_steps,
    step_uri,
)
from dcp.orchestration.inventory import remove_empty_folder
from dcp.orchestration.load import load, read_metadata
from dcp.orchestration.save import save as sync_save
from dcp.recovery import restore
from dcp.recovery.hosts import TierGroup
from dcp.recovery.snapshot import MemorySave, Snapshotter, persist_view
from dcp.recovery.tier import MemoryTier

log = logging.getLogger(__name__)


class CheckpointWarning(UserWarning):
    """A save that failed in the background, a failed retention delete, or
    a corrupt step passed over by :meth:`CheckpointManager.load_latest`:
    the training goes on, the newest complete step stays loadable."""


def _latest_counts(policy: Any) -> list[int]:
    """The ``n`` of every :class:`LatestN` in a preservation policy."""
    inner = getattr(policy, "policies", None)
    if inner is not None:
        return [n for p in inner for n in _latest_counts(p)]
    return [policy.n] if isinstance(policy, LatestN) else []


class CheckpointManager:
    """Saves and resumes a training run under ``root``, one folder
    ``step-<N>`` per step (module doc).  Collective: every rank of the group
    constructs it and calls :meth:`save` and :meth:`load_latest` at the
    same steps.

    Args:
        root: any storage URI or path (normalised by
            :func:`dcp.core.storage.checkpoint_uri`).
        interval: save when ``step % interval == 0`` (:class:`FixedInterval`).
        keep_latest: keep the newest N complete steps (``0``: keep all); at
            least 2 with async saves.
        keep_every: also keep steps that are multiples of this.
        async_save: save with :func:`dcp.async_save` (one save in flight);
            the background save process is started at construction
            (:func:`dcp.prestart_async_worker`), so no save waits for it;
            with a ``memory`` tier, once :meth:`load_latest` returned (or at
            the first save), so its start does not compete with the restore
            (on 2 cores, 4 ranks: a host-lost restore 1.4-2.3 s beside the
            starting processes, 0.64 s without).
        storage_options, coordination, process_group, compression: as for
            :func:`dcp.async_save` (``coordination`` ``"gloo"`` or ``"file"``).
        save_on_preemption: on SIGTERM to any rank, every rank saves the
            step of its next :meth:`save` call synchronously, then
            :attr:`preempted` is True.
        save_policy: a save decision replacing ``interval`` (e.g.
            ``AnyOf(FixedInterval(100), SpecificSteps([1]))``); ``force``
            and preemption are always honoured.
        preservation: a preservation policy replacing ``keep_latest`` and
            ``keep_every`` (e.g. ``AnyOf(LatestN(2), BestN("loss", 3))``).
        save_rng: save each rank's RNG states and restore them on load
            (``False``: neither).
        rng_on_resize: how a load after a change of the data-parallel
            degree sets the RNG states: a rule ``(states of the old
            data-parallel ranks, dp_rank, dp_degree) -> state``
            (:class:`dcp.manager.DeriveRNG`: fresh streams derived from the
            saved ones; :class:`dcp.FromFirstRank`: old data-parallel rank
            0's everywhere); ``None`` makes such a load raise
            :class:`CheckpointError` (with ``save_rng=True``).
        data_parallel: ``(dp_rank, dp_degree)`` of this rank (default: its
            rank and the world size), for per-rank state.
        exclude_from_loading: top-level keys of the state not loaded.
        initial_load_path: a checkpoint or a Hugging Face safetensors
            folder loaded into ``state[model_key]`` when no step is
            complete (model only; tensors cast to the model's dtypes).
        model_key: the key of the model in the state (initial load, export).
        export_dtype: the dtype :meth:`export` casts floating tensors to.
        blocking_staging, timeout: as for :func:`dcp.async_save`.
        memory: a host-memory tier (:class:`dcp.recovery.MemoryTier`): a
            memory step every ``memory.interval`` steps, with copies on
            other hosts; the steps ``interval`` (the save policy) picks are
            then persisted from host memory once their memory step
            committed, and :meth:`load_latest` restores from memory first
            ([recovery.md](docs/recovery.md)).  Needs a process group.
    """

    def __init__(self, root: str | os.PathLike[str], interval: int = 500, keep_latest: int = 3,
                 keep_every: int | None = None, async_save: bool = True,
                 storage_options: dict | None = None, coordination: str = "gloo",
                 process_group=None, *, save_on_preemption: bool = True,
                 save_policy: SaveDecision | None = None,
                 preservation: Preservation | None = None, save_rng: bool = True,
                 rng_on_resize: per_rank.ResizeRule | None = None,
                 data_parallel: tuple[int, int] | None = None,
                 exclude_from_loading: tuple[str, ...] = (),
                 initial_load_path: str | None = None, model_key: str = "model",
                 export_dtype: torch.dtype | None = None, blocking_staging: bool = True,
                 timeout: float = 600.0, memory: MemoryTier | None = None,
                 compression: Compression | str | None = None) -> None:
        self.root = checkpoint_uri(str(root))
        #: how the steps' chunks are compressed (None: not at all)
        self.compression = resolve(compression)
        self.storage_options = dict(storage_options or {})
        if coordination not in ("gloo", "file"):
            raise CheckpointError(f"{self.root!r}: the manager saves with coordination 'gloo' "
                                  f"or 'file', not {coordination!r}: a step is complete only "
                                  f"once one metadata is committed for every rank")
        if preservation is None:
            preservation = AnyOf(LatestN(keep_latest),
                                 *([EveryNSteps(keep_every)] if keep_every is not None else []))
        for n in _latest_counts(preservation):
            if async_save and 0 < n < 2:
                raise CheckpointError(f"{self.root!r}: keep_latest (LatestN) {n} with async "
                                      f"saves: it must be at least 2 (or 0, keep all), since "
                                      f"the newest step may still be saving when the next "
                                      f"one starts")
        self.async_save, self.coordination, self.timeout = async_save, coordination, timeout
        self.blocking_staging = blocking_staging
        self.save_policy: SaveDecision = AnyOf(
            save_policy if save_policy is not None else FixedInterval(interval),
            Forced(), *([OnPreemption()] if save_on_preemption else []))
        self.preservation = preservation
        self.save_rng, self.exclude = save_rng, tuple(exclude_from_loading)
        self.rng_on_resize = rng_on_resize
        self.initial_load_path, self.model_key = initial_load_path, model_key
        self.export_dtype = export_dtype
        self.save_on_preemption = save_on_preemption
        self.process_group = process_group
        self._storage = open_storage(self.root, **self.storage_options)
        folder = getattr(self._storage, "root", None)
        if isinstance(folder, Path) and folder.exists() and not folder.is_dir():
            raise CheckpointError(f"{self.root!r}: the root is a file, not a folder: no step "
                                  f"folder can be saved or found under it")

        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            group = process_group if process_group is not None else dist.group.WORLD
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
            self._src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            # agree on a CPU group, never the accelerator's communicator
            self._cpu_group = coordination_group(process_group)
        else:
            self.rank, self.world_size, self._src, self._cpu_group = 0, 1, 0, None
        self.dp_rank, self.dp_degree = data_parallel or (self.rank, self.world_size)
        self.memory = memory
        self._tier: TierGroup | None = None
        self._snapshots: Snapshotter | None = None
        self._memory_save: MemorySave | None = None  # the newest, its commit not yet waited
        self._persists: list[MemorySave] = []  # committed, persisting or queued to
        #: where the last :meth:`load_latest` from the memory tier took its bytes
        self.last_restore: restore.RestoreReport | None = None
        #: the last memory step's stall and background seconds, on this rank
        self.last_memory_save: MemorySave | None = None
        self._corruption: SilentDataCorruptionError | None = None
        if memory is not None:
            if not isinstance(memory, MemoryTier):
                raise CheckpointError(f"{self.root!r}: memory={memory!r}: a dcp.MemoryTier "
                                      f"(or None), not a {type(memory).__name__}")
            if not self.distributed:
                raise CheckpointError(f"{self.root!r}: the memory tier needs torch.distributed "
                                      f"initialized (its copies go to other hosts' ranks)")
            self._tier = TierGroup(memory, self.root, process_group)
            self._snapshots = Snapshotter(self._tier)
            if memory.replicas > len(self._tier.hosts) - 1:
                n = len(self._tier.hosts)
                warnings.warn(
                    f"MemoryTier(replicas={memory.replicas}): the job spans {n} host"
                    f"{'s' if n != 1 else ''} ({', '.join(self._tier.hosts)}), so a chunk held "
                    f"on one host gets {max(n - 1, 0)} cop{'y' if n == 2 else 'ies'} on others; "
                    f"a lost host's chunks come from the persistent tier", CheckpointWarning,
                    stacklevel=2)

        self.preempted = False
        self._sigterm = False
        self._previous_handler: Any = None
        if save_on_preemption and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._in_flight: tuple[int, AsyncSaveResponse, threading.Event] | None = None
        self._last_saved: int | None = None
        #: the newest step complete under the root or saved by this manager,
        #: once known (rank 0's reading, broadcast): a save must be newer
        self._newest: int | None = None
        self._newest_known = False
        self._metrics: dict[int, dict] = {}
        self._retention: threading.Thread | None = None
        self._lock = threading.Lock()
        self.errors: list[CheckpointError] = []
        self._warned = 0
        self._closed = False
        #: the background save process is still to start (see ``async_save``)
        self._prestart = async_save
        if memory is None:  # it starts while the job resumes
            self._start_worker()

    def _start_worker(self) -> None:
        """Prestart the background save process, once."""
        if not self._prestart or self._closed:
            return
        self._prestart = False
        try:
            prestart_async_worker(self.process_group)
        except CheckpointError:  # no `__main__` guard: the first save raises it
            pass

    # ------------------------------------------------------------- queries
    def step_uri(self, step: int) -> str:
        return step_uri(self.root, step)

    @property
    def in_flight(self) -> int | None:
        """The step whose async save is still persisting on this rank (not
        yet committed nor failed), else ``None``."""
        if self._in_flight is None or self._in_flight[2].is_set():
            return None
        return self._in_flight[0]

    def steps(self) -> list[int]:
        """The complete steps, ascending: those under the root (one listing;
        a root that cannot be listed, a missing bucket, raises naming it)
        and, with a memory tier, the memory steps committed on this host."""
        return sorted(set(self.persistent_steps()) | set(self.memory_steps()))

    def memory_steps(self) -> list[int]:
        """The memory steps committed (and trusted) on this rank's host."""
        return self._tier.store.steps() if self._tier is not None else []

    def persistent_steps(self) -> list[int]:
        """The complete steps under the root, ascending."""
        try:
            names = self._storage.list_files()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.root!r}: listing the root failed: "
                                  f"{type(e).__name__}: {e}") from e
        return complete_steps(names)

    def latest_step(self) -> int | None:
        """The newest complete step, whoever committed it (a background save
        process that outlived its trainer too): the pointer and one
        existence check in the common case, else one listing
        (:mod:`dcp.manager.steps`).  Raises :class:`CheckpointError` naming
        the root if it cannot be listed."""
        return newest_step(self._storage)

    # --------------------------------------------------------------- save
    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def _agree(self, flags: list[int]) -> list[int]:
        """The maximum of ``flags`` over the group: one small all-reduce."""
        if not self.distributed:
            return flags
        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return [int(v) for v in t.tolist()]

    def save(self, step: int, state: dict, force: bool = False,
             metrics: dict[str, float] | None = None) -> bool:
        """Save ``state`` as ``step`` if the save policy, ``force`` or a
        preemption says so; returns whether a save started (or, after a
        preemption, was made).  Collective: call it on every rank at every
        step.  ``metrics`` (the same on every rank) are kept with the step
        for :class:`BestN`.

        Raises:
            CheckpointError: at the call, on every rank, for a step not
                newer than the newest complete one (``force`` forces the
                decision to save, never the replacement of a complete step).
        """
        self._check_open()
        self._start_worker()
        step = self._check_step(step)
        self._check_state(state)
        preempted, forced = self._agree([int(self._sigterm), int(force)])
        ctx = SaveContext(step, bool(forced), bool(preempted))
        persist = self.save_policy.should_save(ctx)
        in_memory = self.memory is not None and step % self.memory.interval == 0
        if not (persist or in_memory):
            self._raise_corruption()
            return False
        self._check_newer(step)
        if in_memory and not (preempted and self.save_on_preemption):
            if self._last_saved == step:
                return False
            self._save_memory(step, state, metrics, persist)
            return True
        if preempted and self.save_on_preemption:  # last words: now, synchronously
            if self._last_saved != step:
                self._save(step, state, metrics, asynchronous=False)
            self.wait()
            self.preempted = True
            return True
        if self._last_saved == step:
            return False
        self._save(step, state, metrics, asynchronous=self.async_save)
        return True

    def _check_step(self, step: Any) -> int:
        """``step`` as an ``int``: any non-negative integer (``np.int64``
        included), not a bool, a float or a negative number."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise CheckpointError(f"{self.root!r}: the step must be a non-negative integer, "
                                  f"not {step!r} ({type(step).__name__})")
        return int(step)

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{self.root!r}: the state must be a dict of values and Statefuls, e.g. "
                f"{{\"model\": model, \"optim\": optim}}, not a {type(state).__name__}")

    def _check_newer(self, step: int) -> None:
        """Refuse, at the call and on every rank alike, a save of a step not
        newer than the newest complete one (or one this manager saved): the
        latest is always the highest complete step, and a complete step is
        never replaced (``force`` forces the decision to save, not that).
        Re-saving the step this manager last saved or loaded is no save
        (:meth:`save` returns False)."""
        if not self._newest_known:
            self._set_newest(self._on_rank0(self.latest_step))
        if self._newest is None or step > self._newest or step == self._last_saved:
            return
        if step == self._newest:
            raise CheckpointError(
                f"{self.root!r}: cannot save step {step}: it is complete there already (saved "
                f"by an earlier job, or by its background save after the trainer died), and a "
                f"complete step is never replaced: resume with load_latest, which returns it, "
                f"and save the steps after it (or save under another root)")
        raise CheckpointError(
            f"{self.root!r}: cannot save step {step}: step {self._newest} is already "
            f"complete or saved there, and a step must be newer than the newest "
            f"(resume with load_latest, or save under another root)")

    def _set_newest(self, step: int | None) -> None:
        self._newest_known = True
        if step is not None and (self._newest is None or step > self._newest):
            self._newest = step

    def _compose(self, step: int, state: dict, metrics: dict | None) -> dict:
        if KEY in state:
            raise CheckpointError(f"step {step}: the state's key {KEY!r} is the manager's own")
        plain: dict[str, Any] = {}
        ranked: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, PerRank):
                ranked[key] = per_rank.encode(value.get())
            else:
                plain[key] = value
        record = {"rank": self.rank, "dp_rank": self.dp_rank, "dp_degree": self.dp_degree,
                  "state": ranked, "rng": rng.capture() if self.save_rng else None}
        plain[KEY] = {"step": step, "world_size": self.world_size, "dp_degree": self.dp_degree,
                      "metrics": dict(metrics or {}),
                      "ranks": {f"{self.rank:05d}": per_rank.to_blob(record)}}
        return plain

    def _save(self, step: int, state: dict, metrics: dict | None, asynchronous: bool) -> None:
        self.wait()  # one save in flight, and its outcome known
        composed = self._compose(step, state, metrics)
        uri = self.step_uri(step)
        self._last_saved = step
        self._set_newest(step)
        self._metrics[step] = dict(metrics or {})
        # names the step in the pointer before its commit, in the committing process
        name = NamePointer(self.root, step, self.storage_options)
        if not asynchronous:
            try:
                sync_save(composed, uri, process_group=self.process_group,
                          storage_options=self.storage_options, before_commit=name,
                          compression=self.compression)
            except CheckpointError as e:
                raise CheckpointError(f"step {step}: {e}") from e
            self._committed()
            return
        done = threading.Event()

        def finished(response: AsyncSaveResponse) -> None:
            try:
                try:
                    response.result()
                except CheckpointError as e:
                    self.errors.append(CheckpointError(f"step {step}: the async save to {uri!r} "
                                                       f"failed: {e}"))
                    return
                self._committed()
            finally:
                done.set()

        response = async_save(composed, uri, process_group=self.process_group,
                              coordination=self.coordination,
                              storage_options=self.storage_options,
                              blocking_staging=self.blocking_staging, timeout=self.timeout,
                              before_commit=name, compression=self.compression)
        self._in_flight = (step, response, done)
        response.add_done_callback(finished)

    def _committed(self) -> None:
        """After a step committed (the pointer named it already): rank 0
        prunes in the background."""
        if self.rank != 0:
            return
        with self._lock:
            previous = self._retention
            self._retention = threading.Thread(target=self._prune, args=(previous,),
                                               name="dcp-manager-retention", daemon=True)
            self._retention.start()

    def _prune(self, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        in_flight = self._in_flight[0] if self._in_flight is not None else None
        try:
            prune_steps(self.root, self.preservation, self.storage_options,
                        in_flight=in_flight, metrics=self._metrics)
        except Exception as e:
            log.warning("hyperdcp: retention under %s failed: %s", self.root, e)
            self.errors.append(CheckpointError(f"{self.root!r}: retention failed: "
                                               f"{type(e).__name__}: {e}"))

    def wait_for_staging(self) -> None:
        """Wait until the save in flight has copied every tensor to host
        memory (only needed with ``blocking_staging=False``): call it before
        the optimizer step changes the tensors in place."""
        if self._in_flight is not None:
            try:
                self._in_flight[1].staged.result()
            except CheckpointError:
                pass  # the save's failure is reported by wait()

    def wait(self) -> None:
        """Wait for the save in flight (and its pointer move), the memory
        step in flight and its persist, and for retention; a failed save is
        warned about (:class:`CheckpointWarning`) and listed in
        :attr:`errors`, the newest complete step untouched."""
        self._wait_in_flight()
        self._wait_memory(persists=True)
        with self._lock:
            retention = self._retention
        if retention is not None:
            retention.join()
        self._warn_errors(stacklevel=3)
        self._raise_corruption()

    def _wait_in_flight(self) -> None:
        if self._in_flight is not None:
            step, _response, done = self._in_flight
            done.wait()
            self._in_flight = None

    def _warn_errors(self, stacklevel: int) -> None:
        """Warn the errors not warned yet, pointing ``stacklevel`` frames up."""
        for e in self.errors[self._warned:]:
            warnings.warn(str(e), CheckpointWarning, stacklevel=stacklevel)
        self._warned = len(self.errors)

    # ---------------------------------------------------------- memory tier
    def _save_memory(self, step: int, state: dict, metrics: dict | None, persist: bool) -> None:
        """Memory step ``step``: staged now, committed in the background;
        with ``persist``, then written from host memory to the root, beside
        the next memory steps.  Waits for the async save in flight and the
        previous memory step's commit (one memory step in flight, its
        outcome known), never for a persist."""
        self._wait_in_flight()
        self._wait_memory(persists=False)
        self._warn_errors(stacklevel=4)  # the caller of save
        self._raise_corruption()
        assert self._snapshots is not None and self._tier is not None
        composed = self._compose(step, state, metrics)
        self._last_saved = step
        if persist:
            self._set_newest(step)
            self._metrics[step] = dict(metrics or {})
        tier = self._tier

        def persist_step(saved: int, info: dict) -> None:
            view = persist_view(tier, saved, info)
            name = NamePointer(self.root, saved, self.storage_options)
            try:
                sync_save(view, self.step_uri(saved), process_group=tier.persist_group,
                          storage_options=self.storage_options, before_commit=name,
                          compression=self.compression)
            except CheckpointError as e:
                raise CheckpointError(f"step {saved}: persisting the memory step to "
                                      f"{self.step_uri(saved)!r} failed: {e}") from e
            self._committed()

        self._memory_save = self._snapshots.start(step, composed,
                                                  persist_step if persist else None)
        self.last_memory_save = self._memory_save

    def _wait_memory(self, persists: bool) -> None:
        """Wait for the memory step in flight to commit (its failure
        recorded) and, with ``persists``, for every persist to end; the
        failures of the persists that ended are recorded either way."""
        ms, self._memory_save = self._memory_save, None
        if ms is not None:
            ms.committed.wait()
            if isinstance(ms.error, SilentDataCorruptionError):
                self._corruption = ms.error
            elif ms.error is not None:
                self.errors.append(CheckpointError(f"step {ms.step}: {ms.error}"))
            elif ms.persist:
                self._persists.append(ms)
        running = []
        for p in self._persists:
            if persists:
                p.wait()
            if not p.done.is_set():
                running.append(p)
            elif p.persist_error is not None:
                self.errors.append(CheckpointError(f"step {p.step}: {p.persist_error}"))
        self._persists = running

    def _raise_corruption(self) -> None:
        """A memory save's SDC error: to the tier's hook, else raised here."""
        error, self._corruption = self._corruption, None
        if error is None:
            return
        hook = self.memory.on_corruption if self.memory is not None else None
        if hook is not None:
            hook(error)
            return
        raise error

    def _read_memory(self, found: restore.Found, persisted: str | None,
                     reports: list[restore.RestoreReport], target: dict) -> None:
        assert self._tier is not None
        reports.append(restore.read_into(self._tier, found, target, persisted,
                                         self.storage_options))

    def _load_memory(self, state: dict) -> int | None:
        """Restore the newest memory step every rank can get complete, unless
        a newer persistent step exists (``None``: the caller loads from the
        persistent tier)."""
        assert self._tier is not None
        passed: set[int] = set()
        persistent = self._on_rank0(self.persistent_steps)
        while True:
            found = restore.find(self._tier, persistent, passed)
            if found is None or (persistent and persistent[-1] > found.step):
                return None
            persisted = self.step_uri(found.step) if found.persisted else None
            reports: list[restore.RestoreReport] = []
            read = functools.partial(self._read_memory, found, persisted, reports)
            error: Exception | None = None
            try:
                self._load_step(found.step, found.md, state, read=read)
            except Exception as e:  # every rank learns whether any failed, and how
                error = e
            failed, other = self._agree([int(error is not None), int(
                error is not None and not isinstance(
                    error, (restore.StepUnavailable, CorruptCheckpointError)))])
            if other:
                raise error if error is not None else CheckpointError(
                    f"memory step {found.step}: the restore failed on another rank")
            if failed:  # no source left for some chunk, on some rank: an older step
                passed.add(found.step)
                warnings.warn(f"{self.root!r}: memory step {found.step} cannot be restored "
                              f"({error if error is not None else 'on another rank'}); trying "
                              f"an older step", CheckpointWarning, stacklevel=3)
                continue
            self.last_restore = reports[0] if reports else None
            late = sorted(set(self.last_restore.late_holders)) if self.last_restore else []
            if late:
                tier = self._tier
                warnings.warn(
                    f"{self.root!r}: memory step {found.step}: rank(s) "
                    f"{', '.join(f'{r} (host {tier.hosts[tier.rank_host[r]]})' for r in late)} "
                    f"did not send their chunks within MemoryTier(restore_timeout="
                    f"{tier.tier.restore_timeout}); they came from their next source",
                    CheckpointWarning, stacklevel=3)
            self._set_newest(found.step)
            self._last_saved = found.step
            return found.step

    # --------------------------------------------------------------- load
    def _broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self._src, group=self._cpu_group)
        return box[0]

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its result broadcast; its CheckpointError
        raised on every rank."""
        result: Any = None
        if self.rank == 0:
            try:
                result = fn()
            except CheckpointError as e:
                result = e
        result = self._broadcast(result)
        if isinstance(result, CheckpointError):
            raise result
        return result

    def load_latest(self, state: dict) -> int | None:
        """Load the newest complete step into ``state`` (in place, as
        :func:`dcp.load`; :class:`PerRank` values through their own rule)
        and restore this rank's RNG states; returns the step, or ``None``
        when no step is complete (after loading ``initial_load_path``, if
        set).  Collective.

        A step found corrupt (:class:`~dcp.CorruptCheckpointError`: its
        metadata does not decode, a checksum does not match, a data file is
        missing or short; on any rank) is warned about
        (:class:`CheckpointWarning`, naming the step and why), marked bad
        by rank 0 (:func:`dcp.manager.steps.mark_bad`) and passed over:
        every rank loads the newest step before it that loads.  Any other
        failure (an I/O error, a timeout) raises and marks nothing."""
        try:
            return self._load_latest(state)
        finally:
            self._start_worker()

    def _load_latest(self, state: dict) -> int | None:
        self._check_open()
        self._check_state(state)
        self.wait()
        self.last_restore = None
        if self._tier is not None:
            restored = self._load_memory(state)
            if restored is not None:
                return restored
        passed: set[int] = set()  # corrupt steps passed over by this call
        while True:
            found, marked = self._on_rank0(lambda: self._newest_readable(passed))
            for bad, reason, note in marked:
                passed.add(bad)
                self._warn_corrupt(bad, reason, note)
            if found is None:
                self._set_newest(None)
                if self.initial_load_path is not None:
                    self._initial_load(state)
                return None
            step, md = found
            error: Exception | None = None
            try:
                self._load_step(step, md, state)
            except Exception as e:  # every rank learns whether any failed, and how
                error = e
            failed, other = self._agree([int(error is not None), int(
                error is not None and not isinstance(error, CorruptCheckpointError))])
            if not failed:
                self._set_newest(step)
                self._last_saved = step
                return step
            if other:
                raise error if error is not None else CheckpointError(
                    f"step {step} ({self.step_uri(step)!r}): the load failed on another rank")
            reason = str(error) if error is not None else "found corrupt by another rank"
            note = self._on_rank0(functools.partial(self._mark, step, reason))
            passed.add(step)
            self._warn_corrupt(step, reason, note)

    def _newest_readable(self, passed: set[int]) -> tuple[tuple[int, Metadata] | None, list]:
        """Rank 0: the newest complete step not in ``passed`` whose metadata
        reads, and its metadata; those whose metadata is corrupt are marked
        bad on the way (``(step, reason, note)`` each)."""
        marked: list[tuple[int, str, str]] = []
        gone: set[int] = set()
        while True:
            step = newest_step(self._storage, exclude=passed | gone | {m[0] for m in marked})
            if step is None:
                return None, marked
            try:
                return (step, read_metadata(self.step_uri(step),
                                            storage_options=self.storage_options)), marked
            except CorruptCheckpointError as e:
                marked.append((step, str(e), self._mark(step, str(e))))
            except NotACheckpointError:  # deleted since it was found
                gone.add(step)

    def _mark(self, step: int, reason: str) -> str:
        """Rank 0: mark ``step`` bad; what became of it, for the warning."""
        try:
            mark_bad(self._storage, step, reason)
        except Exception as e:
            return (f"marking it bad failed ({type(e).__name__}: {e}), so only this call passes "
                    f"it over")
        return (f"marked bad ({self.step_uri(step)}/bad-step.json, its metadata kept as "
                f"metadata.json.bad): it no longer counts as complete")

    def _warn_corrupt(self, step: int, reason: str, note: str) -> None:
        warnings.warn(f"{self.root!r}: step {step} is corrupt and is passed over ({reason}); "
                      f"{note}; load_latest resumes from the newest step that loads",
                      CheckpointWarning, stacklevel=3)

    def _load_step(self, step: int, md: Metadata, state: dict,
                   read: Callable[[dict], None] | None = None) -> None:
        where = f"step {step} ({self.step_uri(step)!r})"

        def info(name: str) -> Any:
            meta = md.objects.get(f"{KEY}.{name}")
            if meta is None:
                raise CheckpointError(f"{where} holds no {KEY}.{name}: not saved by a "
                                      f"CheckpointManager")
            return meta.value

        saved_world, saved_dp = int(info("world_size")), int(info("dp_degree"))
        ranked = {k: v for k, v in state.items()
                  if isinstance(v, PerRank) and k not in self.exclude}
        resized = saved_dp != self.dp_degree
        for key, value in ranked.items():
            if resized and value.on_resize is None:
                raise CheckpointError(
                    f"{where}: per-rank state {key!r} was saved with data-parallel degree "
                    f"{saved_dp} and this job has {self.dp_degree}; give PerRank(..., "
                    f"on_resize=rule) a rule (e.g. dcp.manager.FromFirstRank()) to resume")
        if resized and self.save_rng and self.rng_on_resize is None:
            raise CheckpointError(
                f"{where}: saved on {saved_world} ranks with data-parallel degree {saved_dp}; "
                f"this job has {self.world_size} ranks and degree {self.dp_degree}, so no saved "
                f"RNG streams are this rank's: pass CheckpointManager(rng_on_resize=rule), "
                f"dcp.manager.DeriveRNG() (fresh streams derived from the saved ones) or "
                f"dcp.manager.FromFirstRank() (old data-parallel rank 0's on every rank), or "
                f"save_rng=False to leave the generators as they are")
        own = saved_world == self.world_size
        wanted = [self.rank] if own and not resized else list(range(saved_world))
        target = {k: v for k, v in state.items()
                  if not isinstance(v, PerRank) and k not in self.exclude}
        target[KEY] = {"ranks": {f"{r:05d}": b"" for r in wanted}}
        if read is not None:
            read(target)
        else:
            load(target, self.step_uri(step), process_group=self.process_group,
                 storage_options=self.storage_options)
        for k, v in target.items():  # plain values were replaced in the copy
            if k != KEY and k in state and state[k] is not v:
                state[k] = v
        records = {r: per_rank.from_blob(target[KEY]["ranks"][f"{r:05d}"], f"{where}, rank {r}")
                   for r in wanted}
        mine = records.get(self.rank) if own else None
        if mine is not None and mine["dp_rank"] != self.dp_rank:
            mine = None
        if mine is None and not resized:
            mine = next((rec for _, rec in sorted(records.items())
                         if rec["dp_rank"] == self.dp_rank), None)
        for key, value in ranked.items():
            if not resized:
                if mine is None or key not in mine["state"]:
                    raise CheckpointError(f"{where}: no per-rank state {key!r} for "
                                          f"data-parallel rank {self.dp_rank}")
                value.put(per_rank.decode(mine["state"][key]))
                continue
            by_dp: dict[int, Any] = {}
            for _, rec in sorted(records.items()):
                if key not in rec["state"]:
                    raise CheckpointError(f"{where}, rank {rec['rank']}: no per-rank state "
                                          f"{key!r}")
                by_dp.setdefault(rec["dp_rank"], per_rank.decode(rec["state"][key]))
            assert value.on_resize is not None
            value.put(value.on_resize([by_dp[d] for d in sorted(by_dp)], self.dp_rank,
                                      self.dp_degree))
        if self.save_rng:
            self._restore_rng(where, records, mine, resized)

    def _restore_rng(self, where: str, records: dict[int, dict], mine: dict | None,
                     resized: bool) -> None:
        """This rank's RNG states from its data-parallel rank's record or,
        after a change of the degree, from ``rng_on_resize`` over the first
        record of every old data-parallel rank.  A step saved with
        ``save_rng=False`` holds none: the generators are left as they are."""
        if not resized:
            if mine is None:
                raise CheckpointError(f"{where}: no record of data-parallel rank "
                                      f"{self.dp_rank} to restore rank {self.rank}'s RNG "
                                      f"states from; pass save_rng=False to resume")
            if mine.get("rng") is not None:
                rng.restore(mine["rng"], f"{where}, rank {self.rank}")
            return
        by_dp: dict[int, Any] = {}
        for _, rec in sorted(records.items()):
            by_dp.setdefault(rec["dp_rank"], rec.get("rng"))
        if all(s is None for s in by_dp.values()):
            return
        missing = sorted(d for d, s in by_dp.items() if s is None)
        if missing:
            raise CheckpointError(f"{where}: no RNG states saved for data-parallel rank(s) "
                                  f"{missing}; pass save_rng=False to resume")
        assert self.rng_on_resize is not None
        rng.restore(self.rng_on_resize([by_dp[d] for d in sorted(by_dp)], self.dp_rank,
                                       self.dp_degree), f"{where}, rank {self.rank}")

    def _initial_load(self, state: dict) -> None:
        path = str(self.initial_load_path)
        if self.model_key not in state:
            raise CheckpointError(f"initial_load_path {path!r}: the state has no "
                                  f"{self.model_key!r} to load it into")
        model = state[self.model_key]
        target = model.state_dict() if callable(getattr(model, "state_dict", None)) else model
        try:
            md = read_metadata(path, storage_options=self.storage_options)
        except NotACheckpointError:
            md = None
        if md is None:
            from dcp.interop.safetensors_io import load_safetensors

            load_safetensors(target, path, process_group=self.process_group,
                             allow_dtype_cast=True)
        else:
            prefixed = any(f.startswith(self.model_key + ".") for f in md.fqns())
            load({self.model_key: target} if prefixed else target, path, allow_dtype_cast=True,
                 process_group=self.process_group, storage_options=self.storage_options)
        if target is not model:
            model.load_state_dict(target)

    # ------------------------------------------------------------- export
    def export(self, step: int, model_state: Any, *, dtype: torch.dtype | None = None,
               safetensors: bool = False, path: str | None = None) -> str:
        """Save the model only (``model_state``), floating tensors cast to
        ``dtype`` (default ``export_dtype``), to ``path`` (default
        ``<root>/export-<step>``), as a checkpoint or, with
        ``safetensors=True``, as a Hugging Face safetensors folder; returns
        where.  Collective.  An export already there (a run that resumed
        before its last step and reached it again) is replaced: the new
        checkpoint commits atomically over the old one, and a safetensors
        folder's files that the new export does not rewrite are deleted."""
        step = self._check_step(step)
        self.wait()
        dtype = dtype if dtype is not None else self.export_dtype
        sd = model_state.state_dict() if callable(getattr(model_state, "state_dict", None)) \
            else model_state
        cast = {k: (v.to(dtype) if dtype is not None and isinstance(v, torch.Tensor)
                    and v.is_floating_point() else v) for k, v in sd.items()}
        dest = checkpoint_uri(path) if path else f"{self.root.rstrip('/')}/export-{step}"
        if not safetensors:
            sync_save(cast, dest, process_group=self.process_group,
                      storage_options=self.storage_options, overwrite=True)
            return dest
        staging = f"{dest.rstrip('/')}/.dcp"
        sync_save(cast, staging, process_group=self.process_group,
                  storage_options=self.storage_options, overwrite=True)
        if self.rank == 0:
            from dcp.interop.safetensors_io import checkpoint_to_safetensors

            checkpoint_to_safetensors(staging, dest, storage_options=self.storage_options,
                                      overwrite=True)
            store = open_storage(staging, **self.storage_options)
            store.delete(store.list_files())
            remove_empty_folder(staging, self.storage_options)
        if self.distributed:
            dist.barrier(group=self._cpu_group)
        return dest

    # ------------------------------------------------------------- close
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.root!r}: the CheckpointManager is closed")

    def close(self) -> None:
        """Wait for the save in flight, retention and a restore's late
        transfers (:meth:`dcp.recovery.hosts.TierGroup.drain`); restore the
        SIGTERM handler."""
        if self._closed:
            return
        self.wait()
        if self._tier is not None:
            self._tier.drain()
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
