"""Checkpoints saved without any cross-rank traffic (``coordination="none"``),
and reading a checkpoint's metadata whichever way it was committed.

Without traffic no coordinator can deduplicate, so a fixed rule decides who
writes a chunk held by several ranks: rank ``r`` writes the chunk ``(fqn,
offsets)`` when its replica slot ``(index, count)``
(:func:`dcp.core.tensors.replica_slot`) satisfies ``index == crc32(fqn@offsets)
% count``.  Plain tensors are replicated on every rank of the group by
definition, so each is written by one rank, spread by the hash; a DTensor's
replicas are the ranks that differ only on its ``Replicate`` mesh dimensions,
which every rank derives from the mesh; a :class:`~dcp.TensorShard`'s
replicas are unknowable, so every holder writes it and reading keeps one.  A
non-tensor value is written by rank ``crc32(fqn) % world_size``.  Unlike a
coordinated save, nothing checks that replicas are equal, and a plain tensor
that is not held by every rank of the group (pipeline stages) may be lost:
reading then refuses the checkpoint, naming the tensor.

Each rank commits its own metadata file ``metadata.rankRRRRR.json``
atomically, last; the checkpoint exists once all ``world_size`` of them carry
the same save id.  :func:`read_metadata_bytes` merges them.
"""

from __future__ import annotations

import re
import zlib

from dcp.core.boxes import volume
from dcp.core.metadata import (
    METADATA_FILE,
    TORCH_METADATA_FILE,
    Metadata,
    TensorMeta,
    decode,
    encode,
    rank_metadata_file,
)
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from dcp.orchestration.save import SaveState, _Save, data_file_prefix


def _writes(slot: tuple[int, int], fqn: str, offsets: tuple[int, ...]) -> bool:
    index, count = slot
    return index == zlib.crc32(f"{fqn}@{list(offsets)}".encode()) % count


class IndependentSave(_Save):
    """A save whose every step is local (use with a
    :class:`~dcp.coordination.collectives.LocalCoordinator`): this rank writes the chunks
    and values the rule gives it and commits its own metadata file."""

    def __init__(self, describe, *args, **kwargs) -> None:
        super().__init__(lambda: self._owned(describe()), *args, **kwargs)
        self.metadata_file = rank_metadata_file(self.coord.rank)

    def _owned(self, state: SaveState) -> SaveState:
        """The part of ``state`` this rank writes."""
        rank, world = self.coord.rank, self.coord.world_size
        return SaveState(
            chunks={key: c for key, c in state.chunks.items() if _writes(state.slots[key], *key)},
            json_values={fqn: text for fqn, text in state.json_values.items()
                         if zlib.crc32(fqn.encode()) % world == rank},
            pickled={fqn: blob for fqn, blob in state.pickled.items()
                     if zlib.crc32(fqn.encode()) % world == rank},
            paths=state.paths)

    def global_plan(self, plans):
        """No coordinator: the planner's local plan is final (its global
        step, which needs every rank's plan, does not run)."""
        self.check_target()
        for plan in plans:
            self.decls.update(plan.tensors)
        return plans

    def check_target(self) -> None:
        if self.storage.exists(METADATA_FILE):
            raise CheckpointError(
                f"{self.storage.checkpoint_id!r} holds a checkpoint committed by a coordinated "
                f"save; a coordination='none' save cannot replace it atomically: use another path")
        if not self.overwrite and self.storage.exists(self.metadata_file):
            raise CheckpointError(
                f"{self.storage.checkpoint_id!r} already holds {self.metadata_file!r} of a "
                f"committed checkpoint; pass overwrite=True to replace it")

    def _owns(self, name: str) -> bool:
        return name.startswith(data_file_prefix(self.coord.rank))


def has_metadata(storage: StoragePlugin) -> bool:
    """Whether ``storage`` holds metadata :func:`read_metadata_bytes` reads:
    a committed ``metadata.json``, or rank 0's file of an uncoordinated save
    (existence only; reading it still checks that the save completed)."""
    return storage.exists(METADATA_FILE) or storage.exists(rank_metadata_file(0))


