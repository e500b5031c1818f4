"""Cross-rank coordination with failure propagation.

Every collective step of a save or load runs through a coordinator: each rank
computes its part, exceptions included, and the coordinator (rank 0 of the
group) either combines the parts or, if any rank failed, sends the failure to
everyone.  So an exception on one rank surfaces on every rank as a
:class:`~dcp.errors.CheckpointError` naming the failing rank and phase, and
no rank is left waiting in a step the failing rank never reached (the
pattern of PyTorch DCP's ``_DistWrapper``).

The steps are written once, in :class:`CoordinatorBase`, over two transport
primitives: *gather* (every rank's part to the coordinator) and *reply* (the
coordinator's answer: one value for everyone, or one value per rank).  A
reply always starts with a header saying which of the two it is, so ranks
that disagree on what comes next (one used a cached plan, another did not)
still take part in the same step and all get the failure.  Transports:

* :class:`Coordinator`: ``torch.distributed`` object collectives on a
  process group (the default group if ``None``); without an initialized
  ``torch.distributed``, a single process.
* :class:`LocalCoordinator`: no traffic at all; every rank is its own
  coordinator (``async_save(coordination="none")``).
* :class:`dcp.coordination.file_flag.FileCoordinator`: the file-flag protocol
  over the checkpoint's storage.
"""

from __future__ import annotations

import abc
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dcp import errors
from dcp.coordination import wire
from dcp.coordination.host_exchange import host_key
from dcp.errors import CheckpointError


@dataclass
class _Failure:
    """An exception captured on ``rank``, in a form that pickles."""

    rank: int
    message: str
    trace: str
    kind: str  # class name of a dcp.errors exception, else "CheckpointError"


wire.register(_Failure)


@dataclass
class PerRank:
    """What a step's ``global_fn`` returns to give each rank its own value
    (``values[rank]``) instead of one value for all."""

    values: list[Any]


def _capture(rank: int, fn: Callable[[], Any]) -> tuple[Any, _Failure | None, Exception | None]:
    try:
        return fn(), None, None
    except Exception as e:  # reported to every rank by the caller
        if isinstance(e, CheckpointError):
            failure = _Failure(rank, str(e), traceback.format_exc(), type(e).__name__)
        else:
            failure = _Failure(rank, f"{type(e).__name__}: {e}", traceback.format_exc(),
                               "CheckpointError")
        return None, failure, e


def failure_of(rank: int, message: str) -> _Failure:
    """A failure of ``rank`` that did not come from an exception (a rank that
    never arrived, a process that died)."""
    return _Failure(rank, message, "", "CheckpointError")


