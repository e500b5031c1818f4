"""The persistent background process that persists asynchronous saves.

One worker per trainer rank, spawned (never forked: the trainer may hold
CUDA contexts and threads) at its first :func:`dcp.async_save` and reused for
every later save, so a save pays neither a process start nor ``import torch``
(about 4 s per save here).  It runs at a lower CPU priority than the trainer
(:data:`NICENESS`) and with one intra-op thread.  It has no
device work: it reads the staged chunks from the shared-memory buffer that
the trainer hands over once per layout (a file descriptor, not a copy), and
every later request is a small message.

For each :class:`SaveJob` it runs the save phases of :mod:`dcp.save` on its
own thread and GIL, coordinating through the job's channel — its own gloo
group (``"gloo"``), exchange files on the checkpoint's storage (``"file"``),
or nothing (``"none"``) — with the :class:`~dcp.coordination.plan_cache.PlanCache` it
keeps across saves (the trainer keeps a copy for a replacement worker), and
answers one :class:`Outcome`.

Liveness.  The trainer watches its worker's process sentinel
(:meth:`WorkerHandle.wait`), so it knows at once when its worker dies: one
killed while idle (the OOM killer) is replaced before the next save is
sent, and the save goes on; one that dies during a save fails that save.
A worker cannot tell that a peer's worker is gone: the peer may be one it
waits for in the meeting, or one that some other rank waits for in a gloo
collective (a gather's ranks that are not the dead one's direct peers wait
until ``timeout``).  So the trainer that lost its worker (or whose rank
cannot take part in the save at all: no worker would start) publishes the
failure under the save's key ``save<seq>/abort`` of the job's store, the
first failure winning (:func:`publish_abort`); a worker waiting in the
meeting wakes and fails the save at once, and every other trainer, which
checks that key once per :data:`ABORT_POLL_S` while its worker is busy,
gives its worker :data:`ABORT_GRACE_S` to fail the save by itself and then
kills it (nothing interrupts a blocked gloo call), failing the save on that
rank too, naming the rank at fault; a coordinator's worker that has begun
its commit (it says so, :data:`COMMITTING`) waits for no peer and is never
stopped.  Every rank then starts a new worker at
once, in the background, for the next save.  The cost of the watch is one
store ``check`` per rank per :data:`ABORT_POLL_S` while a save is in flight.

The gloo group is built from the job's rendezvous store (torchrun's store, or
whatever store the trainer's default group was initialized with) under a
prefix unique to the saver.  Before each gloo save the workers meet in the
store (three counter updates and one wait per rank: no N² traffic) and
agree whether to rebuild the group: they do as soon as any of them is new
(its predecessor died) or saw its last save fail.  So ranks that saw one
save end differently — a rank killed after the commit that the others
completed — still meet in one fresh group, instead of in two different ones.

With ``"file"`` coordination the workers meet in a first exchange step
instead.  Either meeting also keeps a rank from writing while another still
stages: on a shared host, a worker's writes and checksums take CPU and
memory bandwidth from the staging copies of ranks still in their stall, and
the job waits for its slowest rank (4 ranks on 2 cores: with the file
workers starting at once, the slowest stall was 1.19× the memcpy floor; held
back 0.4 s, 0.99×).  A staging failure is reported there, before any write.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dcp.asynchronous.staging import Layout
from dcp.coordination.collectives import Coordinator, CoordinatorBase, LocalCoordinator
from dcp.coordination.file_flag import FileCoordinator
from dcp.coordination.independent import IndependentSave
from dcp.coordination.plan_cache import CacheEntry, PlanCache
from dcp.coordination.store_exchange import StoreCoordinator
from dcp.core.compression import Compression
from dcp.core.metadata import Metadata
from dcp.core.planner import SavePlanner, default_planner
from dcp.core.storage import StoragePlugin, open_storage
from dcp.errors import CheckpointError
from dcp.orchestration.gc_pause import gc_paused
from dcp.orchestration.save import BeforeCommit, SaveState, _Save

#: Seconds between two looks of a trainer at the save's abort key while its
#: worker is busy (:meth:`WorkerHandle.wait`).
ABORT_POLL_S = 1.0
#: Seconds a worker gets to fail an aborted save by itself (it was waiting
#: in the meeting, or its collective failed) before its trainer kills it.
ABORT_GRACE_S = 1.0

#: What a coordinator's worker tells its trainer before it commits: from
#: then on it waits for no peer, and a failure elsewhere never stops it
#: (the commit of a save whose every write is in stands).
COMMITTING = "committing"

#: The exit code of a worker that found itself re-running the training
#: script's unguarded code (:func:`refuse_main_rerun`).
EXIT_MAIN_RERUN = 86
#: The name of every worker process.
WORKER_NAME = "dcp-async-save"

#: How much lower than the trainer's the worker's CPU priority is: it takes
#: the CPU time the trainer leaves idle and yields as soon as the trainer
#: wakes up, instead of delaying its steps (README: benchmark).
NICENESS = 10


@dataclass(frozen=True)
class Rendezvous:
    """Where the workers' gloo group meets: the job's store, as
    ``("tcp", host, port)`` or ``("file", path)``, and the key ``prefix`` of
    this group."""

    store: tuple
    prefix: str


@dataclass
class SaveJob:
    """One save for the worker.  ``layout`` is set only when the staging
    buffer changed or the worker is new, ``plan_entries`` (the trainer's
    copy of the plan cache) only when the worker is new; ``error`` is a failure
    of the trainer before the save could start (staging), reported to every
    rank in the save's first step."""

    seq: int
    save_id: str
    checkpoint_id: str
    storage: StoragePlugin | None
    storage_options: dict
    planner: SavePlanner | None
    coordination: str
    overwrite: bool
    before_commit: BeforeCommit | None
    json_values: dict[str, str]
    pickled: dict[str, bytes]
    paths: dict[str, list[str | int]]
    rank: int
    world_size: int
    timeout: float
    rendezvous: Rendezvous | None
    layout: Layout | None
    plan_entries: list[CacheEntry]
    error: CheckpointError | None
    compression: Compression | None = None


