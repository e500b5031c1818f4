"""The MindSpore adapter (dcp/core/mindspore_tensors.py): MindSpore tensors
save and load through the torch machinery, bit-exact, in place.

Importing MindSpore changes the process's global state (it registers a
``bfloat16`` NumPy dtype and logs through its own handlers), so no MindSpore
code runs in the pytest process: the checks marked ``@_in_mindspore`` run
one after the other in ONE subprocess (``python -c``, this module imported
there by name), which reports each check's outcome; each becomes a pytest
test of the same name.  The 2-rank test is a ``dist_scenario`` of a phase of
its own (3), so the ranks that import MindSpore are no other test's.

MindSpore's semi-auto parallel cannot run here: on this CPU machine
``msrun --worker_num=2`` starts both workers and ``init()`` succeeds, but the
first step of a ``semi_auto_parallel`` cell fails with ``RuntimeError:
Invalid communication backend: CPU for semi_auto_parallel/auto_parallel
mode, currently only support Ascend/GPU backend``.  So the layout arithmetic
of :func:`dcp.mindspore_shard` is checked against MindSpore's own Python
layout code (``mindspore.parallel._tensor``, ``Layout(...)(...).to_dict()``)
for every rank of several layouts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import dcp
from helpers import mindspore_scenario, needs_mindspore, raw_bytes

TESTS = Path(__file__).resolve().parent

#: the checks run in the MindSpore subprocess, by name
_CHECKS: dict[str, Callable[[Path], None]] = {}


def _in_mindspore(fn: Callable[[Path], None]):
    """Register ``fn(tmp)`` as a check of the MindSpore subprocess and return
    the pytest test (same name) that reports its outcome."""
    _CHECKS[fn.__name__] = fn

    @needs_mindspore
    def test(mindspore_outcomes):
        outcome = mindspore_outcomes.get(fn.__name__)
        assert outcome is not None, f"{fn.__name__} did not run in the MindSpore subprocess"
        assert outcome["ok"], outcome["tb"]

    test.__name__ = test.__qualname__ = fn.__name__
    test.__doc__ = fn.__doc__
    return test


def _run_checks(results: str, tmp: str) -> None:
    """The subprocess's main: every registered check, each in a fresh
    folder under ``tmp``; outcomes written as JSON to ``results``."""
    outcomes = {}
    for name, fn in _CHECKS.items():
        folder = Path(tmp) / name
        folder.mkdir(parents=True)
        try:
            fn(folder)
            outcomes[name] = {"ok": True, "tb": ""}
        except BaseException:  # noqa: BLE001 - reported as the check's failure
            outcomes[name] = {"ok": False, "tb": traceback.format_exc()}
    Path(results).write_text(json.dumps(outcomes))


@pytest.fixture(scope="module")
def mindspore_outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mindspore")
    results = tmp / "outcomes.json"
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_mindspore_adapter as m; "
            f"m._run_checks({str(results)!r}, {str(tmp / 'checks')!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=280, cwd=tmp)
    if not results.exists():
        pytest.fail(f"the MindSpore subprocess exited {proc.returncode} without outcomes:\n"
                    f"{proc.stderr[-4000:]}")
    return json.loads(results.read_text())


# ----------------------------------------------------------------- helpers


#: MindSpore dtype attribute -> checkpoint (torch) dtype name, every dtype both have
SHARED = {"bool_": "bool", "int8": "int8", "int16": "int16", "int32": "int32",
          "int64": "int64", "uint8": "uint8", "uint16": "uint16", "uint32": "uint32",
          "uint64": "uint64", "float16": "float16", "float32": "float32",
          "float64": "float64", "bfloat16": "bfloat16", "complex64": "complex64"}


def _random(ms, attr: str, shape: tuple[int, ...], seed: int):
    """A MindSpore tensor of dtype ``attr`` with random values over the
    dtype's whole range; floats with NaN, +-inf and -0.0 among them."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    dtype = getattr(ms, attr)
    if attr == "bool_":
        return ms.Tensor(rng.integers(0, 2, n).astype(np.bool_).reshape(shape))
    if attr.startswith(("int", "uint")):
        info = np.iinfo(np.dtype(attr))
        values = rng.integers(info.min, info.max, n, dtype=np.dtype(attr), endpoint=True)
        return ms.Tensor(values.reshape(shape))
    wide = np.float64 if attr in ("float64", "complex64") else np.float32
    values = (rng.standard_normal(n) * 1e3).astype(wide)
    values[:4] = [np.nan, np.inf, -np.inf, -0.0]
    if attr == "complex64":
        imag = rng.standard_normal(n).astype(np.float32)
        imag[4:6] = [np.nan, -0.0]
        return ms.Tensor((values.astype(np.float32) + 1j * imag).astype(np.complex64)
                         .reshape(shape))
    if attr in ("float16", "float32", "float64"):
        return ms.Tensor(values.astype(np.dtype(attr)).reshape(shape))
    return ms.Tensor(values.reshape(shape)).astype(dtype)  # bfloat16: cast by MindSpore


