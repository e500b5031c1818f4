"""Verify every stored checksum of a checkpoint (``hyperdcp verify``).

A load checks the checksum of each chunk it reads whole, but a resharded load
reads parts of chunks and cannot; :func:`verify` reads every byte of every
chunk and pickled value once and reports each one that is damaged — checksum
mismatch, missing file, file too short — by fqn, chunk and file, instead of
stopping at the first.  Reads go block by block (``block_bytes``, reused
buffers), so memory does not grow with chunk size, and files are read in
parallel (the plugin's ``thread_count``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from dcp.core.metadata import METADATA_FILE, Metadata, checksum
from dcp.core.storage import StoragePlugin, open_storage
from dcp.interop.streaming import progress_bar
from dcp.orchestration.load import read_metadata

#: Default bytes read per block.
DEFAULT_BLOCK_BYTES = 16 << 20


@dataclass(frozen=True)
class Damage:
    """One damaged piece: ``what`` names it (tensor fqn and chunk offsets,
    or object fqn), ``file`` holds it, ``problem`` says what is wrong."""

    what: str
    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.what} in file {self.file!r}: {self.problem}"


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`.

    ``checked``: pieces (chunks and pickled values) whose checksum matched;
    ``unchecked``: chunks that carry no checksum (a safetensors folder), read
    in full but not checkable; ``nbytes``: bytes read; ``damaged``: the
    damaged pieces, in file order.
    """

    checked: int = 0
    unchecked: int = 0
    nbytes: int = 0
    damaged: list[Damage] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is damaged."""
        return not self.damaged


@dataclass(frozen=True)
class _Piece:
    what: str
    file: str
    offset: int
    nbytes: int
    checksum: int | None


def _pieces(md: Metadata) -> dict[str, list[_Piece]]:
    """Every stored piece, grouped by file, in byte order."""
    by_file: dict[str, list[_Piece]] = {}
    for fqn, t in md.tensors.items():
        for c in t.chunks:
            what = f"tensor {fqn!r} chunk at offsets {list(c.offsets)}"
            if c.frames is None:
                by_file.setdefault(c.file, []).append(_Piece(
                    what, c.file, c.byte_offset, c.nbytes, c.checksum))
                continue
            # a compressed chunk: each frame's CRC-32C covers its stored bytes
            for f, (start, size, crc) in enumerate(zip(c.frames.stored_offsets(),
                                                       c.frames.stored, c.frames.crcs,
                                                       strict=True)):
                by_file.setdefault(c.file, []).append(_Piece(
                    f"{what}, frame {f}", c.file, c.byte_offset + start, size, crc))
    for fqn, o in md.objects.items():
        b = o.blob  # raw or pickled bytes
        if b is not None:
            by_file.setdefault(b.file, []).append(_Piece(
                f"object {fqn!r}", b.file, b.byte_offset, b.nbytes, b.checksum))
    for pieces in by_file.values():
        pieces.sort(key=lambda p: p.offset)
    return dict(sorted(by_file.items()))


def _verify_file(storage: StoragePlugin, pieces: list[_Piece], block_bytes: int,
                 bar: tqdm) -> VerifyReport:
    report = VerifyReport()
    block = memoryview(bytearray(min(block_bytes, max(p.nbytes for p in pieces))))
    for piece in pieces:
        crc, done = 0, 0
        try:
            while done < piece.nbytes:
                view = block[:min(len(block), piece.nbytes - done)]
                storage.read_ranges(piece.file, [(piece.offset + done, view)])
                crc = checksum(view, crc)
                done += len(view)
                bar.update(len(view))
        except Exception as e:  # reported as damage of this piece
            report.damaged.append(Damage(piece.what, piece.file, f"cannot be read: {e}"))
            bar.update(piece.nbytes - done)
            continue
        finally:
            report.nbytes += done
        if piece.checksum is None:
            report.unchecked += 1
        elif crc != piece.checksum:
            report.damaged.append(Damage(
                piece.what, piece.file,
                f"checksum mismatch in bytes {piece.offset}..{piece.offset + piece.nbytes} "
                f"(stored {piece.checksum:#010x}, computed {crc:#010x})"))
        else:
            report.checked += 1
    return report


def verify(checkpoint_id: str, *, storage: StoragePlugin | None = None,
           storage_options: dict | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES,
           progress: bool = False) -> VerifyReport:
    """Read every stored byte of a checkpoint and check every checksum.

    Args:
        checkpoint_id: path or URI of the checkpoint.
        storage: a ready plugin (e.g. a
            :class:`~dcp.interop.safetensors_io.SafetensorsFolder`) instead of
            ``open_storage(checkpoint_id, **storage_options)``.
        block_bytes: bytes read at a time, per file being read.
        progress: show a progress bar (tqdm, bytes) on stderr.

    Returns:
        A :class:`VerifyReport`; damage is reported there, not raised.

    Raises:
        NotACheckpointError: nothing committed at ``checkpoint_id``.
        CorruptCheckpointError: the metadata itself is malformed, e.g. a
            tensor whose chunks hold fewer or more elements than its shape.
    """
    if storage is None:
        storage = open_storage(str(checkpoint_id), **(storage_options or {}))
    md = read_metadata(str(checkpoint_id), storage=storage)
    for fqn, meta in md.tensors.items():
        meta.check_coverage(fqn, f"{checkpoint_id}/{METADATA_FILE}")
    by_file = _pieces(md)
    total = sum(p.nbytes for pieces in by_file.values() for p in pieces)
    report = VerifyReport()
    with progress_bar(total, "verify", progress) as bar, \
            ThreadPoolExecutor(max(1, storage.thread_count)) as pool:
        parts = pool.map(lambda pieces: _verify_file(storage, pieces, block_bytes, bar),
                         by_file.values())
        for part in parts:
            report.checked += part.checked
            report.unchecked += part.unchecked
            report.nbytes += part.nbytes
            report.damaged += part.damaged
    return report