@dataclass
class Outcome:
    """The worker's answer to job ``seq``: the committed ``metadata`` or the
    ``error``; seconds spent deciding the plan (``planning_s``) and on the
    whole job (``persist_s``); whether plans were exchanged, and then the
    new ``plan_entry``; whether the trainer ran it (``in_trainer``)."""

    seq: int
    metadata: Metadata | None = None
    error: CheckpointError | None = None
    planning_s: float = 0.0
    persist_s: float = 0.0
    exchanged: bool = False
    plan_entry: CacheEntry | None = None
    alone: bool = False  # failed before taking part in the save's coordination
    in_trainer: bool = False  # run by the trainer, its worker still starting


class WorkerDied(CheckpointError):
    """The worker process died (or closed its connection) during a save."""


class WorkerStopped(CheckpointError):
    """The trainer killed its worker: the save failed on another rank (the
    message says where) and the worker had not given up by itself."""


def unguarded_main() -> str | None:
    """The training script a spawned worker would re-run if it has no
    ``if __name__ == "__main__":`` block, else ``None``.

    Spawning re-imports the parent's ``__main__`` module (by path, or by
    name for ``python -m``) in the child as ``__mp_main__``; a script without
    the guard then runs its training code again there (``init_process_group``,
    the training loop, the save), and the worker never starts."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None  # spawn does not re-run a package's __main__
    path = getattr(spec, "origin", None) if name else getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py") or not os.path.isfile(path):
        return None  # interactive, -c, a notebook: nothing is re-run
    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) \
                and "__main__" in ast.unparse(node.test):
            return None
    runs = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                                                       ast.AsyncFunctionDef, ast.ClassDef))
            and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return str(path) if runs else None


def refuse_main_rerun() -> None:
    """In a worker still importing the training script's ``__main__`` module
    (its code outside ``if __name__ == "__main__":`` calls
    :func:`dcp.async_save` again): exit at once with
    :data:`EXIT_MAIN_RERUN`, which the trainer reports, instead of training
    a second copy of the job."""
    process = multiprocessing.current_process()
    if process.name == WORKER_NAME and getattr(process, "_inheriting", False):
        print("hyperdcp: the async-save worker is re-running the training script's top-level "
              "code: put it under `if __name__ == \"__main__\":`", file=sys.stderr)
        os._exit(EXIT_MAIN_RERUN)


def unreachable_from_worker(objects: tuple) -> str | None:
    """The first of ``objects`` that a worker could not unpickle because it
    is defined in a main module the worker does not import (a script fed on
    standard input, ``-c``, a prompt), named; else ``None``."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or (isinstance(path, str)
                                                       and os.path.isfile(path)):
        return None
    for obj in objects:
        if obj is not None and getattr(obj, "__module__", None) == "__main__":
            return f"{getattr(obj, '__qualname__', type(obj).__qualname__)!r} of __main__"
    return None


