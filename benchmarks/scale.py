"""Planning and metadata at the scale of ten thousand ranks, in one process.

A 505B-parameter-class decoder (96 layers, hidden 20480, FFN 4x, vocab 128k)
laid out as tensor parallel x pipeline parallel x data parallel, weights
(bf16) replicated over DP and the optimizer state (fp32 exp_avg, exp_avg_sq
and master weights) sharded over DP along dim 0 as ZeRO-1 does.  Synthetic
local plans of every rank go through the real code paths of a save —
``DefaultSavePlanner.create_global_plan``, ``dcp.orchestration.save.build_metadata``,
``dcp.core.metadata.encode`` — and of a load — ``dcp.core.metadata.decode``,
``DefaultLoadPlanner.create_local_plan`` for one rank of another layout
(resharding TP8 -> TP4, DP x2) and ``create_global_plan`` for the ranks of one
pipeline stage (broadcast readers).  No process or tensor is created: only the planning
and metadata costs, which grow with ranks and chunks, are measured.

    python -m benchmarks.scale [--ranks 1024 4096 10240 16384] [--repeat 1]
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path

from dcp.core.metadata import ChunkMeta, decode, encode
from dcp.core.planner import ReadRequest, SavePlan, TensorDecl, WriteItem
from dcp.orchestration.save import WriteResult, build_metadata
from planners.load import DefaultLoadPlanner
from planners.save import DefaultSavePlanner

from .report import Column, TargetResult, markdown_table, median_range, summarize_runs, write_table

HIDDEN, LAYERS, VOCAB = 20480, 96, 128000
_ITEMSIZE = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Layout:
    """``tp`` x ``pp`` x ``dp`` ranks; rank = (pp * dp + d) * tp + t."""

    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        t = rank % self.tp
        d = (rank // self.tp) % self.dp
        return t, rank // (self.tp * self.dp), d


def _tensors(stage: int, pp: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, global shape, dim sharded over TP or None) of one PP stage."""
    per = LAYERS // pp
    h = HIDDEN
    out = []
    if stage == 0:
        out.append(("embed.weight", (VOCAB, h), 0))
    for layer in range(stage * per, (stage + 1) * per):
        p = f"layers.{layer}"
        out += [(f"{p}.attn.qkv.weight", (3 * h, h), 0), (f"{p}.attn.proj.weight", (h, h), 1),
                (f"{p}.mlp.fc1.weight", (4 * h, h), 0), (f"{p}.mlp.fc2.weight", (h, 4 * h), 1),
                (f"{p}.ln1.weight", (h,), None), (f"{p}.ln2.weight", (h,), None)]
    if stage == pp - 1:
        out.append(("lm_head.weight", (VOCAB, h), 0))
    return out


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Offset and size of part ``i`` of ``n`` split like ``torch.chunk``."""
    step = -(-n // parts)
    lo = min(n, i * step)
    return lo, min(n, lo + step) - lo


def _boxes(layout: Layout, rank: int):
    """Every (fqn, global shape, dtype, offsets, sizes) ``rank`` holds."""
    t, stage, d = layout.coords(rank)
    for name, shape, tp_dim in _tensors(stage, layout.pp):
        offsets, sizes = [0] * len(shape), list(shape)
        if tp_dim is not None:
            offsets[tp_dim], sizes[tp_dim] = _split(shape[tp_dim], layout.tp, t)
        yield f"model.{name}", shape, "bfloat16", tuple(offsets), tuple(sizes)
        lo, n = _split(sizes[0], layout.dp, d)  # ZeRO-1: dim 0 of the TP shard over DP
        z_off = (offsets[0] + lo, *offsets[1:])
        z_size = (n, *sizes[1:])
        for state in ("exp_avg", "exp_avg_sq", "master"):
            yield f"optim.{name}.{state}", shape, "float32", z_off, z_size


def local_plans(layout: Layout) -> list[SavePlan]:
    """Every rank's local save plan, as ``DefaultSavePlanner`` makes them."""
    planner = DefaultSavePlanner()
    plans = []
    for rank in range(layout.world_size):
        plan = SavePlan()
        for fqn, shape, dtype, offsets, sizes in _boxes(layout, rank):
            plan.tensors[fqn] = TensorDecl(shape, dtype)
            plan.items.append(WriteItem(fqn, offsets, sizes, math.prod(sizes) * _ITEMSIZE[dtype]))
        plans.append(planner.create_local_plan(plan))
    return plans


