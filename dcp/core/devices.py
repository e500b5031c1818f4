"""Accelerator devices: where copies run, page-locked host memory, the
current device.

hyperdcp never issues a collective on an accelerator communicator (NCCL,
HCCL): coordination and the broadcasts of a load run on gloo, in host
memory.  What touches a device is copies (device to host when a save
stages, host to device when a load fills its targets), and this module
says how they run, with one path for every accelerator through
``torch.accelerator`` and ``torch.get_device_module`` (CUDA and ROCm,
torch_npu's NPU, ...):

* on the caller's current stream (:class:`CallerStreams`): a copy queued
  there runs after the work the caller queued before the call and before
  the work it queues after, so values are exact when the call returns, on
  the stream the caller computes on, without a synchronization;
* from or into page-locked host memory where the copy is large
  (:func:`page_lock`, :class:`HostStaging`), so it is a DMA transfer that
  overlaps other work; a page-locked buffer is reused from call to call;
* a target materialized for a load goes to :func:`current_device`, the
  accelerator :func:`torch.accelerator.set_device_index` (or
  ``torch.cuda.set_device``) chose, with its index, as torch DCP puts it on
  its group's device.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: Bytes each staged tensor's start is aligned to in a :class:`HostStaging`
#: buffer (and a page for the buffer's start: page-locking works on pages).
ALIGN = 64
PAGE = 4096


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is an accelerator's (not the host's, nor meta)."""
    return device.type not in ("cpu", "meta")


