"""Asynchronous save: the trainer stalls only to copy its tensors to host.

:func:`async_save` describes the state dict, copies every chunk into a
reused shared-memory staging buffer (:mod:`dcp.asynchronous.staging`) and returns.
Planning, coordination, writing and commit run in a persistent background
process per rank (:mod:`dcp.asynchronous.worker`), so the trainer's Python, GIL and
communicators are untouched while the checkpoint persists.  Until that
process has started (seconds: spawn, ``import torch``), a save coordinated
over gloo or not at all runs the same code on the trainer's save thread
instead, so that no save waits for the start; its steps then go over the
job's rendezvous store on every rank
(:class:`dcp.coordination.store_exchange.StoreCoordinator`), and it takes
some of the trainer's CPU and GIL (docs/async-save.md).  A ``"file"`` save
waits for the process: the file protocol's waits cannot watch the abort
key that bounds a save whose peer died.

Coordination of the background processes (``coordination=``):

* ``"gloo"``: a dedicated CPU gloo group of the workers, built from the job's
  rendezvous store under a prefix unique to this saver (never the trainer's
  groups); rebuilt after a failed save.  Ranks that passed different
  checkpoint ids fail at the first step, on every rank, naming the ids.
* ``"file"``: the file-flag protocol over the checkpoint's own storage
  (:mod:`dcp.coordination.file_flag`): no communicator at all.  Ranks that
  passed different ids meet in different folders, so they fail only by
  ``timeout`` (the message names that cause); nothing is committed.
* ``"none"``: no cross-rank traffic; each rank commits its own metadata file
  and readers merge them (:mod:`dcp.coordination.independent`).  Nothing
  compares the ranks' ids: with different ids every rank's ``result()``
  returns, and each folder holds one rank's metadata file, which a load
  refuses as an incomplete checkpoint (never loaded, but not an error at
  save time either).

All ranks of the group must call :func:`async_save` in the same order (it is
collective, like :func:`dcp.save`).  Once per job, at the first call, the
ranks agree on a random token through the job's rendezvous store (one
compare-and-set each); it makes save ids and exchange-file names unique to
this job, so a restarted job never mistakes a crashed one's files for its
own.  Save ``n`` of the job has the id ``<token><n>`` on every rank: no
exchange is needed to name it, which lets a save with a cached plan skip the
planning exchange altogether (:mod:`dcp.coordination.plan_cache`).

Ordering: one save in flight per job.  A new :func:`async_save` or
:func:`dcp.save` first waits for the one in flight; a load should wait for a
save in flight to its checkpoint (:func:`dcp.orchestration.pending.wait`), and elsewhere a
checkpoint is never readable before its metadata is committed, last.

Failures: if any rank's background process raises or dies, ``result()``
raises a :class:`~dcp.CheckpointError` on every rank within seconds (the
rank that lost its process publishes it in the job's store:
:mod:`dcp.asynchronous.worker`), nothing is committed, a previous checkpoint
stays loadable, and the next :func:`async_save` works (the dead worker and
those stopped for it are replaced at once, the gloo group rebuilt).  A
worker killed while idle is replaced by the next :func:`async_save` before
it sends the save, which goes on.  With ``coordination="none"``
a rank's ``result()`` covers its own part only: the checkpoint is complete
once every rank's ``result()`` has returned, and a failed rank leaves it
refused as incomplete.

The worker is a spawned process, so the training script must guard its
entry point with ``if __name__ == "__main__":``, as for any spawned process:
a script without that block fails the first save at once, saying so.  A
worker that re-runs the script's top-level code anyway (a save outside the
block) exits; the saves before run in the trainer, the first one after fails,
and so does every later one, naming what to add: that worker is never
replaced.  One whose re-run blocks (``init_process_group``, training) is not
ready ``timeout`` seconds after its spawn: the save then fails on every
rank, the worker killed.  A script fed
on standard input has no file to re-run, and its worker starts without it.
:func:`prestart_async_worker` (called by :class:`dcp.CheckpointManager`)
starts the worker before the first save, so that fewer saves run in the
trainer.
"""

from __future__ import annotations

