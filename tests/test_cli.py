"""The ``hyperdcp`` command: each subcommand's output and exit code (in
process, through ``dcp.tools.cli.main``), on every storage plugin's URIs; and the
installed command itself (two subprocesses): real exit codes, and progress
bars on a terminal only."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import socket
import struct
import subprocess
import termios
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dcp
import s3_server
from dcp.core.metadata import CHECKSUM
from dcp.tools.cli import main
from dcp.tools.verify import verify
from helpers import assert_bitwise_equal, randn
from storage_plugins.shm import DEFAULT_ROOT


def _state() -> dict:
    w = randn((4, 6), seed=1)
    w[1, 2] = 2.0
    return {"model": {"w": w, "b": torch.arange(6, dtype=torch.int32),
                      "s": torch.tensor(1.5, dtype=torch.bfloat16), "e": torch.empty(0, 3)},
            "step": 7}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def ckpt(tmp_path) -> Path:
    dcp.save(_state(), str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


@pytest.mark.parametrize("sub", ["", "inspect", "verify", "diff", "convert", "demo"])
def test_help_on_every_subcommand(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main([*sub.split(), "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    if sub in ("", "inspect", "verify", "diff", "convert"):
        assert "exit" in out.lower() or "Exit" in out, out


def test_inspect_lists_tensors_chunks_bytes_ranks_and_version(ckpt, capsys):
    code, out, _ = _run(capsys, "inspect", str(ckpt), "--chunks")
    assert code == 0
    assert "hyperdcp format v1, saved by 1 rank(s), 4 tensors, 1 values" in out
    assert "model.w: float32[4, 6] 96 B, 1 chunk(s), written by rank(s) [0]" in out
    assert ("model.s: bfloat16[] 2 B, 1 chunk(s)" in out
            and "model.e: float32[0, 3] 0 B, 0 chunk(s)" in out)
    assert f"{CHECKSUM} 0x" in out and "step: 7" in out

    code, out, _ = _run(capsys, "inspect", f"file://{ckpt}", "--json")
    doc = json.loads(out)
    md = dcp.read_metadata(str(ckpt))
    chunk = md.tensors["model.w"].chunks[0]
    assert (code, doc["format"], doc["version"], doc["world_size"]) == (0, "hyperdcp", 1, 1)
    assert doc["tensors"]["model.w"] == {
        "shape": [4, 6], "dtype": "float32", "nbytes": 96, "file_bytes": 96, "ranks": [0],
        "chunks": [{"offsets": [0, 0], "sizes": [4, 6], "file": chunk.file,
                    "byte_offset": chunk.byte_offset, "nbytes": 96, "checksum": chunk.checksum,
                    "rank": 0, "file_nbytes": 96, "frames": None}]}
    assert doc["objects"] == {"step": 7} and doc["stored_bytes"] == 96 + 24 + 2


def test_verify_lists_every_damaged_piece_and_exits_3(ckpt, capsys):
    code, out, _ = _run(capsys, "verify", str(ckpt))
    assert code == 0 and "3 checksum(s) match, 0 damaged, 122 bytes read" in out

    md = dcp.read_metadata(str(ckpt))
    w, b = md.tensors["model.w"].chunks[0], md.tensors["model.b"].chunks[0]
    data = bytearray((ckpt / w.file).read_bytes())
    data[w.byte_offset + 5] ^= 0x01
    (ckpt / w.file).write_bytes(bytes(data))
    if b.file != w.file:
        (ckpt / b.file).unlink()
    else:  # truncate: cut the file before b's bytes
        (ckpt / b.file).write_bytes((ckpt / b.file).read_bytes()[:b.byte_offset])
    code, out, _ = _run(capsys, "verify", str(ckpt))
    assert code == 3
    damaged = [line for line in out.splitlines() if line.startswith("DAMAGED")]
    assert len(damaged) == 2, out
    assert "'model.w' chunk at offsets [0, 0]" in damaged[0] + damaged[1]
    assert any(w.file in d and "checksum mismatch" in d for d in damaged), damaged
    assert any("'model.b'" in d and b.file in d and "cannot be read" in d for d in damaged), damaged

    (ckpt / "metadata.json").write_text('{"format": "hyperdcp"')
    code, out, _ = _run(capsys, "verify", str(ckpt))
    assert code == 3 and "DAMAGED" in out and "metadata.json" in out
    code, _, err = _run(capsys, "verify", str(ckpt.parent / "nothing"))
    assert code == 1 and "is not a checkpoint" in err and "does not exist" in err, err


def test_diff_names_what_differs_and_by_how_much(ckpt, tmp_path, capsys):
    code, out, _ = _run(capsys, "diff", str(ckpt), str(ckpt))
    assert code == 0 and out.strip() == "same: 5 identical, 0 differ, 0 only in A, 0 only in B"

    other = _state()
    other["model"]["w"][1, 2] = 2.5
    other["model"]["s"] = torch.tensor(1.5, dtype=torch.float16)
    del other["model"]["b"]
    other["extra"] = torch.ones(1)
    other["step"] = 8
    dcp.save(other, str(tmp_path / "other"))
    code, out, _ = _run(capsys, "diff", str(ckpt), str(tmp_path / "other"))
    assert code == 4
    lines = out.splitlines()
    assert "only in A: model.b" in lines and "only in B: extra" in lines
    assert "differs: model.w: 1 of 24 elements differ, max |a-b| = 0.5" in lines
    assert "differs: model.s: dtype bfloat16 vs float16" in lines
    assert "differs: step (value)" in lines
    code, out, _ = _run(capsys, "diff", str(ckpt), str(tmp_path / "other"), "--json")
    doc = json.loads(out)
    assert code == 4 and doc["same"] is False
    assert {"fqn": "model.w", "problem": "values", "detail": "", "differing": 1, "numel": 24,
            "max_abs": 0.5} in doc["tensors"]


def test_convert_in_every_direction(ckpt, tmp_path, capsys):
    sd = {"a.weight": randn((5, 3), seed=2), "a.bias": torch.arange(3, dtype=torch.int64)}
    (tmp_path / "hf").mkdir()
    save_file(sd, tmp_path / "hf" / "model.safetensors")
    code, out, _ = _run(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "from-hf"))
    assert code == 0 and "converted 2 tensors (84 bytes) from safetensors" in out
    assert re.search(r" s \([1-9][\d.]* ?[kMGT]?B/s\)$", out.strip()), out  # never "0 MiB/s"

    code, _, err = _run(capsys, "convert", str(ckpt), str(tmp_path / "x"))
    assert code == 2 and "--to" in err
    code, out, _ = _run(capsys, "convert", str(ckpt), str(tmp_path / "st"), "--to", "safetensors",
                        "--max-shard-size", "64B")
    assert code == 0 and "note: safetensors holds tensors only; skipped 1 value(s): step" in out
    assert len(list((tmp_path / "st").glob("model-*-of-*.safetensors"))) == 2
    # the value is missing there
    assert _run(capsys, "diff", str(ckpt), str(tmp_path / "st"))[0] == 4
    assert _run(capsys, "convert", str(ckpt), str(tmp_path / "st"), "--to", "safetensors")[0] == 1
    assert _run(capsys, "convert", str(ckpt), str(tmp_path / "st"), "--to", "safetensors",
                "--overwrite")[0] == 0

    assert _run(capsys, "convert", str(ckpt), str(tmp_path / "torch"), "--to", "torch-dcp")[0] == 0
    code, _, err = _run(capsys, "convert", str(tmp_path / "torch"), str(tmp_path / "back"))
    assert code == 1 and "pickle" in err and "--trust-pickle" in err
    code, _, err = _run(capsys, "inspect", str(tmp_path / "torch"))
    assert code == 1 and "--trust-pickle" in err
    assert _run(capsys, "convert", str(tmp_path / "torch"), str(tmp_path / "back"),
                "--trust-pickle")[0] == 0
    assert _run(capsys, "diff", str(ckpt), str(tmp_path / "back"))[0] == 0

    (tmp_path / "rename.json").write_text(json.dumps({"model.w": "W"}))
    assert _run(capsys, "convert", str(ckpt), str(tmp_path / "renamed"), "--to", "safetensors",
                "--rename-map", str(tmp_path / "rename.json"))[0] == 0
    assert_bitwise_equal(load_file(tmp_path / "renamed" / "model.safetensors")["W"],
                         _state()["model"]["w"])
    code, _, err = _run(capsys, "convert", str(ckpt), str(tmp_path / "bad"), "--to", "safetensors",
                        "--rename-map", str(tmp_path / "rename.json"), "-o", "nonsense")
    assert code == 2 and "nonsense" in err  # a malformed command line


def _plugin_uri(scheme: str, tmp_path: Path) -> tuple[str, list[str]]:
    """A fresh base URI of ``scheme`` and the -o options it needs."""
    tag = uuid.uuid4().hex[:8]
    if scheme == "path":
        return str(tmp_path / "base"), []
    if scheme == "file":
        return f"file://{tmp_path}/base", ["-o", "file:fsync=false"]
    if scheme == "memory":
        return f"memory://cli-{tag}", []
    if scheme == "shm":
        return f"shm://cli-{tag}", []
    if scheme == "sqlite":
        return f"sqlite://{tmp_path}", []
    assert scheme == "s3"
    options = s3_server.options(s3_server.endpoint())
    return s3_server.fresh_url("cli"), [arg for k, v in options.items()
                                        for arg in ("-o", f"s3:{k}={v}")]


@pytest.mark.parametrize("scheme", ["path", "file", "memory", "shm", "sqlite", "s3"])
def test_every_command_on_every_storage_plugin(scheme, tmp_path, capsys):
    sd = {"w": randn((8, 4), seed=3), "i": torch.arange(5, dtype=torch.int16)}
    (tmp_path / "hf").mkdir()
    save_file(sd, tmp_path / "hf" / "model.safetensors")
    base, options = _plugin_uri(scheme, tmp_path)
    if scheme == "sqlite":  # the example plugin keeps one checkpoint per database file
        ckpt, st, again = (f"sqlite://{tmp_path}/{n}.db" for n in ("ckpt", "st", "again"))
    else:
        ckpt, st, again = (f"{base}/{n}" for n in ("ckpt", "st", "again"))
    try:
        assert _run(capsys, "convert", *options, str(tmp_path / "hf"), ckpt)[0] == 0
        code, out, _ = _run(capsys, "inspect", *options, ckpt)
        assert code == 0 and "w: float32[8, 4] 128 B" in out
        assert _run(capsys, "verify", *options, ckpt)[:2] == (
            0, f"{ckpt}: 2 checksum(s) match, 0 damaged, 138 bytes read\n")
        assert _run(capsys, "convert", *options, ckpt, st, "--to", "safetensors",
                    "--max-shard-size", "100B")[0] == 0
        code, out, _ = _run(capsys, "verify", *options, st)  # a safetensors folder on the plugin
        assert code == 0 and "2 chunk(s) carry no checksum" in out
        assert _run(capsys, "diff", *options, ckpt, st)[0] == 0
        assert _run(capsys, "convert", *options, st, again)[0] == 0
        assert _run(capsys, "diff", *options, again, str(tmp_path / "hf"))[0] == 0
    finally:
        if scheme == "shm":
            shutil.rmtree(Path(DEFAULT_ROOT) / base.removeprefix("shm://"), ignore_errors=True)


def _command(*argv: str, tty: bool) -> tuple[int, str, str]:
    """Run the installed ``hyperdcp`` with stderr on a pipe, or on a
    terminal (a pseudo-terminal of 100 columns) when ``tty``."""
    exe = shutil.which("hyperdcp")
    assert exe, "the hyperdcp command is not installed (pip install -e .)"
    if not tty:
        proc = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=180)
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([exe, *argv], stdout=subprocess.PIPE, stderr=slave, text=True,
                            stdin=subprocess.DEVNULL)
    os.close(slave)
    err = b""
    while True:  # read the terminal while the command runs
        if select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the command closed its end
                break
            if not chunk:
                break
            err += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    out = proc.stdout.read()
    return proc.wait(timeout=180), out, err.decode(errors="replace")


def test_installed_command_shows_progress_only_on_a_terminal(ckpt, tmp_path):
    code, out, err = _command("convert", str(ckpt), str(tmp_path / "st"), "--to", "safetensors",
                              tty=False)
    assert code == 0 and "converted 4 tensors" in out
    assert err == "", err  # no progress bar into a pipe

    md = dcp.read_metadata(str(ckpt))
    chunk = md.tensors["model.b"].chunks[0]
    data = bytearray((ckpt / chunk.file).read_bytes())
    data[chunk.byte_offset] ^= 0x80
    (ckpt / chunk.file).write_bytes(bytes(data))
    code, out, err = _command("verify", str(ckpt), tty=True)
    assert code == 3 and "DAMAGED: tensor 'model.b'" in out
    assert "verify:" in err and "%|" in err, err  # tqdm's bar, on the terminal


def test_per_rank_metadata_of_an_uncoordinated_save_is_a_checkpoint(tmp_path, capsys):
    """A checkpoint of ``async_save(coordination="none")`` has one metadata
    file per rank and no ``metadata.json``: every command reads it."""
    path = str(tmp_path / "none")
    state = _state()
    dcp.async_save(state, path, coordination="none").result(120)
    assert not (tmp_path / "none" / "metadata.json").exists()
    code, out, _ = _run(capsys, "inspect", path)
    assert code == 0 and "hyperdcp format" in out, out
    code, out, _ = _run(capsys, "verify", path)
    assert code == 0, out
    code, _, _ = _run(capsys, "diff", path, path)
    assert code == 0


def test_bad_storage_options_are_one_line_errors(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    dcp.save(_state(), path)
    code, _, err = _run(capsys, "verify", path, "-o", "thred_count=2")
    assert code == 1 and "thred_count" in err and "Traceback" not in err, err
    code, _, err = _run(capsys, "inspect", path, "-o", "no-equals-sign")
    assert code == 2 and "KEY=VALUE" in err, err
    with pytest.raises(dcp.CheckpointError, match="thred_count"):
        dcp.save(_state(), str(tmp_path / "other"), storage_options={"thred_count": 2})


def _s3_options(endpoint: str, **extra) -> list[str]:
    return [arg for k, v in s3_server.options(endpoint, **extra).items()
            for arg in ("-o", f"s3:{k}={v}")]


def test_storage_failures_are_one_line_errors_from_every_subcommand(ckpt, tmp_path, capsys):
    """A missing bucket (moto), an unreachable endpoint (a closed port on
    127.0.0.1, one attempt per request) and a mistyped S3 option: every
    subcommand prints ``hyperdcp: error: ...`` (one line, no traceback) and
    exits 1; the library raises CheckpointError for the same."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    live = s3_server.endpoint()
    cases = [
        ("s3://no-such-bucket/ckpt", _s3_options(live), "The specified bucket does not exist"),
        (f"s3://{s3_server.BUCKET}/ckpt", _s3_options(closed, max_attempts=1),
         f"EndpointConnectionError: Could not connect to the endpoint URL: \"{closed}/"),
        (f"s3://{s3_server.BUCKET}/ckpt", [*_s3_options(live), "-o", "s3:endpoint_urll=x"],
         "'endpoint_urll' (did you mean 'endpoint_url'?)"),
    ]
    for uri, options, says in cases:
        for argv in (["list", uri], ["verify", uri], ["prune", uri], ["inspect", uri],
                     ["diff", uri, str(ckpt)], ["convert", uri, str(tmp_path / "out")],
                     ["convert", str(ckpt), uri, "--to", "safetensors"]):
            code, _, err = _run(capsys, *argv, *options)
            assert (code, err.count("\n")) == (1, 1) and err.startswith("hyperdcp: error: "), \
                (argv, code, err)
            assert says in err, (argv, err)
        storage_options = dict(o.removeprefix("s3:").split("=", 1) for o in options[1::2])
        with pytest.raises(dcp.CheckpointError, match=re.escape(says)):
            dcp.read_metadata(uri, storage_options=storage_options)


