"""The README stays true: its code runs, its commands exist, its links resolve.

* Every ```python block of README.md runs, in order, as one script in a fresh
  directory, followed by every ``hyperdcp ...`` line of its ```sh blocks
  (the checkpoints the quick start wrote are what those lines name).  A block
  that cannot run in one process is preceded by ``<!-- not run: REASON;
  TEST_NAME runs it -->``, and TEST_NAME, a test of this module, runs it
  another way (under torchrun, against a local S3 server).
* Every subcommand the README names is in ``hyperdcp --help``, and every
  option it gives a subcommand is in that subcommand's ``--help``.
* README.md is at most 250 lines; every relative link of README.md,
  CONTRIBUTING.md and docs/*.md points to an existing file, and every repo
  path and ``dcp``/``planners``/``storage_plugins`` name they mention exists.
* The import table of docs/architecture.md is the tree's (its rules are
  tests/test_layering.py's).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
from collections import defaultdict
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = 250

#: A fenced block, with the ``not run`` marker that may precede it.
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```",
                   re.S | re.M)
#: What a command line of the README is expected to exit with (default 0).
EXIT_CODES = {"diff": 4}  # the quick start's two checkpoints differ


def blocks(lang: str) -> list[tuple[str | None, str]]:
    """``(not-run reason or None, body)`` of every ``lang`` block of README.md."""
    return [(m["why"], m["body"]) for m in BLOCK.finditer(README.read_text()) if m["lang"] == lang]


def not_run_block(test_name: str) -> str:
    """The body of the one block whose marker names ``test_name``."""
    found = [body for lang in ("python", "yaml") for why, body in blocks(lang)
             if why and test_name in why]
    assert len(found) == 1, f"README.md: {len(found)} blocks marked for {test_name}, not one"
    return found[0]


def code(text: str) -> str:
    """The code of a Markdown text: its fenced blocks and inline code spans."""
    fenced = [m["body"] for m in BLOCK.finditer(text)]
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", BLOCK.sub("", text)))


def command_lines() -> list[list[str]]:
    """The ``hyperdcp ...`` lines of the README's ```sh blocks, as argv."""
    return [shlex.split(line, comments=True) for _, body in blocks("sh")
            for line in body.splitlines() if line.startswith("hyperdcp ")]


