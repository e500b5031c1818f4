"""Plugin discovery (entry points only, install hints), the third-party
example plugin, the in-memory and shared-memory plugins, and the plugin
author's guide."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import mmap
import os
import random
import re
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import dcp
from dcp.asynchronous import staging
from dcp.core.metadata import METADATA_FILE
from dcp.core.storage import ENTRY_POINT_GROUP, can_replace, installed_schemes, open_storage
from dcp.orchestration.save import describe_state
from dist_harness import dist_scenario
from helpers import (
    assert_bitwise_equal,
    assert_dtensor_equals_full,
    make_dtensor,
    random_tensor,
    zeros_dtensor,
)
from storage_plugins.shm import DEFAULT_ROOT, ShmStorage

ROOT = Path(__file__).resolve().parent.parent

BUILT_IN = {
    "file": "storage_plugins.posix:PosixStorage",
    "s3": "storage_plugins.s3:S3Storage",
    "memory": "storage_plugins.memory:MemoryStorage",
    "shm": "storage_plugins.shm:ShmStorage",
    "fsspec": "storage_plugins.fsspec_store:FsspecStorage",  # any other fsspec URL
}


# --------------------------------------------------------------- discovery
def test_built_in_plugins_are_entry_points():
    schemes = installed_schemes()
    for scheme, target in BUILT_IN.items():
        assert schemes[scheme].value == target, scheme
        assert schemes[scheme].group == ENTRY_POINT_GROUP
        assert schemes[scheme].dist.name == "hyperdcp", scheme


def test_unknown_scheme_lists_installed_schemes():
    with pytest.raises(dcp.CheckpointError) as info:
        dcp.save({"x": torch.ones(1)}, "nosuch://bucket/ckpt")
    message = str(info.value)
    assert "'nosuch'" in message and "nosuch://bucket/ckpt" in message
    assert f"installed: {', '.join(sorted(installed_schemes()))};" in message


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_other_fsspec_url_falls_back_to_the_generic_plugin_naming_the_missing_package():
    with pytest.raises(dcp.CheckpointError) as info:
        dcp.load({"x": torch.ones(1)}, "gs://bucket/ckpt")
    assert "gs://bucket/ckpt" in str(info.value) and "gcsfs" in str(info.value)


def test_s3_without_s3fs_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    monkeypatch.delitem(sys.modules, "storage_plugins.s3", raising=False)
    with pytest.raises(dcp.CheckpointError) as info:
        open_storage("s3://bucket/ckpt")
    assert "s3fs" in str(info.value) and "hyperdcp[s3]" in str(info.value)


def test_bad_transfer_options_are_refused():
    with pytest.raises(dcp.CheckpointError, match="part_size and max_concurrency must be positive"):
        open_storage("memory://bad", part_size=0)


# ------------------------------------------------------ third-party plugin
def test_third_party_plugin_used_by_scheme_alone(tmp_path):
    """tests/plugin_pkg, pip-installed by the test set-up: dcp.save and
    dcp.load find it through its entry point, with no registration."""
    assert installed_schemes()["sqlite"].dist.name == "hyperdcp-sqlite-example"
    url = f"sqlite://{tmp_path}/run/ckpt.db"
    state = {"w": random_tensor((6, 5), torch.float16, seed=1), "step": 9}
    md = dcp.save(state, url)
    assert (tmp_path / "run" / "ckpt.db").is_file()
    assert dcp.read_metadata(url).tensors["w"].shape == md.tensors["w"].shape == (6, 5)
    target = {"w": torch.zeros(6, 5, dtype=torch.float16), "step": 0}
    dcp.load(target, url)
    assert_bitwise_equal(target["w"], state["w"], "w")
    assert target["step"] == 9
    assert sorted(open_storage(url).list_files()) == sorted(md.files() | {METADATA_FILE})


def test_guide_shows_the_example_plugin_verbatim():
    guide = (ROOT / "docs" / "plugin-authors.md").read_text()
    blocks = re.findall(r"<!-- (tests/plugin_pkg/\S+) -->\n```\w+\n(.*?)```", guide, re.S)
    assert [path for path, _ in blocks] == ["tests/plugin_pkg/dcp_sqlite.py",
                                            "tests/plugin_pkg/pyproject.toml"]
    for path, text in blocks:
        assert text == (ROOT / path).read_text(), f"{path} differs from the guide"


# -------------------------------------------------------------- memory://
def test_memory_checkpoint_is_in_fsspec_memory():
    url = "memory://plugins-test/ckpt"
    md = dcp.save({"w": torch.arange(5.0)}, url)
    memory = fsspec.filesystem("memory")
    assert sorted(memory.find("/plugins-test/ckpt")) == sorted(
        f"/plugins-test/ckpt/{name}" for name in md.files() | {METADATA_FILE})
    storage = open_storage(url)
    storage.delete(storage.list_files())
    assert memory.find("/plugins-test/ckpt") == []


# ------------------------------------------------------- POSIX direct I/O
def _aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned memory (an anonymous mapping)."""
    buf = mmap.mmap(-1, max(len(data), 1))
    buf[:len(data)] = data
    return memoryview(buf)[:len(data)]


