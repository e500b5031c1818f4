"""The multi-process harness itself must report failures, recover from a
desynchronised group and survive a crashed rank (else every distributed test
could pass vacuously).  One small W=2 group, a few seconds."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_group


def scen_ok(ctx):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
    (ctx.dir / f"rank{ctx.rank}").write_text("x")


def scen_fail_on_rank1(ctx):
    dist.barrier()
    if ctx.rank == 1:
        raise ValueError("boom from rank one")


def scen_desync(ctx):
    # rank 0 fails before a collective that rank 1 enters: rank 1 must get out
    # through the process-group timeout.
    if ctx.rank == 0:
        raise RuntimeError("rank 0 bails out early")
    dist.all_reduce(torch.ones(1))


def scen_after_desync(ctx):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0, t


def scen_crash(ctx):
    dist.barrier()
    if ctx.rank == 1:
        os._exit(7)
    dist.barrier()


def scen_never_reached(ctx):
    pass


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_group(
        2,
        [scen_ok, scen_fail_on_rank1, scen_desync, scen_after_desync, scen_crash,
         scen_never_reached],
        tmp_path_factory.mktemp("harness"),
        pg_timeout=5,
        group_timeout=120,
    )


def test_passing_scenario_passes(result):
    result.check(scen_ok)
    outcomes = result.outcomes["test_harness:scen_ok"]
    assert (outcomes[0].ok, outcomes[1].ok) == (True, True)


def test_failure_is_reported_with_rank_traceback(result):
    with pytest.raises(AssertionError) as ei:
        result.check(scen_fail_on_rank1)
    msg = str(ei.value)
    assert "scen_fail_on_rank1" in msg
    assert "rank 1 traceback" in msg and "boom from rank one" in msg
    assert "rank 0 traceback" not in msg


def test_desync_fails_then_group_recovers(result):
    with pytest.raises(AssertionError) as ei:
        result.check(scen_desync)
    assert "rank 0 bails out early" in str(ei.value)
    assert "rank 1 traceback" in str(ei.value)  # the timed-out collective
    result.check(scen_after_desync)


def test_crash_is_reported(result):
    with pytest.raises(AssertionError) as ei:
        result.check(scen_crash)
    assert "never finished" in str(ei.value) or "never started" in str(ei.value)
    assert "scen_crash" in str(ei.value)
    with pytest.raises(AssertionError, match="never started"):
        result.check(scen_never_reached)
