"""Each rank's random number generators, captured and restored exactly.

A resumed run continues its random streams (dropout masks, data shuffles,
augmentations) as if it had never stopped only if every generator it draws
from is restored: Python's ``random``, NumPy's legacy global generator,
torch's CPU generator and each accelerator device's.  torchtitan leaves this
as an open request; here it is part of every step the manager saves.

The state is plain JSON (torch's byte states and NumPy's key array as
base64), so it travels in the rank's per-rank record (:mod:`dcp.manager.per_rank`)
and is never pickled.

When the data-parallel degree changes, no old rank's streams are the new
rank's: the ranks of one data-parallel rank share their streams (tensor-
parallel peers must draw the same dropout masks on replicated activations),
and the data-parallel ranks no longer correspond.  The manager then applies
the rule the caller declares (``CheckpointManager(rng_on_resize=...)``, the
signature of :data:`dcp.manager.per_rank.ResizeRule`) or raises, as for
per-rank state: :class:`DeriveRNG` seeds fresh streams from the saved ones,
:class:`dcp.FromFirstRank` continues old data-parallel rank 0's on every
rank.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from typing import Any

import torch

from dcp.errors import CheckpointError


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _accelerator() -> Any:
    """torch's module for this process's accelerator (``torch.cuda``, ...),
    or ``None`` where there is none."""
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available():
        return cuda
    return None


def _encode(python: tuple, torch_state: torch.Tensor, numpy_state: tuple | None,
            accelerator: list[torch.Tensor] | None) -> dict:
    version, internal, gauss = python
    state: dict[str, Any] = {"python": [version, list(internal), gauss],
                             "torch": _b64(torch_state.numpy().tobytes())}
    if numpy_state is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = numpy_state
        state["numpy"] = [kind, _b64(np.asarray(keys, dtype=np.uint32).tobytes()), int(pos),
                          int(has_gauss), float(cached)]
    if accelerator is not None:
        state["accelerator"] = [_b64(s.numpy().tobytes()) for s in accelerator]
    return state


def _numpy() -> Any:
    try:
        import numpy as np
    except ImportError:  # NumPy is optional
        return None
    return np


def capture() -> dict:
    """The state of every generator this rank draws from."""
    np = _numpy()
    accel = _accelerator()
    return _encode(random.getstate(), torch.get_rng_state(),
                   np.random.get_state() if np is not None else None,  # type: ignore[arg-type]
                   accel.get_rng_state_all() if accel is not None else None)


class DeriveRNG:
    """A resize rule for the RNG states (``CheckpointManager(rng_on_resize=
    DeriveRNG())``): every generator of new data-parallel rank ``d`` is
    seeded from the SHA-256 of every old data-parallel rank's states, ``d``
    and the new degree.  The streams are fresh (no old stream is continued
    on two ranks, none is dropped silently: the rule is declared),
    reproducible (resuming the same step on the same layout draws the
    same), distinct across data-parallel ranks and shared by the ranks of
    one data-parallel rank.  Each generator gets a seed of its own, the
    SHA-256 of its name (``python``, ``numpy``, ``torch``,
    ``accelerator:<i>``) and that digest, so no two draw the same stream:
    Python's 19,937-bit Mersenne Twister is seeded with the whole 256-bit
    seed, NumPy's with it as 8 ``uint32`` words, torch's CPU generator and
    each accelerator device with its first 63 bits."""

    def __call__(self, states: list[dict], dp_rank: int, dp_degree: int) -> dict:
        digest = hashlib.sha256(json.dumps([states, dp_rank, dp_degree], sort_keys=True,
                                           separators=(",", ":")).encode()).digest()

        def seed(name: str) -> bytes:
            return hashlib.sha256(name.encode() + digest).digest()

        def seed63(name: str) -> int:  # torch's seed range
            return int.from_bytes(seed(name)[:8], "little") >> 1

        np = _numpy()
        accel = _accelerator()
        devices = None
        if accel is not None:
            devices = [torch.Generator(device=f"{accel.__name__.rsplit('.', 1)[-1]}:{i}")
                       .manual_seed(seed63(f"accelerator:{i}")).get_state()
                       for i in range(accel.device_count())]
        numpy_state = None
        if np is not None:
            words = np.frombuffer(seed("numpy"), dtype=np.uint32)
            numpy_state = np.random.RandomState(words).get_state()
        return _encode(random.Random(int.from_bytes(seed("python"), "little")).getstate(),
                       torch.Generator().manual_seed(seed63("torch")).get_state(), numpy_state,
                       devices)


def restore(state: dict, where: str) -> None:
    """Set every generator to ``state`` (from :func:`capture`); ``where``
    names the step and rank in errors."""
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(_bytes_tensor(state["torch"]))
        if "numpy" in state:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.frombuffer(base64.b64decode(keys), dtype=np.uint32),
                                 pos, has_gauss, cached))
        saved = state.get("accelerator")
        accel = _accelerator()
        if saved is not None and accel is not None:
            if len(saved) != accel.device_count():
                raise CheckpointError(f"{where}: the RNG state holds {len(saved)} accelerator "
                                      f"devices, this process sees {accel.device_count()}")
            accel.set_rng_state_all([_bytes_tensor(s) for s in saved])
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{where}: restoring the RNG state failed: "
                              f"{type(e).__name__}: {e}") from e
