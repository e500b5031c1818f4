"""hyperdcp: distributed checkpointing for large-model training in PyTorch.

Three layers — planner, storage, metadata.  Each rank saves only its own
shards; one coordinator deduplicates replicated chunks and balances the
writes; the metadata (JSON, never pickle) is committed last and atomically.
Loading intersects the boxes each rank needs with the saved chunks, so a
checkpoint loads into any other parallel layout.

Public API: :func:`save`, :func:`async_save`, :func:`load`,
:func:`load_keys`, :func:`read_metadata`, :class:`TensorShard`, :class:`Metadata`,
:class:`LoadReport`, :class:`AsyncSaveResponse`, :class:`CheckpointError`;
:class:`CheckpointManager` (:mod:`dcp.manager`) for a training loop.
MindSpore ``Tensor``/``Parameter`` leaves save and load like torch tensors
(:mod:`dcp.core.mindspore_tensors`); :func:`mindspore_shard`
(:mod:`dcp.core.mindspore_layout`) describes a
sharded MindSpore parameter's slice.

The names are imported on first use (a module ``__getattr__``, PEP 562):
``import dcp`` loads neither torch nor a layer, so the ``hyperdcp`` command
and a job that only imports ``dcp`` start in tenths of a second; the first
name used (``dcp.save``) imports its module and what that needs, torch
included.  Type checkers see the imports of the ``TYPE_CHECKING`` block.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dcp.asynchronous.async_save import (
        AsyncSaveCounters,
        AsyncSaveResponse,
        AsyncSaveStats,
        AsyncSaveTimeout,
        async_save,
        async_save_counters,
        prestart_async_worker,
    )
    from dcp.core.compression import Compression
    from dcp.core.metadata import ChunkMeta, Metadata, ObjectMeta, TensorMeta
    from dcp.core.mindspore_layout import mindspore_shard
    from dcp.core.tensors import TensorShard
    from dcp.errors import (
        CheckpointError,
        CorruptCheckpointError,
        MemoryTierError,
        NotACheckpointError,
        SilentDataCorruptionError,
        UnsupportedDtypeError,
    )
    from dcp.manager import (
        AnyOf,
        BestN,
        CheckpointManager,
        CheckpointWarning,
        DeriveRNG,
        EveryNSteps,
        FixedInterval,
        Forced,
        FromFirstRank,
        LatestN,
        OnPreemption,
        PerRank,
        SpecificSteps,
        SumOf,
    )
    from dcp.orchestration.load import LoadReport, load, load_keys, read_metadata
    from dcp.orchestration.save import save
    from dcp.recovery import MemoryTier, RestoreReport

__all__ = [
    "save", "load", "load_keys", "read_metadata", "TensorShard", "Metadata", "TensorMeta",
    "ChunkMeta", "ObjectMeta", "LoadReport", "CheckpointError", "CorruptCheckpointError",
    "NotACheckpointError", "UnsupportedDtypeError", "MemoryTier", "RestoreReport",
    "MemoryTierError", "SilentDataCorruptionError", "mindspore_shard", "async_save",
    "AsyncSaveResponse", "AsyncSaveStats",
    "AsyncSaveCounters", "AsyncSaveTimeout", "async_save_counters", "prestart_async_worker",
    "CheckpointManager", "CheckpointWarning", "PerRank", "FromFirstRank", "SumOf", "DeriveRNG",
    "AnyOf",
    "BestN", "EveryNSteps", "FixedInterval", "Forced", "LatestN", "OnPreemption",
    "SpecificSteps", "Compression",
]

#: Each module and the public names imported from it on first use: the
#: ``TYPE_CHECKING`` block's, name for name (tests/test_startup.py checks).
_HOMES = {
    "dcp.asynchronous.async_save": ("AsyncSaveCounters", "AsyncSaveResponse", "AsyncSaveStats",
                                    "AsyncSaveTimeout", "async_save", "async_save_counters",
                                    "prestart_async_worker"),
    "dcp.core.compression": ("Compression",),
    "dcp.core.metadata": ("ChunkMeta", "Metadata", "ObjectMeta", "TensorMeta"),
    "dcp.core.mindspore_layout": ("mindspore_shard",),
    "dcp.core.tensors": ("TensorShard",),
    "dcp.errors": ("CheckpointError", "CorruptCheckpointError", "MemoryTierError",
                   "NotACheckpointError", "SilentDataCorruptionError", "UnsupportedDtypeError"),
    "dcp.manager": ("AnyOf", "BestN", "CheckpointManager", "CheckpointWarning", "DeriveRNG",
                    "EveryNSteps", "FixedInterval", "Forced", "FromFirstRank", "LatestN",
                    "OnPreemption", "PerRank", "SpecificSteps", "SumOf"),
    "dcp.orchestration.load": ("LoadReport", "load", "load_keys", "read_metadata"),
    "dcp.orchestration.save": ("save",),
    "dcp.recovery": ("MemoryTier", "RestoreReport"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
#: The layers that ``dcp.X`` reaches without an ``import dcp.X`` (as when
#: ``import dcp`` loaded them all).
_LAYERS = ("asynchronous", "coordination", "core", "errors", "manager", "orchestration")

if not TYPE_CHECKING:  # hidden from type checkers: a misspelt dcp.X stays an error there
    def __getattr__(name: str):
        """``dcp.NAME``: the public name, imported from its module on first
        use and kept as this module's attribute; or one of the layers.
        ``AttributeError`` for any other name."""
        if name in _LAYERS:
            return importlib.import_module(f"{__name__}.{name}")
        if name not in _HOME_OF:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(_HOME_OF[name]), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_LAYERS})
