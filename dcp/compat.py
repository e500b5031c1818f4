"""PyTorch DCP's entry points over hyperdcp: switch with one import.

``import dcp.compat as dcp`` in place of ``import
torch.distributed.checkpoint as dcp``, and code written for
``torch.distributed.checkpoint`` runs unchanged where it calls these
through the alias:

* ours, with torch's signatures: :func:`save`, :func:`load`,
  :func:`async_save` (``checkpoint_id=``, ``storage_writer=`` /
  ``storage_reader=``, ``planner=``, ``process_group=``, ``no_dist=``,
  ``async_checkpointer_type=``), the deprecated :func:`save_state_dict` and
  :func:`load_state_dict` (Accelerate's and older Lightning's calls),
  the private :func:`_load_state_dict_from_keys` (over
  :func:`dcp.load_keys`), :func:`dcp_to_torch_save` and
  :func:`torch_save_to_dcp`, the modules ``state_dict_saver``,
  ``state_dict_loader`` and ``format_utils`` holding them,
  ``CheckpointException`` (:class:`~dcp.CheckpointError`), ``Metadata``
  (:class:`~dcp.Metadata`, what :func:`save` returns) and the planner
  interfaces ``SavePlanner``, ``LoadPlanner``, ``SavePlan``, ``LoadPlan``,
  ``WriteItem``, ``ReadItem`` (:mod:`dcp.core.planner`);
* torch's own objects, which only carry settings hyperdcp reads:
  ``FileSystemWriter``, ``FileSystemReader``, ``DefaultSavePlanner``,
  ``DefaultLoadPlanner``, ``AsyncCheckpointerType``;
* refused, saying what to do instead: ``load_sharded_optimizer_state_dict``
  (FSDP1's loader builds its targets from torch DCP's pickled metadata), the
  storage interfaces ``StorageWriter`` / ``StorageReader`` (their I/O would
  not run), the Hugging Face storages (another format), ``format_utils``'
  ``BroadcastingTorchSaveReader`` and ``DynamicMetaLoadPlanner`` (a torch
  storage and planner: convert the file once instead), torch DCP's
  metadata classes and ``AsyncSaveResponse``.

Stateful values are resolved as torch does (:mod:`dcp.core.stateful`).
What comes along is hyperdcp's behaviour (docs/moving-from-torch-dcp.md):
where PyTorch DCP would cast or drop silently, these raise
:class:`~dcp.CheckpointError` — a missing key (unless
``DefaultLoadPlanner(allow_partial_load=True)``), a dtype mismatch, replicas
that differ, a value that is neither a tensor, JSON, ``bytes`` nor
``io.BytesIO`` (never pickled) — and their messages name torch's way out
(``FileSystemWriter(..., overwrite=True)``,
``DefaultLoadPlanner(allow_partial_load=True)``), or hyperdcp's call where
torch has none.  Code written for torch catches ``RuntimeError``, so each
of these is a ``RuntimeError`` too, led by torch's words for the failure
where torch has them ("Cannot detect which StorageReader or StorageWriter
to use", "Checkpoint already exists", "Missing key in checkpoint
state_dict").

Storage: torch's ``FileSystemWriter`` / ``FileSystemReader`` (their fsspec
subclasses too), or any object of the caller's with a ``path``, names where
the checkpoint lives; hyperdcp's own storage plugin for that path's scheme
does the I/O (torch's other storages are refused: their own I/O or format
would be bypassed).  A writer's ``overwrite`` (PyTorch DCP's default:
``True``) is honoured; hyperdcp keeps the previous checkpoint loadable
until the new one commits.  Its other settings are mapped onto the
plugin's options or refused by name (:func:`_writer_options`).

Planners: torch's ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` with their
default settings are accepted (hyperdcp's planners do their job), and
``allow_partial_load=True`` means ``strict=False``.  Any other setting, a
subclass or another torch planner is refused, since its hooks would not
run; hyperdcp planners (:class:`dcp.core.planner.SavePlanner`,
:class:`~dcp.core.planner.LoadPlanner`) pass through.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import types
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from dcp.asynchronous.async_save import AsyncSaveResponse as _AsyncSaveResponse
from dcp.asynchronous.async_save import async_save as _async_save
from dcp.core.metadata import Metadata
from dcp.core.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from dcp.core.storage import installed_schemes, plugin_name
from dcp.errors import CheckpointError
from dcp.orchestration.load import LoadReport
from dcp.orchestration.load import load as _load
from dcp.orchestration.load import read_selected as _read_selected
from dcp.orchestration.load import select_fqns as _select_fqns
from dcp.orchestration.save import save as _save

#: torch's name for the exception its saves and loads raise.
CheckpointException = CheckpointError

__all__ = ["save", "load", "async_save", "save_state_dict", "load_state_dict",
           "load_sharded_optimizer_state_dict", "CheckpointException", "Metadata",
           "SavePlanner", "LoadPlanner", "SavePlan", "LoadPlan", "WriteItem", "ReadItem"]

#: torch.distributed.checkpoint's objects handed out as they are, by name,
#: and the module defining each: data that hyperdcp reads (a writer's path
#: and overwrite, a default planner's settings, an enum), imported on first
#: use.
_TORCH_OBJECTS = {
    "FileSystemWriter": "torch.distributed.checkpoint.filesystem",
    "FileSystemReader": "torch.distributed.checkpoint.filesystem",
    "DefaultSavePlanner": "torch.distributed.checkpoint.default_planner",
    "DefaultLoadPlanner": "torch.distributed.checkpoint.default_planner",
    "AsyncCheckpointerType": "torch.distributed.checkpoint.state_dict_saver",
}
#: torch's modules of entry points, as modules of ours holding these names.
_MODULES = {"state_dict_saver": ("save", "async_save", "save_state_dict", "AsyncCheckpointerType"),
            "state_dict_loader": ("load", "load_state_dict", "_load_state_dict_from_keys"),
            "format_utils": ("dcp_to_torch_save", "torch_save_to_dcp")}
__all__ += [*_TORCH_OBJECTS, *_MODULES]
_TORCH_METADATA = ("torch DCP's metadata classes: a hyperdcp checkpoint's metadata is "
                   "dcp.read_metadata(path), a dcp.Metadata (TensorMeta, ChunkMeta, ObjectMeta)")
_HF_FORMAT = ("it reads or writes Hugging Face safetensors, not a distributed checkpoint: use "
              "dcp.interop.safetensors_io (load_safetensors, checkpoint_to_safetensors) or "
              "`hyperdcp convert`")
#: Names of torch.distributed.checkpoint that dcp.compat refuses, and why.
_REFUSED = {
    "StorageWriter": "a torch StorageWriter's I/O would not run: hyperdcp's storage plugin for "
                     "the path's scheme does it; pass FileSystemWriter(path) or checkpoint_id= "
                     "(a new backend is a storage plugin: docs/plugin-authors.md)",
    "StorageReader": "a torch StorageReader's I/O would not run: hyperdcp's storage plugin for "
                     "the path's scheme does it; pass FileSystemReader(path) or checkpoint_id= "
                     "(a new backend is a storage plugin: docs/plugin-authors.md)",
    "HuggingFaceStorageWriter": _HF_FORMAT,
    "HuggingFaceStorageReader": _HF_FORMAT,
    "QuantizedHuggingFaceStorageReader": _HF_FORMAT,
    "BytesStorageMetadata": _TORCH_METADATA,
    "ChunkStorageMetadata": _TORCH_METADATA,
    "TensorStorageMetadata": _TORCH_METADATA,
    "BroadcastingTorchSaveReader": "a torch StorageReader's I/O would not run: convert the "
                                   "torch.save file once with "
                                   "dcp.compat.format_utils.torch_save_to_dcp and load that",
    "DynamicMetaLoadPlanner": "its hooks would not run: convert the torch.save file once with "
                              "dcp.compat.format_utils.torch_save_to_dcp and load that",
    "AsyncSaveResponse": "dcp.compat.async_save returns a concurrent.futures.Future of the "
                         "committed dcp.Metadata (torch returns an AsyncSaveResponse only with "
                         "a custom async_stager, which hyperdcp refuses)",
}


class _Refused(CheckpointError, AttributeError):
    """A name of ``torch.distributed.checkpoint`` that ``dcp.compat``
    refuses (an ``AttributeError`` too, so ``hasattr`` says ``False``)."""


def __getattr__(name: str) -> Any:
    """torch's objects (:data:`_TORCH_OBJECTS`) and modules
    (:data:`_MODULES`) on first use; a refusal for :data:`_REFUSED`."""
    if name in _TORCH_OBJECTS:
        value = getattr(importlib.import_module(_TORCH_OBJECTS[name]), name)
    elif name in _REFUSED:
        raise _Refused(f"dcp.compat.{name} is not supported: {_REFUSED[name]}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (it has "
                             f"torch.distributed.checkpoint's {', '.join(__all__)}; import "
                             f"torch's other names from torch.distributed.checkpoint)")
    globals()[name] = value
    return value


#: hyperdcp keywords that its messages name, and what a torch DCP user
#: passes instead (or hyperdcp's own call, where torch has no way).
_TORCH_WAYS = {
    "overwrite=True": "FileSystemWriter(..., overwrite=True)",
    "strict=False load": "partial load (allow_partial_load=True)",
    "strict=False": "planner=DefaultLoadPlanner(allow_partial_load=True)",
    "pass allow_dtype_cast=True": "use dcp.load(..., allow_dtype_cast=True)",
    "allow_dtype_cast=True": "dcp.load(..., allow_dtype_cast=True)",
    "pass allow_pickle=True to save (and to load) it pickled":
        "use dcp.save(..., allow_pickle=True) to save it pickled (and dcp.load(..., "
        "allow_pickle=True) to load it)",
    "allow_pickle=True": "dcp.load(..., allow_pickle=True)",
}
_WAYS = re.compile("|".join(map(re.escape, sorted(_TORCH_WAYS, key=len, reverse=True))))


#: hyperdcp's wording of failures torch DCP has a message for, and torch's
#: words that code written for it matches on, put first.
_TORCH_WORDING = {
    "already holds a committed checkpoint": "Checkpoint already exists",
    "key(s) of the target are not in the checkpoint": "Missing key in checkpoint state_dict",
}


#: Each CheckpointError class made a RuntimeError too, made once.
_RUNTIME: dict[type, type] = {}


def _also_runtime(cls: type[CheckpointError]) -> type:
    """``cls`` made a ``RuntimeError`` too: torch DCP raises
    ``RuntimeError`` (or its ``CheckpointException``) where code written
    for it catches one."""
    if issubclass(cls, RuntimeError):
        return cls
    if cls not in _RUNTIME:
        _RUNTIME[cls] = type(cls.__name__, (cls, RuntimeError),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _RUNTIME[cls]


def _in_torch_terms(error: CheckpointError) -> CheckpointError:
    """``error`` as a drop-in for torch DCP raises it: a ``RuntimeError`` as
    well as a :class:`CheckpointError`, with torch's ``failures`` (``{rank:
    (error, traceback text)}`` of the ranks that failed, from its
    ``tracebacks``; empty for a failure before any coordinated step), its
    message naming torch's ways
    instead of hyperdcp's keywords (:data:`_TORCH_WAYS`) and led by torch's
    words for the failure (:data:`_TORCH_WORDING`)."""
    with contextlib.suppress(TypeError):  # a class with its own layout stays as it is
        error.__class__ = _also_runtime(type(error))
    # torch's CheckpointException.failures: each failing rank's error and traceback
    error.failures = {rank: (error, text)  # type: ignore[attr-defined]
                      for rank, text in getattr(error, "tracebacks", {}).items()}
    if error.args:
        message = _WAYS.sub(lambda m: _TORCH_WAYS[m.group(0)], str(error))
        for ours, torchs in _TORCH_WORDING.items():
            if ours in message and not message.startswith(torchs):
                message = f"{torchs}: {message}"
        error.args = (message, *error.args[1:])
    return error


@contextlib.contextmanager
def _torch_terms() -> Iterator[None]:
    """Inside, a :class:`CheckpointError` is raised :func:`_in_torch_terms`."""
    try:
        yield
    except CheckpointError as e:
        _in_torch_terms(e)
        raise

#: Attributes of torch's default planners that are not settings.
_NOT_SETTINGS = {"mappings", "original_state_dict", "_cached_plans_key", "state_dict",
                 "metadata", "is_coordinator", "keys"}
#: Settings accepted at any value: plan caching (hyperdcp caches plans itself).
_ANY_VALUE = {"_enable_plan_caching"}


def _location(checkpoint_id: str | os.PathLike | None, storage: Any, what: str) -> str:
    """The checkpoint's path or URI, from ``checkpoint_id`` or the storage
    object's ``path``; raises :class:`CheckpointError` if neither names one
    or they disagree."""
    if storage is not None:
        _refuse_torch_storage(storage, what)
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


def _refuse_torch_storage(storage: Any, what: str) -> None:
    """Raise :class:`CheckpointError` for a torch storage object whose own
    I/O or format hyperdcp would bypass: a Hugging Face storage, or a
    ``StorageWriter`` / ``StorageReader`` other than torch's file system
    ones (whose only part taken is the path)."""
    if "torch.distributed.checkpoint" not in sys.modules:  # then it is none of torch's
        return
    from torch.distributed.checkpoint import (
        FileSystemReader,
        FileSystemWriter,
        StorageReader,
        StorageWriter,
    )

    kind = type(storage).__name__
    for cls in type(storage).__mro__:
        if cls.__name__ in ("HuggingFaceStorageWriter", "HuggingFaceStorageReader"):
            raise CheckpointError(f"{what} {kind} is not supported by dcp.compat: {_HF_FORMAT}")
    if (isinstance(storage, StorageWriter | StorageReader)
            and not isinstance(storage, FileSystemWriter | FileSystemReader)):
        interface = "StorageWriter" if isinstance(storage, StorageWriter) else "StorageReader"
        raise CheckpointError(f"{what} {kind} is not supported by dcp.compat: "
                              f"{_REFUSED[interface]}")


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


#: torch's ``FileSystemWriter`` settings without a counterpart here, their
#: defaults, and why another value is refused.
_WRITER_REFUSED = {
    "per_thread_copy_ahead": (10_000_000, "hyperdcp copies accelerator tensors to host memory "
                                          "through its own bounded, reused staging"),
    "transforms": (None, "a stream extension's transform (encryption, say) would not run on "
                         "hyperdcp's files; only torch's ZStandard is accepted (hyperdcp "
                         "then compresses its chunks with zstd: docs/compression.md)"),
    "serialization_format": ("torch_save", "hyperdcp writes its own format"),
}


def _writer_options(storage_writer: Any) -> dict[str, Any]:
    """The storage options torch's ``FileSystemWriter`` settings map onto:
    ``thread_count`` (files written in parallel per rank; torch's default
    1 leaves hyperdcp's), ``sync_files=False`` as ``fsync=False``.
    ``single_file_per_rank`` and ``cache_staged_state_dict`` are accepted
    at any value (the files' layout is hyperdcp's; its async staging buffer
    is reused anyway), and so is torch's ``ZStandard`` extension
    (:func:`_compression`); ``overwrite`` is :func:`_overwrite`'s.  Raises
    :class:`CheckpointError` naming a setting of :data:`_WRITER_REFUSED` at
    another value than torch's default."""
    if storage_writer is None:
        return {}
    for name, (default, why) in _WRITER_REFUSED.items():
        value = getattr(storage_writer, name, default)
        value = getattr(value, "value", value)  # an enum
        if name == "transforms":  # what torch keeps of _extensions=
            name, value = "_extensions", [e for e in getattr(value, "extensions", None) or ()
                                          if type(e).__name__ != "ZStandard"] or None
        if value != default:
            raise CheckpointError(f"FileSystemWriter({name}={value!r}) is not supported by "
                                  f"dcp.compat: {why}")
    options: dict[str, Any] = {}
    threads = getattr(storage_writer, "thread_count", 1)
    if threads != 1:
        options["thread_count"] = int(threads)
    if getattr(storage_writer, "sync_files", True) is False:
        options["fsync"] = False
    return options


def _compression(storage_writer: Any) -> str | None:
    """``"zstd"`` where torch's ``FileSystemWriter`` was given its
    ``ZStandard`` extension (hyperdcp's per-chunk compression in its place,
    docs/compression.md), else ``None``."""
    extensions = getattr(getattr(storage_writer, "transforms", None), "extensions", None) or ()
    return "zstd" if any(type(e).__name__ == "ZStandard" for e in extensions) else None


def _storage_for(where: str) -> None:
    """Raise torch's "Cannot detect" error (a :class:`CheckpointError` and
    a ``RuntimeError``, as everything :func:`_torch_terms` passes on) for a
    checkpoint id that no installed storage plugin serves."""
    name = plugin_name(where)
    if name not in installed_schemes():
        raise CheckpointError(
            f"Cannot detect which StorageReader or StorageWriter to use for {where!r}: no "
            f"hyperdcp storage plugin serves the scheme {name!r} (installed: "
            f"{', '.join(sorted(installed_schemes()))}; a new backend is a storage plugin: "
            f"docs/plugin-authors.md)")


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: Any = None, planner: Any = None, process_group: Any = None,
         no_dist: bool = False, use_collectives: bool = True) -> Metadata:
    """``torch.distributed.checkpoint.save``'s signature over :func:`dcp.save`.

    Returns hyperdcp's :class:`~dcp.Metadata`.  Raises
    :class:`~dcp.CheckpointError` where PyTorch DCP would save silently
    something it cannot load back as it was (module doc).
    """
    with _torch_terms():
        where = _location(checkpoint_id, storage_writer, "storage_writer")
        _storage_for(where)
        return _save(state_dict, where, planner=_save_planner(planner),
                     process_group=_group(process_group, no_dist, use_collectives),
                     overwrite=_overwrite(storage_writer),
                     storage_options=_writer_options(storage_writer),
                     compression=_compression(storage_writer))


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
    with _torch_terms():
        where = _location(checkpoint_id, storage_reader, "storage_reader")
        _storage_for(where)
        hyper_planner, strict = _load_planner(planner)
        return _load(state_dict, where, strict=strict, planner=hyper_planner,
                     process_group=_group(process_group, no_dist, True))