def _spy_direct_writes(monkeypatch) -> list[int]:
    """Lengths of the ``pwrite`` calls made through ``O_DIRECT`` descriptors."""
    direct, pwrite = [], os.pwrite

    def spy(fd, data, offset):
        n = pwrite(fd, data, offset)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct.append(n)
        return n
    monkeypatch.setattr(os, "pwrite", spy)
    return direct


def _o_direct_works(directory: Path) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:  # this filesystem has no O_DIRECT
        return False


def test_posix_writes_aligned_buffers_with_direct_io(tmp_path, monkeypatch):
    if not _o_direct_works(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    direct = _spy_direct_writes(monkeypatch)
    rng = random.Random(0)
    parts = [_aligned(rng.randbytes(3 * 4096 + 100)),  # 3 blocks direct, 100 bytes buffered
             rng.randbytes(7),                          # read-only bytes: buffered
             _aligned(rng.randbytes(8192)),             # aligned memory, unaligned file offset
             bytes(4096 - (3 * 4096 + 100 + 7 + 8192) % 4096),  # padding to a block
             _aligned(rng.randbytes(5 * 4096)),         # all direct
             memoryview(bytearray(rng.randbytes(5000)))[1:]]  # unaligned memory
    storage = open_storage(str(tmp_path))
    assert (storage.direct_io, storage.alignment) == (True, 4096)
    storage.write_file("f.data", parts)
    assert (tmp_path / "f.data").read_bytes() == b"".join(bytes(p) for p in parts)
    assert sum(direct) == 8 * 4096
    assert not open_storage(str(tmp_path), direct_io=False).direct_io
    unsynced = open_storage(str(tmp_path), fsync=False)  # the page cache is faster then
    assert (unsynced.direct_io, unsynced.alignment) == (False, 1)
    unsynced.write_file("g.data", parts)
    assert (tmp_path / "g.data").read_bytes() == b"".join(bytes(p) for p in parts)
    assert sum(direct) == 8 * 4096


def test_posix_falls_back_to_the_page_cache_where_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):  # a filesystem without O_DIRECT (older tmpfs, FUSE)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", refusing_open)
    storage = open_storage(str(tmp_path))
    data = random.Random(1).randbytes(4 * 4096 + 3)
    storage.write_file("f.data", [_aligned(data)])
    assert (tmp_path / "f.data").read_bytes() == data and not storage.direct_io


def test_posix_falls_back_when_the_first_direct_write_is_refused(tmp_path, monkeypatch):
    pwrite = os.pwrite

    def refusing_pwrite(fd, data, offset):  # O_DIRECT opens, then writes fail (some FUSE mounts)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    storage = open_storage(str(tmp_path))
    data = random.Random(2).randbytes(3 * 4096 + 5)
    storage.write_file("f.data", [_aligned(data), b"tail"])
    assert (tmp_path / "f.data").read_bytes() == data + b"tail" and not storage.direct_io


def test_staged_large_chunks_are_page_aligned_whatever_the_sharing_strategy():
    strategy = torch.multiprocessing.get_sharing_strategy()
    state = describe_state({"a": torch.ones(3), "b": random_tensor((1 << 18,), seed=5),
                            "c": random_tensor((1 << 18,), seed=6)}, False)
    try:
        for name in ("file_system", "file_descriptor"):
            torch.multiprocessing.set_sharing_strategy(name)
            layout, _ = staging.Stager().stage(state, blocking=True)
            views = layout.views()
            assert [v.data_ptr() % 4096 for v in views[1:]] == [0, 0], name
            for view, chunk in zip(views, state.chunks.values(), strict=True):
                assert_bitwise_equal(view, chunk.data)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