import atexit
import pickle
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dcp.asynchronous import worker as worker_module
from dcp.asynchronous.staging import Layout, Stager
from dcp.asynchronous.worker import (
    EXIT_MAIN_RERUN,
    Outcome,
    Persister,
    Rendezvous,
    SaveJob,
    WorkerDied,
    WorkerHandle,
    WorkerStopped,
    publish_abort,
    read_abort,
    refuse_main_rerun,
    rerun_error,
    unguarded_main,
    unreachable_from_worker,
)
from dcp.coordination.collectives import Coordinator
from dcp.coordination.plan_cache import PlanCache
from dcp.core.compression import Compression, resolve
from dcp.core.metadata import Metadata
from dcp.core.planner import SavePlanner
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError
from dcp.orchestration import pending
from dcp.orchestration.gc_pause import gc_paused
from dcp.orchestration.save import BeforeCommit, describe_state

COORDINATIONS = ("gloo", "file", "none")


class AsyncSaveTimeout(CheckpointError, TimeoutError):
    """:meth:`AsyncSaveResponse.result` waited ``timeout`` seconds; the save
    itself goes on."""


@dataclass(frozen=True)
class AsyncSaveStats:
    """Measurements of one async save on this rank, in seconds and bytes.

    ``stall_s``: time :func:`async_save` spent describing and staging the
    state (after any wait for a save in flight).  ``staged_bytes``:
    bytes copied to host.  ``planning_s``: background time spent deciding the
    plan (on a plan-cache hit only the key check).  ``persist_s``: background
    time from receiving the save to its commit.  ``plan_exchanged``: whether
    local plans were exchanged (False on a plan-cache hit and with
    ``coordination="none"``).  ``in_trainer``: whether the save ran on a
    thread of the calling process, its background process still starting
    (docs/async-save.md).
    """

    stall_s: float
    staged_bytes: int
    planning_s: float
    persist_s: float
    plan_exchanged: bool
    in_trainer: bool = False


@dataclass(frozen=True)
class AsyncSaveCounters:
    """Totals of one process group's async saves on this rank: ``saves``
    started, ``failures``, ``plan_exchanges`` (saves that exchanged local
    plans), ``bytes_staged`` (bytes copied to host) and
    ``staging_allocations`` (staging buffers allocated; stays 1 while the
    structure is unchanged)."""

    saves: int = 0
    failures: int = 0
    plan_exchanges: int = 0
    bytes_staged: int = 0
    staging_allocations: int = 0


