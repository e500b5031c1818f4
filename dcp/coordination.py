"""Cross-rank coordination with failure propagation.

Every collective step of a save or load runs through :class:`Coordinator`:
each rank computes its part, exceptions included, and the coordinator (rank 0
of the group) either combines the parts or, if any rank failed, sends the
failure to everyone.  So an exception on one rank surfaces on every rank as a
:class:`~dcp.errors.CheckpointError` naming the failing rank and phase, and
no rank is left waiting in a collective the failing rank never reached (the
pattern of PyTorch DCP's ``_DistWrapper``).

Without an initialized ``torch.distributed`` the coordinator is a single
process and the steps run locally.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from dcp import errors
from dcp.errors import CheckpointError


@dataclass
class _Failure:
    """An exception captured on ``rank``, in a form that pickles."""

    rank: int
    message: str
    trace: str
    kind: str  # class name of a dcp.errors exception, else "CheckpointError"


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


class Coordinator:
    """Runs the collective steps of one save or load over ``process_group``
    (the default group if ``None``), or locally when torch.distributed is not
    initialized.  Rank 0 of the group is the coordinator."""

    def __init__(self, process_group: Any = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group
        if self.distributed:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        else:
            self.rank, self.world_size = 0, 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _raise(self, phase: str, failures: list[_Failure], local: Exception | None) -> None:
        """Raise the step's failure; ``.tracebacks`` maps each failing rank to
        its traceback text, and the local exception (if any) is the cause."""
        ranks = ", ".join(str(f.rank) for f in failures)
        if len(failures) == 1:
            detail = failures[0].message
        else:
            detail = "; ".join(f"rank {f.rank}: {f.message}" for f in failures)
        kinds = {f.kind for f in failures}
        cls = getattr(errors, kinds.pop()) if len(kinds) == 1 else CheckpointError
        error = cls(f"{phase} failed on rank {ranks}: {detail}")
        error.tracebacks = {f.rank: f.trace for f in failures}
        raise error from local

    def _gather(self, obj: Any) -> list[Any] | None:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def _scatter(self, objs: list[Any] | None) -> Any:
        if not self.distributed:
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs, group=self.group, group_src=0)
        return out[0]

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def gather_scatter(self, phase: str, local_fn: Callable[[], Any],
                       global_fn: Callable[[list[Any]], list[Any]]) -> Any:
        """Every rank runs ``local_fn``; the coordinator runs ``global_fn`` on
        all results (index = rank) and each rank gets its element of the
        returned list.  Raises :class:`CheckpointError` on every rank if any
        rank's ``local_fn`` or the ``global_fn`` raised."""
        return self._step(phase, local_fn, global_fn, broadcast=False)

    def gather_broadcast(self, phase: str, local_fn: Callable[[], Any],
                         global_fn: Callable[[list[Any]], Any]) -> Any:
        """Like :meth:`gather_scatter`, but every rank gets the one value
        ``global_fn`` returns."""
        return self._step(phase, local_fn, global_fn, broadcast=True)

    def run_all(self, phase: str, fn: Callable[[], Any]) -> Any:
        """Every rank runs ``fn`` and gets its own result back, or, if any
        rank raised, a :class:`CheckpointError` naming it on every rank."""
        value, failure, exc = _capture(self.rank, fn)
        gathered = self._gather(failure)
        if self.is_coordinator:
            gathered = [f for f in gathered if f is not None]
        failures = self._broadcast(gathered)
        if failures:
            self._raise(phase, failures, exc)
        return value

    def broadcast(self, phase: str, fn: Callable[[], Any]) -> Any:
        """The coordinator runs ``fn``; every rank gets its result, or a
        :class:`CheckpointError` if it raised."""
        value, failure, exc = _capture(self.rank, fn) if self.is_coordinator else (None, None, None)
        value, failure = self._broadcast((value, failure))
        if failure is not None:
            self._raise(phase, [failure], exc)
        return value

    def _step(self, phase, local_fn, global_fn, broadcast: bool):
        local, failure, exc = _capture(self.rank, local_fn)
        gathered = self._gather((local, failure))
        result = None
        if self.is_coordinator:
            failures = [f for _, f in gathered if f is not None]
            if not failures:
                value, g_failure, exc = _capture(self.rank, lambda: global_fn([v for v, _ in gathered]))
                failures = [g_failure] if g_failure else []
            if failures:
                result = (None, failures) if broadcast else [(None, failures)] * self.world_size
            else:
                result = (value, None) if broadcast else [(v, None) for v in value]
        value, failures = self._broadcast(result) if broadcast else self._scatter(result)
        if failures:
            self._raise(phase, failures, exc)
        return value

    def barrier(self) -> None:
        """Wait for every rank of the group."""
        if self.distributed:
            dist.barrier(group=self.group)
