"""Quick to start: what ``hyperdcp`` and ``import dcp`` load, each in a
fresh process (modules asserted, never times: ``benchmarks/startup.py``
measures those).

* ``hyperdcp --version``, ``--help`` and a subcommand's ``--help`` import
  neither torch nor numpy, and of ``dcp`` only the parser's modules;
* ``import dcp`` loads no layer, and ``dcp.save`` (the first name used)
  only what a save needs: not the manager nor the interop layer;
* every name of ``dcp.__all__`` resolves, lazily, to the object of its home
  module, ``from dcp import *`` and ``dir(dcp)`` list them, and the lazy
  table is the ``TYPE_CHECKING`` block's;
* a checkpoint saved by one such process loads, element-exact, in another
  that imported nothing but ``dcp`` (and torch for its targets): storage
  plugins found through their entry points, a pickled value through the
  restricted unpickler.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dcp

ROOT = Path(__file__).resolve().parent.parent
#: What the parser may load of dcp: the package, its errors, the parser and
#: the size parser whose default --max-shard-size it shows.
PARSER_MODULES = {"dcp", "dcp.errors", "dcp.tools", "dcp.tools.cli", "dcp.interop",
                  "dcp.interop.sizes"}
HEAVY = ("torch", "numpy", "zstandard", "fsspec", "s3fs", "safetensors", "tqdm")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter started in the repository root, with
    ``args`` as ``sys.argv[1:]``."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def _report(done: subprocess.CompletedProcess) -> dict:
    """The JSON that the last line of ``done``'s output holds."""
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["list", "--help"],
                                  ["convert", "--help"]], ids=" ".join)
def test_hyperdcp_answers_without_torch(argv):
    """``python -m dcp`` (``dcp/__main__.py``, which the ``hyperdcp``
    console script mirrors: both import ``dcp.tools.cli.main``)."""
    done = _python(f"""
        import json, runpy, sys
        sys.argv = ["hyperdcp", *{argv!r}]
        try:
            runpy.run_module("dcp", run_name="__main__")
        except SystemExit as e:
            code = e.code
        print()
        print(json.dumps({{"code": code, "modules": sorted(sys.modules)}}))
        """)
    report = _report(done)
    assert report["code"] == 0, done.stdout
    modules = set(report["modules"])
    assert not [m for m in HEAVY if m in modules], sorted(m for m in modules if m in HEAVY)
    assert {m for m in modules if m.split(".")[0] == "dcp"} <= PARSER_MODULES
    if argv == ["--version"]:
        assert done.stdout.startswith(f"hyperdcp {importlib.metadata.version('hyperdcp')}\n")
    elif argv == ["--help"]:
        for sub in ("demo", "inspect", "verify", "diff", "convert", "list", "prune"):
            assert f"    {sub} " in done.stdout, done.stdout
    elif argv == ["convert", "--help"]:
        assert "(default 5GB)" in done.stdout, done.stdout


def test_import_dcp_loads_no_layer_and_save_only_what_it_needs():
    report = _report(_python("""
        import json, sys
        import dcp
        after_import = sorted(sys.modules)
        dcp.save
        attribute = sorted(sys.modules)
        import tempfile, torch
        with tempfile.TemporaryDirectory() as d:
            dcp.save({"x": torch.ones(2)}, d + "/ckpt")
            dcp.load(target := {"x": torch.zeros(2)}, d + "/ckpt")
        assert torch.equal(target["x"], torch.ones(2))
        print(json.dumps({"import": after_import, "save": attribute, "used": sorted(sys.modules)}))
        """))
    imported = set(report["import"])
    assert {m for m in imported if m.split(".")[0] == "dcp"} == {"dcp"}
    assert not [m for m in HEAVY if m in imported]
    saved = set(report["save"])
    assert {"torch", "dcp.orchestration.save"} <= saved
    for unneeded in ("dcp.manager", "dcp.interop", "dcp.asynchronous", "dcp.tools"):
        assert unneeded not in saved, f"dcp.save loaded {unneeded}"
    # a save and load of plain tensors never import DTensor's package (about
    # 600 modules, 0.6 s): no DTensor can exist before it is imported
    assert "torch.distributed.tensor" not in set(report["used"])


def test_every_public_name_resolves_lazily():
    report = _report(_python("""
        import importlib, json, sys
        import dcp
        homes = dcp._HOME_OF
        wrong = [n for n in dcp.__all__
                 if getattr(dcp, n) is not getattr(importlib.import_module(homes[n]), n)]
        star = {}
        exec("from dcp import *", star)
        try:
            dcp.no_such_name
            missing = "resolved"
        except AttributeError as e:
            missing = str(e)
        print(json.dumps({"wrong": wrong, "star": sorted(set(star) - {"__builtins__"}),
                          "dir": dir(dcp), "core": dcp.core is sys.modules["dcp.core"],
                          "manager": dcp.manager is sys.modules["dcp.manager"],
                          "missing": missing}))
        """))
    assert report["wrong"] == []
    assert report["star"] == sorted(dcp.__all__)
    assert set(dcp.__all__) <= set(report["dir"])
    assert report["core"] and report["manager"]
    assert report["missing"] == "module 'dcp' has no attribute 'no_such_name'"


def test_lazy_names_are_the_type_checking_imports():
    """``_HOMES`` (what runs) and the ``TYPE_CHECKING`` block (what type
    checkers see) name the same modules for the same names, and ``__all__``
    lists each name once."""
    tree = ast.parse((ROOT / "dcp" / "__init__.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If)
                and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"]
    seen = {alias.name: stmt.module for stmt in block.body if isinstance(stmt, ast.ImportFrom)
            for alias in stmt.names}
    assert seen == dcp._HOME_OF
    assert sorted(dcp.__all__) == sorted(set(dcp.__all__)) == sorted(seen)


def test_a_process_that_imported_only_dcp_loads_what_another_saved(tmp_path):
    uri = str(tmp_path / "ckpt")
    _python("""
        import datetime, sys, torch
        import dcp
        state = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7,
                 "b": torch.arange(6, dtype=torch.int64) - 3,
                 "when": {datetime.date(2026, 12, 2), 7}, "step": 7}
        dcp.save(state, sys.argv[1], allow_pickle=True)
        """, uri)
    report = _report(_python("""
        import json, sys, torch
        import dcp
        state = {"w": torch.zeros(4, 6), "b": torch.zeros(6, dtype=torch.int64),
                 "when": None, "step": 0}
        report = dcp.load(state, sys.argv[1], allow_pickle=True)
        print(json.dumps({"w": state["w"].tolist(), "b": state["b"].tolist(),
                          "when": sorted(map(str, state["when"])), "step": state["step"],
                          "missing": list(report.missing_keys)}))
        """, uri))
    import torch

    w = torch.tensor(report["w"], dtype=torch.float32)
    assert torch.equal(w, torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7)
    assert report["b"] == list(range(-3, 3))
    assert report["when"] == ["2026-12-02", "7"] and report["step"] == 7
    assert report["missing"] == []
