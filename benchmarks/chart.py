"""The PNG chart of a run: hyperdcp next to torch.distributed.checkpoint.

One panel per kind of result present in the run: seconds of each family of
save/load scenarios (sync, many small tensors, S3 loads: median bars,
min–max whiskers, per system and world size), the async-save stall,
planning at scale against the number of ranks, and the file-flag protocol's
critical path against the number of ranks.  Needs matplotlib
(``pip install -e '.[bench]'``), imported only when a chart is drawn.
"""

from __future__ import annotations

from pathlib import Path

from .report import Row
from .systems import BASELINE


def _bars(ax, rows: list[Row], title: str) -> None:
    labels = list(dict.fromkeys(f"{r.scenario}\nW={r.world_size}" for r in rows))
    systems = list(dict.fromkeys(r.system for r in rows))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        mine = {f"{r.scenario}\nW={r.world_size}": r for r in rows if r.system == system}
        xs = [i + k * width for i, label in enumerate(labels) if label in mine]
        picked = [mine[label] for label in labels if label in mine]
        medians = [r.seconds_median for r in picked]
        errors = [[r.seconds_median - r.seconds_min for r in picked],
                  [r.seconds_max - r.seconds_median for r in picked]]
        ax.bar(xs, medians, width, yerr=errors, capsize=2, label=system)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("seconds (median, min–max)")
    ax.set_title(title)
    ax.legend(fontsize=7)


def write_chart(path: Path, rows: list[Row], tables: dict[str, list[dict]]) -> Path | None:
    """Draw the panels the run has data for into ``path`` (PNG); None if none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for family in dict.fromkeys(r.family for r in rows):
        def bars(ax, family=family):
            mine = [r for r in rows if r.family == family]
            _bars(ax, mine, f"{family}: {BASELINE} vs hyperdcp")
        panels.append(bars)
    if tables.get("async_save"):
        def stall(ax, table=tables["async_save"]):
            labels = [f"{r['system']}\nW={r['world_size']}" for r in table]
            ax.bar(range(len(table)), [r["stall_s"] for r in table],
                   color=["C0" if r["system"].startswith("torch") else "C1" for r in table])
            ax.set_xticks(range(len(table)))
            ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
            ax.set_ylabel("stall seconds (median)")
            ax.set_title("async save: training stall")
        panels.append(stall)
    if tables.get("scale"):
        def scale(ax, table=tables["scale"]):
            ranks = [r["ranks"] for r in table]
            for key, label in (("global_plan_s", "global save plan"),
                               ("metadata_build_encode_s", "metadata build+encode"),
                               ("metadata_decode_s", "metadata decode"),
                               ("load_local_plan_s", "one rank's load plan")):
                ax.plot(ranks, [r[key] for r in table], marker="o", label=label)
            _over_ranks(ax, "seconds (median)", "hyperdcp planning and metadata at scale")
        panels.append(scale)
    if tables.get("coordination"):
        def coordination(ax, table=tables["coordination"]):
            for transport in dict.fromkeys(r["transport"] for r in table):
                mine = [r for r in table if r["transport"] == transport]
                for step in ("plans", "results"):
                    ax.plot([r["ranks"] for r in mine], [r[f"{step}_critical_s"] for r in mine],
                            marker="o", label=f"{transport}: {step}")
            _over_ranks(ax, "critical path seconds (median)", "coordination of one save")
        panels.append(coordination)
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.5 * len(panels)), squeeze=False)
    for draw, ax in zip(panels, axes[:, 0], strict=True):
        draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _over_ranks(ax, ylabel: str, title: str) -> None:
    """Axes of a curve over rank counts (log2 x axis), with its legend."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