class CoordinatorBase(abc.ABC):
    """The failure-propagating steps of one save or load on one rank.

    ``rank`` and ``world_size`` are this rank's place in the group; rank 0
    is the coordinator unless a subclass says otherwise.  Subclasses provide
    the transport: :meth:`_gather` and :meth:`_reply`, called by every rank
    in the same order; ``step`` numbers them from 0 and ``phase`` names them
    (both only for transports that need names, and for messages).
    """

    rank: int
    world_size: int

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank combines the parts of every step."""
        return self.rank == 0

    @abc.abstractmethod
    def _gather(self, step: int, phase: str, obj: Any) -> list[Any] | None:
        """Send ``obj`` to the coordinator; the coordinator gets every rank's
        object (index = rank), the others ``None``."""

    @abc.abstractmethod
    def _reply(self, step: int, phase: str, shared: bool, value: Any) -> Any:
        """The coordinator sends ``value`` (if ``shared``) or ``value[rank]``
        to each rank; every rank returns its value.  Non-coordinators pass
        ``shared=False, value=None``."""

    _steps: int = 0

    def _next_step(self) -> int:
        self._steps += 1
        return self._steps - 1

    def _raise(self, phase: str, failures: list[_Failure], local: Exception | None) -> None:
        """Raise the step's failure; ``.tracebacks`` maps each failing rank to
        its traceback text, and the local exception (if any) is the cause."""
        ranks = ", ".join(str(f.rank) for f in failures)
        if len(failures) == 1:
            detail = failures[0].message
        else:
            detail = "; ".join(f"rank {f.rank}: {f.message}" for f in failures)
        kinds = {f.kind for f in failures}
        cls: type[CheckpointError] = (getattr(errors, kinds.pop()) if len(kinds) == 1
                                      else CheckpointError)
        error = cls(f"{phase} failed on rank {ranks}: {detail}")
        error.tracebacks = {f.rank: f.trace for f in failures}
        raise error from local

    def step(self, phase: str, local_fn: Callable[[], Any],
             global_fn: Callable[[list[Any]], Any]) -> Any:
        """Every rank runs ``local_fn``; the coordinator runs ``global_fn`` on
        all results (index = rank).  If it returns :class:`PerRank`, each rank
        gets its element, else every rank gets the value.  Raises
        :class:`CheckpointError` on every rank if any rank's ``local_fn`` or
        the ``global_fn`` raised."""
        n = self._next_step()
        local, failure, exc = _capture(self.rank, local_fn)
        gathered = self._transport(phase, lambda: self._gather(n, phase, (local, failure)), n)
        shared = False
        reply: Any = None  # (value, failures) for every rank, or one such pair per rank
        if self.is_coordinator:
            failures = [f for _, f in gathered if f is not None]
            if not failures:
                answer, g_failure, exc = _capture(
                    self.rank, lambda: global_fn([v for v, _ in gathered]))
                failures = [g_failure] if g_failure else []
            if failures:
                shared, reply = True, (None, failures)
            elif isinstance(answer, PerRank):
                reply = [(v, None) for v in answer.values]
            else:
                shared, reply = True, (answer, None)
        value, failures = self._transport(phase, lambda: self._reply(n, phase, shared, reply), n)
        if failures:
            self._raise(phase, failures, exc)
        return value

    def _transport(self, phase: str, fn: Callable[[], Any], step: int = -1) -> Any:
        """``fn()``, a transport primitive of step ``step``; its failure (a
        peer that died or timed out, a broken connection) becomes a
        :class:`CheckpointError` naming this rank and the phase.  At the
        first step the usual cause is a call on some ranks only (``if rank
        == 0:``), and the message says so."""
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as e:
            if step == 0 and self.world_size > 1:
                raise CheckpointError(
                    f"{phase}: rank {self.rank} lost contact with the other ranks at the first "
                    f"step of the call: the others may never have joined; was it called on rank "
                    f"{self.rank} only (e.g. under `if rank == 0:`)? dcp.save, dcp.load and "
                    f"dcp.async_save are collective: every rank of the group calls them (else "
                    f"a rank died, hung or timed out): {type(e).__name__}: {e}") from e
            raise CheckpointError(
                f"{phase}: rank {self.rank} lost contact with the other ranks (a rank died, "
                f"hung or timed out): {type(e).__name__}: {e}") from e

    def gather_scatter(self, phase: str, local_fn: Callable[[], Any],
                       global_fn: Callable[[list[Any]], list[Any]]) -> Any:
        """Like :meth:`step`, ``global_fn`` returning one value per rank."""
        return self.step(phase, local_fn, lambda values: PerRank(global_fn(values)))

    def gather_broadcast(self, phase: str, local_fn: Callable[[], Any],
                         global_fn: Callable[[list[Any]], Any]) -> Any:
        """Like :meth:`step`, every rank getting the one value ``global_fn``
        returns."""
        return self.step(phase, local_fn, global_fn)

    def run_all(self, phase: str, fn: Callable[[], Any]) -> Any:
        """Every rank runs ``fn`` and gets its own result back, or, if any
        rank raised, a :class:`CheckpointError` naming it on every rank."""
        results: list[Any] = []
        self.step(phase, lambda: results.append(fn()), lambda _: None)
        return results[0]

    def broadcast(self, phase: str, fn: Callable[[], Any]) -> Any:
        """The coordinator runs ``fn``; every rank gets its result, or a
        :class:`CheckpointError` if it raised."""
        n = self._next_step()
        reply, exc = None, None
        if self.is_coordinator:
            value, failure, exc = _capture(self.rank, fn)
            reply = (None, [failure]) if failure else (value, None)
        value, failures = self._transport(
            phase, lambda: self._reply(n, phase, self.is_coordinator, reply), n)
        if failures:
            self._raise(phase, failures, exc)
        return value


#: Gloo groups made for coordination over groups of another backend, by
#: the group (a default group made anew, after ``destroy_process_group``,
#: gets its own).
_gloo_groups: dict[Any, Any] = {}


def coordination_group(process_group: Any = None) -> Any:
    """``process_group`` (the default group if ``None``) if it runs on gloo,
    else a gloo group of the same ranks and timeout, made once (by every
    rank for the job's whole group; else only its members take part:
    ``use_local_synchronization``).  Coordination never
    goes through an accelerator communicator: an object gather over NCCL
    stages every rank's plan in accelerator memory, which is what ran out of
    memory on MoE models in public reports, and needs ``set_device`` on
    every rank.

    torch names a subgroup made this way from its ranks and the number of
    groups the calling process holds, so its members call it first holding
    as many groups (as every rank of a job that builds its meshes alike
    does; hyperdcp makes no other groups)."""
    if "gloo" in str(dist.get_backend(process_group)):
        return process_group
    group = process_group if process_group is not None else dist.group.WORLD
    if group not in _gloo_groups:
        # the job's whole group: every rank makes it, under torch's counter of
        # such groups, the same on every rank; a subgroup: only its members
        whole = dist.get_world_size(group) == dist.get_world_size()
        _gloo_groups[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                             timeout=group_timeout(group),
                                             use_local_synchronization=not whole)
    return _gloo_groups[group]


def group_timeout(group: Any = None) -> Any:
    """The collective timeout ``group`` (the default group if ``None``) was
    made with (a ``timedelta``), or ``None`` where its backend does not say."""
    group = group if group is not None else dist.group.WORLD
    try:
        return group._get_backend(group._device_types[0]).options._timeout
    except (AttributeError, IndexError, RuntimeError):
        return None


def _outgoing(value: Any) -> Any:
    """``value`` in :mod:`dcp.coordination.wire`'s encoding (``bytes``), or
    as it is where it holds a type wire does not know (a load's plans:
    object collectives pickle it between the job's own processes)."""
    try:
        return wire.encode(value)
    except TypeError:
        return value


def _incoming(data: Any, where: str) -> Any:
    return wire.decode(data, where) if isinstance(data, bytes) else data


def _size(data: Any) -> int:
    return len(data) if isinstance(data, bytes) else 0


#: Groups of this many ranks or more gather through one leader per host
#: (:class:`Coordinator`).
TWO_LEVEL_FROM = 64


@dataclass
class _Hosts:
    """The hosts of a coordination group: ``hosts`` lists each host's group
    ranks (ascending; hosts in the order of their first rank, the host's
    *leader*); ``mine`` is this rank's host."""

    hosts: list[list[int]]
    mine: int


#: The host layout of each group, by the group (a group made anew gets its
#: own) and its members' global ranks: one all-gather of host names, the
#: first time the group coordinates.  The key holds nothing one rank could
#: see otherwise than another, so every rank of the group takes the cached
#: layout, or makes it, at the same call.
_host_layouts: dict[tuple[Any, tuple[int, ...]], _Hosts | None] = {}


def _host_layout(group: Any, rank: int, members: tuple[int, ...], host: str) -> _Hosts | None:
    """``group``'s hosts (one all-gather of ``host`` over it, once per
    group), or ``None`` where a two-level gather gains nothing (one host, or
    one rank per host).  No group is made: the two levels run point to
    point over ``group`` (:meth:`Coordinator._gather_by_host`), since
    ``torch.distributed.new_group(use_local_synchronization=True)`` names a
    group from its ranks and the number of groups the calling process
    holds, which differ between ranks that made different groups before (a
    host's leader and its other ranks), so that they would wait for each
    other under different names."""
    cache_key = (dist.group.WORLD if group is None else group, members)
    if cache_key not in _host_layouts:
        names: list[Any] = [None] * len(members)
        dist.all_gather_object(names, host, group=group)
        by_host: dict[str, list[int]] = {}
        for r, name in enumerate(names):
            by_host.setdefault(name, []).append(r)
        hosts = list(by_host.values())
        layout = None
        if 1 < len(hosts) < len(members):
            layout = _Hosts(hosts, next(h for h, ranks in enumerate(hosts) if rank in ranks))
        _host_layouts[cache_key] = layout
    return _host_layouts[cache_key]


class Coordinator(CoordinatorBase):
    """Runs the steps over ``process_group`` (the default group if ``None``)
    with ``torch.distributed`` object collectives on gloo (a gloo group of the
    same ranks where the group runs on another backend:
    :func:`coordination_group`), or locally when torch.distributed is not
    initialized.

    What travels is :mod:`dcp.coordination.wire`'s compact encoding (bytes)
    where the payload allows (every step of a save; a load's plans go as
    objects): a local plan of the 505B layout of
    ``benchmarks/scale.py`` is about 1 KB, a write result about 2 KB.

    Groups of at least ``two_level_from`` ranks (:data:`TWO_LEVEL_FROM`)
    spread over several hosts, some with several ranks, gather in two
    levels: each host's ranks to its leader (its lowest rank), which
    bundles their payloads into one (:func:`dcp.coordination.wire.bundle`,
    compressed together: 3-6x smaller at the scale layout), then the
    leaders to the coordinator, which so receives one message per host.
    ``host`` names this rank's host (by default
    :func:`dcp.coordination.host_exchange.host_key`; ranks with equal names
    share a host); the hosts are found by one all-gather of the names, once
    per group.  Group ranks are taken to ascend with global ranks, as in
    every group ``torch.distributed.new_group`` makes.

    :attr:`stats` counts the bytes: ``gathered_bytes`` (the payloads that
    reached the coordinator: its host's ranks' and the other leaders'
    bundles), ``gathered_padded_bytes`` (what the gathers into it moved:
    ``gather_object`` pads every part to the largest) and ``sent_bytes``
    (the coordinator's answers)."""

    def __init__(self, process_group: Any = None, *, host: str | None = None,
                 two_level_from: int = TWO_LEVEL_FROM) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.stats: dict[str, int] = {"gathered_bytes": 0, "gathered_padded_bytes": 0,
                                      "sent_bytes": 0}
        self.group = process_group
        if self.distributed:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            self._members = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
            self.group = coordination_group(process_group)
        else:
            self.rank, self.world_size = 0, 1
        self.hosts: _Hosts | None = None
        if self.distributed and self.world_size >= two_level_from:
            self.hosts = _host_layout(self.group, self.rank, self._members,
                                      host_key() if host is None else host)

    @property
    def members(self) -> tuple[int, ...]:
        """The global ranks of the group (``(0,)`` without torch.distributed)."""
        if not self.distributed:
            return (0,)
        return self._members

    def _count(self, received: list[Any]) -> None:
        sizes = [_size(b) for b in received]
        self.stats["gathered_bytes"] += sum(sizes)
        self.stats["gathered_padded_bytes"] += max(sizes) * len(sizes)

    def _gather_by_host(self, payload: Any, phase: str) -> list[Any] | None:
        """Every rank's payload to the coordinator, through its host's leader."""
        hosts = self.hosts
        assert hosts is not None
        ranks = hosts.hosts[hosts.mine]
        if self.rank != ranks[0]:  # to the host's leader, which takes them in rank order
            dist.send_object_list([payload], group=self.group, group_dst=ranks[0])
            return None
        here = [payload, *(self._receive(r) for r in ranks[1:])]
        if self.is_coordinator:
            self._count(here)
        else:
            bundled = wire.bundle(here) if all(isinstance(p, bytes) for p in here) else here
            dist.send_object_list([bundled], group=self.group, group_dst=0)
            return None
        bundles = [b"", *(self._receive(h[0]) for h in hosts.hosts[1:])]  # its own host's stay
        self._count(bundles[1:])
        out: list[Any] = [None] * self.world_size
        for h, (members, got) in enumerate(zip(hosts.hosts, bundles, strict=True)):
            try:
                parts = here if h == 0 else (
                    wire.unbundle(got, f"the bundle of {phase} from rank {members[0]}")
                    if isinstance(got, bytes) else got)
                if len(parts) != len(members):
                    raise CheckpointError(f"rank {members[0]} sent {len(parts)} parts of "
                                          f"{phase} for the {len(members)} ranks of its host")
            except CheckpointError as e:
                parts = [(None, failure_of(r, str(e))) for r in members]
            for r, part in zip(members, parts, strict=True):
                out[r] = part
        return out

    def _receive(self, src: int) -> Any:
        """The object group rank ``src`` sends this rank."""
        box: list[Any] = [None]
        dist.recv_object_list(box, group=self.group, group_src=src)
        return box[0]

    def _gather(self, step, phase, obj):
        if not self.distributed:
            return [obj]
        if self.hosts is not None:
            out = self._gather_by_host(_outgoing(obj), phase)
        else:
            out = [None] * self.world_size if self.is_coordinator else None
            dist.gather_object(_outgoing(obj), out, group=self.group, group_dst=0)
            if out is not None:
                self._count(out)
        if out is None:
            return None
        parts = []
        for rank, data in enumerate(out):
            try:
                parts.append(_incoming(data, f"rank {rank}'s part of {phase}"))
            except CheckpointError as e:
                parts.append((None, failure_of(rank, str(e))))
        return parts

    def _reply(self, step, phase, shared, value):
        if not self.distributed:
            return value if shared else value[0]
        where = f"the coordinator's answer to {phase}"
        header = _outgoing(value) if self.is_coordinator and shared else None
        box = [(shared, header)]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        shared, header = box[0]
        if self.is_coordinator:
            self.stats["sent_bytes"] += _size(header) * (self.world_size - 1)
        if shared:
            return value if self.is_coordinator else _incoming(header, where)
        parts = None
        if self.is_coordinator:
            try:
                parts = wire.encode_many(value)
            except TypeError:
                parts = value
            self.stats["sent_bytes"] += sum(_size(p) for p in parts[1:])
        out: list[Any] = [None]
        dist.scatter_object_list(out, parts, group=self.group, group_src=0)
        return value[0] if self.is_coordinator else _incoming(out[0], where)


class LocalCoordinator(CoordinatorBase):
    """No cross-rank traffic: every rank coordinates itself (its steps see
    only its own part).  ``rank`` and ``world_size`` still name this rank's
    place in the job, for file names and metadata."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    @property
    def is_coordinator(self) -> bool:
        return True

    def _gather(self, step, phase, obj):
        return [obj]

    def _reply(self, step, phase, shared, value):
        return value if shared else value[0]
