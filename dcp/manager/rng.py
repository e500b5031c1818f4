"""Each rank's random number generators, captured and restored exactly.

A resumed run continues its random streams (dropout masks, data shuffles,
augmentations) as if it had never stopped only if every generator it draws
from is restored: Python's ``random``, NumPy's legacy global generator,
torch's CPU generator and each accelerator device's.  torchtitan leaves this
as an open request; here it is part of every step the manager saves.

The state is plain JSON (torch's byte states and NumPy's key array as
base64), so it travels in the rank's per-rank record (:mod:`dcp.manager.per_rank`)
and is never pickled.
"""

from __future__ import annotations

import base64
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


def capture() -> dict:
    """The state of every generator this rank draws from."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss],
                             "torch": _b64(torch.get_rng_state().numpy().tobytes())}
    try:
        import numpy as np
    except ImportError:  # NumPy is optional
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        state["numpy"] = [kind, _b64(np.asarray(keys, dtype=np.uint32).tobytes()), int(pos),
                          int(has_gauss), float(cached)]
    accel = _accelerator()
    if accel is not None:
        state["accelerator"] = [_b64(s.numpy().tobytes()) for s in accel.get_rng_state_all()]
    return state


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