def save_state_dict(state_dict: dict[str, Any], storage_writer: Any, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False,
                    planner: Any = None) -> Metadata:
    """torch's deprecated ``save_state_dict`` (Accelerate's call) over
    :func:`save`.  ``coordinator_rank`` is accepted at any value: hyperdcp's
    coordinator is the group's rank 0, and the checkpoint is the same."""
    return save(state_dict, storage_writer=storage_writer, planner=planner,
                process_group=process_group, no_dist=no_dist)


def load_state_dict(state_dict: dict[str, Any], storage_reader: Any, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False,
                    planner: Any = None) -> LoadReport:
    """torch's deprecated ``load_state_dict`` (Accelerate's call) over
    :func:`load`; returns the :class:`~dcp.LoadReport` (torch: ``None``).
    ``coordinator_rank`` as for :func:`save_state_dict`."""
    return load(state_dict, storage_reader=storage_reader, planner=planner,
                process_group=process_group, no_dist=no_dist)


def _load_state_dict_from_keys(keys: set[str] | str | None = None, *,
                               checkpoint_id: str | os.PathLike | None = None,
                               storage_reader: Any = None,
                               process_group: Any = None) -> dict[str, Any]:
    """torch's private ``_load_state_dict_from_keys`` (model-only or
    optimizer-only reads) over :func:`dcp.load_keys`'s reading: every value
    the keys select, on CPU at its saved dtype, nested along each fqn's
    path as torch nests it; keys that select nothing are no error (torch's:
    the dict is empty).  A checkpoint that records no paths gives a flat
    dict by fqn (see :func:`dcp.load_keys`)."""
    with _torch_terms():
        where = _location(checkpoint_id, storage_reader, "storage_reader")
        _storage_for(where)
        wanted = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
        return _read_selected(where, lambda md: _select_fqns(md, wanted),
                              process_group=process_group)


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike,
                      torch_save_path: str | os.PathLike) -> None:
    """torch's ``format_utils.dcp_to_torch_save`` over hyperdcp: every value
    of the checkpoint, on CPU at its saved dtype and nested as it was saved
    (:func:`_load_state_dict_from_keys`), written with ``torch.save`` to
    ``torch_save_path``.  Offline, in one process, as torch's; raises
    :class:`CheckpointError` (a ``RuntimeError`` too) for a path that
    holds no hyperdcp checkpoint."""
    import torch

    torch.save(_load_state_dict_from_keys(checkpoint_id=dcp_checkpoint_dir), torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike,
                      dcp_checkpoint_dir: str | os.PathLike) -> None:
    """torch's ``format_utils.torch_save_to_dcp`` over hyperdcp: the
    ``torch.save`` file read with ``torch.load(weights_only=True)`` (tensors,
    containers and plain values; no unpickling of other objects, unlike
    torch's) and saved with :func:`save` (``no_dist=True``: offline, in one
    process).  Raises :class:`CheckpointError` (a ``RuntimeError`` too)
    naming the file if it cannot be read or holds other objects, and as
    :func:`save` does."""
    import pickle

    import torch

    try:
        state_dict = torch.load(torch_save_path, map_location="cpu", weights_only=True)
    except (OSError, pickle.UnpicklingError, RuntimeError) as e:
        raise _in_torch_terms(CheckpointError(
            f"{os.fspath(torch_save_path)!r}: not a torch.save file of tensors and plain "
            f"values ({type(e).__name__}: {e})")) from e
    save(state_dict, checkpoint_id=dcp_checkpoint_dir, no_dist=True)


