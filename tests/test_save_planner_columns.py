"""The vectorized save planner makes the reference planner's plans, item for
item (same assignment rule and tie-breaks), on the scale layout and on
random layouts, and raises the same errors."""

from __future__ import annotations

import random

import pytest

from benchmarks.coordination import layout_for
from benchmarks.scale import local_plans
from dcp.core.planner import SavePlan, TensorDecl, WriteItem
from dcp.errors import CheckpointError
from planners.save import DefaultSavePlanner

SETTINGS = [{}, {"save_to_minimum_rank": True}, {"split_replicated": False},
            {"min_piece_bytes": 64, "tolerance": 0.0}, {"min_piece_bytes": 1}]


def same(plans: list[SavePlan], **settings) -> list[SavePlan]:
    planner = DefaultSavePlanner(**settings)
    fast, reference = planner.create_global_plan(plans), planner.reference_global_plan(plans)
    assert fast == reference
    return fast


@pytest.mark.parametrize("ranks", [128, 256])
def test_scale_layout(ranks):
    plans = local_plans(layout_for(ranks))
    for settings in SETTINGS:
        same(plans, **settings)


def random_plans(rng: random.Random, world: int) -> list[SavePlan]:
    plans = [SavePlan() for _ in range(world)]
    for t in range(rng.randint(1, 12)):
        ndim = rng.choice([0, 1, 2, 3])
        shape = tuple(rng.randint(1, 9) for _ in range(ndim))
        fqn = f"t{rng.randint(0, 99)}.{t}"
        decl = TensorDecl(shape, rng.choice(["float32", "bfloat16"]))
        itemsize = 4 if decl.dtype == "float32" else 2
        parts = rng.randint(1, min(4, shape[0])) if ndim else 1
        step = -(-shape[0] // parts) if ndim else 0
        for k in range(parts):  # split along dim 0, each part held by some ranks
            lo = min(shape[0], k * step) if ndim else 0
            rows = min(step, shape[0] - lo) if ndim else 0
            offsets = (lo, *[0] * (ndim - 1)) if ndim else ()
            sizes = (rows, *shape[1:]) if ndim else ()
            n = 1
            for s in sizes:
                n *= s
            holders = rng.sample(range(world), min(world, rng.choice([1, 1, 2, world,
                                                                    rng.randint(1, world)])))
            for r in range(world):  # every rank declares the tensor; holders hold the part
                plans[r].tensors[fqn] = decl
            for r in holders:
                if n:
                    plans[r].items.append(WriteItem(fqn, offsets, sizes, n * itemsize))
    for plan in plans:
        rng.shuffle(plan.items)
    return plans


@pytest.mark.parametrize("seed", range(60))
def test_random_layouts(seed):
    rng = random.Random(seed)
    plans = random_plans(rng, rng.randint(1, 9))
    for settings in SETTINGS:
        try:
            same(plans, **settings)
        except CheckpointError as e:  # both raise the same error
            with pytest.raises(CheckpointError) as ref:
                DefaultSavePlanner(**settings).reference_global_plan(plans)
            assert str(ref.value) == str(e)


def errors(plans):
    out = []
    for fn in ("create_global_plan", "reference_global_plan"):
        with pytest.raises(CheckpointError) as e:
            getattr(DefaultSavePlanner(), fn)(plans)
        out.append(str(e.value))
    assert out[0] == out[1]
    return out[0]


def test_errors_and_rare_inputs_match():
    d = {"w": TensorDecl((4, 2), "float32")}
    a, b = WriteItem("w", (0, 0), (2, 2), 16), WriteItem("w", (2, 0), (2, 2), 16)
    other = WriteItem("w", (0, 0), (1, 2), 8)
    assert "sizes" in errors([SavePlan(d, [a, b]), SavePlan(d, [other])])
    assert "cover" in errors([SavePlan(d, [a]), SavePlan(d, [a])])
    assert "shape" in errors([SavePlan(d, [a, b]), SavePlan({"w": TensorDecl((4, 3), "float32")},
                                                            [a, b])])
    same([SavePlan(d, [a, b, a]), SavePlan(d, [a])])  # a rank offering a chunk twice
    same([SavePlan(d, []), SavePlan(d, [a, b])])
    same([SavePlan({"s": TensorDecl((), "float32")}, [WriteItem("s", (), (), 4)])] * 3)


def test_overlapping_boxes_of_the_whole_volume_are_refused():
    """DTensor.from_local(..., shape=(4, 1)) over local shards of 3 and 1
    rows on 2 ranks, placed by the placements' offsets (as dcp.async_save
    places them) at rows 0 and 2, so
    they overlap at row 2 and miss row 3 while their elements add up to 4.
    Refused (naming the tensor and both ranks) instead of committed."""
    d = {"w": TensorDecl((4, 1), "float32"), "v": TensorDecl((2, 2), "float32")}
    v0, v1 = WriteItem("v", (0, 0), (2, 1), 8), WriteItem("v", (0, 1), (2, 1), 8)
    r0 = SavePlan(d, [v0, WriteItem("w", (0, 0), (3, 1), 12)])
    r1 = SavePlan(d, [v1, WriteItem("w", (2, 0), (1, 1), 4)])
    message = errors([r0, r1])
    assert message.startswith("'w': the chunk of sizes [3, 1] at offsets [0, 0] on rank(s) [0] "
                              "overlaps the chunk of sizes [1, 1] at offsets [2, 0] on rank(s) [1]")
    tiled = [SavePlan(d, [v0, WriteItem("w", (0, 0), (3, 1), 12)]),
             SavePlan(d, [v1, WriteItem("w", (3, 0), (1, 1), 4)])]
    same(tiled)  # the same shards at offsets that tile are planned
    # 2-D: a column band and two boxes beside it, the last overlapping the band
    g = {"g": TensorDecl((4, 4), "float32")}
    band, top = WriteItem("g", (0, 0), (4, 2), 32), WriteItem("g", (0, 2), (2, 2), 16)
    inside, beside = WriteItem("g", (2, 1), (2, 2), 16), WriteItem("g", (2, 2), (2, 2), 16)
    assert "overlaps the chunk of sizes [2, 2] at offsets [2, 1] on rank(s) [2]" in errors(
        [SavePlan(g, [band]), SavePlan(g, [top]), SavePlan(g, [inside])])
    same([SavePlan(g, [band]), SavePlan(g, [top]), SavePlan(g, [beside])])
