"""A read-only checkpoint presented over another plugin's files.

Interop shows foreign layouts to :func:`dcp.load` as checkpoints: a
safetensors folder (:class:`~dcp.interop.safetensors_io.SafetensorsFolder`)
or a checkpoint seen through a remapping
(:class:`~dcp.interop.remap.RemappedView`).  Each supplies its own
:attr:`ReadOnlyView.metadata`; everything else — reads of the tensor bytes,
their read cost, the memory mapping a load copies whole chunks out of,
listings — goes to the plugin that holds the files, and writing raises.
"""

from __future__ import annotations

import abc

from dcp.core.metadata import METADATA_FILE, Metadata, encode
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError


class ReadOnlyView(StoragePlugin):
    """The files of ``inner`` with the metadata of :attr:`metadata`, which
    subclasses provide.  ``kind`` names the view in errors."""

    @property
    @abc.abstractmethod
    def metadata(self) -> Metadata:
        """The checkpoint's metadata as the view presents it."""

    def __init__(self, checkpoint_id: str, inner: StoragePlugin, kind: str) -> None:
        super().__init__(checkpoint_id)
        self.inner = inner
        self.kind = kind
        self.thread_count = inner.thread_count
        self.read_cost = inner.read_cost

    def read_file(self, name: str) -> bytes:
        if name == METADATA_FILE:
            return encode(self.metadata)
        return self.inner.read_file(name)

    def read_ranges(self, name, ranges) -> None:
        self.inner.read_ranges(name, ranges)

    def read_requests(self, name, requests) -> None:
        self.inner.read_requests(name, requests)

    def read_streamed(self, name, requests, arrived):
        return self.inner.read_streamed(name, requests, arrived)

    def mapped(self, name: str):
        return self.inner.mapped(name)  # the page-cache copies of the plugin holding the files

    def exists(self, name: str) -> bool:
        return name == METADATA_FILE or self.inner.exists(name)

    def list_files(self) -> list[str]:
        return self.inner.list_files()

    def _read_only(self, *args, **kwargs):
        raise CheckpointError(f"{self.checkpoint_id!r} is a {self.kind}, read-only here")

    write_file = commit_file = delete = _read_only