def _zeros(ms, like):
    return ms.Parameter(ms.Tensor(np.zeros(like.shape, np.float32)).astype(like.dtype),
                        name="zeros")


# ------------------------------------------------------------ the checks


@_in_mindspore
def test_every_shared_dtype_round_trips_bit_exact(tmp: Path):
    """Each dtype both sides have: MindSpore -> checkpoint -> MindSpore and
    -> torch, and torch -> checkpoint -> MindSpore, byte for byte."""
    import mindspore as ms

    saved = {attr: _random(ms, attr, (5, 7), seed) for seed, attr in enumerate(SHARED)}
    dcp.save({"ms": saved}, tmp / "ms")
    md = dcp.read_metadata(tmp / "ms")
    assert {f: t.dtype for f, t in md.tensors.items()} == {
        f"ms.{attr}": name for attr, name in SHARED.items()}
    into_ms = {attr: _zeros(ms, t) for attr, t in saved.items()}
    into_torch = {attr: torch.zeros(5, 7, dtype=getattr(torch, name))
                  for attr, name in SHARED.items()}
    dcp.load({"ms": into_ms}, tmp / "ms")
    dcp.load({"ms": into_torch}, tmp / "ms")
    for attr, t in saved.items():
        assert into_ms[attr].dtype == t.dtype, attr
        assert raw_bytes(into_ms[attr]) == raw_bytes(t), attr
        assert raw_bytes(into_torch[attr]) == raw_bytes(t), attr
    # torch-saved, loaded into MindSpore Parameters of the same fqns
    from_torch = {attr: t.flip(0).contiguous() for attr, t in into_torch.items()}
    dcp.save({"ms": from_torch}, tmp / "torch")
    dcp.load({"ms": into_ms}, tmp / "torch")
    for attr, t in from_torch.items():
        assert raw_bytes(into_ms[attr]) == raw_bytes(t) != raw_bytes(saved[attr]), attr


@_in_mindspore
def test_float8_saves_bit_exact_and_refuses_to_be_loaded_into(tmp: Path):
    """float8 MindSpore tensors save as torch's float8 bytes; a float8
    MindSpore target is refused before anything is read."""
    import mindspore as ms

    values = np.array([1.0, -2.0, 0.5, 0.0, -0.0, 448.0, 3.0e-3, np.nan], np.float32)
    saved = {name: ms.Tensor(values, dtype=getattr(ms, name))
             for name in ("float8_e4m3fn", "float8_e5m2")}
    dcp.save(saved, tmp / "f8")
    for name, t in saved.items():
        target = torch.zeros(8, dtype=getattr(torch, name))
        dcp.load({name: target}, tmp / "f8", strict=False)
        expected = torch.from_numpy(values).to(getattr(torch, name))
        assert raw_bytes(target) == raw_bytes(t) == raw_bytes(expected), name
    target = ms.Tensor(np.zeros(8, np.float32), dtype=ms.float8_e4m3fn)
    before = raw_bytes(target)
    with pytest.raises(dcp.UnsupportedDtypeError, match="'float8_e4m3fn'.*Float8E4M3FN"):
        dcp.load({"float8_e4m3fn": target}, tmp / "f8", strict=False)
    assert raw_bytes(target) == before


