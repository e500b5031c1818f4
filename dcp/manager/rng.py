"""Each rank's random number generators, captured and restored exactly.

A resumed run continues its random streams (dropout masks, data shuffles,
augmentations) as if it had never stopped only if every generator it draws
from is restored: Python's ``random``, NumPy's legacy global generator,
torch's CPU generator and the generator of the rank's accelerator device.
torchtitan leaves this as an open request; here it is part of every step
the manager saves.

The accelerator is whichever torch has (``torch.accelerator``: CUDA, ROCm,
torch_npu's NPU, ...), through its module (``torch.get_device_module``).  A
rank draws on its current device (the one ``set_device`` chose), so that
device's generator is the one saved, with the device type, and it is
restored onto the current device of the resumed rank: a resume that sees
another number of devices (another ``CUDA_VISIBLE_DEVICES``) restores the
same stream.  A state of another accelerator type, or one saved with an
accelerator restored without one, leaves the accelerator's generator as it
is, with a warning.

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
import warnings
from typing import Any

import torch

from dcp.core import devices
from dcp.errors import CheckpointError


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _accelerator() -> tuple[torch.device, Any] | None:
    """This thread's current accelerator device (with its index) and torch's
    module for it (``torch.cuda``, ``torch.npu``, ...), or ``None`` where
    torch finds no accelerator."""
    device = devices.current_device()
    if device is None:
        return None
    return device, torch.get_device_module(device.type)


def _encode(python: tuple, torch_state: torch.Tensor, numpy_state: tuple | None,
            accelerator: tuple[str, torch.Tensor] | None) -> dict:
    version, internal, gauss = python
    state: dict[str, Any] = {"python": [version, list(internal), gauss],
                             "torch": _b64(torch_state.numpy().tobytes())}
    if numpy_state is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = numpy_state
        state["numpy"] = [kind, _b64(np.asarray(keys, dtype=np.uint32).tobytes()), int(pos),
                          int(has_gauss), float(cached)]
    if accelerator is not None:
        state["accelerator"] = {"device": accelerator[0],
                                "state": _b64(accelerator[1].numpy().tobytes())}
    return state


def _numpy() -> Any:
    try:
        import numpy as np
    except ImportError:  # NumPy is optional
        return None
    return np


def capture() -> dict:
    """The state of every generator this rank draws from (of the
    accelerator's, its current device's)."""
    np = _numpy()
    accel = _accelerator()
    return _encode(random.getstate(), torch.get_rng_state(),
                   np.random.get_state() if np is not None else None,  # type: ignore[arg-type]
                   None if accel is None
                   else (accel[0].type, accel[1].get_rng_state(accel[0].index)))


class DeriveRNG:
    """A resize rule for the RNG states (``CheckpointManager(rng_on_resize=
    DeriveRNG())``): every generator of new data-parallel rank ``d`` is
    seeded from the SHA-256 of every old data-parallel rank's states, ``d``
    and the new degree.  The streams are fresh (no old stream is continued
    on two ranks, none is dropped silently: the rule is declared),
    reproducible (resuming the same step on the same layout draws the
    same), distinct across data-parallel ranks and shared by the ranks of
    one data-parallel rank.  Each generator gets a seed of its own, the
    SHA-256 of its name (``python``, ``numpy``, ``torch``, ``accelerator``:
    the current device's) and that digest, so no two draw the same stream:
    Python's 19,937-bit Mersenne Twister is seeded with the whole 256-bit
    seed, NumPy's with it as 8 ``uint32`` words, torch's CPU generator and
    the accelerator's with its first 63 bits."""

    def __call__(self, states: list[dict], dp_rank: int, dp_degree: int) -> dict:
        digest = hashlib.sha256(json.dumps([states, dp_rank, dp_degree], sort_keys=True,
                                           separators=(",", ":")).encode()).digest()

        def seed(name: str) -> bytes:
            return hashlib.sha256(name.encode() + digest).digest()

        def seed63(name: str) -> int:  # torch's seed range
            return int.from_bytes(seed(name)[:8], "little") >> 1

        np = _numpy()
        accel = _accelerator()
        device = None
        if accel is not None:
            device = (accel[0].type, torch.Generator(device=accel[0])
                      .manual_seed(seed63("accelerator")).get_state())
        numpy_state = None
        if np is not None:
            words = np.frombuffer(seed("numpy"), dtype=np.uint32)
            numpy_state = np.random.RandomState(words).get_state()
        return _encode(random.Random(int.from_bytes(seed("python"), "little")).getstate(),
                       torch.Generator().manual_seed(seed63("torch")).get_state(), numpy_state,
                       device)


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
        if saved is not None:
            _restore_accelerator(saved, where)
    except Exception as e:
        raise CheckpointError(f"{where}: restoring the RNG state failed: "
                              f"{type(e).__name__}: {e}") from e


def _restore_accelerator(saved: dict, where: str) -> None:
    """Set the current accelerator device's generator to ``saved`` (device
    type and state), or warn why not."""
    accel = _accelerator()
    if accel is None or accel[0].type != saved["device"]:
        found = "no accelerator" if accel is None else f"a {accel[0].type} accelerator"
        warnings.warn(f"{where}: the RNG state holds a {saved['device']} generator, this "
                      f"process has {found}: that generator is not restored", stacklevel=3)
        return
    device, module = accel
    module.set_rng_state(_bytes_tensor(saved["state"]), device.index)
