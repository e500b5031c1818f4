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
