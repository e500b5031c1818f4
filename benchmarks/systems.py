"""The checkpoint systems under comparison, behind one small interface.

``torch-dcp`` is ``torch.distributed.checkpoint`` with the default
``FileSystemWriter``/``FileSystemReader``; it is the baseline of every ratio.
``hyperdcp`` is this project's ``dcp`` with its defaults.
"""

from __future__ import annotations

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


SYSTEMS: dict[str, type] = {cls.name: cls for cls in (TorchDCP, HyperDCP)}


def check_available(name: str) -> str | None:
    """Why system ``name`` cannot run here, or None if it can."""
    if name not in SYSTEMS:
        return f"unknown system {name!r} (known: {', '.join(SYSTEMS)})"
    try:
        SYSTEMS[name]()
    except (ImportError, AttributeError) as e:
        return f"{name} is not usable: {e}"
    return None
