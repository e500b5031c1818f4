"""One host's memory steps: files in host shared memory that outlive the
processes (a restarted rank finds them), never the machine.

A memory step is a checkpoint like a persistent one: ``metadata.json`` is
the step's :class:`dcp.Metadata` (every chunk of every rank, its CRC-32C;
a chunk's ``file``/``byte_offset`` name where its first writer keeps it),
and each rank's bytes sit in a data file of its own.  What this host holds
of it is listed per rank in ``held.r<rank>.json`` (chunk ids, file, byte
offsets): its own ranks' chunks and the copies it keeps for other hosts.
``COMMITTED`` (written last, by an atomic rename) makes the step count on
this host; ``BAD`` marks one that failed to restore twice.  A step being
persisted is *pinned* in the processes persisting it (:meth:`HostStore.pin`):
dropping older steps passes over it until it is unpinned.  Layout::

    <namespace>/<run_id>/step-<N>/{metadata.json, r00003.data, r00003-copies.data,
                                   held.r00003.json, failures, COMMITTED}

Files are reserved whole with ``posix_fallocate`` before a byte is written,
so a host without the memory refuses the save (:class:`MemoryTierError`)
instead of taking a ``SIGBUS`` on a full tmpfs.

*Spares.*  The staging copy into fresh tmpfs pages pays for allocating and
faulting in every page (0.10 s per 256 MiB here, against 0.045 s for a warm
copy).  So when a step is dropped, a rank's own data file is kept as that
rank's spare (``<run_id>/spare/r00003.data``), unless the tier has a
``host_bytes`` cap.  The spare is cut by the bytes the steps left hold
beside the ranks' own data (copies, metadata, lists, values), so that the
host's steady state stays within 2.0x its own bytes: a rank whose host keeps
copies for other hosts as large as its own bytes keeps no spare.  The next
step's own file is the spare, renamed into place, grown back to size and
mapped with ``MAP_POPULATE`` (its pages exist: 0.01 s per 256 MiB), so the
stall is about a warm copy.  A spare is never part of a step, and of a step
made from one only the bytes of its chunks, as the staging copy wrote them,
are ever read.
"""

from __future__ import annotations

import contextlib
import gc
import json
import mmap
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np

from dcp.core import metadata as md_codec
from dcp.core.metadata import Metadata
from dcp.errors import CheckpointError, CorruptCheckpointError, MemoryTierError

COMMITTED, BAD, FAILURES = "COMMITTED", "BAD", "failures"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


