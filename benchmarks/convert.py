"""Conversion throughput and peak memory, against ``cp`` of the same bytes.

    python -m benchmarks.convert [--out DIR] [--size-gib 1.2] [--repeat 3] [--only OP ...]

Input: a synthetic model of about ``size_gib`` GiB laid out like a Hugging
Face checkpoint — a folder of ``model-0000k-of-0000n.safetensors`` shards
(at most 500 MB each) with ``model.safetensors.index.json``, holding the
tensors of a GPT-style transformer in float32 (embedding, then per layer
attention, MLP and norms; the embedding is the largest tensor).  The bytes
are not random — no step here compresses, so content does not matter.

Measured, each in a fresh process (or a ``torchrun`` job of 2) run under
``/usr/bin/time -v``, whose maximum resident set size is the peak memory of
the largest process (each process reports its RSS just before the call, so
import overhead shows separately):

* ``safetensors -> hyperdcp`` and ``hyperdcp -> safetensors``
  (:mod:`dcp.interop.safetensors_io`) and the conversions through PyTorch
  DCP (:mod:`dcp.interop.torch_dcp_io`), each with 1 and 2 processes,
  budget ``BUDGET_BYTES``, data files ``fsync``-ed;
* PyTorch DCP's own tools on the same bytes: ``dcp_to_torch_save``,
  ``torch_save_to_dcp`` and its ``HuggingFaceStorageWriter`` with
  consolidation;
* ``load_safetensors`` into row shards on 2 ranks against
  ``safetensors.torch.load_file`` followed by slicing on every rank;
* baselines: ``cp -r`` of the source files, and ``cp -r`` followed by
  ``sync`` of the copies (the fair baseline for a writer that fsyncs).

Every step reads from a warm page cache (its input was just written).
Seconds are medians over ``repeat`` runs, the order of the operations
reversed on every other run (the first makes the inputs of the later
ones); MiB/s counts tensor bytes.
:func:`run` returns the rows and writes ``convert.json`` and ``convert.md``
into ``out_dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .report import Column, markdown_table, write_table

MIB = 2**20
TIME = "/usr/bin/time"
SHARD_BYTES = 500 * 10**6
# (operation, source format, destination format, processes); a conversion runs
# from the artifact of its source format to a new artifact of its destination
# format.  "torch:" rows are PyTorch DCP's own tools on the same bytes.
OPERATIONS = [
    ("safetensors -> hyperdcp", "safetensors", "hyperdcp", 1),
    ("safetensors -> hyperdcp", "safetensors", "hyperdcp", 2),
    ("hyperdcp -> safetensors", "hyperdcp", "safetensors", 1),
    ("hyperdcp -> safetensors", "hyperdcp", "safetensors", 2),
    ("hyperdcp -> torch-dcp", "hyperdcp", "torch-dcp", 1),
    ("hyperdcp -> torch-dcp", "hyperdcp", "torch-dcp", 2),
    ("torch-dcp -> hyperdcp", "torch-dcp", "hyperdcp", 1),
    ("torch-dcp -> hyperdcp", "torch-dcp", "hyperdcp", 2),
    ("torch: dcp_to_torch_save", "torch-dcp", "torch-save", 1),
    ("torch: torch_save_to_dcp", "torch-save", "torch-dcp", 1),
    ("torch: safetensors -> HF writer, consolidated", "safetensors", "safetensors", 1),
    ("load_safetensors, TP over 2 ranks", "safetensors", None, 2),
    ("torch: load_file + slice, TP over 2 ranks", "safetensors", None, 2),
]
#: Memory budget of the hyperdcp conversions (their default).
BUDGET_BYTES = 512 << 20
_BUDGETED = ("safetensors -> hyperdcp", "hyperdcp -> safetensors", "hyperdcp -> torch-dcp",
             "torch-dcp -> hyperdcp")


def _model_shapes(size_gib: float) -> dict[str, tuple[int, ...]]:
    """A GPT-style float32 model of about ``size_gib`` GiB: hidden 2048,
    vocabulary 32000 (a 250 MiB embedding), 152 MiB per layer."""
    hidden, vocab, ffn = 2048, 32000, 5632
    shapes = {"embed.weight": (vocab, hidden)}
    layer_bytes = 4 * (4 * hidden * hidden + 2 * hidden * ffn + 2 * hidden)
    layers = max(1, round((size_gib * 2**30 - 4 * vocab * hidden) / layer_bytes))
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attn.qkv.weight": (3 * hidden, hidden),
                       p + "attn.o.weight": (hidden, hidden),
                       p + "mlp.up.weight": (ffn, hidden), p + "mlp.down.weight": (hidden, ffn),
                       p + "norm1.weight": (hidden,), p + "norm2.weight": (hidden,)})
    shapes["norm.weight"] = (hidden,)
    return shapes


def _write_model(folder: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The synthetic model as a sharded safetensors folder with its index."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 4 * math.prod(shape)
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: torch.full(shapes[n], float(i % 7)) for i, n in enumerate(names)},
                  folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(4 * math.prod(s) for s in shapes.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _rss() -> int:
    """This process's resident set size, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _tp_target(src: str, rank: int, world: int):
    """Rank ``rank``'s row shard of every tensor of the safetensors folder
    (1-D tensors whole), as the TP-sharded model would hold them."""
    import torch

    import dcp
    from dcp.interop.safetensors_io import SafetensorsFolder

    target = {}
    for fqn, meta in SafetensorsFolder(src).metadata.tensors.items():
        if len(meta.shape) < 2:
            target[fqn] = torch.empty(meta.shape)
            continue
        rows = -(-meta.shape[0] // world)
        start = min(meta.shape[0], rank * rows)
        size = min(meta.shape[0], start + rows) - start
        target[fqn] = dcp.TensorShard(torch.empty((size, *meta.shape[1:])), meta.shape,
                                      (start,) + (0,) * (len(meta.shape) - 1))
    return target


def _load_file_and_slice(src: str, rank: int, world: int) -> list:
    """Every file read with ``load_file``, each 2-D tensor's row shard of
    this rank copied out (the 1-D tensors kept whole): the shards the TP
    model holds, as :func:`_tp_target` gives them to ``load_safetensors``."""
    from safetensors.torch import load_file

    shards = []
    for file in sorted(Path(src).glob("*.safetensors")):
        for t in load_file(file).values():
            if t.dim() >= 2:
                rows = -(-t.shape[0] // world)
                t = t[rank * rows:(rank + 1) * rows].clone()
            shards.append(t)
    return shards


def _hf_consolidated(src: str, dst: str) -> None:
    """PyTorch DCP's path to a Hugging Face folder: the state dict in
    memory (read with safetensors), saved through its HuggingFaceStorageWriter
    with consolidation into 500 MB files."""
    import torch.distributed.checkpoint as torch_dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state, index, size = {}, {}, 0
    for file in sorted(Path(src).glob("*.safetensors")):
        for name, t in load_file(file).items():
            size += t.numel() * t.element_size()
            state[name], index[name] = t, 1 + size // SHARD_BYTES
    torch_dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        dst, fqn_to_index_mapping=index, enable_consolidation=True))


