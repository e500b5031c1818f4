"""hyperdcp: distributed checkpointing for large-model training in PyTorch.

Three layers — planner, storage, metadata.  Each rank saves only its own
shards; one coordinator deduplicates replicated chunks and balances the
writes; the metadata (JSON, never pickle) is committed last and atomically.
Loading intersects the boxes each rank needs with the saved chunks, so a
checkpoint loads into any other parallel layout.

Public API: :func:`save`, :func:`async_save`, :func:`load`,
:func:`read_metadata`, :class:`TensorShard`, :class:`Metadata`,
:class:`LoadReport`, :class:`AsyncSaveResponse`, :class:`CheckpointError`;
:class:`CheckpointManager` (:mod:`dcp.manager`) for a training loop.
MindSpore ``Tensor``/``Parameter`` leaves save and load like torch tensors
(:mod:`dcp.core.mindspore_tensors`); :func:`mindspore_shard`
(:mod:`dcp.core.mindspore_layout`) describes a
sharded MindSpore parameter's slice.
"""

from dcp.asynchronous.async_save import (
    AsyncSaveCounters,
    AsyncSaveResponse,
    AsyncSaveStats,
    AsyncSaveTimeout,
    async_save,
    async_save_counters,
)
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
from dcp.orchestration.load import LoadReport, load, read_metadata
from dcp.orchestration.save import save
from dcp.recovery import MemoryTier, RestoreReport

__all__ = [
    "save", "load", "read_metadata", "TensorShard", "Metadata", "TensorMeta", "ChunkMeta",
    "ObjectMeta", "LoadReport", "CheckpointError", "CorruptCheckpointError",
    "NotACheckpointError", "UnsupportedDtypeError", "MemoryTier", "RestoreReport",
    "MemoryTierError", "SilentDataCorruptionError", "mindspore_shard", "async_save",
    "AsyncSaveResponse", "AsyncSaveStats",
    "AsyncSaveCounters", "AsyncSaveTimeout", "async_save_counters",
    "CheckpointManager", "CheckpointWarning", "PerRank", "FromFirstRank", "SumOf", "DeriveRNG",
    "AnyOf",
    "BestN", "EveryNSteps", "FixedInterval", "Forced", "LatestN", "OnPreemption",
    "SpecificSteps",
]
