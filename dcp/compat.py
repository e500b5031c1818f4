"""PyTorch DCP's call signatures over hyperdcp: switch with one import.

``import dcp.compat as dcp_compat`` in place of ``import
torch.distributed.checkpoint as dcp``, and code written for
``torch.distributed.checkpoint`` runs unchanged: :func:`save`, :func:`load`
and :func:`async_save` take its arguments (``checkpoint_id=``,
``storage_writer=`` / ``storage_reader=``, ``planner=``,
``process_group=``, ``no_dist=``, ``async_checkpointer_type=``), and Stateful
values are resolved as torch does (:mod:`dcp.core.stateful`).

What comes along is hyperdcp's behaviour (docs/moving-from-torch-dcp.md):
where PyTorch DCP would cast or drop silently, these raise
:class:`~dcp.CheckpointError` — a missing key (unless
``DefaultLoadPlanner(allow_partial_load=True)``), a dtype mismatch, replicas
that differ, a value that is neither a tensor, JSON, ``bytes`` nor
``io.BytesIO`` (never pickled).

Storage: torch's ``FileSystemWriter`` / ``FileSystemReader``, or any object
with a ``path``, names where the checkpoint lives; hyperdcp's own storage
plugin for that path's scheme does the I/O.  A writer's ``overwrite``
(PyTorch DCP's default: ``True``) is honoured; hyperdcp keeps the previous
checkpoint loadable until the new one commits.

Planners: torch's ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` with their
default settings are accepted (hyperdcp's planners do their job), and
``allow_partial_load=True`` means ``strict=False``.  Any other setting, a
subclass or another torch planner is refused, since its hooks would not
run; hyperdcp planners (:class:`dcp.core.planner.SavePlanner`,
:class:`~dcp.core.planner.LoadPlanner`) pass through.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from dcp.asynchronous.async_save import AsyncSaveResponse
from dcp.asynchronous.async_save import async_save as _async_save
from dcp.core.metadata import Metadata
from dcp.core.planner import LoadPlanner, SavePlanner
from dcp.errors import CheckpointError
from dcp.orchestration.load import LoadReport
from dcp.orchestration.load import load as _load
from dcp.orchestration.save import save as _save

__all__ = ["save", "load", "async_save"]

#: Attributes of torch's default planners that are not settings.
_NOT_SETTINGS = {"mappings", "original_state_dict", "_cached_plans_key", "state_dict",
                 "metadata", "is_coordinator", "keys"}
#: Settings accepted at any value: plan caching (hyperdcp caches plans itself).
_ANY_VALUE = {"_enable_plan_caching"}


def _location(checkpoint_id: str | os.PathLike | None, storage: Any, what: str) -> str:
    """The checkpoint's path or URI, from ``checkpoint_id`` or the storage
    object's ``path``; raises :class:`CheckpointError` if neither names one
    or they disagree."""
    path = getattr(storage, "path", None) if storage is not None else None
    if storage is not None and path is None:
        raise CheckpointError(
            f"{what} {type(storage).__name__} has no 'path': dcp.compat takes torch's "
            f"FileSystemWriter/FileSystemReader or any object with a path")
    if checkpoint_id is not None and path is not None and (
            os.fspath(checkpoint_id).rstrip("/") != os.fspath(path).rstrip("/")):
        raise CheckpointError(f"checkpoint_id {os.fspath(checkpoint_id)!r} and the {what}'s path "
                              f"{os.fspath(path)!r} differ")
    where = checkpoint_id if checkpoint_id is not None else path
    if where is None:
        raise CheckpointError(f"give checkpoint_id= or {what}= (a path or URI)")
    return os.fspath(where)


def _settings_differ(planner: Any) -> list[str]:
    """The settings of a torch default planner that differ from a freshly
    made one's."""
    fresh = vars(type(planner)())
    return sorted(k for k, v in vars(planner).items()
                  if k not in _NOT_SETTINGS | _ANY_VALUE and fresh.get(k, v) != v)


def _torch_planner(planner: Any, kind: str) -> Any:
    """``planner`` if it is one of torch's default planners of ``kind``
    (``"Save"`` / ``"Load"``), exactly that class; else ``None``."""
    try:
        from torch.distributed.checkpoint import default_planner
    except ImportError:  # pragma: no cover - torch without DCP
        return None
    cls = getattr(default_planner, f"Default{kind}Planner")
    return planner if type(planner) is cls else None


def _save_planner(planner: Any) -> SavePlanner | None:
    if planner is None or isinstance(planner, SavePlanner):
        return planner
    if _torch_planner(planner, "Save") is not None:
        differ = _settings_differ(planner)
        if differ:
            raise CheckpointError(
                f"DefaultSavePlanner with non-default {', '.join(differ)}: dcp.compat accepts "
                f"torch's default planner only (hyperdcp's planner deduplicates and balances)")
        return None
    raise CheckpointError(
        f"planner {type(planner).__name__} is not supported by dcp.compat: its hooks would not "
        f"run; pass torch's DefaultSavePlanner() or a dcp.core.planner.SavePlanner")