def current_device() -> torch.device | None:
    """This thread's current accelerator device, with its index
    (``cuda:3``), or ``None`` where torch finds no accelerator."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        return None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


class CallerStreams:
    """The current stream, on the calling thread, of each accelerator device
    of ``tensors`` (none for host tensors).

    Worker threads start on each device's default stream; one that runs
    :meth:`enter` first queues its copies on the caller's streams instead
    (pass it as a ``ThreadPoolExecutor``'s ``initializer``), ordered with the
    caller's work as if the caller had made them."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        devices = {t.device for t in tensors if is_accelerator(t.device)}
        self.streams = [torch.accelerator.current_stream(d)
                        for d in sorted(devices, key=lambda d: (d.type, d.index or 0))]

    def __bool__(self) -> bool:
        return bool(self.streams)

    def enter(self) -> None:
        """Make the caller's streams this thread's current ones."""
        for stream in self.streams:
            torch.accelerator.set_stream(stream)

    def record(self) -> list[torch.Event]:
        """Events marking what this thread has queued on the streams so far."""
        events = []
        for stream in self.streams:
            event = torch.Event(device=stream.device)
            event.record(stream)
            events.append(event)
        return events


def copy_from_devices(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Event]:
    """Queue the copy of each accelerator ``source`` into its host ``view``
    (``(view, source)`` pairs; host sources are left to the caller) on the
    current stream of its device, without waiting; returns one event per
    device, recorded after them: once they are done, so are the copies."""
    devices = set()
    with torch.no_grad():
        for view, source in pairs:
            if is_accelerator(source.device):
                view.copy_(source, non_blocking=True)
                devices.add(source.device)
    events = []
    for device in devices:
        events.append(torch.Event(device=device))
        events[-1].record(torch.accelerator.current_stream(device))
    return events


# ---------------------------------------------------------------- page-locking


@dataclass(frozen=True)
class _Runtime:
    """How an accelerator's runtime page-locks existing host memory:
    ``register(address, nbytes)`` and ``unregister(address)`` return the
    runtime's error code (0: success); ``clear_error()`` forgets a failed
    call's error where the runtime keeps it for the next one."""

    register: Callable[[int, int], int]
    unregister: Callable[[int], int]
    clear_error: Callable[[], None]


def _cuda_clear_error() -> None:
    """``cudaGetLastError()`` of the CUDA runtime this process loaded: a
    failed ``cudaHostRegister`` leaves its error there, and torch's check
    after the next kernel launch would report it as that kernel's."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
    for path in sorted(paths):
        ctypes.CDLL(path).cudaGetLastError()


def _cuda() -> _Runtime:
    cudart = torch.cuda.cudart()
    return _Runtime(lambda address, n: int(cudart.cudaHostRegister(address, n, 0)),
                    lambda address: int(cudart.cudaHostUnregister(address)), _cuda_clear_error)


#: ``ACL_HOST_REG_MAPPED``: page-locked and mapped, at full DMA bandwidth
#: (page-locked only is measured slower by DeepSpeed's NPU accelerator)
_ACL_HOST_REG_MAPPED = 0x2


def _npu() -> _Runtime | None:
    module = torch.get_device_module("npu")
    if not hasattr(module, "npurt"):  # torch_npu without npuHostRegister
        return None
    npurt = module.npurt()
    return _Runtime(
        lambda address, n: int(npurt.npuHostRegister(address, n, _ACL_HOST_REG_MAPPED)),
        lambda address: int(npurt.npuHostUnregister(address)), lambda: None)


#: The runtimes that can page-lock memory torch did not allocate, by device
#: type (torch's own ``pin_memory`` allocates new memory instead).
RUNTIMES: dict[str, Callable[[], _Runtime | None]] = {"cuda": _cuda, "npu": _npu}


def page_lock(buffer: torch.Tensor, device_type: str) -> bool:
    """Page-lock the memory of ``buffer`` (a contiguous host tensor) for DMA
    transfers with ``device_type``'s devices, until its storage is freed;
    returns whether it is.

    A buffer of no bytes is left alone (the runtime refuses to register
    nothing), and so is one on an accelerator whose runtime cannot register
    memory it did not allocate (torch_npu before ``npurt``).  A refusal (no
    more page-locked memory, a system without the feature) leaves the buffer
    pageable, where copies are as exact and slower: a warning says so, and
    the runtime's error is cleared, or it would fail the caller's next
    kernel."""
    nbytes = buffer.numel() * buffer.element_size()
    factory = RUNTIMES.get(device_type)
    if not nbytes or factory is None:
        return False
    runtime = factory()
    if runtime is None:
        return False
    address = buffer.data_ptr()
    code = runtime.register(address, nbytes)
    if code:
        runtime.clear_error()
        warnings.warn(f"page-locking {nbytes} bytes of host staging memory for {device_type} "
                      f"failed (error {code}): copies from and to it stay pageable (slower)",
                      stacklevel=2)
        return False
    weakref.finalize(buffer.untyped_storage(), runtime.unregister, address)
    return True


def pinned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized flat uint8 host tensor of ``nbytes`` from the current
    accelerator's pinned-memory allocator (cached by torch: freed blocks are
    reused by the next request of the size), for a load's staging of small
    waves; pageable where there is no accelerator."""
    return torch.empty(nbytes, dtype=torch.uint8,
                       pin_memory=torch.accelerator.is_available())


class HostStaging:
    """Host memory that accelerator tensors are staged into, page-locked for
    their devices and reused from call to call while large enough (as
    :mod:`dcp.asynchronous.staging` reuses async save's): a synchronous save
    stages the device bytes it writes here.

    ``allocations`` counts the buffers made.  The buffer is held until the
    object is dropped (:func:`dcp.save` keeps one for the process)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.allocations = 0

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``sources`` (accelerator tensors): contiguous
        views of the buffer, with each source's dtype and shape, valid until
        the next call.  The copies are queued on each device's current
        stream (after the caller's work there) and waited for."""
        offsets, end = [], 0
        for s in sources:
            end = -(-end // ALIGN) * ALIGN
            offsets.append(end)
            end += s.numel() * s.element_size()
        if self.buffer is None or self.buffer.numel() < end:
            self.buffer = None  # the old one is unregistered as it is freed
            self.buffer = self._allocate(end, {s.device.type for s in sources})
        views = [self.buffer[o:o + s.numel() * s.element_size()].view(s.dtype).view(s.shape)
                 for o, s in zip(offsets, sources, strict=True)]
        for event in copy_from_devices(list(zip(views, sources, strict=True))):
            event.synchronize()
        return views

    def _allocate(self, nbytes: int, device_types: set[str]) -> torch.Tensor:
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        shift = -raw.data_ptr() % PAGE
        buffer = raw[shift:shift + nbytes]
        for device_type in device_types:
            page_lock(buffer, device_type)
        self.allocations += 1
        return buffer


def byte_sample(t: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The bytes of ``t`` (in its row-major layout) at ``ranges``
    (``(start, length)`` byte pairs), concatenated into one flat uint8
    tensor on ``t``'s device: what a host copy of ``t`` would hold there,
    gathered where ``t`` lives, so only the sample crosses to the host."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if len(ranges) == 1 and ranges[0] == (0, flat.numel()):
        return flat
    return torch.cat([flat[start:start + length] for start, length in ranges])
