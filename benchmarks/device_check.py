"""The device check: hyperdcp's accelerator paths on a real GPU or NPU, in a
few minutes.

    python -m benchmarks.device_check [--gib 1 4] [--scratch DIR]

One line per check, ``PASS`` or ``FAIL``, then the exit status: 0 when every
check passed, 1 when one failed, 2 on a machine without an accelerator
(nothing to check).  Everything goes through ``torch.accelerator`` and
``torch.get_device_module``, so CUDA and torch_npu run the same checks.

1. ``async-staging``: ``dcp.async_save`` of accelerator tensors with
   ``blocking_staging`` True and False: the staging buffer is page-locked,
   no page-locking warning, and the checkpoint holds the values of the call
   after an in-place update that follows it (after ``response.staged`` for
   non-blocking staging).
2. ``side-stream``: on a stream of the caller's, a save of values still
   being computed there and a load into strided (a column box: a
   Shard(0) -> Shard(1) reshard's target) and cast targets that the caller
   wrote to just before: exact right after ``load`` returns, read on that
   stream, without a synchronization; the sync save's staging page-locked
   and reused; a fingerprint sampled on the device equal to the host's.
3. ``world``: with 2 devices, 2 processes on the accelerator's backend
   (NCCL, HCCL) after ``set_device``: DTensor Shard(0) -> Shard(1), a
   replicated load by broadcast (device-sampled replica fingerprints on
   save), meta targets materialized on each rank's device, a manager on
   each of two subgroups, a conversion shared over the world; with 1 device
   the same in one process with a gloo group.
4. ``rng``: the RNG state of a rank on device 1 of 2 visible, restored in a
   process that sees only that device (as device 0), draws the same (with
   1 device: across a visible-devices setting that names it).
5. ``page-lock-refusal``: a refused page-lock (memory registered twice)
   warns, and the next kernel runs.
6. ``stall-<N>GiB``: the ``async_save`` stall of N GiB of accelerator
   tensors against torch DCP's (``AsyncCheckpointerType.PROCESS``, pinned
   shared-memory staging), as a ratio, and the staging's device-to-host
   bandwidth against one ``copy_`` into page-locked memory (the runtime's
   memcpy); exact bytes checked once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .common import free_port

#: each accelerator type's visible-devices variable
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def _device() -> torch.device:
    kind = torch.accelerator.current_accelerator(check_available=True)
    assert kind is not None
    return torch.device(kind.type, torch.accelerator.current_device_index())


def _busy(device: torch.device, rounds: int = 30) -> None:
    """Queue some tens of ms of work on the current stream."""
    a = torch.randn(4096, 4096, device=device)
    for _ in range(rounds):
        a = torch.tanh(a @ a)


def _exact(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-exact; the host copy of ``actual`` is made on the current stream."""
    actual, expected = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if not torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)):
        raise AssertionError(f"{what}: values differ")


