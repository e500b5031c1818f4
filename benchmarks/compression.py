"""Compression on POSIX: the stored/logical ratio and the save and load time
of one state, compressed (``dcp.Compression``, zstd level 1, 2 MiB frames)
and not, and PyTorch DCP's ``FileSystemWriter(_extensions=[ZStandard()])``
(each written stream compressed whole) beside them.

The states: 64 MiB of bf16 N(0, 0.02) (weights), and 64 MiB of fp32
N(0, 0.02).  Each save goes to a fresh folder under ``--root`` (with the
default ``fsync``), each load into preallocated tensors; the repetitions
alternate compressed and plain so a busy spell touches both alike; medians.
The page cache is not dropped: loads read cached files, so they measure
what decoding costs, not what a slower disk saves.

    python -m benchmarks.compression [--root /tmp] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import dcp


def _state(dtype: torch.dtype, nbytes: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    rows = 8
    return {f"layer{k}.weight": (torch.randn(n // rows // 1024, 1024, generator=g) * 0.02)
            .to(dtype) for k in range(rows)}


def _once(state: dict, path: Path, compression) -> tuple[float, float, float]:
    """``(ratio, save s, load s)`` of one save to ``path`` and its load."""
    start = time.perf_counter()
    md = dcp.save(state, str(path), compression=compression)
    save = time.perf_counter() - start
    ratio = md.unique_bytes / sum(f.stat().st_size for f in path.glob("*.data"))
    target = {k: torch.empty_like(v) for k, v in state.items()}
    start = time.perf_counter()
    dcp.load(target, str(path))
    load = time.perf_counter() - start
    assert all(torch.equal(target[k], v) for k, v in state.items())
    shutil.rmtree(path)
    return ratio, save, load


def _once_torch(state: dict, path: Path) -> tuple[float, float, float]:
    """:func:`_once` for PyTorch DCP with its ``ZStandard`` extension (one
    process, ``no_dist``)."""
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint._extension import ZStandard

    start = time.perf_counter()
    torch_dcp.save(state, storage_writer=torch_dcp.FileSystemWriter(
        str(path), _extensions=[ZStandard()]), no_dist=True)
    save = time.perf_counter() - start
    logical = sum(v.numel() * v.element_size() for v in state.values())
    ratio = logical / sum(f.stat().st_size for f in path.glob("*.distcp"))
    target = {k: torch.empty_like(v) for k, v in state.items()}
    start = time.perf_counter()
    torch_dcp.load(target, storage_reader=torch_dcp.FileSystemReader(str(path)), no_dist=True)
    load = time.perf_counter() - start
    assert all(torch.equal(target[k], v) for k, v in state.items())
    shutil.rmtree(path)
    return ratio, save, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dcp-compression-", dir=args.root))
    policies = {"none": None, "zstd level 1": dcp.Compression(),
                "torch DCP ZStandard()": "torch"}
    try:
        print("| state | compression | ratio | save (s) | load (s) |")
        print("|---|---|---|---|---|")
        for label, dtype in (("bf16 N(0, 0.02), 64 MiB", torch.bfloat16),
                             ("fp32 N(0, 0.02), 64 MiB", torch.float32)):
            state = _state(dtype, 64 << 20)
            runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in policies}
            for k in range(args.repeat):  # alternating
                for name, policy in policies.items():
                    path = root / f"{k}-{name.split()[0]}"
                    runs[name].append(_once_torch(state, path) if policy == "torch"
                                      else _once(state, path, policy))
            for name, results in runs.items():
                ratio = results[0][0]
                save = statistics.median(r[1] for r in results)
                load = statistics.median(r[2] for r in results)
                print(f"| {label} | {name} | {ratio:.2f}x | {save:.2f} | {load:.2f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