def _load_planner(planner: Any) -> tuple[LoadPlanner | None, bool]:
    """hyperdcp's planner (``None``: the default) and ``strict``."""
    if planner is None or isinstance(planner, LoadPlanner):
        return planner, True
    if _torch_planner(planner, "Load") is not None:
        differ = [k for k in _settings_differ(planner) if k != "allow_partial_load"]
        if differ:
            raise CheckpointError(
                f"DefaultLoadPlanner with non-default {', '.join(differ)}: dcp.compat accepts "
                f"torch's default planner only, with allow_partial_load if wished")
        return None, not planner.allow_partial_load
    raise CheckpointError(
        f"planner {type(planner).__name__} is not supported by dcp.compat: its hooks would not "
        f"run; pass torch's DefaultLoadPlanner() or a dcp.core.planner.LoadPlanner")


def _group(process_group: Any, no_dist: bool, use_collectives: bool) -> Any:
    """The process group to run over; raises :class:`CheckpointError` for
    ``no_dist`` or ``use_collectives=False`` in a job of several ranks."""
    import torch.distributed as dist

    several = dist.is_available() and dist.is_initialized() and (
        dist.get_world_size(process_group) > 1)
    if several and (no_dist or not use_collectives):
        what = "no_dist=True" if no_dist else "use_collectives=False"
        raise CheckpointError(
            f"{what} in a job of {dist.get_world_size(process_group)} ranks is not supported "
            f"by dcp.compat: the ranks of one checkpoint save and load together (pass a "
            f"process_group, or use dcp.async_save(coordination='none'))")
    return process_group


def _overwrite(storage_writer: Any) -> bool:
    """PyTorch DCP overwrites by default (``FileSystemWriter(overwrite=True)``)."""
    return bool(getattr(storage_writer, "overwrite", True))


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: Any = None, planner: Any = None, process_group: Any = None,
         no_dist: bool = False, use_collectives: bool = True) -> Metadata:
    """``torch.distributed.checkpoint.save``'s signature over :func:`dcp.save`.

    Returns hyperdcp's :class:`~dcp.Metadata`.  Raises
    :class:`~dcp.CheckpointError` where PyTorch DCP would save silently
    something it cannot load back as it was (module doc).
    """
    where = _location(checkpoint_id, storage_writer, "storage_writer")
    return _save(state_dict, where, planner=_save_planner(planner),
                 process_group=_group(process_group, no_dist, use_collectives),
                 overwrite=_overwrite(storage_writer))


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_reader: Any = None, planner: Any = None, process_group: Any = None,
         no_dist: bool = False) -> LoadReport:
    """``torch.distributed.checkpoint.load``'s signature over :func:`dcp.load`:
    fills ``state_dict`` in place (Stateful values through their
    ``load_state_dict()``).

    Returns the :class:`~dcp.LoadReport` (PyTorch DCP returns ``None``).
    Raises :class:`~dcp.CheckpointError` for a key the checkpoint lacks
    (unless ``DefaultLoadPlanner(allow_partial_load=True)``), a shape or
    dtype mismatch (never cast), or a corrupted checkpoint.
    """
    where = _location(checkpoint_id, storage_reader, "storage_reader")
    hyper_planner, strict = _load_planner(planner)
    return _load(state_dict, where, strict=strict, planner=hyper_planner,
                 process_group=_group(process_group, no_dist, True))


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: Any = None, planner: Any = None, process_group: Any = None,
               async_checkpointer_type: Any = None, async_stager: Any = None,
               no_dist: bool = False, use_collectives: bool = True) -> Future:
    """``torch.distributed.checkpoint.async_save``'s signature over
    :func:`dcp.async_save`: returns once the state is staged in host memory,
    with a ``concurrent.futures.Future`` whose result is the committed
    :class:`~dcp.Metadata` (or whose exception is the save's
    :class:`~dcp.CheckpointError`).

    Both ``AsyncCheckpointerType.THREAD`` and ``PROCESS`` run the save in
    hyperdcp's background process.  A custom ``async_stager`` is refused.
    """
    if async_stager is not None:
        raise CheckpointError(
            f"async_stager {type(async_stager).__name__} is not supported by dcp.compat: "
            f"hyperdcp stages into its own reused shared memory")
    kind = getattr(async_checkpointer_type, "value", async_checkpointer_type)
    if kind not in (None, "thread", "process"):
        raise CheckpointError(f"async_checkpointer_type {async_checkpointer_type!r} is not "
                              f"supported (THREAD or PROCESS)")
    where = _location(checkpoint_id, storage_writer, "storage_writer")
    response = _async_save(state_dict, where, planner=_save_planner(planner),
                           process_group=_group(process_group, no_dist, use_collectives),
                           overwrite=_overwrite(storage_writer))
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def resolve(done: AsyncSaveResponse) -> None:
        try:
            future.set_result(done.result())
        except BaseException as e:  # the save's failure, handed to the caller
            future.set_exception(e)

    response.add_done_callback(resolve)
    return future
