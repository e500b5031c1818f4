"""The coordinator's metadata from write results kept as columns (decoded
from the wire) is the metadata built chunk by chunk, encoded byte for byte
the same, and a replica that differs is named the same way."""

from __future__ import annotations

import pytest

from benchmarks.coordination import layout_for
from benchmarks.scale import local_plans, simulated_write_results
from dcp.coordination import wire
from dcp.core.metadata import encode
from dcp.errors import CheckpointError
from dcp.orchestration import save
from planners.save import DefaultSavePlanner


def payloads(ranks: int, **settings):
    plans = local_plans(layout_for(ranks))
    final = DefaultSavePlanner(**settings).create_global_plan(plans)
    results = simulated_write_results(plans, final)
    decls = {f: d for p in plans for f, d in p.tensors.items()}
    decoded = [results[0], *(wire.decode(wire.encode(r), "r") for r in results[1:])]
    return decls, results, decoded


@pytest.mark.parametrize("settings", [{}, {"split_replicated": False}])
def test_columns_make_the_same_metadata(settings):
    decls, results, decoded = payloads(128, **settings)
    fast = save._metadata_from_columns("s", 128, decls, decoded)
    assert fast is not None
    slow = save._metadata_from_objects("s", 128, decls, results)
    assert encode(fast) == encode(slow)
    assert fast.tensors == slow.tensors
    assert wire.decode(wire.encode(decoded[5]), "r") == results[5]


def test_a_replica_that_differs_is_named_as_before():
    decls, results, decoded = payloads(128)
    rank = next(r for r, res in enumerate(results) if res.replicas)
    key = next(iter(results[rank].replicas))
    results[rank].replicas[key] = 7
    decoded[rank] = wire.decode(wire.encode(results[rank]), "r")
    assert save._metadata_from_columns("s", 128, decls, decoded) is None
    with pytest.raises(CheckpointError) as slow:
        save._metadata_from_objects("s", 128, decls, results)
    with pytest.raises(CheckpointError) as fast:
        save.build_metadata("s", 128, decls, decoded)
    assert str(fast.value) == str(slow.value) and "hold different values" in str(fast.value)
