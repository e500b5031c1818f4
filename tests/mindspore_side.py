"""The MindSpore half of tests/test_mindspore_training.py, run as a subprocess.

A small transformer-ish block (LayerNorm, Dense, ReLU, Dense) trained with
momentum SGD on fixed batches, in MindSpore here and in torch with tensor
parallelism on the pytest side.  This module holds what both halves share
(shapes, hyperparameters, batches, the name maps between the frameworks) and
imports MindSpore only in :func:`main`, so the torch ranks import it freely.

Usage (one process per direction, results written into ``DIR``)::

    python tests/mindspore_side.py ms-to-torch DIR   # train, dcp.save DIR/ckpt, one more step
    python tests/mindspore_side.py torch-to-ms DIR   # dcp.load DIR/ckpt in place, one more step

Files written: ``saved.npz`` (ms-to-torch: the values saved) or
``loaded.npz`` (torch-to-ms: the values loaded), ``next.npz`` (parameters and
moments after the next step) and ``next.json`` (``{"losses": [...],
"next_loss": x}``), every array under its MindSpore name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

IN, HIDDEN, OUT, BATCH = 16, 32, 8, 16
LR, MOMENTUM, LN_EPS = 0.05, 0.9, 1e-5
TRAIN_STEPS = 3  # steps before the save; the step after it is compared

# MindSpore parameter name -> torch parameter name (LayerNorm: gamma/beta vs weight/bias).
PARAMS = {
    "norm.gamma": "norm.weight",
    "norm.beta": "norm.bias",
    "fc1.weight": "fc1.weight",
    "fc1.bias": "fc1.bias",
    "fc2.weight": "fc2.weight",
    "fc2.bias": "fc2.bias",
}


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed batch of ``step`` (inputs, targets), float32."""
    rng = np.random.default_rng(1000 + step)
    return (rng.standard_normal((BATCH, IN), dtype=np.float32),
            rng.standard_normal((BATCH, OUT), dtype=np.float32))


def _rename(pairs: dict[str, str]) -> dict:
    """A remap map renaming each source to its target (a concat of one source:
    the chunks keep their offsets, nothing is staged)."""
    return {target: {"concat": 0, "sources": [source]} for source, target in pairs.items()}


#: Loads a MindSpore checkpoint (``{"model": net, "optim": opt}``) into torch's
#: ``{"model": get_model_state_dict(...), "optim": {"state": ...}}`` (SGD's
#: ``momentum_buffer`` is MindSpore Momentum's ``moments``: both keep
#: ``buf = momentum * buf + grad`` and step ``param -= lr * buf``).
MS_TO_TORCH = _rename(
    {f"model.{m}": f"model.{t}" for m, t in PARAMS.items() if m != t}
    | {f"optim.moments.{m}": f"optim.state.{t}.momentum_buffer" for m, t in PARAMS.items()})

#: The other way: a torch checkpoint into ``{"model": net, "optim": {moments}}``.
TORCH_TO_MS = _rename(
    {f"model.{t}": f"model.{m}" for m, t in PARAMS.items() if m != t}
    | {f"optim.state.{t}.momentum_buffer": f"optim.moments.{m}" for m, t in PARAMS.items()})


def _build():
    import mindspore as ms
    from mindspore import nn

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm((IN,), epsilon=LN_EPS)  # MindSpore's default is 1e-7
            self.fc1 = nn.Dense(IN, HIDDEN)
            self.act = nn.ReLU()
            self.fc2 = nn.Dense(HIDDEN, OUT)

        def construct(self, x):
            return self.fc2(self.act(self.fc1(self.norm(x))))

    net = Block()
    opt = nn.Momentum(net.trainable_params(), learning_rate=LR, momentum=MOMENTUM)
    loss_fn = nn.MSELoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    def step(i: int) -> float:
        x, y = (ms.Tensor(a) for a in batch(i))
        loss, grads = grad_fn(x, y)
        opt(grads)
        return float(loss.asnumpy())

    return net, opt, step


def _values(net, opt) -> dict[str, np.ndarray]:
    """Parameters and moments by MindSpore name (``moments.fc1.weight``)."""
    out = {name: p.asnumpy().copy() for name, p in net.parameters_dict().items()}
    out.update((m.name, m.asnumpy().copy()) for m in opt.moments)
    return out


def main(argv: list[str]) -> None:
    import dcp
    from dcp.interop.remap import load_remapped

    direction, out = argv[0], Path(argv[1])
    net, opt, step = _build()
    ckpt = str(out / "ckpt")
    losses: list[float] = []
    if direction == "ms-to-torch":
        losses = [step(i) for i in range(TRAIN_STEPS)]
        dcp.save({"model": net, "optim": opt}, ckpt)
        np.savez(out / "saved.npz", **_values(net, opt))
    elif direction == "torch-to-ms":
        target = {"model": net, "optim": {m.name: m for m in opt.moments}}
        report = load_remapped(target, ckpt, TORCH_TO_MS)
        (out / "load_report.json").write_text(json.dumps(
            {"missing": report.missing_keys, "unexpected": report.unexpected_keys}))
        np.savez(out / "loaded.npz", **_values(net, opt))
    else:
        raise SystemExit(f"unknown direction {direction!r}")
    next_loss = step(TRAIN_STEPS)
    np.savez(out / "next.npz", **_values(net, opt))
    (out / "next.json").write_text(json.dumps({"losses": losses, "next_loss": next_loss}))


if __name__ == "__main__":
    main(sys.argv[1:])
