"""The checkpoint systems under comparison, behind one small interface.

``torch-dcp`` is ``torch.distributed.checkpoint`` with the default
``FileSystemWriter``/``FileSystemReader``; it is the baseline of every ratio.
``hyperdcp`` is this project's ``dcp`` with its defaults.  ``floor`` is
no checkpoint system but the storage's own limit for saves and loads (see
:class:`StorageFloor`).  A load returns what the system reports about it
(hyperdcp's :class:`dcp.LoadReport`, the floor's :class:`Reads`; torch DCP
reports nothing): the benchmarks take ``requests`` from it where it has one.
(The S3 systems, same names, are in :mod:`benchmarks.s3_load`.)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

BASELINE = "torch-dcp"
FLOOR = "floor"
#: the placement copy measured beside the floor's loads (not a system)
PLACEMENT = "memcpy"


@dataclass(frozen=True)
class Reads:
    """What a floor's load did on this rank: ``requests`` storage reads."""

    requests: int


class System(Protocol):
    name: str

    def save(self, state_dict: dict[str, Any], path: str) -> None: ...

    def load(self, state_dict: dict[str, Any], path: str) -> Any: ...


class TorchDCP:
    name = BASELINE

    def __init__(self) -> None:
        import torch.distributed.checkpoint as tdcp

        self._tdcp = tdcp

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        self._tdcp.save(state_dict, storage_writer=self._tdcp.FileSystemWriter(path))

    def load(self, state_dict: dict[str, Any], path: str) -> None:
        self._tdcp.load(state_dict, storage_reader=self._tdcp.FileSystemReader(path))


class HyperDCP:
    name = "hyperdcp"

    def __init__(self) -> None:
        import dcp

        self._save, self._load = dcp.save, dcp.load

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        self._save(state_dict, path)

    def load(self, state_dict: dict[str, Any], path: str) -> Any:
        return self._load(state_dict, path)


class StorageFloor(HyperDCP):
    """The least time any save or load of a checkpoint can take on this
    storage; not a checkpoint system.

    Save: every distinct chunk written once (of the replicas of a chunk, the
    ranks take turns in key order), each rank's chunks in ``THREADS``
    size-balanced files written in parallel by the POSIX plugin
    (buffered, writeback started as it goes, ``fsync``: the fastest way
    found on this disk), with no planning, checksums, metadata, commit or
    coordination.  A save that writes each byte once cannot be faster.

    Load: every byte of the data files read once, each rank reading ``1/W``
    of them (its contiguous share of the files in name order, ``THREADS``
    threads, 8 MiB ``preadv`` calls into reused buffers), nothing decoded,
    checked, placed or sent.  A load that reads each chunk once per replica
    group cannot be faster; loads that read every replica (torch DCP) share
    the page cache, so on one host they pay the same storage reads plus
    copies.  Loaded values are not checked (nothing is placed).
    """

    name = FLOOR
    floor = True
    PIECE = 8 << 20
    THREADS = 4

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        import torch.distributed as dist

        from dcp.core.tensors import byte_view, to_host
        from dcp.orchestration.save import describe_state
        from storage_plugins.posix import PosixStorage

        rank, world = dist.get_rank(), dist.get_world_size()
        state = describe_state(state_dict, False, rank, world)
        # the members of a replica group hold the same keys: take turns
        mine = [state.chunks[key] for i, key in enumerate(sorted(state.chunks))
                if i % state.slots[key][1] == state.slots[key][0]]
        files: list[list] = [[] for _ in range(self.THREADS)]
        for chunk in sorted(mine, key=lambda c: -c.data.nbytes):  # largest first, to the lightest
            min(files, key=lambda f: sum(c.data.nbytes for c in f)).append(chunk)
        storage = PosixStorage(path)
        with ThreadPoolExecutor(self.THREADS) as pool:
            list(pool.map(lambda k: storage.write_file(
                f"floor.r{rank}.{k}.data", [byte_view(to_host(c.data)) for c in files[k]]),
                range(self.THREADS)))

    def load(self, state_dict: dict[str, Any], path: str) -> Reads:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        files = sorted(p for p in Path(path).iterdir() if p.name.endswith(".data"))
        sizes = [p.stat().st_size for p in files]
        total = sum(sizes)
        lo, hi = total * rank // world, total * (rank + 1) // world
        pieces, start = [], 0  # (file, offset, length) of this rank's share, in PIECE parts
        for p, size in zip(files, sizes, strict=True):
            a, b = max(lo, start), min(hi, start + size)
            pieces += [(p, o - start, min(self.PIECE, b - o)) for o in range(a, b, self.PIECE)]
            start += size
        buffers = [bytearray(self.PIECE) for _ in range(self.THREADS)]

        def read(k: int) -> None:
            fds = {}
            try:
                for p, offset, length in pieces[k::self.THREADS]:
                    if p not in fds:
                        fds[p] = os.open(p, os.O_RDONLY)
                    os.preadv(fds[p], [memoryview(buffers[k])[:length]], offset)
            finally:
                for fd in fds.values():
                    os.close(fd)
        with ThreadPoolExecutor(self.THREADS) as pool:
            list(pool.map(read, range(self.THREADS)))
        return Reads(len(pieces))


SYSTEMS: dict[str, type] = {cls.name: cls for cls in (TorchDCP, HyperDCP, StorageFloor)}


def requests_of(report: Any) -> int | None:
    """The storage requests a load's report counts, None if it counts none
    (torch DCP; hyperdcp before its report had ``requests``)."""
    return getattr(report, "requests", None)


def check_available(name: str) -> str | None:
    """Why system ``name`` cannot run here, or None if it can."""
    if name not in SYSTEMS:
        return f"unknown system {name!r} (known: {', '.join(SYSTEMS)})"
    try:
        SYSTEMS[name]()
    except (ImportError, AttributeError) as e:
        return f"{name} is not usable: {e}"
    return None
