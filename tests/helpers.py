"""Small shared helpers for the dcp tests (comparison, deterministic data, files)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
import threading
from pathlib import Path

import pytest
import torch

from storage_plugins.posix import PosixStorage

ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def random_tensor(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Deterministic tensor (same on every rank for the same seed).

    Floating / complex dtypes get *random bit patterns*, so NaNs, infinities,
    denormals and negative zeros occur: comparisons must be bitwise."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape).clone()


def randn(shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    """Deterministic normal values (finite), for tests that do arithmetic."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in logical (row-major) element order."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same shape, same dtype, same bits for every element (NaN-safe)."""
    prefix = f"{what}: " if what else ""
    assert isinstance(actual, torch.Tensor), (
        f"{prefix}expected a tensor, got {type(actual).__name__}")
    assert actual.dtype == expected.dtype, f"{prefix}dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{prefix}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    if not torch.equal(bits(actual), bits(expected)):
        a, e = bits(actual), bits(expected)
        first = int((a != e).nonzero()[0]) if a.numel() else -1
        raise AssertionError(
            f"{prefix}{int((a != e).sum())} of {a.numel()} bytes differ (first at byte {first})"
        )


def data_bytes_on_disk(ckpt: Path) -> int:
    """Sum of the sizes of all ``*.data`` files under a checkpoint directory."""
    return sum(p.stat().st_size for p in Path(ckpt).rglob("*.data"))


def assert_names(msg: str, *needles: str) -> None:
    for n in needles:
        assert n in msg, f"error message does not name {n!r}: {msg!r}"


def shape_pattern(shape) -> str:
    """Regex matching a shape printed as (4, 6), [4, 6], torch.Size([4, 6]) or 4x6."""
    return r"[\(\[]?\s*" + r"\s*(?:,|x)\s*".join(str(s) for s in shape) + r"\s*[\)\]]?"


def mentions_shape(msg: str, shape) -> bool:
    return re.search(r"(?<![\d])" + shape_pattern(shape) + r"(?![\d])", msg) is not None


# ------------------------------------------------------ storage fault injection
class FailingStorage(PosixStorage):
    """Raises ``OSError`` (ENOSPC) on the ``fail_on``-th ``write_file`` call
    (0: never) and on every later attempt to write that file, so the error
    outlasts the core's retries.

    ``write_file`` runs in the save's writer threads, so the error starts in
    one of them."""

    def __init__(self, *args, fail_on: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_on = fail_on
        self.calls = 0
        self.lock = threading.Lock()
        self.failed_name = None
        self.failed_in_thread = None

    def write_file(self, name, buffers):
        with self.lock:
            self.calls += 1
            n = self.calls
        if n == self.fail_on:
            self.failed_name = name
            self.failed_in_thread = threading.current_thread().name
        if name == self.failed_name:
            raise OSError(28, "injected: no space left on device", name)
        return super().write_file(name, buffers)


# --------------------------------------------------------------- DTensor
def placements_of(spec: str):
    """'S0' -> Shard(0), 'S1' -> Shard(1), 'R' -> Replicate(); 'S0,S1' for 2-D meshes."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in spec.split(","):
        p = p.strip()
        out.append(Replicate() if p == "R" else Shard(int(p[1:])))
    return out


def make_dtensor(full: torch.Tensor, mesh, placements):
    """The DTensor with ``placements`` whose global value is ``full`` (which must
    be identical on every rank; no communication: every rank slices its own
    shard, so any dtype works over gloo)."""
    from torch.distributed.tensor import distribute_tensor

    if isinstance(placements, str):
        placements = placements_of(placements)
    return distribute_tensor(full, mesh, placements, src_data_rank=None)


def zeros_dtensor(shape, dtype, mesh, placements):
    return make_dtensor(torch.zeros(shape, dtype=dtype), mesh, placements)


def assert_dtensor_equals_full(actual, full: torch.Tensor, what: str = "") -> None:
    """``actual``'s local shard is exactly the part of ``full`` it should hold."""
    expected = make_dtensor(full, actual.device_mesh, list(actual.placements))
    assert tuple(actual.shape) == tuple(full.shape), f"{what}: global shape {tuple(actual.shape)}"
    assert_bitwise_equal(actual.to_local(), expected.to_local(), what)


