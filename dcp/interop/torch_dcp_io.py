"""Interop with PyTorch DCP (``torch.distributed.checkpoint``), both ways.

Both directions go through torch's own reader and writer
(``FileSystemReader`` / ``FileSystemWriter`` and its ``load`` / ``save``), so
they follow torch's format wherever it changes; they run in one process,
without collectives, and take local paths (or ``file://`` URIs).

**Reading runs code from the checkpoint.**  PyTorch DCP's ``.metadata`` is a
pickle, and its non-tensor values are ``torch.save`` pickles: reading them
can execute arbitrary code.  :func:`torch_dcp_to_checkpoint` therefore
refuses unless called with ``trusted=True``, which you should pass only for
checkpoints you trust (``hyperdcp convert --trust-pickle``).  The checkpoint
it writes is ours: JSON metadata and raw bytes, safe to read from then on.

Memory stays at about the largest tensor plus a buffer both ways: the
import loads tensors in groups of about ``buffer_bytes``; the export hands
torch's writer placeholder (meta) tensors to plan with and reads each real
tensor only when the writer asks for it, writing one file per tensor
(torch's writer keeps every tensor of a file until the file is done).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from tqdm import tqdm

from dcp.core import tensors
from dcp.core.metadata import Metadata, TensorMeta
from dcp.core.storage import StoragePlugin, open_storage, scheme_of
from dcp.errors import CheckpointError, NotACheckpointError
from dcp.interop.streaming import (
    DEFAULT_BUFFER_BYTES,
    CheckpointWriter,
    ExportResult,
    progress_bar,
    read_object,
    read_tensor,
    renamed,
)
from dcp.orchestration.load import read_metadata

#: The file holding a PyTorch DCP checkpoint's (pickled) metadata.
TORCH_METADATA_FILE = ".metadata"


def _local_path(uri: str) -> str:
    if scheme_of(uri) != "file":
        raise CheckpointError(
            f"{uri!r}: PyTorch DCP checkpoints are read and written here through torch's "
            f"FileSystemReader/Writer, which take local paths (or file:// URIs)")
    return uri.removeprefix("file://")


@contextlib.contextmanager
def _single_process():
    """Around torch's save/load with ``no_dist=True``: silence its warnings
    that it assumes a single process, and that it overwrites a checkpoint
    (both what we ask for)."""
    with warnings.catch_warnings():
        for message in ("torch.distributed is disabled", "Detected an existing checkpoint"):
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def _torch_error(what: str, e: BaseException) -> CheckpointError:
    """A :class:`CheckpointError` for a failure inside torch's DCP; one of
    ours raised from a callback inside it is returned as it was."""
    if isinstance(e, CheckpointException):
        inner = [exc for exc, _ in e.failures.values()]
        if len(inner) == 1 and isinstance(inner[0], CheckpointError):
            return inner[0]
        detail = "; ".join(f"{type(exc).__name__}: {exc}" for exc in inner)
    else:
        detail = f"{type(e).__name__}: {e}"
    return CheckpointError(f"{what} failed in torch.distributed.checkpoint: {detail}")


def _batches(items: list[tuple[str, Any]], nbytes, limit: int) -> list[list[tuple[str, Any]]]:
    """Consecutive groups of at most ``limit`` bytes (a larger item alone)."""
    groups: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for item in items:
        n = nbytes(item[1])
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


def torch_dcp_to_checkpoint(path: str, checkpoint_id: str, *, trusted: bool = False,
                            rename: dict[str, str] | None = None, overwrite: bool = False,
                            allow_pickle: bool = False, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                            storage_options: dict | None = None,
                            progress: bool = False) -> Metadata:
    """Convert a PyTorch DCP checkpoint into ours.

    Tensors are consolidated (torch's loader reassembles every rank's
    shards) and written one chunk each with its checksum, bytes and dtype
    unchanged; non-tensor values become JSON values, or pickles with
    ``allow_pickle``.  fqns are torch's flattened keys (``optim.state.0.
    exp_avg``), which :func:`dcp.load` matches against a nested state dict.

    Args:
        path: the PyTorch DCP checkpoint directory (local, or ``file://``).
        checkpoint_id: destination path or URI of any storage plugin;
            ``storage_options`` go to it.
        trusted: required: the source's metadata and non-tensor values are
            pickles, which can run code.  Pass ``True`` only for
            checkpoints you trust.
        rename: torch fqn -> our fqn.
        overwrite: replace a committed checkpoint at ``checkpoint_id``.
        allow_pickle: store non-JSON values pickled instead of raising.
        buffer_bytes: tensors loaded per call of torch's loader (bytes,
            about), and bytes per data file.
        progress: show a progress bar (tqdm, bytes) on stderr.

    Returns:
        The committed :class:`dcp.Metadata`.

    Raises:
        CheckpointError: without ``trusted``; a dtype we cannot hold, a
            non-JSON value without ``allow_pickle``, a bad rename map, or a
            failure inside torch (its message included); nothing is
            committed then.
        NotACheckpointError: ``path`` has no ``.metadata``.
    """
    if not trusted:
        raise CheckpointError(
            f"{path!r}: a PyTorch DCP checkpoint's metadata is a pickle, and reading it can run "
            f"code; pass trusted=True (hyperdcp convert --trust-pickle) only for checkpoints "
            f"you trust")
    local = _local_path(str(path))
    reader = tdcp.FileSystemReader(local)
    try:
        source = reader.read_metadata()
    except FileNotFoundError:
        raise NotACheckpointError(
            f"{path!r} is not a PyTorch DCP checkpoint: it has no {TORCH_METADATA_FILE}") from None
    except (Exception, CheckpointException) as e:
        raise _torch_error(f"reading {path!r}", e) from e
    entries = source.state_dict_metadata
    names = renamed(entries, rename, repr(str(path)))
    tensor_items = [(fqn, m) for fqn, m in entries.items() if isinstance(m, TensorStorageMetadata)]
    objects = [fqn for fqn, m in entries.items() if not isinstance(m, TensorStorageMetadata)]

    def nbytes(m: TensorStorageMetadata) -> int:
        return m.size.numel() * m.properties.dtype.itemsize

    def load_from_torch(state: dict) -> None:
        try:
            with _single_process():
                tdcp.load(state, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as e:
            raise _torch_error(f"loading {', '.join(list(state)[:3])}... from {path!r}", e) from e

    with CheckpointWriter(checkpoint_id, overwrite=overwrite, allow_pickle=allow_pickle,
                          buffer_bytes=buffer_bytes, storage_options=storage_options) as writer, \
            progress_bar(sum(nbytes(m) for _, m in tensor_items), "import", progress) as bar:
        for group in _batches(tensor_items, nbytes, buffer_bytes):
            for fqn, m in group:
                tensors.dtype_name(m.properties.dtype, fqn)  # refuse what we cannot hold, first
            state = {fqn: torch.empty(tuple(m.size), dtype=m.properties.dtype) for fqn, m in group}
            load_from_torch(state)
            for fqn, m in group:  # popped: the writer holds the only reference
                writer.add_tensor(names[fqn], state.pop(fqn))
                bar.update(nbytes(m))
        if objects:
            values = dict.fromkeys(objects)
            load_from_torch(values)
            for fqn, value in values.items():
                writer.add_object(names[fqn], value)
        return writer.commit()


class _ReadOnDemand(DefaultSavePlanner):
    """torch's default save planner, given meta tensors to plan with; the
    real bytes of each tensor are read from our checkpoint when torch's
    writer resolves its write item."""

    def __init__(self, storage: StoragePlugin, source: dict[str, tuple[str, TensorMeta]],
                 bar: tqdm) -> None:
        super().__init__()
        self.storage = storage
        self.source = source
        self.bar = bar

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn, meta = self.source[write_item.index.fqn]
        tensor = read_tensor(self.storage, fqn, meta)
        self.bar.update(meta.nbytes)
        return tensor


def checkpoint_to_torch_dcp(checkpoint_id: str, path: str, *,
                            rename: dict[str, str] | None = None, overwrite: bool = False,
                            allow_pickle: bool = False, storage_options: dict | None = None,
                            progress: bool = False) -> ExportResult:
    """Export a checkpoint as a PyTorch DCP checkpoint that
    ``torch.distributed.checkpoint.load`` reads.

    Tensors are consolidated from their chunks (checksums verified) one at
    a time as torch's writer asks for them, one ``.distcp`` file each;
    non-tensor values are handed to torch, which pickles them.

    Args:
        checkpoint_id: our checkpoint, path or URI; ``storage_options`` go
            to its plugin.
        path: destination directory (local, or ``file://``).
        rename: our fqn -> torch fqn.
        overwrite: replace a PyTorch DCP checkpoint at ``path``.
        allow_pickle: unpickle values we stored pickled, to hand them on
            (runs code from the checkpoint: trusted checkpoints only).
        progress: show a progress bar (tqdm, bytes) on stderr.

    Returns:
        An :class:`~dcp.interop.streaming.ExportResult` (files: torch's).

    Raises:
        CheckpointError: destination holds a checkpoint without
            ``overwrite``, a pickled value without ``allow_pickle``, a bad
            rename map, or a failure inside torch.
        CorruptCheckpointError: a checksum mismatch or unreadable chunk,
            naming the fqn and file.
    """
    local = _local_path(str(path))
    storage = open_storage(str(checkpoint_id), **(storage_options or {}))
    md = read_metadata(str(checkpoint_id), storage=storage)
    names = renamed(md.fqns(), rename, repr(str(checkpoint_id)))
    if not overwrite and (Path(local) / TORCH_METADATA_FILE).exists():
        raise CheckpointError(f"{path!r} already holds a PyTorch DCP checkpoint; "
                              f"pass overwrite=True to replace it")
    state: dict[str, Any] = {}
    for fqn, meta in md.tensors.items():
        state[names[fqn]] = torch.empty(meta.shape, dtype=tensors.torch_dtype(meta.dtype),
                                        device="meta")
    for fqn, obj in md.objects.items():
        state[names[fqn]] = read_object(storage, fqn, obj, allow_pickle)
    source = {names[fqn]: (fqn, meta) for fqn, meta in md.tensors.items()}
    with progress_bar(md.unique_bytes, "export", progress) as bar:
        try:
            writer = tdcp.FileSystemWriter(local, single_file_per_rank=False, overwrite=overwrite)
            with _single_process():
                saved = tdcp.save(state, storage_writer=writer, no_dist=True,
                                  planner=_ReadOnDemand(storage, source, bar))
        except (Exception, CheckpointException) as e:
            raise _torch_error(f"saving {path!r}", e) from e
    files = sorted({info.relative_path for info in saved.storage_data.values()})
    return ExportResult(files=[TORCH_METADATA_FILE, *files], tensors=len(md.tensors),
                        nbytes=md.unique_bytes)