#: Where dropped steps' own data files wait to be reused, and their names.
SPARES = "spare"
SPARE_NAME = re.compile(r"r\d{5}\.data")


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _blocks(path: Path) -> int:
    """Bytes ``path`` takes (its allocated blocks), 0 if it is gone."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _listdir(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


class Staged:
    """A data file of a memory step, reserved whole and mapped: ``view`` is
    its bytes (a writable ``memoryview``).  ``reused``: the file is a spare
    whose pages exist (cut or grown to ``nbytes``, mapped with
    ``MAP_POPULATE``), else it is created empty."""

    def __init__(self, path: Path, nbytes: int, where: str, reused: bool = False) -> None:
        self.path, self.nbytes, self.reused = path, nbytes, reused
        fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if reused else os.O_TRUNC), 0o600)
        try:
            if reused and os.fstat(fd).st_size > nbytes:
                os.ftruncate(fd, nbytes)
            if nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    raise MemoryTierError(f"{where}: cannot reserve {nbytes} bytes for "
                                          f"{path} ({e.strerror}): the host has not the "
                                          f"memory; the save is refused, the newest memory "
                                          f"step is kept") from e
                flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if reused else 0)
                self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=flags)
            else:
                self._map = None
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def close(self) -> None:
        """Unmap now if no tensor still views the bytes, else once the last
        one is dropped (a transfer's tensors may outlive the call briefly)."""
        m, self._map = self._map, None
        try:
            self.view.release()
            if m is not None:
                m.close()
        except BufferError:
            gc.collect()
            with contextlib.suppress(BufferError):
                self.view.release()
                if m is not None:
                    m.close()


class HostStore:
    """The memory steps of run ``run_id`` on this host, under ``namespace``."""

    def __init__(self, namespace: Path, run_id: str, host: str, *, spares: bool = True) -> None:
        self.root = Path(namespace) / run_id
        self.host = host
        #: keep dropped steps' own data files as the next steps' (module doc)
        self.spares = spares
        self._pinned: set[int] = set()
        self._lock = threading.Lock()

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def where(self, step: int) -> str:
        return f"memory step {step} on host {self.host!r} ({self.step_dir(step)})"

    # ---------------------------------------------------------------- steps
    def steps(self, committed: bool = True) -> list[int]:
        """Steps present on this host, ascending: committed and not bad ones
        (``committed=False``: every step folder, half-written ones too)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if not name.startswith("step-") or not name[5:].isdigit():
                continue
            d = self.root / name
            if committed and (not (d / COMMITTED).exists() or (d / BAD).exists()):
                continue
            out.append(int(name[5:]))
        return sorted(out)

    def unwritable(self) -> str | None:
        """Why this host's folder cannot hold memory steps (it is created
        and a file written and removed in it), or ``None`` if it can."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe-"):
                pass
        except OSError as e:
            return f"{self.root}: {e.strerror or e}"
        return None

    def begin(self, step: int) -> Path:
        """A fresh folder for ``step``: what an earlier save of it left there
        (a killed one, or one at another world size or layout) no longer
        counts: its ``COMMITTED``, ``BAD``, failures, metadata and every
        held list go (no rank writes its list before every rank of the step
        began it: the lists follow the step's first gather); data files are
        each rank's own to overwrite."""
        d = self.step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        stale = [COMMITTED, BAD, FAILURES, md_codec.METADATA_FILE]
        stale += [n for n in os.listdir(d) if n.startswith("held.r") and n.endswith(".json")]
        for name in stale:
            with contextlib.suppress(FileNotFoundError):
                (d / name).unlink()
        return d

    def stage(self, step: int, name: str, nbytes: int) -> Staged:
        """The data file ``name`` of ``step``, reserved and mapped: this
        rank's spare renamed into place where there is one (module doc)."""
        path = self.step_dir(step) / name
        reused = False
        if self.spares and nbytes and SPARE_NAME.fullmatch(name):
            try:
                os.replace(self.root / SPARES / name, path)
                reused = True
            except FileNotFoundError:
                pass
        return Staged(path, nbytes, self.where(step), reused=reused)

    def write_held(self, step: int, rank: int, held: dict) -> None:
        _atomic_write(self.step_dir(step) / f"held.r{rank:05d}.json",
                      json.dumps(held, separators=(",", ":")).encode())

    def write_metadata(self, step: int, md: Metadata) -> None:
        _atomic_write(self.step_dir(step) / md_codec.METADATA_FILE, md_codec.encode(md))

    def commit(self, step: int) -> None:
        _atomic_write(self.step_dir(step) / COMMITTED, b"")

    def retract(self, step: int) -> None:
        """``step`` no longer counts on this host (its ``COMMITTED`` removed):
        its files may go after, and the next commit drops its folder."""
        with contextlib.suppress(FileNotFoundError):
            (self.step_dir(step) / COMMITTED).unlink()

    def release(self, step: int, rank: int, files: tuple[str, ...]) -> None:
        """Rank ``rank`` stops holding ``files`` of ``step``: its held list
        loses them first (atomically), then they are deleted, so the step
        never lists bytes that are gone.  A step missing is a no-op."""
        d = self.step_dir(step)
        path = d / f"held.r{rank:05d}.json"
        try:
            rec = json.loads(path.read_bytes())
            rec["files"] = [f for f in rec["files"] if f[0] not in files]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            rec = None  # no list, or a damaged one (it holds nothing): the files go
        if rec is not None:
            _atomic_write(path, json.dumps(rec, separators=(",", ":")).encode())
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                (d / name).unlink()

    def drop(self, step: int) -> None:
        """Delete ``step``'s folder, keeping its ranks' own data files as
        their spares where the memory bound allows (module doc)."""
        d = self.step_dir(step)
        if self.spares:
            self._keep_spares(d)
        shutil.rmtree(d, ignore_errors=True)

    def _keep_spares(self, d: Path) -> None:
        try:
            names = [n for n in os.listdir(d) if SPARE_NAME.fullmatch(n)]
        except FileNotFoundError:
            return
        if not names:
            return
        others = [self.step_dir(s) for s in self.steps(committed=False)
                  if self.step_dir(s) != d]
        # what the steps left hold beside the ranks' own data: copies, metadata, lists
        small = sum(_blocks(o / n) for o in others for n in _listdir(o)
                    if not SPARE_NAME.fullmatch(n))
        for name in names:
            # room left under 2.0x this rank's own bytes, the others' small files counted
            room = _size(d / name) - small
            room -= room % mmap.PAGESIZE
            if room <= 0:
                continue
            with contextlib.suppress(OSError):
                (self.root / SPARES).mkdir(exist_ok=True)
                os.truncate(d / name, room)
                os.replace(d / name, self.root / SPARES / name)

    def drop_except(self, keep: set[int]) -> None:
        """Delete every step folder not in ``keep`` nor pinned (older and
        half-written ones)."""
        with self._lock:
            for s in self.steps(committed=False):
                if s not in keep and s not in self._pinned:
                    self.drop(s)

    @property
    def pinned(self) -> frozenset[int]:
        """The steps this process is persisting (kept by :meth:`drop_except`)."""
        with self._lock:
            return frozenset(self._pinned)

    def pin(self, step: int) -> None:
        """Keep ``step`` from :meth:`drop_except` until :meth:`unpin`."""
        with self._lock:
            self._pinned.add(step)

    def unpin(self, step: int, drop: bool) -> None:
        """Stop keeping ``step``; with ``drop`` (the host's leader), delete it
        if a newer step committed meanwhile (the drop it was kept from)."""
        with self._lock:
            self._pinned.discard(step)
            if drop and any(s > step for s in self.steps()):
                self.drop(step)

    def usage_committed(self, exclude: int) -> int:
        """Bytes the committed steps of this run other than ``exclude`` hold
        on this host (allocated blocks)."""
        total = 0
        for s in self.steps():
            if s == exclude:
                continue
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self.step_dir(s)):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat().st_blocks * 512
        return total

    # --------------------------------------------------------------- reading
    def metadata_bytes(self, step: int) -> bytes:
        """The encoded metadata of ``step`` (its ``metadata.json``)."""
        try:
            return (self.step_dir(step) / md_codec.METADATA_FILE).read_bytes()
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{self.where(step)}: no metadata.json") from e

    def metadata(self, step: int) -> Metadata:
        return md_codec.decode(self.metadata_bytes(step),
                               str(self.step_dir(step) / md_codec.METADATA_FILE))

    def held(self, step: int) -> dict[int, tuple[str, int]]:
        """Chunk id -> ``(file, byte offset)`` of every chunk this host holds
        of ``step`` (the union of its ranks' ``held`` lists)."""
        out: dict[int, tuple[str, int]] = {}
        d = self.step_dir(step)
        for name in sorted(os.listdir(d)):
            if not (name.startswith("held.r") and name.endswith(".json")):
                continue
            try:
                rec = json.loads((d / name).read_bytes())
                for file, ids, offsets in rec["files"]:
                    md_codec.check_relative_path(file, f"{self.where(step)}: {name}")
                    for i, o in zip(ids, offsets, strict=True):
                        out.setdefault(int(i), (str(file), int(o)))
            except (ValueError, KeyError, TypeError, CheckpointError):
                continue  # a damaged list: its chunks count as not held here
        return out

    def mapped(self, step: int, file: str) -> memoryview | None:
        """The bytes of ``file`` of ``step``, mapped (no copy; private
        pages: writing to them changes nothing on the host), or ``None`` if
        the file is gone.  The mapping lives as long as a view of it.  Bytes
        beyond the file's size are not in the view, so a truncated file gives
        a short view, never a ``SIGBUS`` (short of a file truncated while
        mapped: no process of the run changes a committed step's files)."""
        try:
            fd = os.open(self.step_dir(step) / file, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY)) if size else \
                memoryview(b"")
        finally:
            os.close(fd)

    def record_failure(self, step: int, reason: str) -> int:
        """Count a failed restore of ``step``; at the second it is marked
        ``BAD`` (passed over from then on).  Returns the count."""
        d = self.step_dir(step)
        if not d.exists():
            return 0
        path = d / FAILURES
        try:
            count = int(path.read_text().split("\n", 1)[0]) + 1
        except (FileNotFoundError, ValueError):
            count = 1
        _atomic_write(path, f"{count}\n{reason}\n".encode())
        if count >= 2:
            _atomic_write(d / BAD, reason.encode())
        return count


def chunk_table(md: Metadata) -> tuple[list[str], np.ndarray, np.ndarray, list[tuple]]:
    """The chunks of a memory step numbered as every rank numbers them:
    tensor chunks by fqn (and in the order of each tensor's chunks), then
    raw blobs by fqn.  Returns
    ``(fqn of each, nbytes int64, crc int64, (offsets, sizes) or None for
    a blob)``."""
    fqns: list[str] = []
    nbytes: list[int] = []
    crcs: list[int] = []
    boxes: list[tuple] = []
    for fqn in sorted(md.tensors):
        for c in md.tensors[fqn].chunks:
            fqns.append(fqn)
            nbytes.append(c.nbytes)
            crcs.append(-1 if c.checksum is None else c.checksum)
            boxes.append((c.offsets, c.sizes))
    for fqn in sorted(md.objects):
        o = md.objects[fqn]
        if o.raw is not None:
            fqns.append(fqn)
            nbytes.append(o.raw.nbytes)
            crcs.append(o.raw.checksum)
            boxes.append(())
    return fqns, np.array(nbytes, dtype=np.int64), np.array(crcs, dtype=np.int64), boxes