def _child(operation: str, src: str, dst: str) -> None:
    """Run one conversion in this (fresh) process, or this rank of a
    torchrun job; rank 0 prints the measurements (the slowest rank's)."""
    import torch.distributed as dist

    import dcp
    from dcp.interop.safetensors_io import (
        checkpoint_to_safetensors,
        load_safetensors,
        safetensors_to_checkpoint,
    )
    from dcp.interop.torch_dcp_io import checkpoint_to_torch_dcp, torch_dcp_to_checkpoint

    group, rank, world = None, 0, 1
    if "WORLD_SIZE" in __import__("os").environ:
        dist.init_process_group("gloo")
        group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()

    def tp_load() -> None:
        load_safetensors(_tp_target(src, rank, world), src, process_group=group)

    calls = {
        "safetensors -> hyperdcp": lambda: safetensors_to_checkpoint(
            src, dst, buffer_bytes=BUDGET_BYTES, process_group=group),
        "hyperdcp -> safetensors": lambda: checkpoint_to_safetensors(
            src, dst, max_shard_size=SHARD_BYTES, buffer_bytes=BUDGET_BYTES, process_group=group),
        "hyperdcp -> torch-dcp": lambda: checkpoint_to_torch_dcp(
            src, dst, buffer_bytes=BUDGET_BYTES, process_group=group),
        "torch-dcp -> hyperdcp": lambda: torch_dcp_to_checkpoint(
            src, dst, trusted=True, buffer_bytes=BUDGET_BYTES, process_group=group),
        "torch: dcp_to_torch_save": lambda: __import__(
            "torch.distributed.checkpoint.format_utils",
            fromlist=["x"]).dcp_to_torch_save(src, dst),
        "torch: torch_save_to_dcp": lambda: __import__(
            "torch.distributed.checkpoint.format_utils",
            fromlist=["x"]).torch_save_to_dcp(src, dst),
        "torch: safetensors -> HF writer, consolidated": lambda: _hf_consolidated(src, dst),
        "load_safetensors, TP over 2 ranks": tp_load,
        "torch: load_file + slice, TP over 2 ranks": lambda: _load_file_and_slice(src, rank,
                                                                                  world),
    }
    del dcp
    if group is not None:
        dist.barrier()
    before = _rss()
    started = time.perf_counter()
    calls[operation]()
    seconds = time.perf_counter() - started
    if group is not None:
        slowest = [None] * world
        dist.all_gather_object(slowest, seconds)
        seconds = max(slowest)
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"seconds": seconds, "rss_before": before}))