def _rerun_advice(path: str | None = None) -> str:
    script = f"the training script {path!r}" if path else "the training script"
    return (f"{script} must guard its entry point with `if __name__ == \"__main__\":` (the "
            f"async-save worker is a spawned process, which re-imports the script's main "
            f"module and so re-runs any code outside that block: init_process_group, "
            f"training, the save itself)")


def rerun_error(pid: int | None) -> CheckpointError:
    """The failure of a save whose worker (process ``pid``) exited with
    :data:`EXIT_MAIN_RERUN`: the script needs a ``__main__`` guard."""
    return CheckpointError(f"the async-save worker process (pid {pid}) re-ran the training "
                           f"script's code: {_rerun_advice()}")


class WorkerHandle:
    """The trainer's side of one worker process (spawned on construction;
    :meth:`wait_started` waits for it to be ready)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child,), name=WORKER_NAME, daemon=True)
        self.spawned = time.monotonic()
        with _main_module_importable():
            self.process.start()
        child.close()
        self.started = False

    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process.is_alive()

    def ready(self) -> bool:
        """Whether the worker has started, without waiting (raises as
        :meth:`wait_started` if it died while starting)."""
        if not self.started and (self._conn.poll() or not self.process.is_alive()):
            self.wait_started(0)
        return self.started

    def overdue(self, timeout: float) -> bool:
        """Whether the worker is not ready ``timeout`` seconds after its
        spawn."""
        return not self.started and time.monotonic() - self.spawned >= timeout

    def wait_started(self, timeout: float) -> None:
        """Wait for the worker to be ready (to have imported torch and
        hyperdcp) until ``timeout`` seconds after its spawn at most; raises
        :class:`CheckpointError`, the worker killed, if it died or is not
        ready by then (:func:`rerun_error` if it re-ran the training
        script's code)."""
        if self.started:
            return
        deadline = self.spawned + timeout
        ready = wait_ready([self._conn, self.process.sentinel],
                           max(0.0, deadline - time.monotonic()))
        timed_out = not ready and time.monotonic() >= deadline
        if self._conn in ready:
            try:
                self._conn.recv()  # its "ready"
                self.started = True
                return
            except (EOFError, OSError):
                pass
        alive = self.process.is_alive()
        if alive:
            self.process.kill()
        self.process.join(5)
        if self.process.exitcode == EXIT_MAIN_RERUN:
            raise rerun_error(self.process.pid)
        if timed_out:
            what = f"did not start within timeout={timeout:g} s"
        elif alive:
            what = "closed its connection while starting"
        else:
            what = f"died while starting (exit code {self.process.exitcode})"
        raise CheckpointError(
            f"the async-save worker process (pid {self.process.pid}) {what}; if the training "
            f"script's code outside `if __name__ == \"__main__\":` blocks or trains, the "
            f"spawned worker runs it again: {_rerun_advice()}. Starting a worker (Python, "
            f"import torch) takes seconds; on a loaded machine pass a larger timeout")

    def submit(self, job: SaveJob) -> None:
        """Send ``job`` (a small message, plus the buffer's descriptor when
        ``job.layout`` is set).  Raises :class:`WorkerDied` if the worker
        is gone."""
        try:
            self._conn.send(job)
        except OSError as e:
            raise WorkerDied(f"the async-save worker process (pid {self.process.pid}) is "
                             f"gone: {e}") from e

    def wait(self, aborted: Callable[[], str | None] = lambda: None) -> Outcome:
        """The outcome of the job submitted last.

        Raises:
            WorkerDied: as soon as the worker process dies.
            WorkerStopped: ``aborted()`` (called once per
                :data:`ABORT_POLL_S` while the worker is busy) returned a
                reason, and the worker had not answered
                :data:`ABORT_GRACE_S` later: it is killed.
        """
        watched: list[Any] = [self._conn, self.process.sentinel]
        committing = False
        while True:
            if not wait_ready(watched, ABORT_POLL_S):
                reason = None if committing else aborted()
                if reason is not None and not wait_ready(watched, ABORT_GRACE_S):
                    self.process.kill()
                    self.process.join(5)
                    raise WorkerStopped(reason)
                continue
            try:
                if self._conn.poll():
                    message = self._conn.recv()
                    if message == COMMITTING:
                        committing = True
                        continue
                    return message
            except (EOFError, OSError):
                pass
            self.process.join(5)
            raise WorkerDied(
                f"the async-save worker process (pid {self.process.pid}) died during the save "
                f"({_exit_status(self.process.exitcode)})")

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit after its current job; kill it after
        ``timeout`` seconds, or at once if it never had a job (prestarted,
        or still starting)."""
        try:
            self._conn.send(None)
        except OSError:
            pass
        self.process.join(timeout if self.started else 0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        hint = ", as the kernel's OOM killer sends" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


@contextlib.contextmanager
def _main_module_importable() -> Iterator[None]:
    """Start a spawned process whatever ran the main module.

    Spawning re-runs the parent's main module in the child, by name or by
    the path in its ``__file__``; a script fed on standard input
    (``python - <<EOF``) has ``__file__ == "<stdin>"``, no file, and the
    child dies in ``runpy`` before it runs anything (`multiprocessing
    <https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods>`_
    re-imports only what exists).  For such a main module the start hides
    ``__file__``, as for ``python -c``, so the child skips it; nothing it
    defines is then known to the worker (a class of the script's own does
    not reach it, and the save fails naming it).  Held under a lock, for the
    start only."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hide = (main is not None and getattr(main, "__spec__", None) is None
            and isinstance(path, str) and not os.path.isfile(path))
    if not hide:
        yield
        return
    with _start_lock:
        del main.__file__  # type: ignore[union-attr]
        try:
            yield
        finally:
            main.__file__ = path  # type: ignore[union-attr]