@_in_mindspore
def test_zero_dim_and_empty_tensors_round_trip(tmp: Path):
    import mindspore as ms

    state = {"scalar": ms.Parameter(ms.Tensor(np.float32(-3.25)), name="scalar"),
             "scalar_bf16": ms.Tensor(np.float32(1.5)).astype(ms.bfloat16),
             "empty": ms.Tensor(np.zeros((0, 3), np.int64)),
             "empty_param": ms.Parameter(ms.Tensor(np.zeros((4, 0), np.float16)), name="e")}
    dcp.save(state, tmp / "c")
    md = dcp.read_metadata(tmp / "c")
    assert {f: (t.shape, t.dtype) for f, t in md.tensors.items()} == {
        "scalar": ((), "float32"), "scalar_bf16": ((), "bfloat16"),
        "empty": ((0, 3), "int64"), "empty_param": ((4, 0), "float16")}
    target = {"scalar": ms.Parameter(ms.Tensor(np.float32(0)), name="scalar"),
              "scalar_bf16": ms.Tensor(np.float32(0)).astype(ms.bfloat16),
              "empty": ms.Tensor(np.zeros((0, 3), np.int64)),
              "empty_param": ms.Parameter(ms.Tensor(np.zeros((4, 0), np.float16)), name="e")}
    dcp.load(target, tmp / "c")
    assert float(target["scalar"].asnumpy()) == -3.25 and target["scalar"].shape == ()
    assert float(target["scalar_bf16"].astype(ms.float32).asnumpy()) == 1.5
    assert target["empty"].shape == (0, 3) and target["empty_param"].shape == (4, 0)
    back = {"scalar": torch.zeros(()), "scalar_bf16": torch.zeros((), dtype=torch.bfloat16)}
    dcp.load(back, tmp / "c", strict=False)
    assert back["scalar"].item() == -3.25 and back["scalar_bf16"].item() == 1.5


@_in_mindspore
def test_parameters_and_tensors_are_loaded_in_place(tmp: Path):
    """The caller's objects (a Parameter keeps its name) hold the loaded
    values; another reference to them sees them too."""
    import mindspore as ms

    dcp.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
              "t": torch.tensor([7, 8, 9], dtype=torch.int32)}, tmp / "c")
    w = ms.Parameter(ms.Tensor(np.zeros((3, 4), np.float32)), name="layer.w")
    t = ms.Tensor(np.zeros(3, np.int32))
    state = {"w": w, "t": t}
    alias = state["w"]
    report = dcp.load(state, tmp / "c")
    assert state["w"] is w and state["t"] is t and alias is w
    assert w.name == "layer.w" and isinstance(w, ms.Parameter)
    assert np.array_equal(w.asnumpy(), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert np.array_equal(t.asnumpy(), [7, 8, 9])
    assert report.missing_keys == [] and report.materialized == []


@_in_mindspore
def test_a_cell_saves_and_loads_as_a_stateful(tmp: Path):
    """``{"model": net, "step": 3}``: the net's Parameters are leaves under
    ``model.``; a fresh net loads them into its own Parameters."""
    import mindspore as ms
    from mindspore import nn

    ms.set_seed(1)
    net = nn.SequentialCell([nn.Dense(6, 5), nn.ReLU(), nn.Dense(5, 2)])
    dcp.save({"model": net, "step": 3}, tmp / "c")
    md = dcp.read_metadata(tmp / "c")
    assert sorted(md.tensors) == ["model.0.bias", "model.0.weight", "model.2.bias",
                                  "model.2.weight"]
    assert md.tensors["model.0.weight"].shape == (5, 6) and md.objects["step"].value == 3
    ms.set_seed(2)
    fresh = nn.SequentialCell([nn.Dense(6, 5), nn.ReLU(), nn.Dense(5, 2)])
    params = dict(fresh.parameters_and_names())
    assert not np.array_equal(params["0.weight"].asnumpy(), net[0].weight.asnumpy())
    state = {"model": fresh, "step": 0}
    dcp.load(state, tmp / "c")
    assert state["step"] == 3 and state["model"] is fresh
    for name, p in fresh.parameters_and_names():
        assert params[name] is p
        assert np.array_equal(p.asnumpy(), dict(net.parameters_and_names())[name].asnumpy())
    x = ms.Tensor(np.ones((2, 6), np.float32))
    assert np.array_equal(fresh(x).asnumpy(), net(x).asnumpy())
    # the same checkpoint through parameters_dict(), and into a torch model
    other = nn.SequentialCell([nn.Dense(6, 5), nn.ReLU(), nn.Dense(5, 2)])
    dcp.load({"model": other.parameters_dict()}, tmp / "c", strict=False)
    assert np.array_equal(other(x).asnumpy(), net(x).asnumpy())
    torch_net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                    torch.nn.Linear(5, 2))
    dcp.load({"model": torch_net}, tmp / "c")
    with torch.no_grad():
        assert np.allclose(torch_net(torch.ones(2, 6)).numpy(), net(x).asnumpy(), atol=1e-6)


