"""When to save and what to keep: small policy objects, combined any-of.

As in Orbax's checkpoint manager, a *save-decision* policy says whether a
step is saved (:class:`FixedInterval`, :class:`SpecificSteps`,
:class:`OnPreemption`, :class:`Forced`) and a *preservation* policy which
committed steps stay (:class:`LatestN`, :class:`EveryNSteps`,
:class:`BestN`).  :class:`AnyOf` combines either kind: a step is saved if
any decision says so, kept if any preservation policy keeps it.  A new rule
is a new class with one method, not a keyword threaded through the manager.

Whatever the preservation policies say, the manager never deletes the
newest complete step nor the step in flight (:func:`to_delete`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from dcp.errors import CheckpointError


def _count(policy: str, n: object, least: int) -> None:
    """Refuse a count that is not an integer of at least ``least``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise CheckpointError(f"{policy}: n must be an integer of at least {least}, not {n!r}")


@dataclass(frozen=True)
class SaveContext:
    """What a save decision sees: the ``step``, whether the caller
    ``forced`` it and whether any rank was ``preempted``."""

    step: int
    forced: bool = False
    preempted: bool = False


class SaveDecision(Protocol):
    def should_save(self, ctx: SaveContext) -> bool: ...


@dataclass(frozen=True)
class StepInfo:
    """A committed step as preservation policies see it: its number and the
    ``metrics`` the caller passed to ``save``."""

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)


class Preservation(Protocol):
    def keep(self, steps: list[StepInfo]) -> set[int]: ...


# ------------------------------------------------------------ save decisions
@dataclass(frozen=True)
class FixedInterval:
    """Save every ``interval`` steps (``step % interval == 0``)."""

    interval: int

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise CheckpointError(f"the save interval must be at least 1, not {self.interval}")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.interval == 0


@dataclass(frozen=True)
class SpecificSteps:
    """Save exactly these steps."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(steps))

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps


class OnPreemption:
    """Save when any rank received SIGTERM (the "last words")."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.preempted


class Forced:
    """Save when the caller passes ``force=True``."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.forced


# ------------------------------------------------------ preservation policies
@dataclass(frozen=True)
class LatestN:
    """Keep the newest ``n`` committed steps (``0``: keep all)."""

    n: int

    def __post_init__(self) -> None:
        _count("LatestN (keep_latest)", self.n, 0)

    def keep(self, steps: list[StepInfo]) -> set[int]:
        ordered = sorted(s.step for s in steps)
        return set(ordered if self.n == 0 else ordered[-self.n:])


@dataclass(frozen=True)
class EveryNSteps:
    """Keep every step that is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        _count("EveryNSteps (keep_every)", self.n, 1)

    def keep(self, steps: list[StepInfo]) -> set[int]:
        return {s.step for s in steps if s.step % self.n == 0}


@dataclass(frozen=True)
class BestN:
    """Keep the ``n`` steps with the best ``metric`` (``mode="min"``: the
    lowest, ``"max"``: the highest), among those saved with it; ties go to
    the newer step."""

    metric: str
    n: int
    mode: str = "min"

    def __post_init__(self) -> None:
        _count("BestN", self.n, 1)
        if self.mode not in ("min", "max"):
            raise CheckpointError(f"BestN mode must be 'min' or 'max', not {self.mode!r}")

    def keep(self, steps: list[StepInfo]) -> set[int]:
        scored = [s for s in steps if self.metric in s.metrics]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda s: (sign * float(s.metrics[self.metric]), -s.step))
        return {s.step for s in scored[:self.n]}


# ----------------------------------------------------------------- combined
class AnyOf:
    """Any-of over decisions (save if one says so) or over preservation
    policies (keep what one keeps)."""

    def __init__(self, *policies) -> None:
        self.policies = policies

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)

    def keep(self, steps: list[StepInfo]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return kept

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


def to_delete(preservation: Preservation, complete: list[StepInfo],
              in_flight: int | None = None) -> list[int]:
    """The committed steps ``preservation`` lets go, never the newest one
    nor ``in_flight``."""
    if not complete:
        return []
    newest = max(s.step for s in complete)
    kept = preservation.keep(complete) | {newest}
    return sorted(s.step for s in complete if s.step not in kept and s.step != in_flight)
