"""State that differs from rank to rank: a data loader's position, a
sampler's offset, the RNG streams.

The rest of a checkpoint is one global state, whatever the layout; this is
not.  Each rank's record is saved as one raw blob under its own key
(``_manager.ranks.<rank>``, held by that rank alone), JSON inside, never
pickled.  A record names the data-parallel rank and degree it was saved
under, so a resumed job of the same degree gives each rank the state of its
data-parallel rank, whatever the other dimensions do.

When the data-parallel degree changes, the position of one data-parallel
rank no longer means anything on its own: a :class:`PerRank` value applies
the rule it declares (``on_resize``: every old data-parallel rank's state,
the new rank and degree -> this rank's state), or the load raises naming the
key and both degrees.  It is never silently dropped or duplicated.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dcp.errors import CheckpointError

#: ``(states of the old data-parallel ranks, in order, new dp rank, new dp degree) -> state``
ResizeRule = Callable[[list[Any], int, int], Any]


@dataclass
class PerRank:
    """A value of the state dict kept per rank: a Stateful (``state_dict()``
    / ``load_state_dict()``) or a dict, updated in place on load.  Its state
    must be JSON values and tensors (small: it is read whole).

    ``on_resize``: the rule applied when the data-parallel degree changed
    (:data:`ResizeRule`); ``None`` makes such a load raise."""

    value: Any
    on_resize: ResizeRule | None = None

    def get(self) -> Any:
        sd = getattr(self.value, "state_dict", None)
        return sd() if callable(sd) and not isinstance(self.value, dict) else dict(self.value)

    def put(self, state: Any) -> None:
        load = getattr(self.value, "load_state_dict", None)
        if callable(load) and not isinstance(self.value, dict):
            load(state)
        elif isinstance(self.value, dict):
            self.value.clear()
            self.value.update(state)
        else:
            raise CheckpointError(f"PerRank holds a {type(self.value).__name__}, neither a dict "
                                  f"nor a Stateful")


class FromFirstRank:
    """A resize rule: every new rank takes old data-parallel rank 0's state
    (for state all data-parallel ranks share, e.g. an epoch counter)."""

    def __call__(self, states: list[Any], dp_rank: int, dp_degree: int) -> Any:
        return states[0]


class SumOf:
    """A resize rule for counters that together cover the data seen (e.g.
    samples consumed per rank): the old total split evenly, the remainder
    to the lowest ranks, under each of ``keys``; other keys from old rank 0."""

    def __init__(self, *keys: str) -> None:
        self.keys = keys

    def __call__(self, states: list[Any], dp_rank: int, dp_degree: int) -> Any:
        out = dict(states[0])
        for key in self.keys:
            total = sum(int(s[key]) for s in states)
            out[key] = total // dp_degree + (1 if dp_rank < total % dp_degree else 0)
        return out


def encode(value: Any) -> Any:
    """``value`` as JSON values: tensors as ``{"__tensor__": base64, dtype, shape}``."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.numel() and t.dtype != torch.uint8 else t
        return {"__tensor__": base64.b64encode(raw.numpy().tobytes()).decode("ascii"),
                "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"per-rank state holds a {type(value).__name__}: only JSON values "
                          f"and tensors are kept per rank")


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, value["dtype"])
            data = bytearray(base64.b64decode(value["__tensor__"]))
            if not data:
                return torch.empty(value["shape"], dtype=dtype)
            flat = torch.frombuffer(data, dtype=torch.uint8)
            return flat.view(dtype).reshape(value["shape"]).clone()
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def to_blob(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


def from_blob(blob: bytes, where: str) -> dict:
    try:
        record = json.loads(bytes(blob))
    except ValueError as e:
        raise CheckpointError(f"{where}: the per-rank record does not decode: {e}") from e
    if not isinstance(record, dict):
        raise CheckpointError(f"{where}: the per-rank record is not a JSON object")
    return record
