"""The standard load planner: match keys, then intersect boxes.

Each box a rank needs is intersected with every saved chunk of its tensor as
N-dimensional half-open boxes; only the intersections are read, so a
checkpoint saved with one layout (TP8, Shard(0), ...) loads into another
(TP4, Shard(1), ...) without offline conversion and without reading whole
chunks for a slice.
"""

from __future__ import annotations

from dcp.boxes import intersect, volume
from dcp.errors import CheckpointError
from dcp.metadata import Metadata
from dcp.planner import LoadPlan, LoadPlanner, ReadItem, ReadRequest


class DefaultLoadPlanner(LoadPlanner):
    """Strict key matching and box intersection."""

    def create_local_plan(self, metadata: Metadata, requests: list[ReadRequest],
                          objects: list[str], *, strict: bool,
                          allow_dtype_cast: bool) -> LoadPlan:
        plan = LoadPlan()
        wanted = {r.fqn for r in requests} | set(objects)
        plan.unexpected_keys = [f for f in metadata.fqns() if f not in wanted]
        plan.missing_keys = [f for f in objects if f not in metadata.objects]
        for index, req in enumerate(requests):
            saved = metadata.tensors.get(req.fqn)
            if saved is None:
                plan.missing_keys.append(req.fqn)
                continue
            if saved.shape != req.shape:
                raise CheckpointError(
                    f"{req.fqn!r}: checkpoint shape {list(saved.shape)} != target shape "
                    f"{list(req.shape)}")
            if saved.dtype != req.dtype and not allow_dtype_cast:
                raise CheckpointError(
                    f"{req.fqn!r}: checkpoint dtype {saved.dtype} != target dtype {req.dtype} "
                    f"(pass allow_dtype_cast=True to cast)")
            found = 0
            for number, chunk in enumerate(saved.chunks):
                box = intersect(req.offsets, req.sizes, chunk.offsets, chunk.sizes)
                if box is not None:
                    plan.items.append(ReadItem(req.fqn, index, number, *box))
                    found += volume(box[1])
            if found != volume(req.sizes):
                raise CheckpointError(
                    f"{req.fqn!r}: the checkpoint's chunks cover {found} of the "
                    f"{volume(req.sizes)} elements needed at offsets {list(req.offsets)}")
        if strict and plan.missing_keys:
            raise CheckpointError(
                f"{len(plan.missing_keys)} key(s) of the target are not in the checkpoint: "
                f"{', '.join(plan.missing_keys)} (pass strict=False to load the rest)")
        return plan