def test_large_chunks_start_at_aligned_offsets_in_files_and_staging(tmp_path):
    state = {"small": torch.arange(3, dtype=torch.int8),
             "big": random_tensor(((1 << 18) + 5,), seed=3),        # 1 MiB + 20 bytes
             "big2": random_tensor((1 << 18,), torch.float32, seed=4)}
    md = dcp.save(state, str(tmp_path / "ck"), storage_options={"thread_count": 1})  # one file
    offsets = {fqn: t.chunks[0].byte_offset for fqn, t in md.tensors.items()}
    assert offsets["big"] % 4096 == 0 and offsets["big2"] % 4096 == 0
    assert sum(c.nbytes for t in md.tensors.values() for c in t.chunks) == 3 + 2 * (1 << 20) + 20
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, str(tmp_path / "ck"))
    for k in state:
        assert_bitwise_equal(target[k], state[k])
    staged = staging._specs(describe_state(state, False))
    assert [s.byte_offset % 4096 for s in staged if s.nbytes >= (1 << 20)] == [0, 0]


# ----------------------------------------------------------------- shm://
def test_shm_checkpoint_lives_under_dev_shm(tmp_path):
    storage = open_storage("shm://plugins-test-a/ckpt")
    assert isinstance(storage, ShmStorage)
    assert storage.root == Path(DEFAULT_ROOT) / "plugins-test-a" / "ckpt"
    assert (storage.fsync, storage.thread_count) == (False, 4)
    custom = open_storage("shm://run/ckpt", root=str(tmp_path), thread_count=2)
    assert (custom.root, custom.thread_count) == (tmp_path / "run" / "ckpt", 2)
    md = dcp.save({"w": torch.arange(4.0)}, "shm://run/ckpt",
                  storage_options={"root": str(tmp_path)})
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == sorted(
        md.files() | {METADATA_FILE})


@pytest.mark.parametrize("bad", ["shm://", "shm:///abs/path", "shm://a/../../etc", "shm://.."])
def test_shm_refuses_ids_outside_its_root(bad):
    with pytest.raises(dcp.CheckpointError) as info:
        open_storage(bad)
    assert repr(bad) in str(info.value)


def _shm_id(ctx) -> str:
    """A shared-memory checkpoint id unique to this test session."""
    return f"shm://tests-{hashlib.sha1(str(ctx.shared).encode()).hexdigest()[:12]}/ckpt"


FULL = {"w": ((12, 8), torch.float32, 31), "h": ((6, 10), torch.bfloat16, 32)}


@dist_scenario(world_size=2, phase=0)
def test_shm_save_by_2_processes(ctx):
    """Two ranks (processes) save to shared memory and load it resharded."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    full = {k: random_tensor(shape, dtype, seed) for k, (shape, dtype, seed) in FULL.items()}
    state = {k: make_dtensor(v, mesh, "S0") for k, v in full.items()} | {"step": 11}
    dcp.save(state, _shm_id(ctx))
    target = {k: zeros_dtensor(v.shape, v.dtype, mesh, "S1") for k, v in full.items()} | {"step": 0}
    dcp.load(target, _shm_id(ctx))
    for k, v in full.items():
        assert_dtensor_equals_full(target[k], v, k)
    assert target["step"] == 11


@dist_scenario(world_size=4, phase=1)
def test_shm_survives_its_writers_and_loads_in_4_processes(ctx):
    """The phase-0 group's processes have exited; their shared-memory
    checkpoint is still there, and 4 new processes load it resharded."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    target = {k: zeros_dtensor(shape, dtype, mesh, "S1,S0")
              for k, (shape, dtype, _) in FULL.items()}
    target["step"] = 0
    dcp.load(target, _shm_id(ctx))
    for k, (shape, dtype, seed) in FULL.items():
        assert_dtensor_equals_full(target[k], random_tensor(shape, dtype, seed), k)
    assert target["step"] == 11
    ctx.barrier()
    if ctx.rank == 0:
        storage = open_storage(_shm_id(ctx))
        storage.delete(storage.list_files())
        assert storage.list_files() == []
        for directory in (storage.root, storage.root.parent):
            directory.rmdir()