def simulated_write_results(local: list[SavePlan], final: list[SavePlan]) -> list[WriteResult]:
    """What every rank would report after writing its final plan (one data
    file per rank, zero checksums and fingerprints): its chunks, and the
    fingerprints of the chunks it holds but did not write whole, as
    ``dcp.save`` reports them."""
    results = []
    for rank, (offered, plan) in enumerate(zip(local, final, strict=True)):
        name, offset, result = f"r{rank:05d}-0.0123456789abcdef.data", 0, WriteResult()
        for item in plan.items:
            result.chunks.append((item.fqn, ChunkMeta(item.offsets, item.sizes, name, offset,
                                                      item.nbytes, 0, rank)))
            offset += item.nbytes
        whole = {(i.fqn, i.offsets, i.sizes) for i in plan.items}
        result.replicas = {(i.fqn, i.offsets): 0 for i in offered.items
                           if (i.fqn, i.offsets, i.sizes) not in whole}
        results.append(result)
    return results


def best_write_max(plans: list[SavePlan]) -> int:
    """A lower bound of the busiest writer's bytes that any plan can reach:
    for every set R of ranks holding a replicated chunk, R's ranks must
    write their single-holder chunks and every chunk held only within R, so
    the fullest of them writes at least the water level that spreads those
    bytes over R's ranks on top of what they must write anyway."""
    holders: dict[tuple, list[int]] = {}
    nbytes: dict[tuple, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key = (item.fqn, item.offsets)
            holders.setdefault(key, []).append(rank)
            nbytes[key] = item.nbytes
    pinned = [0] * len(plans)
    shared: dict[frozenset, int] = {}
    for key, ranks in holders.items():
        if len(ranks) == 1:
            pinned[ranks[0]] += nbytes[key]
        else:
            group = frozenset(ranks)
            shared[group] = shared.get(group, 0) + nbytes[key]
    best = max(pinned)
    for group in shared:
        extra = sum(b for g, b in shared.items() if g <= group)
        loads = sorted(pinned[r] for r in group)
        for n in range(len(loads), 0, -1):  # water level over the n least-loaded ranks
            level = (sum(loads[:n]) + extra) / n
            if level >= loads[n - 1]:
                break
        best = max(best, level)
    return best


def _requests(layout: Layout, rank: int) -> list[ReadRequest]:
    return [ReadRequest(fqn, offsets, sizes, shape, dtype)
            for fqn, shape, dtype, offsets, sizes in _boxes(layout, rank)]


def _ratio(loads: list[int]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def measure(ranks: int) -> dict:
    """Run the save and load planning of a ``ranks``-rank job; seconds,
    bytes and balance ratios."""
    save_layout = Layout(tp=8, pp=16, dp=ranks // 128)
    load_layout = Layout(tp=4, pp=16, dp=ranks // 64)
    row = {"ranks": save_layout.world_size}
    plans = local_plans(save_layout)
    row["local_plan_items"] = sum(len(p.items) for p in plans)
    gc.collect()

    t = time.perf_counter()
    final = DefaultSavePlanner().create_global_plan(plans)
    row["global_plan_s"] = time.perf_counter() - t
    written = [sum(i.nbytes for i in p.items) for p in final]
    row["write_max_over_mean"] = _ratio(written)
    row["write_best_max_over_mean"] = best_write_max(plans) / (sum(written) / len(written))

    results = simulated_write_results(plans, final)
    decls = {fqn: decl for p in plans for fqn, decl in p.tensors.items()}
    del plans
    t = time.perf_counter()
    md = build_metadata("0123456789abcdef", save_layout.world_size, decls, results)
    data = encode(md)
    row["metadata_build_encode_s"] = time.perf_counter() - t
    row["chunks"] = sum(len(t.chunks) for t in md.tensors.values())
    row["metadata_mb"] = len(data) / 1e6
    del md, results, final
    gc.collect()

    t = time.perf_counter()
    md = decode(data)
    row["metadata_decode_s"] = time.perf_counter() - t

    planner = DefaultLoadPlanner()
    rank = load_layout.world_size // 2 + 3
    t = time.perf_counter()
    planner.create_local_plan(md, _requests(load_layout, rank), [], strict=True,
                              allow_dtype_cast=False)
    row["load_local_plan_s"] = time.perf_counter() - t

    # Regions are shared only within a pipeline stage: the global load plan
    # of one stage's ranks shows the readers' balance and cost per stage.
    stage = [r for r in range(load_layout.world_size) if load_layout.coords(r)[1] == 1]
    local = [planner.create_local_plan(md, _requests(load_layout, r), [], strict=True,
                                       allow_dtype_cast=False) for r in stage]
    t = time.perf_counter()
    final_load = planner.create_global_plan(local)
    row["load_global_plan_one_stage_s"] = time.perf_counter() - t
    row["read_max_over_mean"] = _ratio([sum(i.nbytes for i in p.items) for p in final_load])
    return row


def run(out_dir, *, ranks=(1024, 4096, 10240, 16384), repeat: int = 3,
        quick: bool = False) -> list[dict]:
    """Measure each rank count ``repeat`` times; one row per rank count with
    the medians of the seconds (``*_s``) and their ranges (``*_s_range``);
    sizes and balance ratios do not vary.  Written to ``out_dir/scale.json``
    and ``scale.md``."""
    if quick:
        ranks, repeat = (1024,), 1
    rows = [summarize_runs([measure(n) for _ in range(repeat)]) for n in ranks]
    write_table(out_dir, "scale", rows, markdown(rows))
    return rows


COLUMNS: list[Column] = [
    ("ranks", lambda r: f"{r['ranks']:,}"),
    ("local plan items", lambda r: f"{r['local_plan_items']:,}"),
    ("chunks", lambda r: f"{r['chunks']:,}"),
    ("global save plan s", lambda r: median_range(r, "global_plan_s", ".2f")),
    ("write max/mean (layout's best)",
     lambda r: f"{r['write_max_over_mean']:.3f} ({r['write_best_max_over_mean']:.3f})"),
    ("metadata MB", lambda r: f"{r['metadata_mb']:.2f}"),
    ("build+encode s", lambda r: median_range(r, "metadata_build_encode_s", ".2f")),
    ("decode s", lambda r: median_range(r, "metadata_decode_s")),
    ("one rank's load plan (TP4, DP×2) s", lambda r: median_range(r, "load_local_plan_s")),
    ("read max/mean (one stage)", lambda r: f"{r['read_max_over_mean']:.3f}"),
]


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (seconds: median (min–max))."""
    return markdown_table(rows, COLUMNS)


def targets(rows: list[dict]) -> list[TargetResult]:
    """The issue's limits, at the largest rank count measured."""
    if not rows:
        return []
    r = max(rows, key=lambda row: row["ranks"])
    n = f"{r['ranks']:,} ranks"
    return [
        TargetResult(f"scale {n}: global save planning s", r["global_plan_s"], 10, timing=True),
        TargetResult(f"scale {n}: metadata MB", r["metadata_mb"], 100, timing=False),
        TargetResult(f"scale {n}: metadata decode s", r["metadata_decode_s"], 2, timing=True),
        TargetResult(f"scale {n}: one rank's load planning s", r["load_local_plan_s"], 0.5,
                     timing=True),
        TargetResult(f"scale {n}: write max/mean over the layout's best",
                     r["write_max_over_mean"] / r["write_best_max_over_mean"], 1.05, timing=False),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1024, 4096, 10240, 16384])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    print(markdown(run(args.out, ranks=args.ranks, repeat=args.repeat)))


if __name__ == "__main__":
    main()
