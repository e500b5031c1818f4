"""Storage benchmarks (single process).

* **S3** (moto's S3 server on loopback, started here): ``dcp.save`` /
  ``dcp.load`` through the S3 plugin against raw s3fs transfers of the same
  bytes with the same concurrency — the same objects written with
  ``pipe_file`` (same part size and parts in flight) from as many threads as
  the plugin's ``thread_count``, and the same byte ranges read back with
  ``cat_ranges``.  Target: hyperdcp at >= 0.8x raw s3fs throughput.  A third
  system, the S3 plugin alone (its ``write_file`` / ``read_ranges`` on the
  same files and chunks, without the core's planning and checksums), shows
  which part of any gap is the plugin's.  Two cases: files of one part (one
  PUT each) and multipart uploads.
* **In memory vs POSIX**: the same state dict saved and loaded through
  ``memory://``, ``shm://`` and a POSIX directory (with and without fsync).

``run(out_dir)`` writes ``storage.json`` and ``storage.md`` there and returns
the rows; ``python -m benchmarks.storage [--out DIR] [--repeat N] [--quick]``
prints the table.  Needs the bench extra (s3fs, moto) and pytest (for
:func:`dcp.testing.local_s3_server`), imported when it runs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import dcp
from dcp.core.storage import open_storage

from .common import timed
from .report import Column, markdown_table, write_table

if TYPE_CHECKING:
    import s3fs

MiB = 1 << 20
MB = 1e6
TARGET = 0.8  # hyperdcp / raw s3fs throughput
BUCKET = "bench"
THREADS, CONCURRENCY = 4, 4
S3_CASES = {  # name -> (tensor count, tensor bytes, part_size)
    "s3, one PUT per file": (4, 16 * MiB, 16 * MiB),
    "s3, multipart (5 MiB parts)": (4, 16 * MiB, 5 * MiB),
}
MEMORY_CASE = (16, 4 * MiB)  # tensor count, tensor bytes


def _state(count: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(nbytes // 4, generator=g) for i in range(count)}


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _row(case: str, kind: str, system: str, nbytes: int, seconds: list[float], **extra) -> dict:
    median = statistics.median(seconds)
    return {"family": "storage", "scenario": case, "kind": kind, "system": system,
            "bytes": nbytes, "repeats": len(seconds), "seconds_median": median,
            "seconds_min": min(seconds), "seconds_max": max(seconds),
            "MB_per_s": nbytes / MB / median, **extra}


def _file_images(state: dict[str, torch.Tensor], md: dcp.Metadata) -> dict[str, bytes]:
    """The bytes of every data file of a checkpoint of ``state``, rebuilt from
    its metadata (what the raw baseline uploads)."""
    pieces: dict[str, list[tuple[int, bytes]]] = {}
    for fqn, meta in md.tensors.items():
        for chunk in meta.chunks:
            data = state[fqn].numpy().tobytes()
            pieces.setdefault(chunk.file, []).append((chunk.byte_offset, data))
    return {name: b"".join(data for _, data in sorted(parts)) for name, parts in pieces.items()}


def _raw_save(fs: s3fs.S3FileSystem, prefix: str, images: dict[str, bytes],
              part_size: int) -> None:
    def put(item: tuple[str, bytes]) -> None:
        fs.pipe_file(f"{prefix}/{item[0]}", item[1], chunksize=part_size,
                     max_concurrency=CONCURRENCY)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(put, images.items()))


def _raw_load(fs: s3fs.S3FileSystem, prefix: str, md: dcp.Metadata, part_size: int) -> None:
    """Each chunk's bytes, in pieces of at most ``part_size``,
    ``CONCURRENCY`` requests per call, from ``THREADS`` threads."""
    def read(chunk) -> None:
        starts = list(range(chunk.byte_offset, chunk.byte_offset + chunk.nbytes, part_size))
        ends = [min(s + part_size, chunk.byte_offset + chunk.nbytes) for s in starts]
        for i in range(0, len(starts), CONCURRENCY):
            fs.cat_ranges([f"{prefix}/{chunk.file}"] * len(starts[i:i + CONCURRENCY]),
                          starts[i:i + CONCURRENCY], ends[i:i + CONCURRENCY], on_error="raise")

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(read, [c for meta in md.tensors.values() for c in meta.chunks]))


def _plugin_save(storage, images: dict[str, bytes]) -> None:
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda item: storage.write_file(item[0], [memoryview(item[1])]),
                      images.items()))


def _plugin_load(storage, md: dcp.Metadata, state: dict[str, torch.Tensor]) -> None:
    """Each chunk read by the plugin straight into a tensor, ``THREADS`` at a time."""
    jobs = [(c, torch.empty_like(state[fqn]))
            for fqn, meta in md.tensors.items() for c in meta.chunks]
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda job: storage.read_ranges(
            job[0].file, [(job[0].byte_offset, memoryview(job[1].numpy()).cast("B"))]), jobs))


def _s3_rows(endpoint: str, repeat: int, quick: bool) -> list[dict]:
    import s3fs

    credentials = {"endpoint_url": endpoint, "key": "bench", "secret": "bench",
                   "client_kwargs": {"region_name": "us-east-1"}}
    raw = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **credentials)
    raw.call_s3("create_bucket", Bucket=BUCKET)
    rows = []
    for case, (count, nbytes, part_size) in S3_CASES.items():
        state = _state(count, nbytes // 64 if quick else nbytes)
        total = sum(t.numel() * 4 for t in state.values())
        options = {**credentials, "thread_count": THREADS, "max_concurrency": CONCURRENCY,
                   "part_size": part_size}
        # warm-up (connections, clients) and the file layout the raw baseline copies
        layout = dcp.save(state, f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", storage_options=options)
        images = _file_images(state, layout)
        times: dict[tuple[str, str], list[float]] = {}
        verified = True
        for r in range(repeat):
            order = ["hyperdcp", "S3 plugin alone", "raw s3fs"]
            for system in order if r % 2 == 0 else order[::-1]:
                save = times.setdefault(("save", system), [])
                load = times.setdefault(("load", system), [])
                if system == "hyperdcp":
                    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
                    save.append(timed(dcp.save, state, url, storage_options=options))
                    target = _zeros(state)
                    load.append(timed(dcp.load, target, url, storage_options=options))
                    verified &= all(torch.equal(target[k], v) for k, v in state.items())
                    raw.rm(url.removeprefix("s3://"), recursive=True)
                elif system == "S3 plugin alone":
                    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}-plugin"
                    storage = open_storage(url, **options)
                    save.append(timed(_plugin_save, storage, images))
                    load.append(timed(_plugin_load, storage, layout, state))
                    raw.rm(url.removeprefix("s3://"), recursive=True)
                else:
                    prefix = f"{BUCKET}/{uuid.uuid4().hex[:8]}-raw"
                    save.append(timed(_raw_save, raw, prefix, images, part_size))
                    load.append(timed(_raw_load, raw, prefix, layout, part_size))
                    raw.rm(prefix, recursive=True)
        for kind in ("save", "load"):
            ours, base = times[(kind, "hyperdcp")], times[(kind, "raw s3fs")]
            ratio = statistics.median(base) / statistics.median(ours)
            alone = times[(kind, "S3 plugin alone")]
            rows.append(_row(case, kind, "raw s3fs", total, base))
            rows.append(_row(case, kind, "S3 plugin alone", total, alone,
                             vs_raw_s3fs=statistics.median(base) / statistics.median(alone),
                             vs_raw_s3fs_best=min(base) / min(alone)))
            rows.append(_row(case, kind, "hyperdcp", total, ours, vs_raw_s3fs=ratio,
                             vs_raw_s3fs_best=min(base) / min(ours), target=TARGET,
                             met=ratio >= TARGET,
                             **({"verified": verified} if kind == "load" else {})))
    return rows


def _memory_rows(scratch: Path, repeat: int, quick: bool) -> list[dict]:
    count, nbytes = MEMORY_CASE
    state = _state(count, nbytes // 64 if quick else nbytes)
    total = sum(t.numel() * 4 for t in state.values())
    run_id = uuid.uuid4().hex[:8]
    systems = {  # name -> (checkpoint id of repeat r, storage options)
        "posix (fsync)": (lambda r: str(scratch / f"posix-{r}"), {}),
        "posix (no fsync)": (lambda r: str(scratch / f"nofsync-{r}"), {"fsync": False}),
        "shm://": (lambda r: f"shm://bench-{run_id}/{r}", {}),
        "memory://": (lambda r: f"memory://bench-{run_id}/{r}", {}),
    }
    times: dict[tuple[str, str], list[float]] = {}
    verified = {name: True for name in systems}
    for r in range(repeat):
        names = list(systems) if r % 2 == 0 else list(systems)[::-1]
        for name in names:
            location, options = systems[name]
            times.setdefault(("save", name), []).append(
                timed(dcp.save, state, location(r), storage_options=options))
            target = _zeros(state)
            times.setdefault(("load", name), []).append(
                timed(dcp.load, target, location(r), storage_options=options))
            verified[name] &= all(torch.equal(target[k], v) for k, v in state.items())
            storage = open_storage(location(r), **options)
            storage.delete(storage.list_files())
    shm_root = Path("/dev/shm/hyperdcp") / f"bench-{run_id}"
    if shm_root.exists():
        shutil.rmtree(shm_root)
    rows = []
    for kind in ("save", "load"):
        base = statistics.median(times[(kind, "posix (fsync)")])
        for name in systems:
            seconds = times[(kind, name)]
            rows.append(_row("in memory vs POSIX", kind, name, total, seconds,
                             vs_posix=base / statistics.median(seconds),
                             **({"verified": verified[name]} if kind == "load" else {})))
    return rows


def _ratio(row: dict) -> str:
    if "vs_raw_s3fs" in row:
        ratio = f"{row['vs_raw_s3fs']:.2f}x raw s3fs (best runs: {row['vs_raw_s3fs_best']:.2f}x)"
        if "met" in row:
            ratio += f", {'meets' if row['met'] else 'misses'} >= {TARGET}"
    elif "vs_posix" in row:
        ratio = f"{row['vs_posix']:.2f}x posix (fsync)"
    else:
        ratio = "baseline"
    if row.get("verified") is False:
        ratio += "; LOADED VALUES WRONG"
    return ratio


COLUMNS: list[Column] = [
    ("scenario", lambda r: r["scenario"]),
    ("op", lambda r: r["kind"]),
    ("system", lambda r: r["system"]),
    ("MB", lambda r: f"{r['bytes'] / MB:.0f}"),
    ("s (median, min–max)",
     lambda r: f"{r['seconds_median']:.3f} ({r['seconds_min']:.3f}–{r['seconds_max']:.3f})"),
    ("MB/s (median)", lambda r: f"{r['MB_per_s']:.0f}"),
    ("ratio of medians", _ratio),
]


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    return markdown_table(rows, COLUMNS)


def run(out_dir, *, repeat: int = 3, quick: bool = False, scratch: str | None = None) -> list[dict]:
    """Run both benchmarks; write ``storage.json`` and ``storage.md`` into
    ``out_dir`` and return the rows (one per scenario, operation and
    system).  ``quick``: state dicts 64x smaller (a harness check; the
    numbers mean little)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hyperdcp-storage-bench-", dir=scratch))
    from dcp.testing import local_s3_server

    try:
        with local_s3_server() as endpoint:
            rows = _s3_rows(endpoint, repeat, quick)
        rows += _memory_rows(work, repeat, quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_table(out, "storage", rows, markdown(rows))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.storage",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="state dicts 64x smaller")
    args = parser.parse_args()
    print(markdown(run(args.out, repeat=args.repeat, quick=args.quick)))
