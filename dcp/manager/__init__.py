"""The training loop's checkpoint layer: :class:`CheckpointManager`, its
save-decision and preservation policies, and per-rank state."""

from dcp.manager.manager import CheckpointManager, CheckpointWarning
from dcp.manager.per_rank import FromFirstRank, PerRank, SumOf
from dcp.manager.policies import (
    AnyOf,
    BestN,
    EveryNSteps,
    FixedInterval,
    Forced,
    LatestN,
    OnPreemption,
    SpecificSteps,
)
from dcp.manager.rng import DeriveRNG

__all__ = ["CheckpointManager", "CheckpointWarning", "PerRank", "FromFirstRank", "SumOf",
           "DeriveRNG",
           "AnyOf", "BestN", "EveryNSteps", "FixedInterval", "Forced", "LatestN",
           "OnPreemption", "SpecificSteps"]
