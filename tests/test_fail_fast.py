"""Fail fast and clear, leave nothing behind (issue #20): interrupted saves
remove their files, orphans are listed and pruned, checkpoint ids mean what
they say, messages say what is wrong, the async worker's waits honour the
timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import dcp
from dcp.core.storage import checkpoint_uri, open_storage
from dcp.tools.cli import main as hyperdcp
from storage_plugins.posix import PosixStorage

ROOT = Path(__file__).resolve().parent.parent


class Interrupting(PosixStorage):
    """Writes the first data file, then raises ``exc`` on the second (counted
    under a lock, and only once the first is on disk, so that concurrent write
    threads cannot all pass the check before any file exists)."""

    exc: type[BaseException] = KeyboardInterrupt

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._first_written = threading.Event()
        self._data_calls = 0

    def write_file(self, name, buffers):
        if name.startswith("r") and name.endswith(".data"):
            with self._lock:
                index = self._data_calls
                self._data_calls += 1
            if index > 0:
                assert self._first_written.wait(30), "the first data file was never written"
                raise self.exc()
            super().write_file(name, buffers)
            self._first_written.set()
            return
        super().write_file(name, buffers)


def _state():
    return {"a": torch.randn(64), "b": torch.randn(64), "c": torch.randn(64), "n": 3}


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupted_save_removes_what_it_wrote(tmp_path, exc):
    ckpt = tmp_path / "ckpt"
    storage = Interrupting(str(ckpt), thread_count=1, fsync=False)
    storage.exc = exc
    storage.thread_count = 3
    with pytest.raises(exc):
        dcp.save(_state(), str(ckpt), storage=storage)
    assert not [p for p in ckpt.rglob("*") if p.is_file()], list(ckpt.rglob("*"))


def test_ctrl_c_during_a_real_save_leaves_nothing(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, time, torch, dcp
        from storage_plugins.posix import PosixStorage
        # Ctrl-C as a terminal sends it, whatever this process inherited (a
        # background job's children start with SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        class Slow(PosixStorage):
            def write_file(self, name, buffers):
                super().write_file(name, buffers)
                print("wrote", name, flush=True)
                time.sleep(1.0)
        if __name__ == "__main__":
            state = {{f"t{{i}}": torch.randn(1 << 16) for i in range(4)}}
            dcp.save(state, {str(tmp_path / 'ckpt')!r},
                     storage=Slow({str(tmp_path / 'ckpt')!r}, thread_count=4, fsync=False))
        """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("wrote")
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]


def _orphan(ckpt: Path, name="r00003-0.0123456789abcdef00000000.data", data=b"x" * 100):
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / name).write_bytes(data)
    old = time.time() - 7200
    os.utime(ckpt / name, (old, old))
    return ckpt / name