@_in_mindspore
def test_an_optimizer_saves_and_loads_its_own_state_in_place(tmp: Path):
    """``{"model": net, "optim": opt}`` (Momentum and Adam): the optimizer
    is saved as its own state (step, learning rate, moments), without the
    model's parameters again, and a fresh optimizer's Parameters are loaded
    in place (MindSpore's own ``load_state_dict`` refuses its state_dict())."""
    import mindspore as ms
    from mindspore import nn

    for make, moment in ((lambda ps: nn.Momentum(ps, 0.05, 0.9), "moments"),
                         (lambda ps: nn.Adam(ps, 0.01), "moment1")):
        ms.set_seed(3)
        net = nn.SequentialCell([nn.Dense(4, 3), nn.ReLU(), nn.Dense(3, 2)])
        opt = make(net.trainable_params())
        grad = ms.value_and_grad(lambda x, net=net: net(x).sum(), None, opt.parameters)
        for _ in range(2):
            opt(grad(ms.Tensor(np.arange(8, dtype=np.float32).reshape(2, 4)))[1])
        folder = tmp / moment
        dcp.save({"model": net, "optim": opt}, folder)
        saved = set(dcp.read_metadata(folder).tensors)
        own = {k for k, p in opt.parameters_dict().items()
               if all(p is not q for q in opt.parameters)}
        assert saved == {f"model.{k}" for k in net.parameters_dict()} | {
            f"optim.{k}" for k in own}, saved
        assert f"optim.{moment}.0.weight" in saved and "optim.0.weight" not in saved
        ms.set_seed(4)
        net2 = nn.SequentialCell([nn.Dense(4, 3), nn.ReLU(), nn.Dense(3, 2)])
        opt2 = make(net2.trainable_params())
        before = dict(opt2.parameters_dict())
        report = dcp.load({"model": net2, "optim": opt2}, folder)
        assert report.missing_keys == [] and report.unexpected_keys == []
        for k, p in opt2.parameters_dict().items():
            assert before[k] is p
            assert raw_bytes(p) == raw_bytes(opt.parameters_dict()[k]), k
        assert np.abs(opt2.parameters_dict()[f"{moment}.0.weight"].asnumpy()).sum() > 0


@_in_mindspore
def test_views_of_mindspore_tensors_are_loaded_through_to_their_base(tmp: Path):
    """A transposed view and a column slice (part of a fused weight) are
    filled, and their bases see the values."""
    import mindspore as ms

    values = np.arange(24, dtype=np.float32).reshape(6, 4)
    dcp.save({"t": torch.from_numpy(values.copy()), "q": torch.from_numpy(values[:4, :3].copy())},
             tmp / "c")
    base = ms.Tensor(np.zeros((4, 6), np.float32))
    fused = ms.Parameter(ms.Tensor(np.zeros((4, 9), np.float32)), name="qkv")
    view, part = base.T, fused[:, 0:3]
    dcp.load({"t": view, "q": part}, tmp / "c")
    assert np.array_equal(base.asnumpy(), values.T)
    assert np.array_equal(fused.asnumpy()[:, :3], values[:4, :3])
    assert not fused.asnumpy()[:, 3:].any()


@_in_mindspore
def test_mindspore_targets_are_untouched_where_nothing_is_loaded(tmp: Path):
    """A key missing under ``strict=False`` and a load that fails on a
    damaged chunk leave the MindSpore targets' values as they were."""
    import mindspore as ms

    dcp.save({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(4)}, tmp / "c")
    sentinel = np.full(5, 42.0, np.float32)
    missing = ms.Parameter(ms.Tensor(sentinel.copy()), name="missing")
    a = ms.Parameter(ms.Tensor(np.zeros(6, np.float32)), name="a")
    report = dcp.load({"a": a, "missing": missing}, tmp / "c", strict=False)
    assert report.missing_keys == ["missing"]
    assert np.array_equal(missing.asnumpy(), sentinel)
    assert np.array_equal(a.asnumpy(), np.arange(6, dtype=np.float32))
    chunk = dcp.read_metadata(tmp / "c").tensors["b"].chunks[0]
    path = tmp / "c" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset] ^= 0xFF
    path.write_bytes(bytes(data))
    a2 = ms.Parameter(ms.Tensor(sentinel[:1].repeat(6)), name="a")
    b2 = ms.Parameter(ms.Tensor(sentinel[:4].copy()), name="b")
    try:
        dcp.load({"a": a2, "b": b2}, tmp / "c")
    except dcp.CorruptCheckpointError as e:
        assert "'b'" in str(e), e
    else:
        raise AssertionError("a damaged chunk loaded")
    assert np.array_equal(a2.asnumpy(), np.full(6, 42.0, np.float32))
    assert np.array_equal(b2.asnumpy(), sentinel[:4])


