"""Training moves between MindSpore and a torch tensor-parallel job through one
checkpoint (issue #21, point 3).

The model, a LayerNorm -> Dense -> ReLU -> Dense block trained with momentum
SGD on fixed batches, and the name maps between the frameworks live in
``mindspore_side.py``, which also runs the MindSpore half as one subprocess
per direction (importing MindSpore into the gloo ranks is avoided: one short
process keeps the frameworks' threads and allocators apart).  The torch half
runs on 2 gloo ranks with ``fc1`` column-wise and ``fc2`` row-wise parallel
(DTensor), in the session's W=2 group.

* MindSpore -> torch: MindSpore trains 3 steps and saves ``{"model": net,
  "optim": opt}`` with ``dcp.save``; the TP job loads it through
  ``load_remapped`` (LayerNorm's gamma/beta are torch's weight/bias,
  Momentum's ``moments`` are SGD's ``momentum_buffer``): every local shard
  is bit-identical to its slice of MindSpore's values, and the next step's
  loss, parameters and moments match MindSpore's next step.
* torch -> MindSpore: the TP job trains 3 steps and saves its
  ``get_model_state_dict`` / ``get_optimizer_state_dict``; MindSpore loads
  them into its net and moments in place: bit-identical, and its next step
  matches torch's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import mindspore_side as side
from helpers import assert_bitwise_equal, make_dtensor, mindspore_scenario

SIDE_SCRIPT = Path(__file__).with_name("mindspore_side.py")

# Tolerance between the frameworks' next steps.  Both start from bit-identical
# float32 values and the same batch; they differ only in kernels and in the
# order of summation (torch's fc2 sums its 32 hidden units as two partial sums
# of 16, one per rank, then all-reduces).  A float32 dot product of n terms
# is off by at most ~n * 2**-24 of the sum of |terms| (n <= 32 here: ~2e-6);
# the loss and gradients chain a few such sums (LayerNorm, two Dense layers,
# their backward), each of a few thousand multiply-adds.  rtol 1e-5 is 5x that
# bound, and orders of magnitude below any mistake in the state: the momentum
# term lr * momentum * buf alone is ~1e-3 of a parameter.  Element-wise, the
# allowed error is RTOL of the element plus RTOL of the tensor's largest
# element, so elements near 0 (ReLU, small moments) are held to the tensor's
# scale.
RTOL = 1e-5


def _close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = float(np.abs(expected).max(initial=0.0))
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def _on_rank0(ctx, fn) -> None:
    """Run ``fn()`` on rank 0 while the other ranks wait; a failure there
    raises on every rank (instead of leaving them in a collective)."""
    import torch.distributed as dist

    error = [None]
    if ctx.rank == 0:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - carried to every rank
            error = [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise AssertionError(f"on rank 0: {error[0]}")


def _run_mindspore(direction: str, out: Path) -> None:
    """mindspore_side.py for ``direction`` (~8 s: imports ~5 s); its timeout
    stays under the harness's 60 s gloo timeout, which bounds the other
    rank's wait in :func:`_on_rank0`, so a hang reports as this one."""
    proc = subprocess.run([sys.executable, str(SIDE_SCRIPT), direction, str(out)],
                          capture_output=True, text=True, timeout=50)
    if proc.returncode != 0:
        raise RuntimeError(f"mindspore_side.py {direction} exited {proc.returncode}:\n"
                           f"{proc.stderr[-4000:]}")