def _convert(operation: str, src: Path, dst: Path, procs: int) -> dict:
    """Run one conversion in a fresh process (``procs`` > 1: a torchrun job
    of as many) under GNU time; its measurements plus ``peak_rss`` (bytes),
    time's maximum resident set size of one process."""
    if not Path(TIME).exists():
        raise RuntimeError(f"{TIME} (GNU time) is needed to measure peak memory: "
                           "apt-get install time")
    launch = [sys.executable, "-m", "benchmarks.convert"] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
        "--master-port", "29517", "-m", "benchmarks.convert"]
    out = subprocess.run([TIME, "-v", *launch, "--child", operation, str(src), str(dst)],
                         capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parent.parent)
    if out.returncode:
        raise RuntimeError(f"{operation} ({procs} processes) failed:\n{out.stderr[-3000:]}")
    sample = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1)
    return {**sample, "peak_rss": int(kib) * 1024}


def _files(folder: Path) -> list[str]:
    if folder.is_file():
        return [str(folder)]
    return [str(p) for p in sorted(folder.rglob("*")) if p.is_file()]


def _cp(src: Path, dst: Path, sync: bool) -> float:
    started = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    if sync:
        subprocess.run(["sync", *_files(dst)], check=True)
    return time.perf_counter() - started


def _remove(path: Path) -> None:
    if path.is_file():
        path.unlink()
    shutil.rmtree(path, ignore_errors=True)


def _artifact(work: Path, target: str, source: str) -> Path:
    name = f"{target}-from-{source}"
    return work / (name + ".pt" if target == "torch-save" else name)


def _selected(only: list[str] | None) -> list[tuple]:
    """The operations to run: those whose name contains one of ``only``
    (every one for ``None``), plus the conversions that make their inputs
    (the first conversion into each source format they need).  Raises
    :class:`ValueError` when ``only`` matches nothing."""
    if only is None:
        return OPERATIONS
    chosen = [op for op in OPERATIONS if any(word in op[0] for word in only)]
    if not chosen:
        raise ValueError(f"--only {only} matches no operation of {[op[0] for op in OPERATIONS]}")
    needed = {op[1] for op in chosen} - {"safetensors"}
    makers = [next(op for op in OPERATIONS if op[2] == fmt and not op[0].startswith("torch:"))
              for fmt in needed]
    return [op for op in OPERATIONS if op in chosen or op in makers]


