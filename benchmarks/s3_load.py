"""Loads from S3, judged by seconds, GET requests and GET bytes.

The object store is moto's S3 server on 127.0.0.1, run by the benchmark in
its own (parent) process behind :class:`RequestCounter`, a WSGI middleware
that counts the requests by method and the bytes of the GET response bodies
*at the server*; the ranks are spawned processes that reach it over
loopback.  The counters are reset before each measured load and read after
it, so every count is exactly that load's traffic.

State dict (:data:`FULL`): 4 fp32 tensors of [1024, 1024] = 16 MiB in the
layouts of :mod:`benchmarks.state_dicts` (small, because moto's ranged GETs
cost time in proportion to the object's size).  Scenarios:

- ``s3_load_shard0_to_shard1``: a ``Shard(0)`` checkpoint into ``Shard(1)``
  (each rank needs 1/W of every row);
- ``s3_load_replicated_to_replicated``: a replicated checkpoint into a
  replicated state dict (every rank needs all of it).

Systems (the same names as on files):

- ``torch-dcp``: ``torch.distributed.checkpoint`` with its fsspec reader
  and writer (``FsspecReader`` / ``FsspecWriter``) on s3fs, saving and
  loading its own checkpoint;
- ``hyperdcp``: ``dcp.save`` / ``dcp.load`` on an ``s3://`` id
  (``storage_options`` with the endpoint);
- ``floor``: raw s3fs, no checkpoint system: the data files of hyperdcp's
  checkpoint fetched with one whole-object GET each, the files split among
  the ranks (largest first, to the least loaded), each rank's GETs
  concurrent; nothing decoded, checked or placed.  Every byte a load needs
  is fetched once, in the fewest requests.

Per world size one process group saves each source checkpoint once per
system (unmeasured), then loads ``repeat`` times per scenario, the systems'
order rotating by one place between repeats and between scenarios; before
each load the target is zeroed, after it every rank checks its values
element-exact (not the floor's: it places nothing).  Targets:
``Shard(0)->Shard(1)`` in at most torch DCP's time; replicated ->
replicated at W=4 in at most 0.5x torch DCP's time, with GET bytes at most
1.05x the checkpoint.

    python -m benchmarks.s3_load [--world-sizes 2 4] [--repeat 3] [--quick]

(the same as ``python -m benchmarks --scenario s3_load ...``).  Needs the
bench extra (s3fs, moto), imported only when it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .common import RunConfig, launch, record, rotation, timed_collective
from .report import (
    MB,
    Column,
    Row,
    Sample,
    TargetResult,
    fmt,
    requests_cell,
    seconds_cell,
    verified_cell,
)
from .state_dicts import StateDictSpec, is_correct, local_tensors, state_dict, zero
from .systems import BASELINE, FLOOR, Reads

FAMILY = "s3_load"
NEEDS = ("s3fs", "moto")  # the bench extra
FULL = StateDictSpec(num_tensors=4, rows=1024, cols=1024)
QUICK = StateDictSpec(num_tensors=2, rows=64, cols=64)
WARMUP = StateDictSpec(num_tensors=1, rows=16, cols=16)
BUCKET = "bench"
REGION = "us-east-1"
LOADS: dict[str, tuple[str, str]] = {
    "s3_load_shard0_to_shard1": ("shard0", "shard1"),
    "s3_load_replicated_to_replicated": ("replicated", "replicated"),
}
SCENARIOS = {name: f"S3 (moto): load a {src} checkpoint into {dst}"
             for name, (src, dst) in LOADS.items()}
#: Targets: hyperdcp / torch-dcp seconds; GET bytes / checkpoint bytes.
RESHARD_VS_TORCH, REPLICATED_VS_TORCH, REPLICATED_GET_BYTES = 1.0, 0.5, 1.05
#: The path of the counters on the server (not passed on to moto).
COUNTS_PATH = "/_bench/counts"


# --- the server --------------------------------------------------------------


class RequestCounter:
    """WSGI middleware in front of moto: counts the requests by method, the
    GETs of a bucket alone (listings) apart as ``"GET bucket"``, and the
    bytes of every GET response body as ``"GET bytes"``.

    ``GET`` :data:`COUNTS_PATH` answers the counts as JSON (``?reset=1``
    then zeroes them); it is not counted.  Conditional writes
    (``If-None-Match``) are served one at a time, so that of two racing
    exclusive creates exactly one wins, as on S3 (moto alone checks, then
    writes).
    """

    def __init__(self, app) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._conditional = threading.Lock()
        self._counts: Counter = Counter()

    def _add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _answer_counts(self, environ, start_response):
        with self._lock:
            body = json.dumps(dict(self._counts)).encode()
            if "reset=1" in environ.get("QUERY_STRING", ""):
                self._counts.clear()
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(body)))])
        return [body]

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == COUNTS_PATH:
            return self._answer_counts(environ, start_response)
        method = environ["REQUEST_METHOD"]
        self._add(method)
        if method == "GET" and "/" not in path.strip("/"):
            self._add("GET bucket")
        if "HTTP_IF_NONE_MATCH" in environ:
            with self._conditional:
                body = list(self.app(environ, start_response))
        else:
            body = self.app(environ, start_response)
        return self._counted(body) if method == "GET" else body

    def _counted(self, body) -> Iterator[bytes]:
        try:
            for chunk in body:
                self._add("GET bytes", len(chunk))
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


@contextlib.contextmanager
def counting_server(wrap: Callable[[Any], Any] | None = None) -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1, in a thread of this
    process, behind a :class:`RequestCounter` (itself behind ``wrap(app)``,
    another WSGI middleware, where given), with the bucket :data:`BUCKET`;
    yields its endpoint URL.  Sets fake credentials, a region and
    ``AWS_EC2_METADATA_DISABLED`` in the environment (which the spawned
    ranks inherit)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", REGION)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    app = RequestCounter(DomainDispatcherApplication(create_backend_app))
    if wrap is not None:
        app = wrap(app)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    try:
        _raw_fs(endpoint).call_s3("create_bucket", Bucket=BUCKET)
        yield endpoint
    finally:
        server.shutdown()
        thread.join()


def server_counts(endpoint: str, reset: bool = False) -> dict[str, int]:
    """The server's counts since the last reset (then a reset, if asked)."""
    query = "?reset=1" if reset else ""
    with urllib.request.urlopen(f"{endpoint}{COUNTS_PATH}{query}", timeout=30) as answer:
        return json.loads(answer.read())


