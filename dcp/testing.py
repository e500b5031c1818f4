"""Test kit for storage plugin authors: a pytest conformance suite, and a
local S3 server for tests.

Run the suite against a plugin by subclassing :class:`StorageConformance` in
a test module and giving it a fresh, empty location per test::

    import pytest
    from dcp.testing import StorageConformance

    class TestMyStore(StorageConformance):
        @pytest.fixture
        def checkpoint_id(self, tmp_path):
            return f"mystore://{tmp_path}/ckpt"

        @pytest.fixture
        def storage_options(self):          # optional; default {}
            return {"thread_count": 2}

The plugin is opened through :func:`dcp.core.storage.open_storage`, so the suite
also checks that it is registered in the ``dcp.storage_plugins`` entry-point
group.  It covers writes, ranged reads, atomic and exclusive commits, the
exchange-file protocol (torn files included), listing, deletion, errors,
pickling and a save/load round trip through :func:`dcp.save` and
:func:`dcp.load`.  It
needs pytest (and torch, like the rest of ``dcp``); :func:`local_s3_server`
also needs ``moto[server]``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import dcp
from dcp.core.metadata import METADATA_FILE
from dcp.core.storage import (
    StoragePlugin,
    checkpoint_uri,
    installed_schemes,
    open_storage,
    scheme_of,
)


def _payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


class _FailingBuffers:
    """A buffer sequence whose iteration fails after the ``good`` buffers: a
    write whose source breaks off half-way."""

    def __init__(self, good: list[bytes]) -> None:
        self.good = good

    def __getitem__(self, index: int) -> bytes:
        if index < len(self.good):
            return self.good[index]
        raise RuntimeError("the producer of this file's bytes failed half-way")


class StorageConformance:
    """The contract of :class:`~dcp.core.storage.StoragePlugin`, as pytest tests.

    Subclasses provide the ``checkpoint_id`` fixture (a location no other
    test uses, empty at the start) and may override ``storage_options``.
    """

    @pytest.fixture
    def checkpoint_id(self) -> str:
        """A fresh, empty location for one test: override it."""
        raise NotImplementedError("give the conformance suite a `checkpoint_id` fixture")

    @pytest.fixture
    def storage_options(self) -> dict:
        """The plugin's options (``storage_options``); default none."""
        return {}

    @pytest.fixture
    def storage(self, checkpoint_id, storage_options) -> StoragePlugin:
        """The plugin under test, opened through its entry point."""
        return open_storage(checkpoint_id, **storage_options)

    @pytest.fixture
    def other(self, checkpoint_id, storage_options) -> StoragePlugin:
        """A second instance on the same location: another rank's view."""
        return open_storage(checkpoint_id, **storage_options)

    # ---- registration ----------------------------------------------------

    def test_registered_by_entry_point(self, checkpoint_id, storage):
        """``open_storage`` finds the plugin by the id's scheme and hands it
        the id normalised (``file:///abs`` becomes ``/abs``)."""
        entry = installed_schemes()[scheme_of(checkpoint_id)]
        assert type(storage) is entry.load()
        assert storage.checkpoint_id == checkpoint_uri(checkpoint_id)
        assert storage.thread_count >= 1

    def test_picklable(self, storage):
        """``dcp.async_save`` pickles a ``storage=`` instance to its
        background process: the copy must work on the same location."""
        storage.write_file("f.data", [b"before pickling"])
        copy = pickle.loads(pickle.dumps(storage))
        assert copy.read_file("f.data") == b"before pickling"
        copy.write_file("g.data", [b"by the copy"])
        assert storage.read_file("g.data") == b"by the copy"

    # ---- writes and reads ------------------------------------------------

    def test_write_concatenates_buffers(self, storage):
        """A file is the concatenation of its buffers, whatever their format."""
        floats = torch.arange(7, dtype=torch.float64)
        buffers = [b"head", bytearray(b""), memoryview(floats.numpy()), _payload(3000, 1),
                   memoryview(_payload(10, 2))]
        storage.write_file("f.data", buffers)
        expected = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        assert storage.read_file("f.data") == expected

    def test_write_empty_file(self, storage):
        """A file may be empty."""
        storage.write_file("empty.data", [])
        assert storage.read_file("empty.data") == b""
        assert storage.list_files() == ["empty.data"]

    def test_nested_names(self, storage):
        """Names may contain ``/``; listings give them relative to the root."""
        storage.write_file("a/b/c.data", [b"nested"])
        storage.write_file("top.data", [b"top"])
        assert storage.read_file("a/b/c.data") == b"nested"
        assert storage.list_files() == ["a/b/c.data", "top.data"]

    def test_concurrent_writes(self, storage):
        """Several threads write different files at once."""
        files = {f"r00000-{k}.data": _payload(5000 + 17 * k, 10 + k) for k in range(8)}
        with ThreadPoolExecutor(max(2, storage.thread_count)) as pool:
            list(pool.map(lambda item: storage.write_file(item[0], [item[1]]), files.items()))
        assert storage.list_files() == sorted(files)
        for name, data in files.items():
            assert storage.read_file(name) == data, name

    def test_write_replaces_file(self, storage):
        """Writing an existing name replaces its content entirely."""
        storage.write_file("f.data", [b"first version, longer"])
        storage.write_file("f.data", [b"second"])
        assert storage.read_file("f.data") == b"second"

    def test_read_ranges(self, storage):
        """Ranges: out of order, overlapping, empty, at the end, the whole file."""
        data = _payload(4096, 3)
        storage.write_file("f.data", [data[:1000], data[1000:]])
        spans = [(4000, 96), (0, 1), (10, 0), (100, 900), (500, 600), (1000, 1), (4095, 1),
                 (0, 4096), (2048, 0), (999, 2)]
        buffers = [bytearray(n) for _, n in spans]
        storage.read_ranges("f.data", [(off, memoryview(buf))
                                       for (off, _), buf in zip(spans, buffers, strict=True)])
        for (off, n), buf in zip(spans, buffers, strict=True):
            assert bytes(buf) == data[off:off + n], (off, n)

    def test_read_ranges_into_typed_memory(self, storage):
        """Ranges land in the caller's memory, even a typed tensor's."""
        values = torch.arange(12, dtype=torch.int32)
        storage.write_file("f.data", [memoryview(values.numpy())])
        target = torch.zeros(5, dtype=torch.int32)
        storage.read_ranges("f.data", [(8, memoryview(target.numpy()))])
        assert target.tolist() == [2, 3, 4, 5, 6]

    def test_read_ranges_past_end_raises(self, storage):
        """A range beyond the end raises, naming the file."""
        storage.write_file("f.data", [b"0123456789"])
        for offset, size in [(8, 4), (10, 1), (50, 5)]:
            with pytest.raises(Exception) as info:
                storage.read_ranges("f.data", [(offset, memoryview(bytearray(size)))])
            assert "f.data" in str(info.value), (offset, size, str(info.value))

    def test_read_missing_file_raises(self, storage):
        """Reading a missing file raises (``FileNotFoundError`` for
        ``read_file``), naming the file."""
        with pytest.raises(FileNotFoundError) as info:
            storage.read_file("missing.data")
        assert "missing.data" in str(info.value)
        with pytest.raises(Exception) as info:
            storage.read_ranges("missing.data", [(0, memoryview(bytearray(4)))])
        assert "missing.data" in str(info.value)

    def test_failed_write_leaves_no_other_file(self, storage):
        """A write that fails half-way raises; at most a partial file under
        its own name remains (the core deletes it), and the name can be
        written again."""
        with pytest.raises(RuntimeError, match="half-way"):
            storage.write_file("f.data", _FailingBuffers([_payload(2048, 4)]))
        assert set(storage.list_files()) <= {"f.data"}
        storage.write_file("f.data", [b"complete"])
        assert storage.read_file("f.data") == b"complete"

    # ---- commit -----------------------------------------------------------

    def test_commit_exclusive(self, storage, other):
        """``overwrite=False`` refuses an existing name; ``True`` replaces it."""
        storage.commit_file(METADATA_FILE, b"first", overwrite=False)
        with pytest.raises(FileExistsError):
            other.commit_file(METADATA_FILE, b"second", overwrite=False)
        assert storage.read_file(METADATA_FILE) == b"first"
        other.commit_file(METADATA_FILE, b"third", overwrite=True)
        assert storage.read_file(METADATA_FILE) == b"third"

    def test_commit_overwrite_creates(self, storage):
        """``overwrite=True`` also creates a new file (in a new directory)."""
        storage.commit_file("sub/m.json", b"new", overwrite=True)
        assert storage.read_file("sub/m.json") == b"new"

    def test_concurrent_exclusive_commits_have_one_winner(self, storage, checkpoint_id,
                                                          storage_options):
        """Of several simultaneous exclusive commits exactly one wins."""
        contenders = [open_storage(checkpoint_id, **storage_options) for _ in range(6)]
        start = threading.Barrier(len(contenders))

        def commit(k: int) -> bool:
            start.wait()
            try:
                contenders[k].commit_file(METADATA_FILE, b"commit %d" % k, overwrite=False)
                return True
            except FileExistsError:
                return False

        with ThreadPoolExecutor(len(contenders)) as pool:
            won = list(pool.map(commit, range(len(contenders))))
        assert won.count(True) == 1, won
        assert storage.read_file(METADATA_FILE) == b"commit %d" % won.index(True)

    def test_commit_is_atomic_for_readers(self, storage, other):
        """A reader sees the old or the new content of a committed file,
        never a mixture or a part."""
        versions = [_payload(64 * 1024, 20 + k) for k in range(2)]
        storage.commit_file(METADATA_FILE, versions[0], overwrite=True)
        seen, done = [], threading.Event()

        def read() -> None:
            while not done.is_set():
                seen.append(other.read_file(METADATA_FILE))

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for k in range(6):
                storage.commit_file(METADATA_FILE, versions[(k + 1) % 2], overwrite=True)
        finally:
            done.set()
            reader.join()
        assert seen and all(s in versions for s in seen)

    # ---- exists, listing, deletion -----------------------------------------

    def test_exists(self, storage, other):
        """``exists`` sees files another instance wrote or committed."""
        assert not storage.exists("f.data")
        other.write_file("f.data", [b"x"])
        other.commit_file("m.json", b"{}", overwrite=False)
        assert storage.exists("f.data") and storage.exists("m.json")
        assert not storage.exists("f")

    def test_listing_shows_other_writers_files(self, storage, other):
        """Listings show another instance's new and deleted files at once."""
        assert storage.list_files() == []
        storage.write_file("a.data", [b"a"])
        assert storage.list_files() == ["a.data"]
        other.write_file("b/c.data", [b"b"])
        other.commit_file(METADATA_FILE, b"{}", overwrite=False)
        assert storage.list_files() == ["a.data", "b/c.data", METADATA_FILE]
        other.delete(["a.data"])
        assert storage.list_files() == ["b/c.data", METADATA_FILE]

    def test_delete(self, storage):
        """Deletion removes what it names and ignores what does not exist."""
        for name in ["a.data", "b.data", "d/c.data"]:
            storage.write_file(name, [name.encode()])
        storage.delete(["a.data", "never-written.data", "d/c.data"])
        assert storage.list_files() == ["b.data"]
        with pytest.raises(FileNotFoundError):
            storage.read_file("a.data")
        storage.delete([])
        storage.delete(iter(["b.data"]))
        assert storage.list_files() == []

    # ---- exchange files (file-flag coordination) ---------------------------

    def test_exchange_roundtrip(self, storage, other):
        """Exchange files, empty ones included, read back exactly."""
        for k, payload in enumerate([b"", b"x", _payload(10_000, 5)]):
            storage.write_exchange(f"exchange/plan.{k}", payload)
            assert other.read_exchange(f"exchange/plan.{k}") == payload

    def test_exchange_missing_is_none(self, storage):
        """A missing exchange file reads as ``None`` (not yet written)."""
        assert storage.read_exchange("exchange/nothing") is None

    def test_exchange_torn_files_are_incomplete(self, storage, other):
        """Torn, truncated, altered or padded exchange files read as ``None``."""
        payload = _payload(300, 6)
        storage.write_exchange("complete", payload)
        whole = storage.read_file("complete")
        flipped = bytearray(whole)
        flipped[7] ^= 0x01
        torn = {
            "payload-only": payload,
            "half": whole[:len(whole) // 2],
            "trailer-cut": whole[:-1],
            "flipped-byte": bytes(flipped),
            "extra-byte": payload + b"!" + whole[len(payload):],
            "empty": b"",
        }
        for name, data in torn.items():
            storage.write_file(name, [data])
            assert other.read_exchange(name) is None, name
        storage.write_exchange("payload-only", payload)
        assert other.read_exchange("payload-only") == payload

    # ---- through the public API --------------------------------------------

    def test_save_load_roundtrip(self, checkpoint_id, storage_options, storage):
        """``dcp.save`` then ``dcp.load`` through the plugin, bit-exact."""
        state = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
                 "b": torch.tensor([1, -2, 3], dtype=torch.int64),
                 "h": torch.arange(6, dtype=torch.bfloat16),
                 "meta": {"step": 7, "name": "conformance"}}
        md = dcp.save(state, checkpoint_id, storage_options=storage_options)
        assert storage.exists(METADATA_FILE)
        assert set(storage.list_files()) == md.files() | {METADATA_FILE}
        target = {"w": torch.zeros(4, 6), "b": torch.zeros(3, dtype=torch.int64),
                  "h": torch.zeros(6, dtype=torch.bfloat16), "meta": {"step": 0, "name": ""}}
        dcp.load(target, checkpoint_id, storage_options=storage_options)
        for key in ("w", "b", "h"):
            assert torch.equal(target[key], state[key]) and target[key].dtype == state[key].dtype
        assert target["meta"] == {"step": 7, "name": "conformance"}

    def test_second_save_needs_overwrite(self, checkpoint_id, storage_options, storage):
        """A committed checkpoint is replaced only with ``overwrite=True``,
        and its stale data files are deleted."""
        dcp.save({"x": torch.ones(3)}, checkpoint_id, storage_options=storage_options)
        with pytest.raises(dcp.CheckpointError, match="overwrite=True"):
            dcp.save({"x": torch.zeros(3)}, checkpoint_id, storage_options=storage_options)
        md = dcp.save({"x": torch.full((3,), 2.0)}, checkpoint_id, overwrite=True,
                      storage_options=storage_options)
        assert set(storage.list_files()) == md.files() | {METADATA_FILE}
        target = {"x": torch.zeros(3)}
        dcp.load(target, checkpoint_id, storage_options=storage_options)
        assert target["x"].tolist() == [2.0, 2.0, 2.0]

    def test_load_without_commit_is_not_a_checkpoint(self, checkpoint_id, storage_options, storage):
        """Data files without committed metadata are not a checkpoint."""
        storage.write_file("r00000-0.abc.data", [b"orphan"])
        with pytest.raises(dcp.NotACheckpointError, match=METADATA_FILE):
            dcp.load({"x": torch.zeros(1)}, checkpoint_id, storage_options=storage_options)


