"""Wire format 2 (a small JSON text, integer columns and bytes in a binary
section): exact round trips of the scale layout's plans and results,
crafted references refused, write results relative to cached plans made
whole again exactly, host bundles, and the poll schedule's bounds."""

from __future__ import annotations

import itertools
import json
import pickle
import struct

import numpy as np
import pytest

import dcp
from benchmarks.coordination import layout_for
from benchmarks.scale import local_plans, simulated_write_results
from dcp.coordination import wire
from dcp.coordination.file_flag import POLL_FLOOR, POLL_LATENESS, poll_times
from dcp.core.metadata import ChunkMeta, encode
from dcp.orchestration import save
from planners.save import DefaultSavePlanner


@pytest.fixture(scope="module")
def scale():
    plans = local_plans(layout_for(128))
    final = DefaultSavePlanner().create_global_plan(plans)
    return plans, final, simulated_write_results(plans, final)


def test_plans_and_results_round_trip_exact_with_no_integer_list_in_the_json(scale):
    plans, final, results = scale
    for value in (plans[7], final[7], results[7], (final[3], None)):
        data = wire.encode(value)
        assert wire.decode(data, "x") == value
        text = json.loads(wire.body(data))
        lists = [v for v in _walk(text) if isinstance(v, list) and v and
                 all(type(i) is int for i in v) and len(v) > 3]
        assert not lists, lists[:1]  # columns live in the section
    # plans of one tensor table (a data-parallel group's) share one read-only mapping
    one, two = (wire.decode(wire.encode(plans[5]), "p") for _ in range(2))
    again = pickle.loads(pickle.dumps(one))  # as its columns, while its items are not built
    assert type(again).__name__ == "ColumnarSavePlan" and again == plans[5]
    assert one.tensors is two.tensors and one == two == plans[5]
    with pytest.raises(TypeError):
        one.tensors["x"] = None
    big = {"blob": bytes(range(256)) * 40, "n": 2**40, "neg": -(2**40), "crc": 2**32 - 1}
    assert wire.decode(wire.encode(big), "b") == big


def _walk(doc):
    yield doc
    if isinstance(doc, list):
        for v in doc:
            yield from _walk(v)
    elif isinstance(doc, dict):
        for v in doc.values():
            yield from _walk(v)


def _envelope(doc: dict, section: bytes) -> bytes:
    text = json.dumps(doc).encode()
    return b"DCPW" + bytes([wire.FORMAT_VERSION, 0]) + struct.pack("<I", len(text)) + text \
        + section


@pytest.mark.parametrize("ref", [
    {"@": ["i8", 0, 3]},  # 24 bytes from a section of 16
    {"@": ["i8", -8, 1]},
    {"@": ["f8", 0, 1]},  # not an integer dtype
    {"@": ["i4", 0, "2"]},
    [1, 2, 3, 4],  # a JSON list where a column belongs
])
def test_a_crafted_column_is_refused_naming_the_file(scale, ref):
    plans, _, _ = scale
    doc = json.loads(wire.body(wire.encode(plans[1])))
    doc["j"]["b"] = ref
    with pytest.raises(dcp.CheckpointError, match="rank 9's file: malformed exchange payload"):
        wire.decode(_envelope(doc, bytes(16)), "rank 9's file")
    for crafted in (_envelope({"b": [4, 99]}, bytes(8)), b"DCPW\x02\x00\xff\xff\xff\xff{}",
                    b"DCPW\x01\x00" + struct.pack("<I", 2) + b"{}"):
        with pytest.raises(dcp.CheckpointError, match="malformed exchange payload"):
            wire.decode(crafted, "f")


def test_results_relative_to_cached_plans_are_made_whole_exactly(scale):
    plans, final, results = scale
    world = len(plans)
    relative = [wire.relative_result(r, f, p, rank)
                for rank, (r, f, p) in enumerate(zip(results, final, plans, strict=True))]
    assert all(r is not None for r in relative)
    full = sum(len(wire.encode(r)) for r in results)
    compact = sum(len(wire.encode(r)) for r in relative)
    assert compact < 0.6 * full, (compact, full)
    whole = [wire.absolute_result(wire.decode(wire.encode(r), "r"), f, p, rank)
             for rank, (r, f, p) in enumerate(zip(relative, final, plans, strict=True))]
    assert whole == results
    decls = {f: d for p in plans for f, d in p.tensors.items()}
    assert encode(save.build_metadata("s", world, decls, whole)) == encode(
        save._metadata_from_objects("s", world, decls, results))
    # what a cached plan does not give travels whole
    odd = save.WriteResult(chunks=[("nope", ChunkMeta((0,), (1,), "f", 0, 4, 1, 3))])
    assert wire.relative_result(odd, final[3], plans[3], 3) is None
    other = save.WriteResult(chunks=results[3].chunks, replicas={("nope", (0,)): 1})
    assert wire.relative_result(other, final[3], plans[3], 3) is None
    bad = wire.decode(wire.encode(relative[3]), "r")
    bad.item = np.array([len(final[3].items)])
    bad.file, bad.at, bad.crc = bad.file[:1], bad.at[:1], bad.crc[:1]
    with pytest.raises(dcp.CheckpointError, match="rank 3's write result names a chunk"):
        wire.absolute_result(bad, final[3], plans[3], 3)


def test_host_bundles_round_trip_and_damage_is_named(scale):
    plans, _, results = scale
    payloads = [wire.encode((p, None)) for p in plans[:8]] + [wire.encode("small")]
    bundle = wire.bundle(payloads + [b"not a payload"])
    assert len(bundle) < sum(map(len, payloads)) / 2  # compressed together
    parts = wire.unbundle(bundle, "b")
    assert [wire.decode(p, "p") for p in parts[:-1]] == [wire.decode(p, "p") for p in payloads]
    with pytest.raises(dcp.CheckpointError, match="rank 5's part: malformed exchange payload"):
        wire.decode(parts[-1], "rank 5's part")
    for damaged in (bundle[:-3], payloads[0], b""):
        with pytest.raises(dcp.CheckpointError, match="bundle from rank 4: malformed bundle"):
            wire.unbundle(damaged, "bundle from rank 4")


def test_polls_are_bounded_by_the_wait_and_late_by_at_most_a_fraction():
    for first in (0.001, 0.05, 0.5):
        times = list(itertools.takewhile(lambda t: t < 600.0, poll_times(first)))
        assert len(times) <= 46, (first, len(times))
        for at, then in itertools.pairwise(times[1:]):
            assert then - at <= max(POLL_FLOOR, POLL_LATENESS * at, first) + 1e-12
