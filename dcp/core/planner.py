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
import functools
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Literal, overload

from dcp.core import read_plan
from dcp.core.metadata import Metadata
from dcp.core.read_cost import ReadCost
from dcp.errors import CheckpointError

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
    ``request`` of this rank.

    Of a compressed chunk, the frames covering the box are read and
    decoded: ``stored_nbytes`` is their bytes in the data file and
    ``decode_nbytes`` the logical bytes of those of them that are coded
    (frames stored raw are copied, not decoded).  Both are 0 for a chunk
    stored as it is, whose ``nbytes`` are read.
    """

    fqn: str
    request: int
    chunk: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    stored_nbytes: int = 0
    decode_nbytes: int = 0

    @property
    def read_nbytes(self) -> int:
        """Bytes its read takes from storage: the covering frames' stored
        bytes of a compressed chunk, else ``nbytes``."""
        return self.stored_nbytes or self.nbytes

    def seconds(self, cost: ReadCost) -> float:
        """Estimated seconds its read and decoding take one reader thread
        on storage of ``cost`` (:meth:`~dcp.core.read_cost.ReadCost.seconds`)."""
        return cost.seconds(self.read_nbytes, self.decode_nbytes)


@dataclass(frozen=True)
class Transfer:
    """One broadcast of regions read once from storage.

    Rank ``src`` of the replica group ``ranks`` (ranks of the load's process
    group) reads the regions and sends them to the other members.  ``items``
    are this rank's own :class:`ReadItem` for them; every member lists the
    same regions in the same order.  ``shared_memory``: the members share a
    host and pass the bytes through shared memory (:mod:`dcp.coordination.host_exchange`)
    instead of a ``torch.distributed`` broadcast.  ``whole_chunk``: the
    source reads the one chunk its items lie in whole and sends all of it,
    and each member takes its own regions (``items``, which then differ
    between members) out of it — a chunk read once per host for a resharded
    load (shared memory only).
    """

    ranks: tuple[int, ...]
    src: int
    items: tuple[ReadItem, ...]
    shared_memory: bool = False
    whole_chunk: bool = False

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


#: The paths a region read once per replica group takes to the other
#: members: every member reads it itself after one has pulled it into the
#: host's shared cache; through host shared memory; by broadcast.
PAGE_CACHE, SHARED_MEMORY, BROADCAST = "page_cache", "shared_memory", "broadcast"


@dataclass
class LoadPlan:
    """A rank's reads, and the keys that did not match the checkpoint.

    ``items`` are read from storage by this rank (those of transfers it is
    the source of included); ``cached`` are read by this rank too, but after
    another member of its host has pulled them into the storage's shared
    cache (the page cache path: a memory copy, not a storage read);
    ``transfers`` are the broadcasts it takes part in, in the order every
    member runs them; ``groups`` lists the replica groups of the load's
    broadcasts, which all ranks create in this order.  ``paths`` (the same
    on every rank) says, per replica group ``ranks``, which path its regions
    took and how many bytes went each way: ``(ranks, path, nbytes)``
    (logical bytes; ``"storage"``: the bytes read from storage, the
    covering frames' stored bytes for compressed chunks).  On storage whose
    cache a host shares, one group's regions may go two ways: those of
    compressed chunks decoded once per host and passed on through
    ``shared_memory``, the others re-read by each rank through the
    ``page_cache``.

    ``whole_chunks`` (local plans) lists the chunks ``(fqn, chunk, nbytes)``
    this rank reads whole for a part of them; ``checks`` (final plans), on
    storage whose cache the host shares, the chunks whose CRC-32C this rank
    checks for its host: a chunk read whole by several ranks of one host is
    checked once, by one of them, on the same cached bytes.  ``None``: no
    such designation, every rank checks every chunk it reads whole.
    ``host_ranks`` (final plans): how many ranks of the load share this
    rank's host (they share its cores when reading from its page cache).

    Set by the loader on local plans: ``host`` names the rank's host (ranks
    with the same non-empty ``host`` share its page cache and shared
    memory); ``shared_memory`` whether the rank can receive through host
    shared memory (it takes part in a load of several ranks and knows its
    host); ``shared_cache`` is the storage's
    :attr:`~dcp.core.read_cost.ReadCost.shared_cache`, and ``read_cost``
    its whole read cost, by which the global plan prices each region's
    read (:meth:`ReadItem.seconds`).
    """

    items: list[ReadItem] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    groups: list[tuple[int, ...]] = field(default_factory=list)
    cached: list[ReadItem] = field(default_factory=list)
    paths: list[tuple[tuple[int, ...], str, int]] = field(default_factory=list)
    host_ranks: int = 1
    whole_chunks: list[tuple[str, int, int]] = field(default_factory=list)
    checks: list[tuple[str, int]] | None = None
    host: str = ""
    shared_memory: bool = False
    shared_cache: bool = False
    read_cost: ReadCost = field(default_factory=ReadCost)


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

    def read_whole_chunk(self, chunk_nbytes: int, extents: list[tuple[int, int, int]],
                         cost: ReadCost) -> bool:
        """Runs on every rank, per chunk of which it needs only some regions,
        whose byte runs lie at ``extents`` (chunk-relative ``(start, end,
        longest gap)`` per region, :func:`dcp.core.boxes.run_extent`):
        whether to read the chunk whole (and check its CRC-32C).  The
        default: :func:`dcp.core.read_plan.whole_chunk_cheaper`."""
        return read_plan.whole_chunk_cheaper(chunk_nbytes, extents, cost)

    def create_requests(self, runs: list[read_plan.Run],
                        cost: ReadCost) -> list[read_plan.Request]:
        """Runs on every rank, per data file: the storage requests that read
        ``runs``.  The default coalesces them by the storage's read cost
        (:func:`dcp.core.read_plan.coalesce`)."""
        return read_plan.coalesce(runs, cost)


@overload
def default_planner(kind: Literal["save"]) -> SavePlanner: ...


@overload
def default_planner(kind: Literal["load"]) -> LoadPlanner: ...


def default_planner(kind: str) -> SavePlanner | LoadPlanner:
    """A new instance of the planner registered as ``kind`` (``"save"`` or
    ``"load"``) in the ``dcp.planners`` entry-point group."""
    return _registered_planner(kind)()


@functools.cache
def _registered_planner(kind: str) -> type:
    """The planner class registered as ``kind``, looked up once per process
    (as the storage plugins are): scanning the installed packages' entry
    points takes 8-20 ms here, 30-60 ms with four ranks on two cores — on
    every save and load otherwise."""
    found = entry_points(group=PLANNER_GROUP, name=kind)
    if not found:
        raise CheckpointError(
            f"no {kind!r} planner is registered in the {PLANNER_GROUP!r} entry-point group "
            f"(is hyperdcp installed with pip?)")
    return next(iter(found)).load()
