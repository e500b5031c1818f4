"""Shared fixtures.  The tests directory is on sys.path (pytest rootdir-relative
"prepend" import mode), so test modules import ``dist_harness`` and ``helpers``
directly, and so do the spawned ranks."""

from __future__ import annotations

import os

import pytest

from dist_harness import _REGISTRY, SessionGroups

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two test processes share the 2 cores CI has: one thread each, or their
    # intra-op pools spin against each other
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before xdist names the groups
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``--dist loadgroup``), every test that needs the
    spawned groups of one chain runs in one worker, so each group is spawned
    once per run (a chain's groups share ``ctx.shared`` across phases)."""
    for item in items:
        if "dist_groups" in getattr(item, "fixturenames", ()):
            fn = getattr(item, "function", None)
            reg = _REGISTRY.get(f"{fn.__module__}:{fn.__qualname__}") if fn else None
            item.add_marker(pytest.mark.xdist_group(f"dist_{reg.chain if reg else 'main'}"))


@pytest.fixture(scope="session")
def dist_groups(tmp_path_factory):
    """Runs the ``@dist_scenario`` groups (one spawned group per world size and
    phase, each group at most once per session)."""
    return SessionGroups(tmp_path_factory.mktemp("dist"))


def pytest_terminal_summary(terminalreporter, config):
    """With ``--durations``: each spawned group's wall time and its slowest
    scenarios (pytest charges a whole group to the first test that needs it)."""
    if not config.getoption("durations", None):
        return
    for groups in SessionGroups.instances:
        for (chain, ws, phase), res in sorted(groups.results.items(),
                                              key=lambda kv: -kv[1].secs):
            terminalreporter.write_line(
                f"[group] {chain} world_size={ws} phase={phase}: {res.secs:.1f}s "
                f"(imports + init {res.ready_secs:.1f}s)")
            for row in sorted(res.summary().splitlines(),
                              key=lambda r: -float(r.split()[1].rstrip("s")))[:8]:
                terminalreporter.write_line(f"    {row}")