def load_sharded_optimizer_state_dict(model_state_dict: dict[str, Any], optimizer_key: str,
                                      storage_reader: Any, planner: Any = None) -> dict:
    """Refused, always raising :class:`CheckpointError`: torch's FSDP1
    helper builds the optimizer's ``ShardedTensor`` targets from torch DCP's
    pickled metadata, which a hyperdcp checkpoint does not have.  The
    message gives the way that works for FSDP1 and FSDP2 alike."""
    raise CheckpointError(
        f"dcp.compat.load_sharded_optimizer_state_dict is not supported: torch's builds the "
        f"optimizer's targets from torch DCP's pickled metadata. Make the target with "
        f"torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optim), load "
        f"{{{optimizer_key!r}: that}} with dcp.compat.load, then call "
        f"set_optimizer_state_dict(model, optim, that)")


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
    with _torch_terms():
        if async_stager is not None:
            raise CheckpointError(
                f"async_stager {type(async_stager).__name__} is not supported by dcp.compat: "
                f"hyperdcp stages into its own reused shared memory")
        kind = getattr(async_checkpointer_type, "value", async_checkpointer_type)
        if kind not in (None, "thread", "process"):
            raise CheckpointError(f"async_checkpointer_type {async_checkpointer_type!r} is not "
                                  f"supported (THREAD or PROCESS)")
        where = _location(checkpoint_id, storage_writer, "storage_writer")
        _storage_for(where)
        response = _async_save(state_dict, where, planner=_save_planner(planner),
                               process_group=_group(process_group, no_dist, use_collectives),
                               overwrite=_overwrite(storage_writer),
                               storage_options=_writer_options(storage_writer),
                               compression=_compression(storage_writer))
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def resolve(done: _AsyncSaveResponse) -> None:
        try:
            future.set_result(done.result())
        except CheckpointError as e:  # the save's failure, handed to the caller
            future.set_exception(_in_torch_terms(e))
        except BaseException as e:
            future.set_exception(e)

    response.add_done_callback(resolve)
    return future


def _module(name: str) -> types.ModuleType:
    """torch's module ``name`` of entry points (:data:`_MODULES`) as one of
    ours, its names taken from this module on first use (its refusals
    too), registered in ``sys.modules`` so that ``from
    dcp.compat.format_utils import dcp_to_torch_save`` works as torch's
    spelling does."""
    module = types.ModuleType(f"{__name__}.{name}", f"torch.distributed.checkpoint.{name}'s "
                              f"entry points over hyperdcp (dcp.compat).")
    names = _MODULES[name]

    def attr(key: str) -> Any:
        return getattr(sys.modules[__name__], key) if key in names else __getattr__(key)

    module.__dict__.update(__getattr__=attr, __all__=list(names))
    sys.modules[module.__name__] = module
    return module


for _name in _MODULES:
    globals()[_name] = _module(_name)