@_in_mindspore
def test_a_tensor_shard_of_a_mindspore_tensor_loads_its_box(tmp: Path):
    import mindspore as ms

    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    dcp.save({"w": whole}, tmp / "c")
    local = ms.Tensor(np.zeros((3, 2), np.float32))
    dcp.load({"w": dcp.TensorShard(local, (6, 4), (3, 2))}, tmp / "c")
    assert np.array_equal(local.asnumpy(), whole[3:, 2:].numpy())
    # a TensorShard of a whole MindSpore tensor saves as that tensor
    dcp.save({"w": dcp.TensorShard(local, (3, 2), (0, 0))}, tmp / "d")
    back = torch.zeros(3, 2)
    dcp.load({"w": back}, tmp / "d")
    assert torch.equal(back, whole[3:, 2:])


@_in_mindspore
def test_torch_and_mindspore_leaves_mix_in_one_state_dict(tmp: Path):
    import mindspore as ms

    state = {"torch": torch.arange(4.0),
             "ms": ms.Parameter(ms.Tensor(np.arange(6, dtype=np.int16)), name="ms"),
             "nested": [ms.Tensor(np.full((2, 2), 2.5, np.float64)), torch.ones(2)],
             "pair": (ms.Tensor(np.array([True, False])), torch.tensor([3, 4])),
             "lr": 0.1}
    dcp.save(state, tmp / "c")
    target = {"torch": torch.zeros(4),
              "ms": ms.Parameter(ms.Tensor(np.zeros(6, np.int16)), name="ms"),
              "nested": [ms.Tensor(np.zeros((2, 2), np.float64)), torch.zeros(2)],
              "pair": (ms.Tensor(np.array([False, False])), torch.zeros(2, dtype=torch.int64)),
              "lr": 0.0}
    nested, pair = target["nested"], target["pair"]
    dcp.load(target, tmp / "c")
    assert torch.equal(target["torch"], torch.arange(4.0)) and target["lr"] == 0.1
    assert np.array_equal(target["ms"].asnumpy(), np.arange(6))
    assert target["nested"] is nested and isinstance(nested[0], ms.Tensor)
    assert np.array_equal(nested[0].asnumpy(), np.full((2, 2), 2.5))
    assert torch.equal(nested[1], torch.ones(2))
    assert target["pair"] is pair and pair[0].asnumpy().tolist() == [True, False]
    assert pair[1].tolist() == [3, 4]


@_in_mindspore
def test_async_save_holds_the_values_at_the_call(tmp: Path):
    """Values changed after ``async_save`` returns stay out of the
    checkpoint; the CheckpointManager saves a Cell through it."""
    import mindspore as ms
    from mindspore import nn

    p = ms.Parameter(ms.Tensor(np.arange(8, dtype=np.float32)), name="p")
    t = ms.Tensor(np.ones((2, 3), np.float16)).astype(ms.bfloat16)
    response = dcp.async_save({"p": p, "t": t, "step": 1}, tmp / "a")
    p.copy_(ms.Tensor(np.full(8, -1, np.float32)))
    t.copy_(ms.Tensor(np.zeros((2, 3), np.float32)).astype(ms.bfloat16))
    response.result(timeout=120)
    target = {"p": torch.zeros(8), "t": torch.zeros(2, 3, dtype=torch.bfloat16), "step": 0}
    dcp.load(target, tmp / "a")
    assert torch.equal(target["p"], torch.arange(8.0)) and target["step"] == 1
    assert torch.equal(target["t"], torch.ones(2, 3, dtype=torch.bfloat16))
    assert np.array_equal(p.asnumpy(), np.full(8, -1))

    net = nn.Dense(3, 2)
    mgr = dcp.CheckpointManager(str(tmp / "run"), interval=1)
    assert mgr.save(1, {"model": net})
    mgr.close()
    fresh = nn.Dense(3, 2)
    fresh.weight.copy_(ms.Tensor(np.zeros((2, 3), np.float32)))
    again = dcp.CheckpointManager(str(tmp / "run"), interval=1)
    assert again.load_latest({"model": fresh}) == 1
    again.close()
    assert np.array_equal(fresh.weight.asnumpy(), net.weight.asnumpy())
    assert np.array_equal(fresh.bias.asnumpy(), net.bias.asnumpy())


