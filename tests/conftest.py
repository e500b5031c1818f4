"""Shared fixtures.  The tests directory is on sys.path (pytest rootdir-relative
"prepend" import mode), so test modules import ``dist_harness`` and ``helpers``
directly, and so do the spawned ranks."""

from __future__ import annotations

import pytest

from dist_harness import SessionGroups


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
        for (ws, phase), res in sorted(groups.results.items(), key=lambda kv: -kv[1].secs):
            terminalreporter.write_line(
                f"[group] world_size={ws} phase={phase}: {res.secs:.1f}s "
                f"(imports + init {res.ready_secs:.1f}s)")
            for row in sorted(res.summary().splitlines(),
                              key=lambda r: -float(r.split()[1].rstrip("s")))[:8]:
                terminalreporter.write_line(f"    {row}")
