"""The accelerator pieces that run without one (one process, no ranks):
page-locking through a stubbed runtime, RNG capture and restore through a
stubbed accelerator module, replica fingerprints sampled where a tensor
lives, and meta targets materialized where the load says.  What needs a
real device (streams, DMA copies) is ``benchmarks/device_check.py``'s."""

from __future__ import annotations

import base64
import gc
import json

import pytest
import torch

import dcp
from dcp.asynchronous.staging import ChunkSpec, Stager
from dcp.core import devices, tensors
from dcp.core.metadata import checksum
from dcp.manager import rng
from dcp.orchestration.save import REPLICA_SAMPLE_BYTES, fingerprint, sample_ranges
from helpers import assert_bitwise_equal, random_tensor


class _Runtime:
    """A page-locking runtime that records its calls and fails with ``code``."""

    def __init__(self) -> None:
        self.code = 0
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.cleared = 0

    def make(self) -> devices._Runtime:
        def register(address: int, nbytes: int) -> int:
            self.registered.append((address, nbytes))
            return self.code

        def unregister(address: int) -> int:
            self.unregistered.append(address)
            return 0

        def clear() -> None:
            self.cleared += 1

        return devices._Runtime(register, unregister, clear)


def test_page_lock_skips_no_bytes_warns_on_a_refusal_and_unlocks_when_freed(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setitem(devices.RUNTIMES, "cuda", runtime.make)
    # async save's staging of chunks that hold no bytes: nothing to register
    empty = ChunkSpec("w", (0, 4), "float32", (0, 0), (0, 4), 0, (0, 1), "cuda")
    Stager()._allocate([empty])
    assert devices.page_lock(torch.empty(0, dtype=torch.uint8), "cuda") is False
    assert runtime.registered == []
    runtime.code = 1  # cudaErrorInvalidValue
    refused = torch.empty(4096, dtype=torch.uint8)
    with pytest.warns(UserWarning, match=r"page-locking 4096 bytes .* for cuda failed \(error 1\)"):
        assert devices.page_lock(refused, "cuda") is False
    assert runtime.cleared == 1  # else the next kernel of the trainer reports it
    runtime.code = 0
    buffer = torch.empty(1 << 16, dtype=torch.uint8)
    address = buffer.data_ptr()
    assert devices.page_lock(buffer, "cuda") is True
    assert runtime.registered[-1] == (address, 1 << 16)
    view = buffer[10:20]
    del buffer
    gc.collect()
    assert runtime.unregistered == []  # a view still holds the memory
    del view
    gc.collect()
    assert runtime.unregistered == [address]
    assert devices.page_lock(torch.empty(8, dtype=torch.uint8), "xpu") is False  # no runtime


class _Generators:
    """A stubbed accelerator module: one 16-byte generator state per device."""

    def __init__(self, count: int, seed: int) -> None:
        self.states = [torch.full((16,), seed + i, dtype=torch.uint8) for i in range(count)]

    def get_rng_state(self, index: int) -> torch.Tensor:
        return self.states[index].clone()

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        self.states[index] = state.clone()


def _on(monkeypatch, device: torch.device | None, module: _Generators | None) -> None:
    monkeypatch.setattr(devices, "current_device", lambda: device)
    real = torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module",
                        lambda kind=None: module if device is not None and kind == device.type
                        else real(kind))


def test_rng_saves_the_current_device_generator_and_restores_it_on_any_device_count(
        monkeypatch):
    eight = _Generators(8, seed=10)
    _on(monkeypatch, torch.device("cuda", 5), eight)
    state = json.loads(json.dumps(rng.capture()))  # as the per-rank record keeps it
    assert state["accelerator"] == {
        "device": "cuda", "state": base64.b64encode(bytes([15] * 16)).decode()}
    # resumed where one device is visible (CUDA_VISIBLE_DEVICES=5): its device 0
    one = _Generators(1, seed=0)
    _on(monkeypatch, torch.device("cuda", 0), one)
    rng.restore(state, "step 3, rank 5")
    assert one.states[0].tolist() == [15] * 16
    # another accelerator type, or none: that generator stays as it is
    xpu = _Generators(2, seed=40)
    _on(monkeypatch, torch.device("xpu", 1), xpu)
    with pytest.warns(UserWarning, match="step 3, rank 5: the RNG state holds a cuda generator, "
                                         "this process has a xpu accelerator"):
        rng.restore(state, "step 3, rank 5")
    assert xpu.states[1].tolist() == [41] * 16
    _on(monkeypatch, None, None)
    with pytest.warns(UserWarning, match="this process has no accelerator"):
        rng.restore(state, "step 3, rank 5")
    assert "accelerator" not in rng.capture()


@pytest.mark.parametrize("shape", [(3, 5), (1024, 1027)])  # under and over the sample size
def test_a_replica_sampled_where_it_lives_has_the_host_fingerprint(shape):
    t = random_tensor(shape, torch.float32, seed=5)
    for view in (t, t.t()):  # contiguous, and as a strided view
        nbytes = view.numel() * view.element_size()
        sample = devices.byte_sample(view, sample_ranges(nbytes))
        assert sample.numel() == min(nbytes, REPLICA_SAMPLE_BYTES)
        host = fingerprint(tensors.byte_view(tensors.to_host(view)))
        assert checksum(tensors.byte_view(sample)) == host


def test_meta_targets_are_materialized_on_the_device_the_load_names(tmp_path, monkeypatch):
    saved = {"w": random_tensor((4, 6), torch.float32, seed=1)}
    dcp.save(saved, str(tmp_path / "ckpt"))
    target = {"w": torch.empty(4, 6, device="meta")}
    report = dcp.load(target, str(tmp_path / "ckpt"), device="cpu")
    assert report.materialized == ["w"] and target["w"].device.type == "cpu"
    assert_bitwise_equal(target["w"], saved["w"], "w")
    meta = torch.empty(2, device="meta")
    # by default the current accelerator, with its index; the host without one
    monkeypatch.setattr(devices, "current_device", lambda: torch.device("cuda", 3))
    assert tensors._materialize_device(meta, None) == torch.device("cuda", 3)
    assert tensors._materialize_device(meta, "cpu") == torch.device("cpu")
    monkeypatch.setattr(devices, "current_device", lambda: None)
    assert tensors._materialize_device(meta, None) == torch.device("cpu")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="runs the checks on a device")
def test_the_device_check_says_there_is_nothing_to_check_without_an_accelerator(capsys):
    from benchmarks import device_check

    assert device_check.main([]) == 2
    assert "torch finds no accelerator" in capsys.readouterr().out