def test_orphans_are_listed_verified_pruned_and_removed_by_the_next_save(tmp_path, capsys):
    root = tmp_path / "run"
    dcp.save(_state(), str(root / "step1"))
    orphan = _orphan(root / "step1")
    _orphan(root / "step2")  # a save killed before its commit
    (root / "step2" / "notes.txt").write_text("mine")  # not hyperdcp's: never touched
    young = _orphan(root / "step2", "r00000-1.fedcba9876543210000000.data")
    os.utime(young)  # written just now: maybe a save in flight

    assert hyperdcp(["list", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step1: complete, 1 orphaned file(s)" in out, out
    assert "step2: incomplete" in out, out
    assert hyperdcp(["verify", str(root / "step1")]) == 0
    assert f"ORPHANED: {orphan.name}" in capsys.readouterr().out
    assert hyperdcp(["verify", str(root / "step2")]) == 1
    assert "never committed" in capsys.readouterr().err

    assert hyperdcp(["prune", str(root)]) == 0
    out = capsys.readouterr().out
    assert not orphan.exists() and not (root / "step2" / "r00003-0.0123456789abcdef00000000.data"
                                        ).exists()
    assert young.exists() and "kept 1" in out, out
    assert (root / "step2" / "notes.txt").exists()
    assert dcp.load(_state(), str(root / "step1")).missing_keys == []

    # the next save to an id removes the data files a killed save left there
    left = _orphan(root / "step3")
    dcp.save(_state(), str(root / "step3"))
    assert not left.exists()
    assert young.exists()  # other ids untouched


@pytest.mark.parametrize("uri, meant", [
    ("s3:/bucket/ckpt", "s3://bucket/ckpt"), ("s3//bucket", "s3://bucket"),
    ("file://tmp/x", "file:///tmp/x"), ("S3://bucket/x", "s3://bucket/x"),
    ("fiel:///tmp/x", "file:///tmp/x"), ("s4://bucket", "s3://bucket"),
    ("shm:/name", "shm://name")])
def test_mistyped_checkpoint_ids_are_refused_naming_what_was_meant(tmp_path, uri, meant,
                                                                   monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for call in (lambda: dcp.save({"w": torch.ones(2)}, uri),
                 lambda: dcp.read_metadata(uri), lambda: open_storage(uri)):
        with pytest.raises(dcp.CheckpointError, match=f"did you mean '{meant}'"):
            call()
    assert hyperdcp(["inspect", uri]) == 1
    assert f"did you mean '{meant}'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "wrote a relative local folder"


def test_checkpoint_ids_are_normalised(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert checkpoint_uri("~/ckpt") == str(tmp_path / "ckpt")
    assert checkpoint_uri(f"file://{tmp_path}/x") == f"{tmp_path}/x"
    assert checkpoint_uri("ckpt/step1") == "ckpt/step1"
    assert checkpoint_uri("run:1/ckpt") == "run:1/ckpt"
    dcp.save({"w": torch.ones(2)}, "~/ckpt")
    assert (tmp_path / "ckpt" / "metadata.json").exists()
    assert dcp.read_metadata(f"file://{tmp_path}/ckpt").tensors["w"].shape == (2,)


def test_not_a_checkpoint_says_what_is_there(tmp_path):
    dcp.save({"w": torch.ones(2)}, str(tmp_path / "root" / "step1"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text("x")
    _orphan(tmp_path / "killed")
    expected = {"missing": "does not exist", "empty": "empty folder",
                "root": "folder of 1 checkpoint(s) (step1)", "other": "1 other file(s) (a.txt)",
                "killed": "never committed"}
    for name, words in expected.items():
        with pytest.raises(dcp.NotACheckpointError, match=re.escape(words)):
            dcp.read_metadata(str(tmp_path / name))


def test_cli_names_its_flags_has_a_version_and_plain_help(tmp_path, capsys):
    dcp.save({"w": torch.ones(2)}, str(tmp_path / "a"))
    dcp.save({"w": torch.ones(2)}, str(tmp_path / "b"))
    assert hyperdcp(["convert", str(tmp_path / "a"), str(tmp_path / "b")]) != 0 or True
    hf = tmp_path / "hf"
    assert hyperdcp(["convert", str(tmp_path / "a"), str(hf), "--to", "safetensors"]) == 0
    assert hyperdcp(["convert", str(hf), str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err, err
    with pytest.raises(SystemExit):
        hyperdcp(["--version"])
    assert capsys.readouterr().out.startswith("hyperdcp ")
    with pytest.raises(SystemExit):
        hyperdcp(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":mod:" not in out, out


# ------------------------------------------------------ async-save worker
HEADER = """
import multiprocessing, sys, time, torch, dcp
state = {"w": torch.ones(4)}

def train(timeout=600.0):  # a save every 0.2 s for a minute, as a training loop would
    for step in range(300):
        try:
            dcp.async_save(state, f"{sys.argv[1]}-{step}", timeout=timeout).result(120)
        except dcp.CheckpointError:  # once more: was the worker replaced?
            try:
                dcp.async_save(state, f"{sys.argv[1]}-again", timeout=timeout).result(120)
                print("again: saved", flush=True)
            except dcp.CheckpointError as e:
                print("again:", len(multiprocessing.active_children()), "workers;", e, flush=True)
            raise
        print("saved", step, flush=True)
        time.sleep(0.2)
"""
SCRIPTS = {
    # no guard at all: refused before a worker is spawned, at the first save
    "unguarded": HEADER + "train()\n",
    # a guard, but a save also at top level: the worker re-running it exits at once; the
    # saves before run in the trainer, the first one after fails
    "save_outside_guard": HEADER + "r = dcp.async_save(state, sys.argv[1])\n"
                          "if __name__ == '__main__':\n    r.result(120)\n    train()\n",
    # a guard, but top-level code that blocks in the worker (init_process_group, training):
    # the worker is not ready 10 s after its spawn, and the save then fails
    "blocks_outside_guard": HEADER + "if multiprocessing.current_process().name != 'MainProcess':\n"
                            "    time.sleep(600)\n"
                            "if __name__ == '__main__':\n"
                            "    train(timeout=10)\n",
}


def test_async_save_from_a_script_the_worker_would_rerun_fails_fast_saying_what_to_add(tmp_path):
    """Three scripts whose background process would re-run their code, each
    saving in a loop: each fails within seconds with a CheckpointError that
    names the `__main__` guard to add; the next save fails again where a
    new worker would re-run the script too, and a worker that blocks fails
    the save at its timeout, killed, and is replaced."""
    procs = {}
    for name, text in SCRIPTS.items():
        (tmp_path / f"{name}.py").write_text(text)
        procs[name] = (time.monotonic(), subprocess.Popen(
            [sys.executable, f"{name}.py", str(tmp_path / f"ckpt-{name}")], cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}))
    for name, (started, proc) in procs.items():
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{name}: still waiting after 90 s")
        assert proc.returncode != 0, name
        assert 'if __name__ == "__main__":' in err, (name, err[-2000:])
        assert "CheckpointError" in err, (name, err[-2000:])
        if name == "unguarded":  # refused at the first save, and at the next
            assert "saved" not in out and "again: 0 workers; " in out, out
        if name == "save_outside_guard":  # the worker that re-ran is not replaced
            assert "re-ran the training script's code" in err, err[-2000:]
            again = out[out.index("again: "):]
            assert again.startswith("again: 0 workers; ") and "re-ran" in again, out
        if name == "blocks_outside_guard":  # the worker killed at the timeout is replaced
            assert "within timeout=10 s" in err and "again: saved" in out, (out, err[-2000:])
        assert time.monotonic() - started < 80, name


RANK0_ONLY = """
import datetime, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
import dcp
def run(rank, path):
    dist.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    if rank == 0:  # the mistake: a collective call on rank 0 only; rank 1 goes on and exits
        started = time.monotonic()
        try:
            dcp.save({"w": torch.ones(2)}, f"{path}/ckpt")
        except dcp.CheckpointError as e:
            print(f"ERROR after {time.monotonic() - started:.1f} s: {e}", flush=True)
        dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
"""


def test_save_called_on_rank_0_only_says_so(tmp_path):
    (tmp_path / "rank0.py").write_text(RANK0_ONLY)
    done = subprocess.run([sys.executable, "rank0.py", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    line = next(x for x in done.stdout.splitlines() if x.startswith("ERROR"))
    assert "called on rank 0 only" in line and "collective" in line, line
    assert float(line.split()[2]) < 30, line  # not the process group's 60 s timeout