def check_async_staging(scratch: Path) -> str:
    import dcp
    from dcp.asynchronous import async_save as module

    device = _device()
    out = []
    for blocking in (True, False):
        state = {f"t{i}": torch.randn(1024, 1024, device=device) for i in range(8)}
        expected = {k: v.cpu() for k, v in state.items()}
        path = str(scratch / f"async-{blocking}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            response = dcp.async_save(state, path, blocking_staging=blocking)
            if not blocking:
                response.staged.result()
            for v in state.values():
                v.add_(1)  # in place, after the call
            response.result()
        locking = [str(w.message) for w in caught if "page-locking" in str(w.message)]
        assert not locking, locking
        buffer = module._savers[None].stager.layout.buffer
        assert buffer.is_pinned(), "the async staging buffer is not page-locked"
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(target, path)
        for k, v in expected.items():
            _exact(target[k], v, f"{k} (blocking_staging={blocking})")
        out.append(f"blocking_staging={blocking}: pinned, exact")
    return "; ".join(out)


def check_side_stream(scratch: Path) -> str:
    import dcp
    from dcp.core import devices, tensors
    from dcp.core.metadata import checksum
    from dcp.orchestration import save as save_module

    device = _device()
    side = torch.Stream(device=device)
    caller = torch.accelerator.current_stream(device)
    rows, cols = 2048, 1024
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    path = str(scratch / "side-stream")
    torch.accelerator.set_stream(side)
    try:
        x = torch.zeros(rows, cols, device=device)
        _busy(device)
        x.copy_(full.to(device, non_blocking=True) * 2)  # still queued when save is called
        dcp.save({"w": x, "v": x[:, :64] + 1}, path)
        allocations = save_module._host_staging.allocations
        dcp.save({"w": x, "v": x[:, :64] + 1}, path, overwrite=True)
        assert save_module._host_staging.allocations == allocations, "staging reallocated"
        assert save_module._host_staging.buffer.is_pinned(), "sync save staging not page-locked"
        # targets the caller writes just before the load: a column box of a
        # row-major tensor (strided) and a cast one
        whole = torch.empty(rows, cols, device=device)
        cast = torch.empty(rows, 64, dtype=torch.float64, device=device)
        _busy(device)
        whole.fill_(-1)
        cast.fill_(-1)
        box = whole[:, 256:768]
        target = {"w": dcp.TensorShard(box, (rows, cols), (0, 256)), "v": cast}
        dcp.load(target, path, allow_dtype_cast=True)
        # read on the stream, right after the call
        _exact(box * 1, (full * 2)[:, 256:768], "strided target")
        _exact(cast * 1, ((full * 2)[:, :64] + 1).double(), "cast target")
        _exact(whole[:, :256] * 1, torch.full((rows, 256), -1.0), "outside the box")
        sample_at = save_module.sample_ranges(x.numel() * x.element_size())
        on_device = checksum(tensors.byte_view(devices.byte_sample(x, sample_at).cpu()))
        assert on_device == save_module.fingerprint(tensors.byte_view(x.cpu())), "fingerprints"
    finally:
        torch.accelerator.set_stream(caller)
    return "save and load exact on a side stream; staging pinned and reused; fingerprint equal"


def _world_worker(rank: int, world_size: int, port: int, scratch: str, out: str) -> None:
    device_type = torch.accelerator.current_accelerator().type
    torch.accelerator.set_device_index(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = dist.get_default_backend_for_device(device_type)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        _world_checks(rank, world_size, device_type, Path(scratch))
        Path(out, f"rank{rank}").write_text("ok")
    except BaseException:
        Path(out, f"rank{rank}").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _world_checks(rank: int, world_size: int, device_type: str, scratch: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dcp
    from dcp.interop.safetensors_io import checkpoint_to_safetensors, safetensors_to_checkpoint
    from planners.load import DefaultLoadPlanner

    device = _device()
    g = torch.Generator().manual_seed(3)
    full = {"a": torch.randn(64, 48, generator=g), "r": torch.randn(128, 32, generator=g)}
    mesh = init_device_mesh(device_type, (world_size,))
    sharded = str(scratch / "world-sharded")
    dcp.save({"a": distribute_tensor(full["a"].to(device), mesh, [Shard(0)]),
              "r": full["r"].to(device)}, sharded)  # "r": replicated, fingerprinted on device
    target = {"a": distribute_tensor(torch.zeros(64, 48, device=device), mesh, [Shard(1)]),
              "r": torch.zeros(128, 32, device=device)}
    dcp.load(target, sharded, planner=DefaultLoadPlanner(replica_path="broadcast"))
    loaded = target["a"].full_tensor() if world_size > 1 else target["a"].to_local()
    _exact(loaded, full["a"], "Shard(0) -> Shard(1)")
    _exact(target["r"], full["r"], "replicated, by broadcast")
    meta = {"r": torch.empty(128, 32, device="meta")}
    report = dcp.load(meta, sharded)
    assert report.materialized == ["r"] and meta["r"].device == device, meta["r"].device
    _exact(meta["r"], full["r"], "materialized")
    groups = [dist.new_group([r]) for r in range(world_size)]
    with dcp.CheckpointManager(scratch / f"run-{rank}", process_group=groups[rank],
                               async_save=False) as mgr:
        assert mgr.save(1, {"r": target["r"]}, force=True)
    folder = str(scratch / "world-hf")
    checkpoint_to_safetensors(sharded, folder, process_group=dist.group.WORLD, overwrite=True)
    back = str(scratch / "world-back")
    safetensors_to_checkpoint(folder, back, process_group=dist.group.WORLD, overwrite=True)
    again = {"r": torch.zeros(128, 32, device=device)}
    dcp.load(again, back)
    _exact(again["r"], full["r"], "converted and back")


def check_world(scratch: Path) -> str:
    count = torch.accelerator.device_count()
    if count >= 2:
        import torch.multiprocessing as mp

        out = scratch / "world-results"
        out.mkdir()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # hyperdcp's gloo groups, one host
        try:
            mp.spawn(_world_worker, args=(2, free_port(), str(scratch), str(out)), nprocs=2)
        except Exception:
            failed = {p.name: p.read_text() for p in out.iterdir() if p.read_text() != "ok"}
            raise AssertionError(json.dumps(failed)[-2000:]) from None
        backend = dist.get_default_backend_for_device(_device().type)
        return f"2 processes on {backend}: reshard, broadcast, meta, managers, conversion exact"
    _world_checks(0, 1, _device().type, scratch)
    return "1 device: one process, gloo group: reshard, meta, manager, conversion exact"


_RNG_CODE = """
import json, sys, torch
from dcp.manager import rng
torch.accelerator.set_device_index(int(sys.argv[2]))
device = torch.device(torch.accelerator.current_accelerator().type, int(sys.argv[2]))
if sys.argv[1] == "capture":
    torch.rand(8, device=device)
    state = rng.capture()
else:
    state = json.loads(open(sys.argv[3]).read())
    rng.restore(state, "device check")
draws = torch.rand(4, device=device).tolist()
if sys.argv[1] == "capture":
    open(sys.argv[3], "w").write(json.dumps(state))
print(json.dumps(draws))
"""


def check_rng(scratch: Path) -> str:
    kind = _device().type
    variable = VISIBLE.get(kind)
    if variable is None:
        raise AssertionError(f"no visible-devices variable known for {kind}")
    two = torch.accelerator.device_count() >= 2
    first, second = (("0,1", 1), ("1", 0)) if two else ((None, 0), ("0", 0))
    state = scratch / "rng.json"
    draws = []
    for (visible, index), step in ((first, "capture"), (second, "restore")):
        env = dict(os.environ)
        env.pop(variable, None)
        if visible is not None:
            env[variable] = visible
        done = subprocess.run([sys.executable, "-c", _RNG_CODE, step, str(index), str(state)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        draws.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert draws[0] == draws[1], draws
    return (f"{variable}={first[0]} device {first[1]} -> {variable}={second[0]} device "
            f"{second[1]}: same draws")


def check_page_lock_refusal(scratch: Path) -> str:
    from dcp.core import devices

    device = _device()
    buffer = torch.empty(1 << 20, dtype=torch.uint8)
    assert devices.page_lock(buffer, device.type), "the first page-lock failed"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not devices.page_lock(buffer, device.type), "registered twice"
    assert any("page-locking" in str(w.message) for w in caught), "no warning"
    y = torch.ones(1024, device=device) * 3  # a kernel after the refusal
    torch.accelerator.synchronize()
    assert y.sum().item() == 3072
    return "refusal warned, next kernel ran"


def check_stall(scratch: Path, gib: float) -> str:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import dcp

    device = _device()
    n = 16
    numel = int(gib * (1 << 30)) // 4 // n
    state = {f"t{i}": torch.randn(numel, device=device) for i in range(n)}
    nbytes = numel * 4 * n
    torch.accelerator.synchronize()
    ours = []
    for k in range(2):  # the first pays the worker's start and the buffer
        path = str(scratch / f"stall-ours-{k}")
        start = time.perf_counter()
        response = dcp.async_save(state, path)
        ours.append(time.perf_counter() - start)
        response.result()
        if k == 0:
            target = {key: torch.empty_like(v) for key, v in state.items()}
            dcp.load(target, path)
            for key, v in state.items():
                _exact(target[key], v, key)
        shutil.rmtree(path)
    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True,
                                          use_async_staging=False, use_non_blocking_copy=True))
    theirs = []
    try:
        for k in range(2):
            path = str(scratch / f"stall-torch-{k}")
            start = time.perf_counter()
            future = tdcp.async_save(state, storage_writer=tdcp.FileSystemWriter(path),
                                     async_stager=stager,
                                     async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            theirs.append(time.perf_counter() - start)
            (future.upload_completion if hasattr(future, "upload_completion") else future).result()
            shutil.rmtree(path)
    finally:
        stager.close()
    pinned = torch.empty(nbytes // n, dtype=torch.uint8, pin_memory=True)
    flat = [v.view(torch.uint8) for v in state.values()]
    torch.accelerator.synchronize()
    start = time.perf_counter()
    for src in flat:
        pinned.copy_(src, non_blocking=True)
    torch.accelerator.synchronize()
    memcpy = time.perf_counter() - start
    return (f"stall {ours[1]:.3f} s vs torch DCP PROCESS {theirs[1]:.3f} s "
            f"(ratio {ours[1] / theirs[1]:.2f}); staging {nbytes / ours[1] / 1e9:.1f} GB/s vs "
            f"memcpy {nbytes / memcpy / 1e9:.1f} GB/s (ratio {memcpy / ours[1]:.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0],
                        help="sizes of the stall check (GiB of accelerator tensors)")
    parser.add_argument("--scratch", default=None, help="folder for the checkpoints (temporary)")
    args = parser.parse_args(argv)
    if not torch.accelerator.is_available():
        print("device_check: torch finds no accelerator (torch.accelerator.is_available() is "
              "False): nothing to check; run it on a machine with a GPU or NPU")
        return 2
    torch.accelerator.set_device_index(0)
    scratch = Path(tempfile.mkdtemp(prefix="hyperdcp-device-check-", dir=args.scratch))
    store = dist.FileStore(str(scratch / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    checks: list[tuple[str, Callable[[Path], str]]] = [
        ("async-staging", check_async_staging), ("side-stream", check_side_stream),
        ("world", check_world), ("rng", check_rng),
        ("page-lock-refusal", check_page_lock_refusal)]
    checks += [(f"stall-{gib:g}GiB", lambda path, gib=gib: check_stall(path, gib))
                for gib in args.gib]
    failed = 0
    try:
        for name, check in checks:
            start = time.perf_counter()
            try:
                detail = check(scratch)
                print(f"PASS {name} ({time.perf_counter() - start:.1f} s): {detail}", flush=True)
            except Exception as e:
                failed += 1
                where = traceback.extract_tb(e.__traceback__)[-1]
                print(f"FAIL {name} ({time.perf_counter() - start:.1f} s): {type(e).__name__}: "
                      f"{e} [{Path(where.filename).name}:{where.lineno}]", flush=True)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
