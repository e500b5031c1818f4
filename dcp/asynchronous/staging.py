"""Staging: copying a rank's tensors into reused shared host memory.

The only work :func:`dcp.async_save` does on the caller's thread besides
describing the state dict.  All chunks of a rank live in one flat buffer of
shared memory (``share_memory_()``), each at a 64-byte aligned offset (a
page boundary for chunks of :data:`dcp.core.storage.ALIGNED_CHUNK_BYTES` or more,
which a direct-I/O storage plugin then writes without a copy), so the
background worker maps the same pages (one file descriptor, handed over once)
and nothing of the state is ever serialized.  The buffer is kept for the
next save: as long as the chunks' sizes, dtypes and devices stay the same,
staging allocates nothing and is one copy per chunk.

Device tensors are copied device-to-host with ``non_blocking=True`` on their
device's current stream (the caller's), then an event of that device
(``torch.Event``, the accelerator-generic API) marks the end of the copies
(:func:`dcp.core.devices.copy_from_devices`).  For accelerator sources the
buffer is page-locked once (:func:`dcp.core.devices.page_lock`:
``cudaHostRegister`` on CUDA, ``npuHostRegister`` on torch_npu builds that
have it), so those copies are true DMA transfers; where the runtime cannot or
will not, they copy into pageable memory (correct, but without overlap), and
a warning says so.  CPU tensors are copied with ``Tensor.copy_`` (a memcpy
that releases the GIL).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from dcp.core import devices, tensors
from dcp.core.metadata import DTYPE_ITEMSIZE
from dcp.core.storage import ALIGNED_CHUNK_BYTES
from dcp.orchestration.save import SaveState

ALIGN = 64  # bytes; every chunk starts at a multiple
PAGE = 4096  # bytes; every chunk of at least ALIGNED_CHUNK_BYTES starts at a multiple


@dataclass(frozen=True)
class ChunkSpec:
    """Where one chunk lies in the staging buffer, and what it is: the box
    ``(offsets, sizes)`` of ``fqn`` (global ``global_shape``, ``dtype``),
    starting ``byte_offset`` bytes into the buffer, replica ``slot`` (see
    :func:`dcp.core.tensors.replica_slot`), copied from a ``device`` type."""

    fqn: str
    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    byte_offset: int
    slot: tuple[int, int]
    device: str

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk."""
        return math.prod(self.sizes) * DTYPE_ITEMSIZE[self.dtype]


@dataclass
class Layout:
    """A staging buffer (flat ``uint8`` tensor in shared memory) and the
    chunks it holds, in state-dict order."""

    buffer: torch.Tensor
    chunks: list[ChunkSpec]

    def views(self) -> list[torch.Tensor]:
        """One tensor per chunk, viewing its bytes in the buffer."""
        return [self.buffer[c.byte_offset:c.byte_offset + c.nbytes]
                .view(tensors.torch_dtype(c.dtype)).view(c.sizes) for c in self.chunks]

    def state(self, json_values: dict[str, str], pickled: dict[str, bytes],
              paths: dict[str, list[str | int]]) -> SaveState:
        """The :class:`SaveState` of a save whose tensors are these staged
        chunks."""
        state = SaveState(json_values=json_values, pickled=pickled, paths=paths)
        for c, view in zip(self.chunks, self.views(), strict=True):
            key = (c.fqn, c.offsets)
            state.chunks[key] = tensors.LocalChunk(c.global_shape, c.dtype, c.offsets, c.sizes,
                                                   view)
            state.slots[key] = c.slot
        return state


def _specs(state: SaveState) -> list[ChunkSpec]:
    specs, offset = [], 0
    for (fqn, offsets), chunk in state.chunks.items():
        nbytes = math.prod(chunk.sizes) * DTYPE_ITEMSIZE[chunk.dtype]
        align = PAGE if nbytes >= ALIGNED_CHUNK_BYTES else ALIGN
        offset = -(-offset // align) * align
        specs.append(ChunkSpec(fqn, chunk.global_shape, chunk.dtype, offsets, chunk.sizes, offset,
                               state.slots[(fqn, offsets)], chunk.data.device.type))
        offset += nbytes
    return specs


class Stager:
    """Copies a rank's chunks into its reused shared staging buffer.

    ``allocations`` counts buffers allocated, ``bytes_staged`` the bytes
    copied, over the stager's life.
    """

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self._views: list[torch.Tensor] = []
        self.allocations = 0
        self.bytes_staged = 0

    def stage(self, state: SaveState, blocking: bool) -> tuple[Layout, Future]:
        """Copy every chunk of ``state`` into the buffer (a new one only if
        the chunks' sizes, dtypes or devices changed).

        Returns the layout and a future that completes (result ``None``) once
        every byte is in host memory: already done when ``blocking``; else
        CPU chunks are copied on a background thread and device copies are
        awaited there, and the caller must not modify its tensors in place
        before the future is done.
        """
        specs = _specs(state)
        layout = self.layout
        if layout is None or layout.chunks != specs:
            layout = self._allocate(specs)
        sources = [chunk.data.detach() for chunk in state.chunks.values()]
        self.bytes_staged += sum(s.nbytes for s in specs)
        staged: Future = Future()
        host = [(v, s) for v, s in zip(self._views, sources, strict=True) if s.device.type == "cpu"]
        events = devices.copy_from_devices(list(zip(self._views, sources, strict=True)))

        def finish() -> None:
            with torch.no_grad():
                for view, source in host:
                    view.copy_(source)
            for event in events:
                event.synchronize()

        if blocking:
            finish()
            staged.set_result(None)
        else:
            def run() -> None:
                try:
                    finish()
                except Exception as e:  # handed to whoever waits on the future
                    staged.set_exception(e)
                else:
                    staged.set_result(None)
            threading.Thread(target=run, name="dcp-staging", daemon=True).start()
        return layout, staged

    def _allocate(self, specs: list[ChunkSpec]) -> Layout:
        end = specs[-1].byte_offset + specs[-1].nbytes if specs else 0
        # a page more than needed, so that offsets count from a page boundary
        # whatever header the allocator puts first (torch's "file_system"
        # sharing strategy starts the data 64 bytes into the mapping)
        shared = torch.empty(end + PAGE, dtype=torch.uint8).share_memory_()
        shift = -shared.data_ptr() % PAGE
        buffer = shared[shift:shift + end]
        for device_type in {s.device for s in specs if s.device != "cpu"}:
            devices.page_lock(buffer, device_type)
        self.layout = Layout(buffer, specs)
        self._views = self.layout.views()
        self.allocations += 1
        return self.layout