@_in_mindspore
def test_unsupported_dtypes_name_the_fqn_before_anything_is_written(tmp: Path):
    import mindspore as ms

    for dtype in ("complex128", "hifloat8", "qint4x2"):
        bad = ms.Tensor(np.ones(2, np.float32 if dtype != "complex128" else np.complex128),
                        dtype=getattr(ms, dtype))
        where = tmp / dtype
        with pytest.raises(dcp.UnsupportedDtypeError, match=rf"'opt\.bad'.*{bad.dtype}"):
            dcp.save({"ok": torch.ones(2), "opt": {"bad": bad}}, where)
        assert not where.exists() or not any(where.iterdir()), dtype
        with pytest.raises(dcp.UnsupportedDtypeError, match=rf"'opt\.bad'.*{bad.dtype}"):
            dcp.async_save({"opt": {"bad": bad}}, where).result(timeout=120)
        assert not where.exists() or not any(where.iterdir()), dtype
    dcp.save({"opt": {"bad": torch.ones(2, dtype=torch.complex64)}}, tmp / "c")
    target = ms.Tensor(np.zeros(2, np.complex128))
    with pytest.raises(dcp.UnsupportedDtypeError, match=r"'opt\.bad'.*Complex128"):
        dcp.load({"opt": {"bad": target}}, tmp / "c")
    assert np.array_equal(target.asnumpy(), np.zeros(2))


@_in_mindspore
def test_dtype_mismatches_obey_allow_dtype_cast(tmp: Path):
    """A saved dtype other than the MindSpore target's raises unless
    ``allow_dtype_cast=True``, also a dtype MindSpore lacks."""
    import mindspore as ms

    values = torch.tensor([0.25, 2.0, 0.5, 8.0])
    dcp.save({"w": values, "e8": values.to(torch.float8_e8m0fnu)}, tmp / "c")
    for fqn in ("w", "e8"):
        target = ms.Parameter(ms.Tensor(np.zeros(4, np.float16)), name=fqn)
        with pytest.raises(dcp.CheckpointError, match=rf"'{fqn}'.*(float32|float8_e8m0fnu)"):
            dcp.load({fqn: target}, tmp / "c", strict=False)
        assert np.array_equal(target.asnumpy(), np.zeros(4))
        dcp.load({fqn: target}, tmp / "c", strict=False, allow_dtype_cast=True)
        assert target.dtype == ms.float16
        assert np.array_equal(target.asnumpy(), values.numpy().astype(np.float16)), fqn


def _layouts():
    """(device matrix, tensor map, global shape): MindSpore-style layouts,
    split and replicated dimensions, one dimension over two device
    dimensions (a tuple entry)."""
    return [((2,), (0, -1), (4, 6)), ((2,), (-1, 0), (4, 6)), ((2,), (-1, -1), (4, 6)),
            ((2, 1), (1, -1), (4, 3)), ((2, 4), (1, 0), (8, 12)), ((2, 4), (0, 1), (8, 12)),
            ((2, 4), (-1, 1), (5, 6)), ((2, 2, 2), (2, -1, 0), (4, 3, 6)),
            ((2, 2, 2), (0, 2, -1), (6, 4, 5)), ((4, 2), ((1, 0), -1), (16, 3)),
            ((2, 2, 2), ((2, 0), 1), (8, 6)), ((2, 2, 2), ((0, 2), -1), (8, 2)),
            ((3, 2), (-1, (0, 1)), (2, 12))]