class AsyncSaveResponse:
    """The handle of one :func:`async_save`.

    ``checkpoint_id``: where it saves.  ``staged``: a
    ``concurrent.futures.Future`` done (result ``None``) once every tensor is
    in host memory — already done unless ``blocking_staging=False``; wait for
    it before modifying any saved tensor in place.  ``stats``: an
    :class:`AsyncSaveStats` once the save is done.
    """

    def __init__(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        self.staged: Future = Future()
        self.stats: AsyncSaveStats | None = None
        self._outcome: Future = Future()

    def result(self, timeout: float | None = None) -> Metadata:
        """Wait for the save (at most ``timeout`` seconds) and return its
        committed :class:`~dcp.Metadata`.

        Raises:
            CheckpointError: the save failed — on some rank, naming it, or
                because a background process died; raised on every rank.
            AsyncSaveTimeout: ``timeout`` passed first (a ``TimeoutError``
                too; the save goes on).
        """
        try:
            return self._outcome.result(timeout)
        except FutureTimeout:
            raise AsyncSaveTimeout(f"the async save to {self.checkpoint_id!r} is still in "
                                   f"flight after {timeout} s") from None

    def done(self) -> bool:
        """Whether the save has committed or failed."""
        return self._outcome.done()

    def add_done_callback(self, fn: Callable[[AsyncSaveResponse], None]) -> None:
        """Call ``fn(self)`` once the save has committed or failed (at once
        if it has), on a library thread; exceptions it raises are logged and
        ignored."""
        self._outcome.add_done_callback(lambda _: fn(self))


@dataclass(frozen=True)
class _Options:
    """The caller's options of one :func:`async_save`."""

    planner: SavePlanner | None
    storage: StoragePlugin | None
    storage_options: dict
    coordination: str
    overwrite: bool
    allow_pickle: bool
    blocking_staging: bool
    timeout: float
    before_commit: BeforeCommit | None
    compression: Compression | None


def _as_error(e: BaseException, rank: int, what: str) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    return CheckpointError(f"rank {rank}: {what} failed: {type(e).__name__}: {e}")


class _Saver:
    """The async saves of one process group on this rank: its worker,
    staging buffer, token, save count and counters."""

    instances = 0

    def __init__(self, process_group) -> None:
        coord = Coordinator(process_group)
        #: the job's store under this saver's prefix, where the workers meet
        #: and a failed save is published (``None`` in a single process)
        self.store: dist.Store | None = None
        if coord.distributed:
            self.group, self.rank, self.world_size = process_group, coord.rank, coord.world_size
            group_id = zlib.crc32(repr(coord.members).encode())
            key = f"hyperdcp/async/{group_id:08x}/{_Saver.instances}"
            store = c10d._get_default_store()
            self.token = store.compare_set(key, "", uuid.uuid4().hex[:8]).decode()
            base = getattr(store, "_underlying_non_prefix_store", store)
            self.store = dist.PrefixStore(self._prefix(), base)
        else:
            self.group, self.rank, self.world_size = None, 0, 1
            self.token = uuid.uuid4().hex[:8]
        _Saver.instances += 1
        self.stager = Stager()
        self._worker_lock = threading.Lock()
        self.worker: WorkerHandle | None = None
        self.worker_layout: Layout | None = None  # the buffer this worker holds
        self.worker_fresh = False  # the worker has had no job yet: send it the plan cache
        self.plans = PlanCache()  # a copy of the worker's, for a new worker
        #: runs the saves on the persist thread while the worker starts
        self.here = Persister(in_process=True)
        self.seq = 0
        self.counters = AsyncSaveCounters()

    def _rendezvous(self) -> Rendezvous:
        """Where this saver's workers build their gloo group: the store the
        job's default group was initialized with (reachable from another
        process), under a prefix unique to the saver."""
        store = c10d._get_default_store()
        base = getattr(store, "_underlying_non_prefix_store", store)
        if isinstance(base, dist.TCPStore):
            address: tuple = ("tcp", base.host, base.port)
        elif isinstance(base, dist.FileStore):
            address = ("file", base.path)  # type: ignore[attr-defined]  # torch's stub omits it
        else:
            raise CheckpointError(
                f"coordination='gloo' needs a TCP or file rendezvous store (torchrun's, or "
                f"MASTER_ADDR/MASTER_PORT), not a {type(base).__name__}; use coordination='file'")
        return Rendezvous(address, self._prefix())

    def _prefix(self) -> str:
        return f"hyperdcp/async/{self.token}/"

    def ensure_worker(self) -> WorkerHandle:
        """This rank's worker, spawned now (it starts in the background) if
        there is none: before the first save, after one died (the OOM
        killer, idle or during a save) or was stopped.

        Raises:
            CheckpointError: the training script would be re-run by a
                spawned process (no ``__main__`` guard), or the worker
                exited because it did re-run the script's top-level code
                (:data:`~dcp.asynchronous.worker.EXIT_MAIN_RERUN`): such a
                worker is never replaced (a new one would do the same), and
                every later call raises again, naming what to add."""
        with self._worker_lock:
            if self.worker is not None and not self.worker.alive():
                if self.worker.process.exitcode == EXIT_MAIN_RERUN:
                    raise CheckpointError(f"rank {self.rank}: async save: "
                                          f"{rerun_error(self.worker.process.pid)}")
                self.worker.stop(timeout=0)
                self.worker = None
            if self.worker is None:
                script = unguarded_main()
                if script is not None:  # the spawned worker would re-run the training
                    raise CheckpointError(f"rank {self.rank}: async save: "
                                          f"{worker_module._rerun_advice(script)}")
                self.worker, self.worker_layout, self.worker_fresh = WorkerHandle(), None, True
            return self.worker

    def _replace_worker(self) -> None:
        """After this rank's worker died or was stopped: start the next one
        now, so that the next save finds it ready."""
        with self._worker_lock:
            if self.worker is not None and self.worker.process.exitcode != EXIT_MAIN_RERUN:
                self.worker.stop(timeout=0)
                self.worker = None
        try:
            self.ensure_worker()
        except CheckpointError:  # the next save reports it
            pass

    def save(self, state_dict, checkpoint_id: str, options: _Options,
             finish: Callable[[], None]) -> AsyncSaveResponse:
        """Stage ``state_dict``, then hand the save to the worker on a
        thread that resolves the returned response and calls ``finish``."""
        start = time.perf_counter()
        response = AsyncSaveResponse(checkpoint_id)
        seq, self.seq = self.seq, self.seq + 1
        state, layout, rendezvous, error = None, None, None, None
        try:
            if options.coordination == "gloo" and self.world_size > 1:
                rendezvous = self._rendezvous()
            state = describe_state(state_dict, options.allow_pickle, self.rank, self.world_size)
            layout, response.staged = self.stager.stage(state, options.blocking_staging)
        except Exception as e:  # reported to every rank by the worker's first step
            error = _as_error(e, self.rank, f"staging for {checkpoint_id!r}")
            response.staged.set_exception(error)
        job = SaveJob(
            seq=seq, save_id=f"{self.token}{seq:08d}", checkpoint_id=checkpoint_id,
            storage=options.storage, storage_options=options.storage_options,
            planner=options.planner, coordination=options.coordination,
            overwrite=options.overwrite, before_commit=options.before_commit,
            json_values=state.json_values if state else {}, pickled=state.pickled if state else {},
            paths=state.paths if state else {},
            rank=self.rank, world_size=self.world_size, timeout=options.timeout,
            rendezvous=rendezvous, layout=layout, plan_entries=[], error=error,
            compression=options.compression)
        stall = time.perf_counter() - start
        threading.Thread(target=self._persist, args=(job, response, stall, finish),
                         name="dcp-async-save", daemon=True).start()
        return response

    def _persist(self, job: SaveJob, response: AsyncSaveResponse, stall: float,
                 finish: Callable[[], None]) -> None:
        try:
            staging_error = response.staged.exception()  # waits for non-blocking copies
            if staging_error is not None and job.error is None:
                job = replace(job, error=_as_error(staging_error, self.rank,
                                                   f"staging for {job.checkpoint_id!r}"))
            outcome = self._run(job)
        except Exception as e:  # resolve the response whatever happened
            outcome = Outcome(job.seq, error=_as_error(e, self.rank, "async save"))
        if job.coordination != "none":  # the outcome of a coordinated save is every rank's
            if outcome.error is not None:
                self.plans.entries.clear()
            elif outcome.plan_entry is not None:
                self.plans.add(outcome.plan_entry)
        c = self.counters
        self.counters = replace(
            c, saves=c.saves + 1, failures=c.failures + (outcome.error is not None),
            plan_exchanges=c.plan_exchanges + outcome.exchanged,
            bytes_staged=self.stager.bytes_staged, staging_allocations=self.stager.allocations)
        staged_bytes = sum(c.nbytes for c in job.layout.chunks) if job.layout is not None else 0
        response.stats = AsyncSaveStats(stall, staged_bytes, outcome.planning_s,
                                        outcome.persist_s, outcome.exchanged, outcome.in_trainer)
        finish()
        if outcome.error is not None:
            response._outcome.set_exception(outcome.error)
        else:
            response._outcome.set_result(outcome.metadata)

    def _run(self, job: SaveJob) -> Outcome:
        """Run ``job`` in the worker and return its outcome.  A failure
        that keeps this rank out of the save (no worker would start, the
        worker died, or did not read the job) is published to the other
        ranks (:func:`dcp.asynchronous.worker.publish_abort`), so that they
        fail the save within seconds instead of ``timeout``; the worker is
        replaced at once when it is gone."""
        try:
            outcome = self._submit_and_wait(job)
        except WorkerStopped as e:  # another rank failed the save
            self._replace_worker()
            return Outcome(job.seq, error=CheckpointError(
                f"rank {self.rank}: async save of {job.checkpoint_id!r} failed on another rank: "
                f"{e}; this rank's background process was stopped (nothing interrupts a blocked "
                f"collective) and a new one is starting for the next save"))
        except CheckpointError as e:
            cause = f"rank {self.rank}: {e}"
            if isinstance(e, WorkerDied):
                self._replace_worker()
            self._publish_abort(job, cause)
            return Outcome(job.seq, error=CheckpointError(
                f"rank {self.rank}: async save of {job.checkpoint_id!r} failed: {e}; the other "
                f"ranks are told (the save fails there too, unless it had committed), a "
                f"previous checkpoint stays as it was"
                + (", and a new background process is starting for the next save"
                   if isinstance(e, WorkerDied) else "")))
        if outcome.alone:
            self.worker_layout = None  # it may not hold the buffer
            message = str(outcome.error)
            self._publish_abort(job, message if message.startswith(f"rank {self.rank}")
                                else f"rank {self.rank}: {message}")
        elif outcome.error is not None and self.store is not None:
            published = read_abort(self.store, job.seq)  # a peer lost contact: say why
            if published is not None and published not in str(outcome.error):
                outcome.error = CheckpointError(f"{outcome.error} (the cause: {published})")
        return replace(outcome, seq=job.seq)

    def _publish_abort(self, job: SaveJob, cause: str) -> None:
        if self.store is not None and job.coordination != "none" and self.world_size > 1:
            publish_abort(self.store, job.seq, cause)

    def _run_here(self, job: SaveJob) -> Outcome:
        """Run ``job`` on this (persist) thread, as the worker would, with
        the plan cache's copy: no save waits for the worker's start.  The
        trainer's garbage collector, thread count and priority are left as
        they are; the save takes some of the trainer's CPU and GIL instead
        (docs/async-save.md)."""
        culprit = unreachable_from_worker((job.storage, job.planner, job.before_commit))
        if culprit is not None:  # refused as the worker would refuse it
            return Outcome(job.seq, alone=True, error=CheckpointError(
                f"rank {self.rank}: the async save to {job.checkpoint_id!r} passed {culprit}, "
                f"which its background process cannot import: a class or function of a "
                f"script fed on standard input or typed at a prompt is not; define it in a "
                f"module"))
        self.here.cache = PlanCache()
        job = replace(job, plan_entries=list(self.plans.entries.values()))
        outcome, cleanup = self.here.run(job, lambda: None)
        cleanup()
        return replace(outcome, in_trainer=True)

    def _submit_and_wait(self, job: SaveJob) -> Outcome:
        """Hand ``job`` to a live worker (a new one if the last died while
        idle, with the plan cache's copy; the staging buffer only if the
        worker lacks it) and wait for its outcome, watching the save's
        abort key.  While the worker is still starting (for less than the
        save's ``timeout`` since its spawn), a save coordinated over gloo
        (or not at all) runs here instead (:meth:`_run_here`); a worker not
        ready by then fails the save, killed (the next save starts another)."""
        for attempt in (0, 1):
            worker = self.ensure_worker()
            if job.coordination != "file" and not worker.ready() \
                    and not worker.overdue(job.timeout):
                return self._run_here(job)
            sent = job
            if self.worker_fresh:
                sent = replace(sent, plan_entries=list(self.plans.entries.values()))
            if sent.layout is self.worker_layout:
                sent = replace(sent, layout=None)
            worker.wait_started(job.timeout)  # at most timeout after its spawn
            try:
                try:
                    worker.submit(sent)
                except (pickle.PicklingError, TypeError, AttributeError) as e:
                    # the storage or planner does not pickle: the save fails on every rank
                    sent = replace(sent, storage=None, planner=None, before_commit=None,
                                   error=_as_error(e, self.rank, "sending the save to its worker"))
                    worker.submit(sent)
            except WorkerDied:
                if attempt:
                    raise
                continue  # it died (idle) since the look: once more with a new one
            self.worker_layout, self.worker_fresh = job.layout, False
            break
        store = self.store
        watch = (lambda: read_abort(store, job.seq)) if store is not None and \
            job.coordination != "none" and self.world_size > 1 else (lambda: None)
        return worker.wait(watch)

    def stop(self) -> None:
        """Stop the worker (after its current job)."""
        if self.worker is not None:
            self.worker.stop()
            self.worker = None


_savers: dict[object, _Saver] = {}
_lock = threading.Lock()


def _saver_for(process_group) -> _Saver:
    refuse_main_rerun()  # in a worker re-running an unguarded script: exit, do not recurse
    with _lock:
        saver = _savers.get(process_group)
        if saver is None:
            saver = _savers[process_group] = _Saver(process_group)
        return saver


def async_save(state_dict: dict, checkpoint_id: str, *, planner: SavePlanner | None = None,
               storage: StoragePlugin | None = None, process_group=None,
               coordination: str = "gloo", overwrite: bool = False, allow_pickle: bool = False,
               storage_options: dict | None = None, blocking_staging: bool = True,
               callback: Callable[[AsyncSaveResponse], None] | None = None,
               timeout: float = 600.0,
               before_commit: BeforeCommit | None = None,
               compression: Compression | str | None = None) -> AsyncSaveResponse:
    """Save a (sharded) state dict in the background; collective over the
    group, like :func:`dcp.save`, whose checkpoints it writes.

    Returns once every tensor is copied to host memory (with
    ``blocking_staging=False``, once the copies are started: wait for
    ``response.staged`` before changing any saved tensor in place).  From
    then on the caller may change every tensor in place: the checkpoint holds
    the values at the call.  A save already in flight in this process is
    waited for first.

    Args:
        state_dict, checkpoint_id, planner, overwrite, allow_pickle,
            storage_options, compression: as for :func:`dcp.save` (chunks
            are compressed by the background process's writer threads, never
            in the call).
        storage: a ready storage plugin; it is pickled to the background
            process once per save.
        process_group: the group saving together (default group by default).
        coordination: ``"gloo"``, ``"file"`` or ``"none"`` (module doc).
        blocking_staging: ``False`` to return before the device-to-host (or
            host) copies finish; they complete in the background.
        callback: called with the response once the save committed or
            failed, on a library thread.
        timeout: seconds any wait of the save may last before it fails:
            a new background process's start, counted from its spawn
            (seconds: Python and ``import torch``; saves before it is up run
            in the trainer, and the first one after ``timeout`` fails), and
            each rank's wait for the others at one coordination step (at a
            first save, that includes the others' start).  Writing itself
            is not bounded.
        before_commit: as for :func:`dcp.save`; run in rank 0's background
            process, so it must pickle (a module-level function or class
            instance).  Not with ``coordination="none"``, which has no
            single commit.

    Returns:
        An :class:`AsyncSaveResponse`.

    Raises:
        CheckpointError: for an unknown ``coordination``, or
        ``before_commit`` with ``coordination="none"``.  Every other
        failure, staging included, is raised by
        :meth:`AsyncSaveResponse.result` on every rank.
    """
    if coordination not in COORDINATIONS:
        raise CheckpointError(f"coordination must be one of {', '.join(COORDINATIONS)}, "
                              f"not {coordination!r}")
    if before_commit is not None and coordination == "none":
        raise CheckpointError("before_commit needs a coordinated save (coordination 'gloo' or "
                              "'file'): with 'none' each rank commits its own metadata file")
    policy = resolve(compression)
    pending.wait()
    saver = _saver_for(process_group)
    options = _Options(planner, storage, dict(storage_options or {}), coordination, overwrite,
                       allow_pickle, blocking_staging, float(timeout), before_commit, policy)
    with gc_paused():
        response = saver.save(state_dict, str(checkpoint_id), options,
                              pending.begin(str(checkpoint_id)))
    if callback is not None:
        response.add_done_callback(callback)
    return response


def async_save_counters(process_group=None) -> AsyncSaveCounters:
    """The :class:`AsyncSaveCounters` of ``process_group``'s async saves on
    this rank (all zero before the first)."""
    with _lock:
        saver = _savers.get(process_group)
    return saver.counters if saver is not None else AsyncSaveCounters()


def prestart_async_worker(process_group=None) -> None:
    """Start this rank's background save process for ``process_group``'s
    async saves now, and return at once: it starts (spawn, ``import
    torch``: seconds) while the caller resumes and trains; saves before it
    is up run in the trainer (module doc).  Without it, the first save
    starts the process.
    :class:`dcp.CheckpointManager` calls it when made with
    ``async_save=True``.  Call it on every rank of the group (it makes the
    group's saver, in the order the ranks' first async saves would); a
    second call does nothing while the process lives.

    Raises:
        CheckpointError: the training script has no ``if __name__ ==
            "__main__":`` block, so a spawned process would re-run it, or
            the group's worker exited having re-run the script's code.
    """
    _saver_for(process_group).ensure_worker()


@atexit.register
def _shutdown() -> None:
    """At exit: let the saves in flight finish, then stop the workers."""
    pending.wait()
    for saver in list(_savers.values()):
        saver.stop()
