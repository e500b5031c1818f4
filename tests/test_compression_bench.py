"""The compression benchmark's own measuring parts (``benchmarks/compression.py``):
the covering frames it counts a resharded load against, and its bandwidth
limit's pacing and counts."""

from __future__ import annotations

import io
import time

import torch

import dcp
from benchmarks.compression import Throttle, covering_bytes


def test_covering_bytes_are_what_a_partial_load_reads(tmp_path):
    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    dcp.save({"w": w}, tmp_path / "c", compression=dcp.Compression(frame_bytes=4096))
    md = dcp.read_metadata(str(tmp_path / "c"))
    stored = md.tensors["w"].chunks[0].frames.stored
    rows = {"w": dcp.TensorShard(torch.empty(10, 512, dtype=torch.bfloat16), (256, 512), (50, 0))}
    assert covering_bytes(md, rows) == (3, sum(stored[12:15]))  # 1 KiB rows, 4 per frame
    assert dcp.load(rows, tmp_path / "c").bytes_read == sum(stored[12:15])
    cols = {"w": dcp.TensorShard(torch.empty(256, 100, dtype=torch.bfloat16), (256, 512), (0, 300))}
    assert covering_bytes(md, cols) == (64, sum(stored))


def test_the_throttle_paces_and_counts_both_ways():
    def app(environ, start_response):
        environ["wsgi.input"].read(500_000)
        start_response("200 OK", [])
        return [bytes(1_000_000)]

    throttle = Throttle(app, rate=10e6)
    environ = {"PATH_INFO": "/bucket/r00000-0.data", "REQUEST_METHOD": "GET",
               "wsgi.input": io.BytesIO(bytes(500_000))}
    start = time.monotonic()
    body = b"".join(throttle(environ, lambda status, headers: None))
    assert time.monotonic() - start >= 0.1  # 1 MB down at 10 MB/s
    assert len(body) == 1_000_000
    assert throttle.counts() == {"up bytes": 500_000, "down bytes": 1_000_000, "data GETs": 1,
                                 "data GET bytes": 1_000_000}
    assert throttle.counts() == {}