@_in_mindspore
def test_layout_boxes_are_mindsporess_slices_on_every_rank(tmp: Path):
    """Every rank of every layout: the TensorShard's box holds exactly the
    values MindSpore's own ``_load_tensor`` gives that rank (tuple entries:
    through MindSpore's ``_expand_layout``), and its slice index agrees with
    ``_get_tensor_slice_index``."""
    import mindspore as ms
    from mindspore.parallel import _tensor

    for matrix, tmap, shape in _layouts():
        whole = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        boxes = set()
        for rank in range(int(np.prod(matrix))):
            if any(isinstance(e, tuple) for e in tmap):
                _, emap, eshape = _tensor._expand_layout(list(matrix), list(tmap), list(shape))
                expected = _tensor._load_tensor(ms.Tensor(whole.reshape(eshape)), list(matrix),
                                                emap, rank_id=rank)
            else:
                expected = _tensor._load_tensor(ms.Tensor(whole), list(matrix), list(tmap),
                                                rank_id=rank)
            local = ms.Tensor(np.ascontiguousarray(expected).reshape(-1))
            sizes = [d // s for d, s in zip(shape, _tensor._get_tensor_strategy(
                list(matrix), list(tmap)), strict=True)]
            shard = dcp.mindspore_shard(local.reshape(sizes), shape, matrix, tmap, rank)
            box = tuple(slice(o, o + s) for o, s in zip(shard.global_offsets, sizes, strict=True))
            assert np.array_equal(whole[box].reshape(-1), expected.reshape(-1)), (
                matrix, tmap, rank)
            assert tuple(shard.global_shape) == shape
            boxes.add(tuple(shard.global_offsets))
            if not any(isinstance(e, tuple) for e in tmap):
                strategy = _tensor._get_tensor_strategy(list(matrix), list(tmap))
                index = _tensor._get_tensor_slice_index(list(matrix), strategy, list(tmap), rank)
                flat = np.ravel_multi_index([o // s for o, s in zip(
                    shard.global_offsets, sizes, strict=True)], strategy)
                assert flat == int(index), (matrix, tmap, rank)
        splits = int(np.prod(_tensor._get_tensor_strategy(list(matrix), list(tmap))))
        assert len(boxes) == splits, (matrix, tmap)  # ranks of one box: replicas


@_in_mindspore
def test_layout_objects_give_the_helpers_arguments(tmp: Path):
    """``Layout(...)(...).to_dict()``'s device matrix and tensor map, alias
    names turned into device dimensions by MindSpore, give the boxes
    expected by hand."""
    from mindspore.parallel import Layout

    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    spec = layout(("dp", "mp"), "sp").to_dict()
    assert spec["tensor_map"] == ((2, 0), 1)
    data = torch.zeros(2, 3)
    offsets = [tuple(dcp.mindspore_shard(data, (8, 6), spec["device_matrix"],
                                         spec["tensor_map"], r).global_offsets)
               for r in range(8)]
    # rank = dp*4 + sp*2 + mp; rows: (dp, mp) major dp, cols: sp
    assert offsets == [(0, 0), (2, 0), (0, 3), (2, 3), (4, 0), (6, 0), (4, 3), (6, 3)]
    spec = layout("None", "mp").to_dict()
    assert [tuple(dcp.mindspore_shard(torch.zeros(4, 3), (4, 6), spec["device_matrix"],
                                      spec["tensor_map"], r).global_offsets)
            for r in range(8)] == [(0, 0), (0, 3)] * 4


def test_layout_errors_name_the_shape_and_layout():
    """Refusals of :func:`dcp.mindspore_shard` (no MindSpore needed)."""
    cases = [
        (torch.zeros(2, 3), (5, 3), (2,), (0, -1), 0, "size 5 cannot be split evenly 2 ways"),
        (torch.zeros(2, 3), (4, 3), (2,), (0,), 0, "one entry per dimension"),
        (torch.zeros(2, 3), (4, 3), (2,), (1, -1), 0, "at most once"),
        (torch.zeros(2, 3), (4, 6), (2, 2), (0, 0), 0, "at most once"),
        (torch.zeros(2, 3), (4, 3), (2,), (0, -1), 2, "rank 2 is not one of"),
        (torch.zeros(4, 3), (4, 3), (2,), (0, -1), 1, r"slice has shape \(4, 3\), not .*\(2, 3\)"),
        (torch.zeros(2, 3), (4, 3), (0, 1), (0, -1), 0, "sizes must be positive"),
    ]
    for data, shape, matrix, tmap, rank, message in cases:
        with pytest.raises(dcp.CheckpointError, match=message) as info:
            dcp.mindspore_shard(data, shape, matrix, tmap, rank)
        assert f"shape {shape}" in str(info.value)
    with pytest.raises(dcp.CheckpointError, match="rank_list has 3 ranks, the device matrix 2"):
        dcp.mindspore_shard(torch.zeros(2, 3), (4, 3), (2, 1), (1, -1), 0, rank_list=[0, 1, 2])
    with pytest.raises(dcp.CheckpointError, match="not alias names"):
        dcp.mindspore_shard(torch.zeros(2, 3), (4, 3), (2,), ("dp", "None"), 0)
    shard = dcp.mindspore_shard(torch.zeros(2, 3), (4, 3), (2,), (0, -1), 7, rank_list=[9, 7])
    assert tuple(shard.global_offsets) == (2, 0)