def run(what: str, argv: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AWS_EC2_METADATA_DISABLED": "true"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    """The slow subprocesses, started at once so that they run while other
    tests do: the README's FSDP2 block as two ranks with the environment
    ``torchrun`` gives its workers (its launcher process left out: one
    ``import torch`` less), and ``python -m dcp --help``."""
    work = tmp_path_factory.mktemp("fsdp")
    (work / "train.py").write_text(not_run_block("test_fsdp2_block_runs_under_torchrun"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    jobs = {"fsdp": work, "ranks": [
        subprocess.Popen([sys.executable, "train.py"], cwd=work, **pipes,
                         env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(2)]}
    jobs["help"] = subprocess.Popen([sys.executable, "-m", "dcp", "--help"], cwd=ROOT, **pipes)
    yield jobs
    for job in [*jobs["ranks"], jobs["help"]]:
        job.kill()
        job.wait()


# ----------------------------------------------------------------- the code
def test_every_not_run_block_names_a_test_that_runs_it():
    names = {name for name in globals() if name.startswith("test_")}
    for lang in ("python", "yaml", "sh"):
        for why, _ in blocks(lang):
            if why is not None:
                assert any(word in names for word in re.findall(r"\w+", why)), (
                    f"README.md: the block marked 'not run: {why}' names no test of {__name__}")


def test_quick_start_and_command_lines_run_in_one_process(tmp_path, background):
    # ``background`` first: its subprocesses run meanwhile
    sources = [body for why, body in blocks("python") if why is None]
    commands = command_lines()
    assert len(sources) >= 2 and commands, "README.md lost its quick start or its command lines"
    script = "\n".join(sources) + textwrap.dedent(f"""
        import contextlib, io, json
        from dcp.tools.cli import main as _hyperdcp
        _codes = []
        for _argv in {[argv[1:] for argv in commands]!r}:
            with contextlib.redirect_stdout(io.StringIO()):
                _codes.append(_hyperdcp(_argv))
        print("EXIT CODES", json.dumps(_codes))
        """)
    # python -c: the spawned async-save worker has no main module to re-run
    done = run("README.md's Python blocks", [sys.executable, "-c", script], tmp_path)
    codes = json.loads(done.stdout.rsplit("EXIT CODES", 1)[1])
    for argv, rc in zip(commands, codes, strict=True):
        assert rc == EXIT_CODES.get(argv[1], 0), f"README.md: `{shlex.join(argv)}` exited {rc}"


def test_fsdp2_block_runs_under_torchrun(background):
    """Two ranks with the environment ``torchrun`` gives its workers (started
    by the ``background`` fixture)."""
    outputs = [rank.communicate(timeout=180)[0] for rank in background["ranks"]]
    for rank, output in zip(background["ranks"], outputs, strict=True):
        assert rank.returncode == 0, f"train.py exited {rank.returncode}:\n{output}"
    import dcp

    md = dcp.read_metadata(str(background["fsdp"] / "ckpt/fsdp/step1"))
    assert md.world_size == 2 and md.objects["step"].value == 1
    assert md.tensors["model.0.weight"].shape == (32, 16)
    assert any(fqn.startswith("optim.state.") for fqn in md.tensors)


def test_storage_config_block_runs_against_moto(tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    yaml = pytest.importorskip("yaml")
    import torch

    import dcp
    from dcp.testing import local_s3_server

    (config,) = [body for why, body in blocks("yaml") if why is None]
    cfg = yaml.safe_load(config)
    options = cfg["checkpoint"]["storage_options"]
    assert {"endpoint_url", "key", "secret"} <= set(options), "README.md: S3 config lost a key"
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.chdir(tmp_path)
    with local_s3_server() as endpoint:
        options.update(endpoint_url=endpoint, key="testing", secret="testing")
        (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
        import s3fs

        bucket = cfg["checkpoint"]["dir"].removeprefix("s3://").split("/")[0]
        s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing",
                          client_kwargs=options.get("client_kwargs", {})).mkdir(bucket)
        saved = torch.arange(12.0).reshape(3, 4)
        state = {"w": saved.clone(), "step": 7}
        exec(not_run_block("test_storage_config_block_runs_against_moto"),
             {"dcp": dcp, "state": state, "step": 7})
        md = dcp.read_metadata(f"{cfg['checkpoint']['dir']}/step7", storage_options=options)
    assert md.tensors["w"].shape == (3, 4) and md.objects["step"].value == 7
    assert torch.equal(state["w"], saved)


# ------------------------------------------------------------- the commands
def _help(argv: list[str]) -> str:
    from dcp.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def test_every_subcommand_and_option_named_exists(background):
    listed = background["help"].communicate(timeout=120)[0]
    assert background["help"].returncode == 0, listed
    subcommands = set(re.findall(r"^    (\w+) ", listed, re.M))
    assert {"inspect", "verify", "diff", "convert", "demo"} <= subcommands, listed
    text = README.read_text()
    named = {m for line in code(text).splitlines()
             for m in re.findall(r"^\s*hyperdcp (?!SUBCOMMAND)([a-z]\w*)", line)}
    assert named <= subcommands, f"README.md names unknown subcommands: {named - subcommands}"
    for sub in named:
        usage = _help([sub])
        lines = [line for _, body in blocks("sh") + blocks("text")
                 for line in body.splitlines() if line.startswith(f"hyperdcp {sub} ")]
        options = {o for line in lines for o in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", line)}
        for option in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}\b", usage), (
                f"README.md: `hyperdcp {sub}` has no option {option}")
    for option in re.findall(r"`(-[a-z]) ?[^`]*`", text):  # -o, -q of the prose
        assert option in _help(["inspect"]), f"README.md: no option {option}"


# ------------------------------------------------------ length and links
def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md: {lines} lines, over {MAX_LINES}: move detail to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(doc):
    assert doc.exists(), f"{doc.relative_to(ROOT)} is missing"
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.relative_to(ROOT)}: the link {target} points to nothing"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


TOP = ("dcp", "planners", "storage_plugins", "tests", "benchmarks", "docs", ".ci")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_and_module_names_mentioned_exist(doc):
    text = doc.read_text()
    where = doc.relative_to(ROOT)
    for path in re.findall(r"`([\w.-]+/[\w./-]*)", text):
        if path.split("/")[0] in TOP:
            assert (ROOT / path).exists(), f"{where}: `{path}` does not exist"
    groups = set(entry_points().groups)
    for name in set(re.findall(r"(?<![\w./-])((?:dcp|planners|storage_plugins)(?:\.[A-Za-z_]\w*)+)",
                               text)):
        if name in groups:
            continue
        parts = name.split(".")
        k = 1  # parts[:k] is the longest prefix that is a module
        while k < len(parts) and _is_module(".".join(parts[:k + 1])):
            k += 1
        if k == len(parts):  # a module, found without importing it (dcp.integrations.*
            continue         # import their trainer)
        obj = importlib.import_module(".".join(parts[:k]))
        for attr in parts[k:]:
            assert hasattr(obj, attr), f"{where}: `{name}` does not exist (no {attr!r})"
            obj = getattr(obj, attr)


# ------------------------------------------------------------ architecture
def _imports() -> dict[Path, set[Path]]:
    """Each module of dcp/, planners/ and storage_plugins/ -> the modules of
    those packages it imports (anywhere in its body)."""
    files = [p for top in ("dcp", "planners", "storage_plugins")
             for p in (ROOT / top).rglob("*.py")]

    def module_file(name: str) -> Path | None:
        base = ROOT.joinpath(*name.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path in files:
                return path
        return None

    graph: dict[Path, set[Path]] = {}
    for path in files:
        found: set[Path | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {module_file(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    found.add(module_file(f"{node.module}.{a.name}") or module_file(node.module))
        graph[path] = {target for target in found if target is not None and target != path}
    return graph


def _package(path: Path) -> str:
    """The row of docs/architecture.md's import table ``path`` belongs to:
    a subpackage of dcp/, a module directly in dcp/, or a top-level package."""
    parts = path.relative_to(ROOT).parts
    if parts[0] != "dcp":
        return f"{parts[0]}/"
    return f"dcp/{parts[1]}" if len(parts) == 2 else f"dcp/{parts[1]}/"


def test_architecture_doc_import_table_is_the_trees():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Who imports whom", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for row in re.findall(r"^\| `([^`]+)` \| (.*) \|$", section, re.M):
        documented[row[0]] = set(re.findall(r"`([^`]+)`", row[1]))
    actual: dict[str, set[str]] = defaultdict(set)
    for path, targets in _imports().items():
        actual[_package(path)] |= {_package(t) for t in targets} - {_package(path)}
    assert documented == dict(actual), (
        "docs/architecture.md: 'Who imports whom' differs from the tree; the tree's:\n"
        + "\n".join(f"| `{k}` | {', '.join(f'`{v}`' for v in sorted(vs)) or '–'} |"
                     for k, vs in sorted(actual.items())))
