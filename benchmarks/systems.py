"""The checkpoint systems under comparison, behind one small interface.

``torch-dcp`` is ``torch.distributed.checkpoint`` with the default
``FileSystemWriter``/``FileSystemReader``; it is the baseline of every ratio.
``hyperdcp`` is this project's ``dcp`` with its defaults.  ``read-floor`` is
no checkpoint system but the storage's own limit for loads (see
:class:`ReadFloor`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

BASELINE = "torch-dcp"


class System(Protocol):
    name: str

    def save(self, state_dict: dict[str, Any], path: str) -> None: ...

    def load(self, state_dict: dict[str, Any], path: str) -> None: ...


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

    def load(self, state_dict: dict[str, Any], path: str) -> None:
        self._load(state_dict, path)


class ReadFloor(HyperDCP):
    """The least time any load of a checkpoint can take on this storage:
    every byte of its data files read once, each rank reading ``1/W`` of
    them (its contiguous share of the files in name order, 4 threads, 8 MiB
    ``preadv`` calls into one reused buffer), nothing decoded, checked,
    placed or sent.  A load that reads each chunk once per replica group
    cannot be faster than this; loads that read every replica (torch DCP)
    share the page cache, so on one host they pay the same storage reads
    plus copies.  Saves are hyperdcp's (the floor needs files to read) and
    are not reported; loaded values are not checked (nothing is placed).
    """

    name = "read-floor"
    floor = True
    PIECE = 8 << 20

    def load(self, state_dict: dict[str, Any], path: str) -> None:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        files = sorted(p for p in Path(path).iterdir() if p.name.endswith(".data"))
        sizes = [p.stat().st_size for p in files]
        total = sum(sizes)
        lo, hi = total * rank // world, total * (rank + 1) // world
        pieces, start = [], 0  # (file, offset, length) of this rank's share, in PIECE parts
        for p, size in zip(files, sizes):
            a, b = max(lo, start), min(hi, start + size)
            pieces += [(p, o - start, min(self.PIECE, b - o)) for o in range(a, b, self.PIECE)]
            start += size
        buffers = [bytearray(self.PIECE) for _ in range(4)]

        def read(k: int) -> None:
            fds = {}
            try:
                for p, offset, length in pieces[k::4]:
                    if p not in fds:
                        fds[p] = os.open(p, os.O_RDONLY)
                    os.preadv(fds[p], [memoryview(buffers[k])[:length]], offset)
            finally:
                for fd in fds.values():
                    os.close(fd)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(read, range(4)))


SYSTEMS: dict[str, type] = {cls.name: cls for cls in (TorchDCP, HyperDCP, ReadFloor)}


def check_available(name: str) -> str | None:
    """Why system ``name`` cannot run here, or None if it can."""
    if name not in SYSTEMS:
        return f"unknown system {name!r} (known: {', '.join(SYSTEMS)})"
    try:
        SYSTEMS[name]()
    except (ImportError, AttributeError) as e:
        return f"{name} is not usable: {e}"
    return None