@needs_mindspore
def test_a_torch_only_job_never_imports_mindspore(tmp_path):
    """With mindspore installed, a torch save, async save and load (a
    Stateful module included) leave ``mindspore`` out of ``sys.modules``."""
    code = textwrap.dedent(f"""
        import sys, torch, dcp
        import dcp.core.mindspore_tensors
        model = torch.nn.Linear(3, 2)
        state = {{"model": model, "t": torch.arange(4.0), "step": 1}}
        dcp.save(state, {str(tmp_path / 'c')!r})
        dcp.async_save(state, {str(tmp_path / 'a')!r}).result(timeout=120)
        target = {{"model": torch.nn.Linear(3, 2), "t": torch.zeros(4), "step": 0}}
        dcp.load(target, {str(tmp_path / 'a')!r})
        assert torch.equal(target["t"], torch.arange(4.0)) and target["step"] == 1
        assert torch.equal(target["model"].weight, model.weight)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "mindspore"))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ----------------------------------------------- two ranks, one group


def _pieces(rank: int):
    """This rank's MindSpore shards, by :func:`dcp.mindspore_shard`, and the
    global values: rows split over (2,), columns over (2, 1), replicated."""
    import mindspore as ms

    rows = np.arange(24, dtype=np.float32).reshape(6, 4)
    cols = (np.arange(12, dtype=np.int64).reshape(2, 6) - 5) * 1000
    rep = np.linspace(-1, 1, 10).astype(np.float16).reshape(2, 5)
    state = {
        "rows": dcp.mindspore_shard(ms.Parameter(ms.Tensor(rows[3 * rank:3 * rank + 3]),
                                                 name="rows"), rows.shape, (2,), (0, -1), rank),
        "cols": dcp.mindspore_shard(ms.Tensor(cols[:, 3 * rank:3 * rank + 3]), cols.shape,
                                    (2, 1), (-1, 1), rank),
        "rep": dcp.mindspore_shard(ms.Tensor(rep), rep.shape, (2,), (-1, -1), rank),
        "step": 7,
    }
    return state, {"rows": rows, "cols": cols, "rep": rep}


@mindspore_scenario(2, phase=3)  # a group of its own: no other test's ranks import MindSpore
def test_two_ranks_save_mindspore_shards_of_global_tensors(ctx):
    """Each rank saves its MindSpore TensorShards (from the layout helper);
    replicas are written once; the ranks load their shards back; rank 0
    alone loads the whole tensors into MindSpore and into torch."""
    import mindspore as ms
    import torch.distributed as dist

    state, whole = _pieces(ctx.rank)
    path = ctx.dir / "ckpt"
    md = dcp.save(state, path)
    assert {f: len(t.chunks) for f, t in md.tensors.items()} == {"rows": 2, "cols": 2, "rep": 1}
    assert {f: t.shape for f, t in md.tensors.items()} == {
        f: a.shape for f, a in whole.items()}
    fresh, _ = _pieces(ctx.rank)
    for shard in (fresh["rows"], fresh["cols"], fresh["rep"]):
        shard.data.copy_(ms.Tensor(np.zeros(shard.data.shape, np.float32))
                         .astype(shard.data.dtype))
    fresh["step"] = 0
    dcp.load(fresh, path)
    for fqn in whole:
        assert raw_bytes(fresh[fqn].data) == raw_bytes(state[fqn].data), (ctx.rank, fqn)
    assert fresh["step"] == 7
    solo = dist.new_group([0])
    error = [None]
    if ctx.rank == 0:
        try:
            into_ms = {f: ms.Tensor(np.zeros(a.shape, a.dtype)) for f, a in whole.items()}
            into_torch = {f: torch.zeros(a.shape, dtype=getattr(torch, str(a.dtype)))
                          for f, a in whole.items()}
            dcp.load(into_ms, path, process_group=solo, strict=False)
            dcp.load(into_torch, path, process_group=solo, strict=False)
            for fqn, a in whole.items():
                assert np.array_equal(into_ms[fqn].asnumpy(), a), fqn
                assert np.array_equal(into_torch[fqn].numpy(), a), fqn
        except BaseException as e:  # noqa: BLE001 - carried to every rank
            error = [f"{type(e).__name__}: {e}\n{traceback.format_exc()}"]
    dist.broadcast_object_list(error, src=0)
    assert error[0] is None, f"on rank 0: {error[0]}"