def _credentials(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": "bench", "secret": "bench",
            "client_kwargs": {"region_name": REGION}}


def _raw_fs(endpoint: str, **options):
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                             **_credentials(endpoint), **options)


# --- the systems -------------------------------------------------------------


class TorchDCPFsspec:
    """torch DCP's fsspec writer and reader on s3fs."""

    name = BASELINE

    def __init__(self, endpoint: str) -> None:
        import torch.distributed.checkpoint as tdcp

        try:
            from torch.distributed.checkpoint import FsspecReader, FsspecWriter
        except ImportError:  # not exported by torch 2.13
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        self._tdcp, self._reader, self._writer = tdcp, FsspecReader, FsspecWriter
        self._options = _credentials(endpoint)

    def save(self, sd: dict[str, Any], path: str) -> None:
        # sync_files: an os.sync() per file on fsspec streams; nothing to sync on S3
        writer = self._writer(path, sync_files=False, **self._options)
        self._tdcp.save(sd, storage_writer=writer)

    def load(self, sd: dict[str, Any], path: str) -> None:
        self._tdcp.load(sd, storage_reader=self._reader(path, **self._options))


class HyperDCPS3:
    """``dcp.save`` / ``dcp.load`` on an ``s3://`` id."""

    name = "hyperdcp"

    def __init__(self, endpoint: str) -> None:
        import dcp

        self._dcp = dcp
        self.options = _credentials(endpoint)

    def save(self, sd: dict[str, Any], path: str) -> None:
        self._dcp.save(sd, path, storage_options=self.options)

    def load(self, sd: dict[str, Any], path: str) -> Any:
        return self._dcp.load(sd, path, storage_options=self.options)


class S3Floor(HyperDCPS3):
    """Raw s3fs: this rank's share of the data files of a hyperdcp
    checkpoint (chosen when it is saved, unmeasured), one whole-object GET
    each (``max_concurrency=1``: no HEAD, no split into ranges), all at
    once.  Not a checkpoint system: nothing is placed."""

    name = FLOOR
    floor = True

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self._fs = _raw_fs(endpoint, max_concurrency=1)
        self._share: dict[str, list[str]] = {}

    def save(self, sd: dict[str, Any], path: str) -> None:
        super().save(sd, path)
        md = self._dcp.read_metadata(path, storage_options=self.options)
        sizes: Counter = Counter()
        for meta in md.tensors.values():
            for chunk in meta.chunks:
                sizes[chunk.file] = max(sizes[chunk.file], chunk.byte_offset + chunk.nbytes)
        loads = [0] * dist.get_world_size()
        mine = []
        for name in sorted(sizes, key=lambda n: (-sizes[n], n)):  # largest first, to the lightest
            rank = loads.index(min(loads))
            loads[rank] += sizes[name]
            if rank == dist.get_rank():
                mine.append(f"{path.removeprefix('s3://')}/{name}")
        self._share[path] = mine

    def load(self, sd: dict[str, Any], path: str) -> Reads:
        from fsspec.asyn import sync

        paths = self._share[path]

        async def get_all() -> list[bytes]:
            return await asyncio.gather(*(self._fs._cat_file(p) for p in paths))

        sync(self._fs.loop, get_all)
        return Reads(len(paths))


S3_SYSTEMS: dict[str, type] = {cls.name: cls for cls in (TorchDCPFsspec, HyperDCPS3, S3Floor)}