def what_is_there(storage: StoragePlugin) -> str:
    """What a location without committed metadata holds, for the message
    that says it is not a checkpoint: nothing (a missing path), the files of
    an interrupted save, checkpoints in its subfolders (a root), or other
    files."""
    from dcp.orchestration.inventory import file_kind

    try:
        names = storage.list_files()
    except NotADirectoryError:
        return f"it is a file, not a folder (a checkpoint is a folder holding {METADATA_FILE})"
    except Exception as e:  # the message is about the missing metadata: say what we could
        return f"no committed {METADATA_FILE}, and listing it failed ({type(e).__name__}: {e})"
    if TORCH_METADATA_FILE in names:
        return (f"it is a PyTorch DCP checkpoint ({TORCH_METADATA_FILE}, a pickle): convert it "
                f"once, if you trust it, with `hyperdcp convert --trust-pickle "
                f"{storage.checkpoint_id} DST` and load DST (or load it with "
                f"torch.distributed.checkpoint)")
    if not names:
        exists = storage.location_exists()
        if exists is None:
            return "nothing is stored there (no object under that prefix)"
        if not exists:
            return "that path does not exist (nothing was ever saved there)"
        return "it is an empty folder"
    ours = [n for n in names if file_kind(n) is not None]
    if ours:
        return (f"it holds {len(ours)} file(s) of a save that never committed (no "
                f"{METADATA_FILE}): the save was interrupted, or is still in flight; "
                f"`hyperdcp prune {storage.checkpoint_id}` deletes what an interrupted save "
                f"left")
    below = sorted({n.rsplit("/", 1)[0] for n in names if "/" in n
                    and file_kind(n.rsplit("/", 1)[1]) == "metadata"}, key=_natural)
    if below:
        shown = ", ".join(below[:5]) + (", ..." if len(below) > 5 else "")
        return (f"it is a folder of {len(below)} checkpoint(s) ({shown}); pass one of them "
                f"(`hyperdcp list {storage.checkpoint_id}` lists them)")
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (f"it exists but holds no committed {METADATA_FILE} nor {rank_metadata_file(0)}, "
            f"only {len(names)} other file(s) ({shown})")


def _natural(name: str) -> list:
    """Sort key putting ``step-5`` before ``step-10``: digit runs by value."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def read_metadata_bytes(storage: StoragePlugin) -> bytes:
    """The checkpoint's encoded metadata: the committed ``metadata.json`` of a
    coordinated save, else the merge of the per-rank files of a
    ``coordination="none"`` save.

    Raises:
        NotACheckpointError: neither is there, or some rank's file is missing
            or belongs to another save (the save did not complete).
        CorruptCheckpointError: a file is malformed, or the ranks' files
            disagree on a tensor or leave part of one unsaved.
    """
    try:
        return storage.read_file(METADATA_FILE)
    except (FileNotFoundError, NotADirectoryError):  # none, or the root is a file
        pass
    where = f"{storage.checkpoint_id}/{rank_metadata_file(0)}"
    try:
        first = decode(storage.read_file(rank_metadata_file(0)), where)
    except (FileNotFoundError, NotADirectoryError):
        raise NotACheckpointError(
            f"{storage.checkpoint_id!r} is not a checkpoint: {what_is_there(storage)}") from None
    parts, missing = [first], []
    for rank in range(1, first.world_size):
        name = rank_metadata_file(rank)
        try:
            md = decode(storage.read_file(name), f"{storage.checkpoint_id}/{name}")
        except FileNotFoundError:
            md = None
        if md is None or md.save_id != first.save_id:
            missing.append(rank)
        else:
            parts.append(md)
    if missing:
        raise NotACheckpointError(
            f"{storage.checkpoint_id!r} is an incomplete checkpoint: rank(s) "
            f"{', '.join(map(str, missing))} of {first.world_size} never committed save "
            f"{first.save_id} (the save failed or is still in flight)")
    return encode(_merge(parts, storage.checkpoint_id))


def _merge(parts: list[Metadata], checkpoint_id: str) -> Metadata:
    merged = Metadata(save_id=parts[0].save_id, world_size=parts[0].world_size)
    for rank, md in enumerate(parts):
        for fqn, t in md.tensors.items():
            seen = merged.tensors.setdefault(fqn, TensorMeta(t.shape, t.dtype))
            if (seen.shape, seen.dtype) != (t.shape, t.dtype):
                raise CorruptCheckpointError(
                    f"{checkpoint_id!r}: {fqn!r} is {list(seen.shape)} {seen.dtype} in the "
                    f"metadata of an earlier rank but {list(t.shape)} {t.dtype} in rank {rank}'s")
            have = {c.offsets for c in seen.chunks}
            seen.chunks.extend(c for c in t.chunks if c.offsets not in have)
        for fqn, obj in md.objects.items():
            merged.objects.setdefault(fqn, obj)
        if md.paths is not None:
            merged.paths = {**md.paths, **(merged.paths or {})}
    for fqn, t in merged.tensors.items():
        t.chunks.sort(key=lambda c: c.offsets)
        covered = sum(volume(c.sizes) for c in t.chunks)
        if covered != volume(t.shape):
            raise CorruptCheckpointError(
                f"{checkpoint_id!r}: the ranks' chunks of {fqn!r} cover {covered} of its "
                f"{volume(t.shape)} elements (a plain tensor not held by every rank of the "
                f"group cannot be saved with coordination='none')")
    return merged