_S3_SERVER = """
import sys
import threading

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

moto = DomainDispatcherApplication(create_backend_app)
conditional = threading.Lock()


def app(environ, start_response):
    # moto checks If-None-Match, then writes: two conditional creates served
    # at once could both pass the check.  S3 decides them atomically, so
    # they are served one at a time here.
    if "HTTP_IF_NONE_MATCH" not in environ:
        return moto(environ, start_response)
    with conditional:
        return list(moto(environ, start_response))


server = make_server("127.0.0.1", 0, app, threaded=True)
print(server.server_port, flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()  # serve until the parent closes the pipe or dies
server.shutdown()
"""


@contextlib.contextmanager
def local_s3_server(*, min_part_size: int | None = None) -> Iterator[str]:
    """Run moto's S3 server on 127.0.0.1 (a free port) in a child process;
    yields its endpoint URL.  The server stops when the context exits or the
    parent process dies.  Conditional writes (``If-None-Match``) are served
    one at a time, so that, as on S3, of two racing exclusive creates exactly
    one succeeds (moto alone checks, then writes).  ``min_part_size`` lowers S3's 5 MiB minimum
    multipart part size so tests can upload small objects in parts.

    Clients need credentials (any will do) and a region, and should set
    ``AWS_EC2_METADATA_DISABLED=true`` so botocore never probes EC2.
    """
    env = dict(os.environ)
    if min_part_size is not None:
        env["S3_UPLOAD_PART_MIN_SIZE"] = str(min_part_size)
    server = subprocess.Popen([sys.executable, "-c", _S3_SERVER], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    stdin, stdout = server.stdin, server.stdout
    assert stdin is not None and stdout is not None  # both opened as pipes above
    try:
        port = stdout.readline().strip()
        if not port:
            raise RuntimeError(f"moto's S3 server did not start (exit status {server.wait()})")
        yield f"http://127.0.0.1:{int(port)}"
    finally:
        stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
