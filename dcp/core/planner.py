"""Planner interfaces: what each rank writes on save and reads on load.

Planning follows PyTorch DCP's split — local plans, a global plan made by one
coordinator, final local plans — but planners see only fqns, shapes, box
offsets/sizes, dtype names and byte counts, never tensors.  The standard
implementations live in the ``planners`` package and are found through the
``dcp.planners`` entry-point group (names ``save`` and ``load``); pass your
own instance to :func:`dcp.save` / :func:`dcp.load` to change the policy.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from dcp.errors import CheckpointError
from dcp.core.metadata import Metadata

PLANNER_GROUP = "dcp.planners"


@dataclass(frozen=True)
class TensorDecl:
    """A tensor's global ``shape`` (elements) and ``dtype`` name."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class WriteItem:
    """A chunk a rank holds and may write: the box ``(offsets, sizes)`` of
    ``fqn`` in global coordinates, ``nbytes`` long.  ``(fqn, offsets)``
    identifies the chunk: every holder of it holds the same bytes."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int


@dataclass
class SavePlan:
    """A rank's tensors and chunks: offered (local plan) or to write (final)."""

    tensors: dict[str, TensorDecl] = field(default_factory=dict)
    items: list[WriteItem] = field(default_factory=list)


class SavePlanner(abc.ABC):
    """Decides which rank writes which chunk."""

    #: Whether a save may reuse this planner's final plans while the state
    #: dict's structure and the planner's attributes stay the same
    #: (:mod:`dcp.coordination.plan_cache`): true only if :meth:`create_global_plan`
    #: depends on nothing else (no hidden state, no randomness, no clock).
    cacheable: bool = False

    def create_local_plan(self, plan: SavePlan) -> SavePlan:
        """Runs on every rank with everything the rank holds; returns what it
        offers to write.  The default offers every non-empty chunk."""
        return SavePlan(plan.tensors, [i for i in plan.items if i.nbytes > 0])

    @abc.abstractmethod
    def create_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Runs on the coordinator with every rank's local plan (index = rank);
        returns each rank's final plan: the chunks it must write.

        Must raise :class:`~dcp.errors.CheckpointError` naming the fqn and
        ranks when ranks disagree on a tensor's shape, dtype or chunks.
        """


@dataclass(frozen=True)
class ReadRequest:
    """A box a rank needs: ``(offsets, sizes)`` of ``fqn``, whose global
    shape and dtype in the target are ``shape`` and ``dtype``."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ReadItem:
    """Read the box ``(offsets, sizes)`` (global coordinates, ``nbytes``
    long) of chunk number ``chunk`` of ``fqn`` into request number
    ``request`` of this rank."""

    fqn: str
    request: int
    chunk: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Transfer:
    """One broadcast of regions read once from storage.

    Rank ``src`` of the replica group ``ranks`` (ranks of the load's process
    group) reads the regions and sends them to the other members.  ``items``
    are this rank's own :class:`ReadItem` for them; every member lists the
    same regions in the same order.  ``shared_memory``: the members share a
    host and pass the bytes through shared memory (:mod:`dcp.coordination.host_exchange`)
    instead of a ``torch.distributed`` broadcast.
    """

    ranks: tuple[int, ...]
    src: int
    items: tuple[ReadItem, ...]
    shared_memory: bool = False

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


@dataclass
class LoadPlan:
    """A rank's reads, and the keys that did not match the checkpoint.

    ``items`` are read from storage by this rank (those of transfers it is
    the source of included); ``transfers`` are the broadcasts it takes part
    in, in the order every member runs them; ``groups`` lists the replica
    groups of the load's broadcasts, which all ranks create in this order.
    ``host`` (set by the loader on local plans) names the rank's
    shared-memory domain: ranks with the same non-empty ``host`` can pass
    bytes through host shared memory.
    """

    items: list[ReadItem] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    groups: list[tuple[int, ...]] = field(default_factory=list)
    host: str = ""


class LoadPlanner(abc.ABC):
    """Decides which bytes each rank reads."""

    @abc.abstractmethod
    def create_local_plan(self, metadata: Metadata, requests: list[ReadRequest],
                          objects: list[str], *, strict: bool,
                          allow_dtype_cast: bool) -> LoadPlan:
        """Runs on every rank: match its ``requests`` (tensor boxes) and
        ``objects`` (fqns of non-tensor leaves) against ``metadata``.

        Must raise :class:`~dcp.errors.CheckpointError` for a shape mismatch
        (naming both shapes), a dtype mismatch unless ``allow_dtype_cast``,
        and, when ``strict``, for target keys missing from the checkpoint.
        """

    def create_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Runs on the coordinator with every rank's local plan; returns the
        final plans.  The default keeps each rank's own reads."""
        return plans


def default_planner(kind: str) -> SavePlanner | LoadPlanner:
    """A new instance of the planner registered as ``kind`` (``"save"`` or
    ``"load"``) in the ``dcp.planners`` entry-point group."""
    found = entry_points(group=PLANNER_GROUP, name=kind)
    if not found:
        raise CheckpointError(
            f"no {kind!r} planner is registered in the {PLANNER_GROUP!r} entry-point group "
            f"(is hyperdcp installed with pip?)")
    return next(iter(found)).load()()
