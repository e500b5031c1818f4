"""The plugin author's conformance suite (``dcp.testing``) run against every
built-in storage plugin and the third-party example plugin
(``tests/plugin_pkg``, installed by ``make install``)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

import s3_server
from dcp.testing import StorageConformance
from storage_plugins.shm import DEFAULT_ROOT


class TestPosix(StorageConformance):
    @pytest.fixture
    def checkpoint_id(self, tmp_path):
        return str(tmp_path / "ckpt")


class TestPosixFileUrl(StorageConformance):
    @pytest.fixture
    def checkpoint_id(self, tmp_path):
        return f"file://{tmp_path}/ckpt"

    @pytest.fixture
    def storage_options(self):
        return {"thread_count": 2, "fsync": False}


class TestMemory(StorageConformance):
    @pytest.fixture
    def checkpoint_id(self):
        return f"memory://conformance-{uuid.uuid4().hex[:8]}/ckpt"


class TestShm(StorageConformance):
    @pytest.fixture
    def checkpoint_id(self):
        name = f"conformance-{uuid.uuid4().hex[:8]}"
        yield f"shm://{name}/ckpt"
        if (Path(DEFAULT_ROOT) / name).exists():
            shutil.rmtree(Path(DEFAULT_ROOT) / name)


class TestS3(StorageConformance):
    @pytest.fixture
    def checkpoint_id(self):
        return s3_server.fresh_url("conformance")

    @pytest.fixture
    def storage_options(self):
        # parts of 2 KiB: the suite's larger files go as multipart uploads
        return s3_server.options(s3_server.endpoint(), part_size=2048, max_concurrency=4)


class TestSqlitePlugin(StorageConformance):
    """The third-party example plugin, found through its entry point only."""

    @pytest.fixture
    def checkpoint_id(self, tmp_path):
        return f"sqlite://{tmp_path}/ckpt.db"