@pytest.mark.parametrize("uri", ["path", "shm://replace-test/ckpt"])
def test_replace_renames_over_the_old_file_where_the_plugin_can(uri, tmp_path):
    storage = open_storage(str(tmp_path / "ckpt") if uri == "path" else uri,
                           **({} if uri == "path" else {"root": str(tmp_path)}))
    assert can_replace(storage)
    storage.write_file("f", [b"old"])
    storage.write_file("f.tmp", [b"new"])
    storage.replace("f.tmp", "f")
    assert storage.list_files() == ["f"] and storage.read_file("f") == b"new"
    storage.replace("f", "g")  # to a new name too
    assert storage.list_files() == ["g"]
    memory = open_storage(f"memory://replace-{uuid.uuid4().hex}")
    assert not can_replace(memory)
    memory.write_file("f.tmp", [b"new"])
    with pytest.raises(NotImplementedError, match="cannot replace a file atomically"):
        memory.replace("f.tmp", "f")


def _mount_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, fstype, *_ = line.split()
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


def test_posix_reads_from_the_page_cache_alone_without_waiting(tmp_path):
    """``read_cached``: what the page cache holds, byte-exact, and nothing
    of what it does not (an evicted file gives 0 bytes where eviction works:
    not on tmpfs, whose pages are the file)."""
    storage = open_storage(str(tmp_path))
    data = random.Random(3).randbytes(1 << 20)
    storage.write_file("f.data", [data])
    fd = os.open(tmp_path / "f.data", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    bufs = [memoryview(bytearray(4096)), memoryview(bytearray(70_000)),
            memoryview(bytearray(100))]
    offsets = [0, 300_001, len(data) - 50]  # the last one runs past the end of the file
    cold = storage.read_cached("f.data", list(zip(offsets, bufs, strict=True)))
    if _mount_type(tmp_path) not in ("tmpfs", "ramfs"):
        assert cold[:2] == [0, 0], cold
    if _mount_type(tmp_path) not in ("tmpfs", "ramfs"):
        # looking never starts the device reading: the file is still not cached
        for _ in range(5):
            assert storage.read_cached("f.data", [(0, memoryview(bytearray(len(data))))]) == [0]
        # nor does a read-ahead it started land later (asked of the page cache itself, as
        # read_cached asks; a RWF_NOWAIT probe would test the filesystem, and some, e.g.
        # overlayfs over ext4, serve one from the device)
        time.sleep(0.2)
        assert storage.read_cached("f.data", [(0, memoryview(bytearray(len(data))))]) == [0]
    storage.read_ranges("f.data", [(0, memoryview(bytearray(len(data))))])  # now cached
    for b in bufs:
        b[:] = bytes(len(b))
    warm = storage.read_cached("f.data", list(zip(offsets, bufs, strict=True)))
    assert warm == [4096, 70_000, 50]
    for offset, buf, n in zip(offsets, bufs, warm, strict=True):
        assert bytes(buf[:n]) == data[offset:offset + n]
    assert bytes(bufs[2][50:]) == bytes(50)
    # the default of a plugin without such reads: nothing filled
    memory = open_storage(f"memory://cached-{uuid.uuid4().hex}")
    memory.write_file("f", [b"abc"])
    assert memory.read_cached("f", [(0, memoryview(bytearray(3)))]) == [0]


def test_posix_turns_cache_only_reads_off_where_the_filesystem_refuses_them(tmp_path, monkeypatch):
    storage = open_storage(str(tmp_path))
    storage.write_file("f.data", [b"x" * 8192])
    preadv = os.preadv
    refused = []

    def refusing(fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            refused.append(offset)
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return preadv(fd, buffers, offset, flags)
    monkeypatch.setattr(os, "preadv", refusing)
    buf = memoryview(bytearray(8192))
    assert storage.read_cached("f.data", [(0, buf)]) == [0]
    assert storage.read_cached("f.data", [(0, buf)]) == [0]
    assert refused == [0]  # off after the first refusal
    storage.read_ranges("f.data", [(0, buf)])
    assert bytes(buf) == b"x" * 8192