def run(out_dir, *, size_gib: float = 1.2, repeat: int = 3,
        scratch: str | None = None, only: list[str] | None = None) -> list[dict]:
    """Measure the operations (those named by ``only``, see
    :func:`_selected`; default every one) and their ``cp`` baselines;
    returns one row per operation and process count (seconds: median of
    ``repeat``; ``x cp``: seconds over those of ``cp -r`` of the same
    source; memory in MiB) and writes ``convert.json`` and ``convert.md``
    into ``out_dir``."""
    operations = _selected(only)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hyperdcp-bench-convert-", dir=scratch))
    shapes = _model_shapes(size_gib)
    tensor_bytes = sum(4 * math.prod(s) for s in shapes.values())
    largest = max(4 * math.prod(s) for s in shapes.values())
    try:
        artifacts = {"safetensors": work / "safetensors"}
        _write_model(artifacts["safetensors"], shapes)
        samples: dict[tuple[str, int], list[dict]] = {(op, n): [] for op, _, _, n in operations}
        baselines: dict[tuple[str, bool], list[float]] = {}
        for turn in range(repeat):
            copied = set()  # cp baselines: once per source format and repeat
            for operation, source, target, procs in (operations[::-1] if turn % 2 else
                                                     operations):
                src = artifacts[source]
                if source not in copied:
                    copied.add(source)
                    for sync in (False, True):
                        copy = work / ("copy.pt" if src.is_file() else "copy")
                        baselines.setdefault((source, sync), []).append(_cp(src, copy, sync))
                        _remove(copy)
                dst = _artifact(work, target or "none", source)
                if target is not None and operation.startswith("torch:"):
                    dst = dst.with_name("torch-" + dst.name)
                _remove(dst)
                samples[(operation, procs)].append(_convert(operation, src, dst, procs))
                if target is not None and not operation.startswith("torch:"):
                    artifacts.setdefault(target, dst)  # later operations read the first made
                elif target == "torch-save":
                    artifacts.setdefault(target, dst)
        rows = []
        for operation, source, _target, procs in operations:
            runs = samples[(operation, procs)]
            seconds = statistics.median(s["seconds"] for s in runs)
            cp = statistics.median(baselines[(source, False)])
            cp_sync = statistics.median(baselines[(source, True)])
            peak = max(s["peak_rss"] for s in runs)
            growth = max(s["peak_rss"] - s["rss_before"] for s in runs)
            rows.append({
                "operation": operation, "processes": procs, "tensor_bytes": tensor_bytes,
                "seconds": round(seconds, 3), "MiB/s": round(tensor_bytes / MIB / seconds),
                "cp_seconds": round(cp, 3), "cp_sync_seconds": round(cp_sync, 3),
                "x cp": round(seconds / cp, 2), "x cp+sync": round(seconds / cp_sync, 2),
                "peak_rss_MiB": round(peak / MIB), "rss_growth_MiB": round(growth / MIB),
                "budget_MiB": BUDGET_BYTES // MIB if operation in _BUDGETED else None,
                "largest_tensor_MiB": round(largest / MIB),
                "all_seconds": [round(s["seconds"], 3) for s in runs],
                "all_rss_growth_MiB": [round((s["peak_rss"] - s["rss_before"]) / MIB)
                                       for s in runs],
                "model_MiB": round(tensor_bytes / MIB), "repeat": repeat})
    finally:
        _remove(work)
    write_table(out_dir, "convert", rows, markdown(rows))
    return rows


COLUMNS: list[Column] = [
    ("operation", lambda r: r["operation"]),
    ("processes", lambda r: str(r["processes"])),
    ("seconds", lambda r: f"{r['seconds']:.2f}"),
    ("MiB/s", lambda r: str(r["MiB/s"])),
    ("cp -r (s)", lambda r: f"{r['cp_seconds']:.2f}"),
    ("cp -r + sync (s)", lambda r: f"{r['cp_sync_seconds']:.2f}"),
    ("× cp+sync", lambda r: f"{r['x cp+sync']:.2f}"),
    ("peak RSS (MiB)", lambda r: str(r["peak_rss_MiB"])),
    ("RSS growth (MiB)", lambda r: str(r["rss_growth_MiB"])),
    ("budget (MiB)", lambda r: "-" if r["budget_MiB"] is None else str(r["budget_MiB"])),
]


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table, with the model's size in the title."""
    head = (f"Model: {rows[0]['model_MiB']} MiB of float32 tensors, largest "
            f"{rows[0]['largest_tensor_MiB']} MiB; median of {rows[0]['repeat']}.")
    return f"{head}\n\n{markdown_table(rows, COLUMNS)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convert",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    parser.add_argument("--size-gib", type=float, default=1.2, help="model size (default 1.2 GiB)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (default 3)")
    parser.add_argument("--scratch", default=None, help="directory for the files (default: tmp)")
    parser.add_argument("--only", nargs="+", metavar="OP", default=None,
                        help="run only the operations whose name contains one of these (plus "
                             "those making their inputs), e.g. --only 'hyperdcp -> safetensors'")
    parser.add_argument("--child", nargs=3, metavar=("OPERATION", "SRC", "DST"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    rows = run(args.out, size_gib=args.size_gib, repeat=args.repeat, scratch=args.scratch,
               only=args.only)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