# --- the family --------------------------------------------------------------


def run(scenarios: list[str], config: RunConfig) -> list[Sample]:
    """Measure ``scenarios`` (names from :data:`SCENARIOS`) at every world
    size, against one server started here."""
    spec = QUICK if config.quick else FULL
    samples: list[Sample] = []
    loads = [s for s in LOADS if s in scenarios]
    with counting_server() as endpoint:
        for world_size in config.world_sizes:
            spec.check_divisible(world_size, FAMILY)
            print(f"[{FAMILY}] W={world_size}: {', '.join(loads)}", file=sys.stderr)
            prefix = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}-w{world_size}"
            samples += launch(_worker, world_size, loads, config, spec, endpoint, prefix)[0]
    return samples


def targets(rows: list[Row]) -> list[TargetResult]:
    """The loads issue's S3 targets, checked against hyperdcp's rows."""
    results = []
    for r in rows:
        if r.family != FAMILY or r.system != "hyperdcp":
            continue
        name = f"{r.scenario} W={r.world_size}"
        if r.scenario == "s3_load_shard0_to_shard1":
            results.append(TargetResult(f"{name}: hyperdcp seconds / torch-dcp seconds",
                                        r.seconds_ratio, limit=RESHARD_VS_TORCH, timing=True))
        elif r.scenario == "s3_load_replicated_to_replicated" and r.world_size == 4:
            results.append(TargetResult(f"{name}: hyperdcp seconds / torch-dcp seconds",
                                        r.seconds_ratio, limit=REPLICATED_VS_TORCH, timing=True))
            results.append(TargetResult(
                f"{name}: hyperdcp GET bytes / checkpoint bytes", _get_share(r),
                limit=REPLICATED_GET_BYTES, timing=False))
    return results


def _get_share(r: Row) -> float | None:
    if r.get_bytes is None or not r.checkpoint_bytes:
        return None
    return r.get_bytes / r.checkpoint_bytes


COLUMNS: list[Column] = [
    ("scenario", lambda r: r.scenario),
    ("W", lambda r: str(r.world_size)),
    ("system", lambda r: r.system),
    ("seconds: median (min–max)", seconds_cell),
    ("× time", lambda r: fmt(r.seconds_ratio, ".2f")),
    ("× floor", lambda r: fmt(r.seconds_vs_floor, ".2f")),
    ("GET requests", lambda r: fmt(r.get_requests, ".0f")),
    ("all requests", lambda r: fmt(r.server_requests, ".0f")),
    ("GET MB", lambda r: fmt(None if r.get_bytes is None else r.get_bytes / MB, ".1f")),
    ("GET bytes / checkpoint", lambda r: fmt(_get_share(r), ".2f")),
    ("reported requests/rank", requests_cell),
    ("correct", verified_cell),
]


def _worker(rank: int, world_size: int, loads: list[str], config: RunConfig,
            spec: StateDictSpec, endpoint: str, prefix: str) -> list[Sample]:
    systems = [S3_SYSTEMS[name](endpoint) for name in config.systems if name in S3_SYSTEMS]
    mesh = init_device_mesh("cpu", (world_size,))
    sources = list(dict.fromkeys(LOADS[s][0] for s in loads))
    destinations = {dst: state_dict(dst, spec, mesh, filled=False)
                    for dst in {LOADS[s][1] for s in loads}}

    def path(system, layout: str) -> str:
        return f"{prefix}/{system.name}-{layout}"

    for system in systems:  # imports, connections, first collectives: unmeasured
        system.save(state_dict("shard0", WARMUP, mesh, filled=True), path(system, "warmup"))
        system.load(state_dict("shard1", WARMUP, mesh, filled=False), path(system, "warmup"))
    for layout in sources:
        source = state_dict(layout, spec, mesh, filled=True)
        for system in systems:
            system.save(source, path(system, layout))
        del source

    samples: list[Sample] = []
    for repeat in range(config.repeat):
        for step, scenario in enumerate(loads):
            src, dst = LOADS[scenario]
            target = destinations[dst]
            for system in rotation(systems, repeat + step):
                zero(target)
                if rank == 0:
                    server_counts(endpoint, reset=True)
                m = timed_collective(system.load, target, path(system, src))
                dist.barrier()  # every rank's requests are answered
                server = server_counts(endpoint) if rank == 0 else None
                needed = sum(t.nbytes for t in local_tensors(target))
                ok = None if getattr(system, "floor", False) else is_correct(target, dst, spec)
                record(samples, FAMILY, scenario, "load", system, repeat, m, needed, ok,
                       server=server, checkpoint_bytes=spec.nbytes)
    if rank == 0:
        _raw_fs(endpoint).rm(prefix.removeprefix("s3://"), recursive=True)
    return samples


if __name__ == "__main__":
    from benchmarks.__main__ import main

    sys.exit(main(["--scenario", FAMILY, *sys.argv[1:]]))