_start_lock = threading.Lock()


def publish_abort(store: Any, seq: int, reason: str) -> None:
    """Publish that save ``seq`` failed on this rank (``reason`` names it)
    under ``store`` (the saver's prefix of the job's store), unless another
    rank's failure came first, and release the save's meeting, so that
    every rank's worker or trainer fails the save within seconds (module
    doc).  Best effort: a store that cannot be reached leaves the others to
    their ``timeout``."""
    try:
        store.compare_set(f"save{seq}/abort", "", reason)
        store.set(f"save{seq}/go", "1")
    except Exception:  # the store is gone too: nothing more to tell
        pass


def read_abort(store: Any, seq: int) -> str | None:
    """The failure published for save ``seq`` (:func:`publish_abort`), or
    ``None``."""
    key = f"save{seq}/abort"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # a store that cannot be reached says nothing
        return None


def _main(conn) -> None:
    # lower only once started: at nice 10, `import torch` on a busy machine
    # takes many times longer, and the first save waits for it
    torch.set_num_threads(1)
    os.nice(NICENESS)
    _name_process(WORKER_NAME)
    conn.send("ready")
    worker = Persister()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the trainer is gone: an idle worker leaves quietly
            return
        except Exception as e:  # a job that does not unpickle here
            conn.send(Outcome(-1, error=CheckpointError(
                f"the async-save worker could not read the save it was sent "
                f"({type(e).__name__}: {e}); its storage, planner and before_commit must be "
                f"importable there: a class or function of a script fed on standard input "
                f"or typed at a prompt is not; define it in a module"), alone=True))
            continue
        if job is None:
            return
        with gc_paused():
            outcome, cleanup = worker.run(job, lambda: conn.send(COMMITTING))
        try:
            conn.send(outcome)
        except OSError:  # the trainer died during the save, which went on without it
            cleanup()
            return
        cleanup()