class Block(torch.nn.Module):
    """The torch twin of mindspore_side's block (torch names: see side.PARAMS)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(side.IN, eps=side.LN_EPS)
        self.fc1 = torch.nn.Linear(side.IN, side.HIDDEN)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(side.HIDDEN, side.OUT)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.norm(x))))


def _tp_block():
    """The block on a 1-D mesh of 2 ranks (fc1 column-wise, fc2 row-wise;
    LayerNorm replicated) with its momentum SGD.  ``foreach=False``: the
    optimizer holds DTensors (fc1, fc2) and plain tensors (the norm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)  # the same full weights on every rank before they are sharded
    model = Block()
    parallelize_module(model, init_device_mesh("cpu", (2,)),
                       {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    optim = torch.optim.SGD(model.parameters(), lr=side.LR, momentum=side.MOMENTUM,
                            foreach=False)
    return model, optim


def _train_step(model, optim, step: int) -> float:
    x, y = (torch.from_numpy(a) for a in side.batch(step))
    optim.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return loss.item()


def _local(t) -> torch.Tensor:
    """This rank's shard of a parameter or moment (the tensor itself if plain)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _slice_of(t, full: np.ndarray) -> torch.Tensor:
    """The part of ``full`` that ``t``'s local shard holds."""
    full_t = torch.from_numpy(np.ascontiguousarray(full))
    if hasattr(t, "to_local"):
        return make_dtensor(full_t, t.device_mesh, list(t.placements)).to_local()
    return full_t


def _state(model, optim) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """MindSpore name -> (parameter, momentum buffer) of the torch block."""
    params = dict(model.named_parameters())
    return {m: (params[t].detach(), optim.state[params[t]]["momentum_buffer"])
            for m, t in side.PARAMS.items()}


def _assert_state_matches(model, optim, values, *, exact: bool, what: str) -> None:
    """Every local shard of the torch block's parameters and moments against
    its slice of MindSpore's ``values`` (npz, MindSpore names): bit-identical
    if ``exact``, else within RTOL."""
    for name, (param, buf) in _state(model, optim).items():
        for fqn, t in ((name, param), (f"moments.{name}", buf)):
            local, expected = _local(t), _slice_of(t, values[fqn])
            if exact:
                assert_bitwise_equal(local, expected, f"{what} {fqn}")
            else:
                _close(local.numpy(), expected.numpy(), f"{what} {fqn}")


@mindspore_scenario(2)
def test_mindspore_checkpoint_resumes_under_torch_tp(ctx):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from dcp.interop.remap import load_remapped

    _on_rank0(ctx, lambda: _run_mindspore("ms-to-torch", ctx.dir))
    saved, after = np.load(ctx.dir / "saved.npz"), np.load(ctx.dir / "next.npz")
    ms = json.loads((ctx.dir / "next.json").read_text())
    assert len(ms["losses"]) == side.TRAIN_STEPS and ms["losses"][-1] > 0

    model, optim = _tp_block()
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optim)  # a fresh optimizer: zero moments
    target = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    report = load_remapped(target, str(ctx.dir / "ckpt"), side.MS_TO_TORCH)
    assert report.missing_keys == []
    # what torch has no place for: Momentum's step counter and hyperparameters
    # (the optimizer saves its own state only, not the model's parameters again)
    assert sorted(report.unexpected_keys) == [
        "optim.global_step", "optim.learning_rate", "optim.momentum"], report.unexpected_keys
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, optim, optim_sd)
    assert isinstance(model.fc1.weight, torch.distributed.tensor.DTensor)
    assert _local(model.fc1.weight).shape == (side.HIDDEN // 2, side.IN)
    _assert_state_matches(model, optim, saved, exact=True, what="loaded from MindSpore:")

    loss = _train_step(model, optim, side.TRAIN_STEPS)
    np.testing.assert_allclose(loss, ms["next_loss"], rtol=RTOL,
                               err_msg="torch's next-step loss vs MindSpore's")
    _assert_state_matches(model, optim, after, exact=False, what="after the next step:")


@mindspore_scenario(2)
def test_torch_tp_checkpoint_resumes_in_mindspore(ctx):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import dcp

    model, optim = _tp_block()
    losses = [_train_step(model, optim, i) for i in range(side.TRAIN_STEPS)]
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, optim)}, str(ctx.dir / "ckpt"))
    saved = {n: (_local(p).clone(), _local(b).clone())
             for n, (p, b) in _state(model, optim).items()}
    _on_rank0(ctx, lambda: _run_mindspore("torch-to-ms", ctx.dir))
    loaded, after = np.load(ctx.dir / "loaded.npz"), np.load(ctx.dir / "next.npz")
    ms = json.loads((ctx.dir / "next.json").read_text())
    assert json.loads((ctx.dir / "load_report.json").read_text())["missing"] == []

    # what MindSpore loaded, sliced as this rank holds it, is this rank's shard
    for name, (param, buf) in _state(model, optim).items():
        assert_bitwise_equal(saved[name][0], _slice_of(param, loaded[name]), name)
        assert_bitwise_equal(saved[name][1], _slice_of(buf, loaded[f"moments.{name}"]),
                             f"moments.{name}")

    loss = _train_step(model, optim, side.TRAIN_STEPS)
    assert losses[-1] != loss
    np.testing.assert_allclose(ms["next_loss"], loss, rtol=RTOL,
                               err_msg="MindSpore's next-step loss vs torch's")
    _assert_state_matches(model, optim, after, exact=False, what="after the next step:")