def test_verify_refuses_chunks_that_do_not_cover_the_shape(tmp_path, capsys):
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(35.0).reshape(7, 5)}, str(path))
    doc = json.loads((path / "metadata.json").read_text())
    doc["tensors"]["w"]["shape"] = [9, 5]
    (path / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(dcp.CorruptCheckpointError, match=r"'w' has shape \[9, 5\].*hold 35"):
        verify(str(path))
    code, out, _ = _run(capsys, "verify", str(path))
    assert code == 3 and "DAMAGED" in out and "'w' has shape [9, 5]" in out, out


def test_folders_named_ckpt_are_checkpoints_and_only_plain_files_are_mindspore(ckpt, tmp_path,
                                                                               capsys):
    run = tmp_path / "run.ckpt"
    dcp.save(_state(), str(run))
    code, out, err = _run(capsys, "inspect", str(run))
    assert code == 0 and "hyperdcp format" in out, err
    lightning = tmp_path / "epoch=0-step=10.ckpt"  # PyTorch Lightning's name for a DCP folder
    assert _run(capsys, "convert", str(ckpt), str(lightning), "--to", "torch-dcp")[0] == 0
    code, _, err = _run(capsys, "inspect", str(lightning))
    assert code == 1 and "is a PyTorch DCP checkpoint" in err, err
    code, _, err = _run(capsys, "convert", "--trust-pickle", str(lightning), str(tmp_path / "b"))
    assert code == 0, err
    (tmp_path / "empty.ckpt").mkdir()
    code, _, err = _run(capsys, "inspect", str(tmp_path / "empty.ckpt"))
    assert code == 1 and "is not a checkpoint" in err and "Traceback" not in err, err
    text = tmp_path / "notes"  # no suffix, starts with b"\n": not taken for a .ckpt
    text.write_bytes(b"\n\n\nheading\n\n\nsome text\n" * 4)
    code, _, err = _run(capsys, "inspect", str(text))
    assert code == 1 and "is not a checkpoint" in err, err


def test_converting_a_non_hyperdcp_source_to_a_ckpt_name_is_a_usage_error(tmp_path, capsys):
    save_file({"w": randn((2, 3), seed=3)}, tmp_path / "m.safetensors")
    code, _, err = _run(capsys, "convert", str(tmp_path / "m.safetensors"),
                        str(tmp_path / "o.ckpt"))
    assert code == 2 and "convert to hyperdcp first" in err and "--to mindspore" in err, err
    assert not (tmp_path / "o.ckpt").exists()
    code, _, err = _run(capsys, "convert", str(tmp_path / "m.safetensors"), str(tmp_path / "h"))
    assert code == 0, err
    code, _, err = _run(capsys, "convert", str(tmp_path / "h"), str(tmp_path / "o.ckpt"))
    assert code == 0 and (tmp_path / "o.ckpt").is_file(), err
    code, out, err = _run(capsys, "inspect", str(tmp_path / "o.ckpt"))
    assert code == 0 and "mindspore" in out, err


def test_a_memory_tier_step_is_never_pruned_or_verified_as_a_whole_checkpoint(tmp_path, capsys):
    """One host's part of a memory-tier step (its held list, and a copies
    file holding another host's chunks) is listed as a memory step; prune
    leaves every file of it, and verify refuses it by name.  The same
    folder without its held list is an ordinary checkpoint with an orphan,
    which prune deletes: what made the copies vanish before."""
    step = tmp_path / "run-0123" / "step-3"
    state = _state()
    dcp.save(state, str(step))
    copies = step / "r00000-copies.data"
    copies.write_bytes(b"\x01" * 4096)
    (step / "held.r00000.json").write_text('{"files": [["r00000-copies.data", 4096]]}')

    code, out, _ = _run(capsys, "list", str(tmp_path))
    assert code == 0 and "run-0123/step-3: memory step" in out and "orphaned" not in out
    code, out, _ = _run(capsys, "prune", str(tmp_path), "--min-age", "0")
    assert code == 0 and copies.read_bytes() == b"\x01" * 4096
    code, _, err = _run(capsys, "verify", str(step))
    assert code == 1 and "memory-tier step" in err
    restored = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": 0}
    dcp.load(restored, str(step))
    for k, v in state["model"].items():
        assert_bitwise_equal(restored["model"][k], v)
    assert restored["step"] == 7

    (step / "held.r00000.json").unlink()
    code, out, _ = _run(capsys, "prune", str(tmp_path), "--min-age", "0")
    assert code == 0 and not copies.exists()