def _name_process(name: str) -> None:
    """Give this process ``name`` as its command name where the system
    has one (Linux: ``/proc/self/comm``, what ``pgrep``, ``top`` and
    ``ps -o comm`` show; at most 15 bytes)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _announced(committing: Callable[[], None],
               before_commit: BeforeCommit | None) -> BeforeCommit:
    """The save's ``before_commit``, telling the trainer first that the
    commit begins (:data:`COMMITTING`)."""
    def announce(metadata: Metadata) -> None:
        try:
            committing()
        except OSError:  # the trainer is gone: the commit goes on without it
            pass
        if before_commit is not None:
            before_commit(metadata)

    return announce


def _closing(coord: FileCoordinator, save: _Save) -> Callable[[], None]:
    """The cleanup after a failed save over exchange files: they go
    (:meth:`FileCoordinator.close`), then the folder if the save made it
    (its exchange files made it, and outlived the save's discard)."""
    def cleanup() -> None:
        coord.close()
        save.remove_folder()

    return cleanup


class Persister:
    """What runs a worker's saves, and keeps across them: the staging
    layout, the plan cache and its gloo group.

    ``in_process``: it runs in the trainer (:mod:`dcp.asynchronous.async_save`,
    until the rank's worker process is ready), where the default process
    group is the trainer's: it never makes or destroys a group, and its
    saves' steps go over the job's store (:class:`StoreCoordinator`), as do
    those of every rank of a save that any rank runs in process (agreed at
    the meeting).  Its waits for peers watch the save's abort key, since a
    thread cannot be killed; its own writes run to their end."""

    def __init__(self, in_process: bool = False) -> None:
        self.in_process = in_process
        self.layout: Layout | None = None
        self.cache = PlanCache()
        self.store: Any = None  # the rendezvous store, under the saver's prefix
        self.group_ok = False  # a gloo group exists and its last save succeeded

    def run(self, job: SaveJob,
            committing: Callable[[], None]) -> tuple[Outcome, Callable[[], None]]:
        """Run ``job``; ``committing()`` is called right before this
        (coordinator) worker commits, when it waits for no peer any more."""
        start = time.perf_counter()
        if job.layout is not None:
            self.layout = job.layout
        for entry in job.plan_entries:
            self.cache.add(entry)
        cleanup: Callable[[], None] = lambda: None  # noqa: E731
        failed = cleanup  # the cleanup after a failure
        joined = False  # whether this rank took part in the save's coordination
        try:
            storage = job.storage or open_storage(job.checkpoint_id, **job.storage_options)
            planner = (job.planner if job.planner is not None
                       else cast(SavePlanner, default_planner("save")))
            state = (self.layout.state(job.json_values, job.pickled, job.paths) if self.layout
                     else SaveState())

            def describe() -> SaveState:
                if job.error is not None:
                    raise job.error
                return state

            if job.coordination == "none":
                local = LocalCoordinator(job.rank, job.world_size)
                independent = IndependentSave(describe, storage, planner, local, job.overwrite,
                                              compression=job.compression)
                metadata = independent.run(job.save_id)
                outcome = Outcome(job.seq, metadata)
            else:
                coord = self._coordinator(job, storage)
                joined = True
                save = _Save(describe, storage, planner, coord, job.overwrite,
                             _announced(committing, job.before_commit), job.compression)
                if isinstance(coord, FileCoordinator):
                    cleanup = coord.close
                    failed = _closing(coord, save)
                    # like the gloo workers' meeting: no rank starts writing
                    # while another still stages (nor past a staging failure)
                    coord.run_all("waiting for every rank to stage", describe)
                done = self.cache.save(save, job.save_id)
                self.group_ok = isinstance(coord, Coordinator)  # its gloo group works
                outcome = Outcome(job.seq, done.metadata, planning_s=done.planning_s,
                                  exchanged=done.exchanged,
                                  plan_entry=done.entry)
        except Exception as e:  # every failure goes back to the trainer
            if not isinstance(e, CheckpointError):
                e = CheckpointError(f"rank {job.rank}: async save of {job.checkpoint_id!r} failed: "
                                    f"{type(e).__name__}: {e}")
            outcome = Outcome(job.seq, error=e,
                              alone=not joined and job.coordination != "none")
            cleanup = failed
        outcome.persist_s = time.perf_counter() - start
        return outcome, cleanup

    def _coordinator(self, job: SaveJob, storage: StoragePlugin) -> CoordinatorBase:
        if job.coordination == "file":
            return FileCoordinator(storage, job.save_id, job.rank, job.world_size, job.timeout)
        if job.world_size == 1:
            return LocalCoordinator(0, 1)
        return self._join_group(job)

    def _join_group(self, job: SaveJob) -> CoordinatorBase:
        """Meet the other ranks in the job's rendezvous store and return
        the save's coordinator: over the store if any rank runs the save in
        process, else over the worker's default process group, the gloo
        group of the rendezvous, rebuilt (as group ``seq``) if any rank
        needs it."""
        rendezvous, rank, world_size = job.rendezvous, job.rank, job.world_size
        if rendezvous is None:  # the trainer found no store to share; job.error says why
            raise job.error or CheckpointError(f"rank {rank}: no rendezvous store for the group")
        arrival = datetime.timedelta(seconds=job.timeout)
        if self.store is None:
            kind, *where = rendezvous.store
            if kind == "tcp":
                base: Any = dist.TCPStore(where[0], where[1], is_master=False, timeout=arrival,
                                          wait_for_workers=False)
            else:
                base = dist.FileStore(where[0], -1)
            self.store = dist.PrefixStore(rendezvous.prefix, base)
        meet = f"save{job.seq}"
        healthy = self.group_ok and dist.is_initialized()
        if not healthy:
            self.store.add(f"{meet}/rebuild", 1)
        if self.in_process:
            self.store.add(f"{meet}/in_process", 1)
        self.group_ok = False  # until this save succeeds
        if self.store.add(f"{meet}/arrived", 1) == world_size:
            self.store.set(f"{meet}/go", "1")
            if job.seq:  # everyone is past the previous meeting
                for key in ("rebuild", "in_process", "arrived", "go", "abort"):
                    self.store.delete_key(f"save{job.seq - 1}/{key}")
        # a peer whose worker died mid-save fails this one within the
        # coordination timeout, which also covers starting the peers' workers
        try:
            self.store.wait([f"{meet}/go"], arrival)
        except Exception as e:  # the store's timeout error names no rank
            starting = ("" if healthy else "; a first save (or one after a failure) also waits "
                        "for every rank's worker process to start, which takes seconds: pass a "
                        "larger timeout if that is slower here")
            raise CheckpointError(
                f"rank {rank}: not every rank's background process arrived for save "
                f"{job.seq} of this job within timeout={job.timeout:g} s (did every rank call "
                f"dcp.async_save?{starting}) ({type(e).__name__}: {e})") from e
        reason = read_abort(self.store, job.seq)
        if reason is not None:  # released by a rank that cannot take part
            raise CheckpointError(f"rank {rank}: async save of {job.checkpoint_id!r} failed on "
                                  f"another rank: {reason}")
        if self.store.add(f"{meet}/in_process", 0):
            store = self.store
            return StoreCoordinator(store, f"{meet}/x/", rank, world_size, job.timeout,
                                    lambda: read_abort(store, job.seq), ABORT_POLL_S)
        if not self.store.add(f"{meet}/rebuild", 0):
            return Coordinator()
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"group{job.seq}", self.store),
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=job.timeout))
        return Coordinator()