class RecordingKinds:
    """Mixed into a coordinator (before it): keeps, on the coordinator, the
    type names of the write results it gathered, one set per step."""

    kinds: list[set[str]]

    def _gather(self, step, phase, obj):
        parts = super()._gather(step, phase, obj)  # type: ignore[misc]
        if parts is not None:
            self.kinds.append({type(v[3]).__name__ for v, _ in parts
                               if isinstance(v, tuple) and len(v) == 5})
        return parts


#: Whether MindSpore is installed (``make test`` installs the ``mindspore`` extra).
HAVE_MINDSPORE = importlib.util.find_spec("mindspore") is not None
needs_mindspore = pytest.mark.skipif(
    not HAVE_MINDSPORE, reason="mindspore is not installed (pip install 'hyperdcp[mindspore]')")


def raw_bytes(t) -> bytes:
    """The raw row-major bytes of a torch or MindSpore tensor."""
    if isinstance(t, torch.Tensor):
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return t.asnumpy().tobytes()


def mindspore_scenario(world_size: int = 2, **kwargs):
    """``dist_scenario(world_size, **kwargs)`` where MindSpore is installed;
    without it a test that skips (and no scenario registered, so no group
    runs it)."""
    from dist_harness import dist_scenario

    def deco(fn):
        if HAVE_MINDSPORE:
            return dist_scenario(world_size, **kwargs)(fn)

        @needs_mindspore
        def skipped():
            pass

        skipped.__name__ = skipped.__qualname__ = fn.__name__
        skipped.__doc__ = fn.__doc__
        return skipped

    return deco


#: A torch.distributed backend registered, as NCCL and HCCL are, for an
#: accelerator device type only (see :func:`accelerator_world`).
ACCELERATOR_ONLY = "test_accelerator_only"


def _accelerator_only_backend(store, rank, size, timeout):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


@contextlib.contextmanager
def accelerator_world(ctx, timeout_s: float = 60.0):
    """Inside a ``dist_scenario``: the job's default group made again, for
    the block, on :data:`ACCELERATOR_ONLY`, a backend registered for
    ``"cuda"`` only; then a gloo default group again.  Like an NCCL or HCCL
    job's world, it has no backend for host tensors: a collective on one
    raises ``No backend type associated with device type cpu`` (it never
    carries a tensor: this machine has no accelerator), and every group made
    without a backend inherits it."""
    import datetime

    import torch.distributed as dist

    if ACCELERATOR_ONLY not in dist.Backend.backend_list:
        dist.Backend.register_backend(ACCELERATOR_ONLY, _accelerator_only_backend,
                                      devices=["cuda"])
    store = dist.FileStore(str(ctx.dir / "accelerator-world-store"), ctx.world_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.destroy_process_group()
    dist.init_process_group(ACCELERATOR_ONLY, store=dist.PrefixStore("accelerator", store),
                            rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timeout)


def from_rank0(value_on_rank0):
    """``value_on_rank0()`` computed on rank 0 of the default group and
    broadcast: the same value on every rank."""
    import torch.distributed as dist

    box = [value_on_rank0() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wait_for(path: Path, timeout: float = 300.0) -> str:
    """The text of ``path`` once another process has written it (a wait
    outside any collective, whose timeout a long job would outlast)."""
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written within {timeout} s"
        time.sleep(0.05)
    return path.read_text()


def assert_same_state(actual, expected, where: str = "") -> None:
    """Nested dicts and lists equal, their tensors bit for bit
    (:func:`assert_bitwise_equal`); ``where`` names the path in failures."""
    if isinstance(expected, torch.Tensor):
        assert_bitwise_equal(actual, expected, where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), \
            (where, sorted(actual), sorted(expected))
        for k in expected:
            assert_same_state(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(a, e, f"{where}.{i}")
    else:
        assert actual == expected, (where, actual, expected)
