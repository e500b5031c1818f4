"""The layering of docs' architecture, checked on the source with ``ast``
(nothing is imported, no process started).

- No import cycle among the modules of ``dcp/``, ``planners/`` and
  ``storage_plugins/``.
- ``planners/`` and ``storage_plugins/`` use of ``dcp`` only ``dcp.core.*``,
  ``dcp.errors`` and the names ``dcp/__init__.py`` exports, never the
  orchestration, asynchronous, coordination, interop or tools layers; and
  neither imports the other.
- ``dcp/`` never imports ``planners/`` or ``storage_plugins/`` (it finds them
  through entry points, as it finds a third party's), and ``dcp.core``
  imports nothing of ``dcp`` but ``dcp.core`` and ``dcp.errors`` (else the
  rule above would be broken one step away).
- torch: within ``dcp/core/`` only the tensor adapters import it
  (``tensors.py``; ``devices.py``, its accelerator side: streams, page-locked
  memory; and ``mindspore_tensors.py``, which hands MindSpore tensors over
  as torch ones); ``planners/`` never.
- ``dcp/integrations/`` (trainers picking hyperdcp from their configuration)
  uses only the public API: ``dcp``'s names, the conversions of
  ``dcp.interop`` and the format's names in ``dcp.core.metadata``; nothing in
  ``dcp/`` imports it, so ``import dcp`` never loads a trainer.
- mindspore: only ``dcp/core/mindspore_tensors.py`` imports it, and only
  inside functions (a torch-only job never loads it); nothing else in
  ``dcp/``, ``planners/`` or ``storage_plugins/``, at any level.

Which imports count.  For the layer and torch rules, every ``import``
statement, wherever it stands (module level, a function body, an
``if TYPE_CHECKING:`` block): a deferred or type-only import is still a
dependency.  For cycles, only those that run while the module loads (module
level, class bodies, ``try``/``if`` blocks): an import in a function body runs
when the function is called, after loading, which is the usual way to break
a load-time cycle, and a ``TYPE_CHECKING`` block never runs.  ``from a import
b`` depends on the module ``a.b`` when the tree has one, else on ``a``; the
parent packages Python loads on the way (``dcp/__init__.py`` before
``dcp.core.boxes``) are not counted, or every module would depend on the
whole public API.  Imports by string (``importlib``, entry points) are not
seen: they are how ``dcp`` reaches its plugins.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dcp", "planners", "storage_plugins")
#: what planners/ and storage_plugins/ may import of dcp (besides ``dcp`` itself)
DCP_FOR_IMPLEMENTATIONS = ("dcp.core", "dcp.errors")
TORCH_IN_CORE = ("dcp.core.tensors", "dcp.core.devices", "dcp.core.mindspore_tensors")
MINDSPORE_ADAPTER = "dcp.core.mindspore_tensors"
INTEGRATIONS = "dcp.integrations"
#: what dcp/integrations/ may import of dcp (besides ``dcp`` itself): the public API
DCP_FOR_INTEGRATIONS = ("dcp.interop", "dcp.core.metadata")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module, or the package a name was imported from
    path: str  # the importing file, relative to the root
    line: int
    deferred: bool  # inside a function body
    type_only: bool  # inside ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, path: str, is_package: bool, modules: set[str]) -> None:
        self.module, self.path, self.modules = module, path, modules
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[Import] = []
        self.deferred = self.type_only = False

    def _add(self, target: str, node: ast.stmt) -> None:
        self.found.append(Import(self.module, target, self.path, node.lineno, self.deferred,
                                 self.type_only))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            self._add(submodule if submodule in self.modules else source, node)

    def _function(self, node: ast.AST) -> None:
        outer, self.deferred = self.deferred, True
        self.generic_visit(node)
        self.deferred = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self.type_only = self.type_only, True
        for stmt in node.body:
            self.visit(stmt)
        self.type_only = outer
        for stmt in node.orelse:
            self.visit(stmt)


def scan(root: Path) -> dict[str, list[Import]]:
    """Every module of the three packages under ``root``, with its imports."""
    files = {_module_name(p, root): p for package in PACKAGES
             for p in sorted((root / package).rglob("*.py"))}
    modules = set(files)
    out = {}
    for module, path in files.items():
        collector = _Collector(module, str(path.relative_to(root)), path.name == "__init__.py",
                               modules)
        collector.visit(ast.parse(path.read_text(), str(path)))
        out[module] = collector.found
    return out


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def cycles(imports: dict[str, list[Import]]) -> list[list[Import]]:
    """The load-time import edges of each strongly connected group of
    modules (Tarjan), one list per group of two or more modules."""
    edges = {m: [i for i in found if not (i.deferred or i.type_only)
                 and i.target in imports and i.target != m]
             for m, found in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for edge in edges[v]:
            w = edge.target
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(edges):
        if module not in index:
            connect(module)
    return [[e for m in sorted(g) for e in edges[m] if e.target in g] for g in groups]


def layer_violations(imports: dict[str, list[Import]]) -> list[tuple[Import, str]]:
    """Each import that breaks a layer rule, with the rule."""
    out = []
    for module, found in sorted(imports.items()):
        for i in found:
            t = i.target
            if _within(module, "planners") or _within(module, "storage_plugins"):
                other = "storage_plugins" if _within(module, "planners") else "planners"
                if _within(t, other):
                    out.append((i, "planners and storage_plugins never import each other"))
                elif (_within(t, "dcp") and t != "dcp"
                      and not any(_within(t, ok) for ok in DCP_FOR_IMPLEMENTATIONS)):
                    out.append((i, "implementations use only dcp.core.*, dcp.errors and "
                                   "dcp's top-level names"))
            elif _within(module, INTEGRATIONS):
                if (_within(t, "dcp") and t != "dcp" and not _within(t, INTEGRATIONS)
                        and not any(_within(t, ok) for ok in DCP_FOR_INTEGRATIONS)):
                    out.append((i, "integrations use only dcp's public API (dcp, dcp.interop, "
                                   "dcp.core.metadata)"))
            elif _within(module, "dcp"):
                if _within(t, "planners") or _within(t, "storage_plugins"):
                    out.append((i, "dcp finds planners and plugins through entry points only"))
                elif _within(t, INTEGRATIONS):
                    out.append((i, "nothing in dcp imports the integrations (import dcp loads "
                                   "no trainer)"))
                elif (_within(module, "dcp.core") and _within(t, "dcp")
                      and not any(_within(t, ok) for ok in DCP_FOR_IMPLEMENTATIONS)):
                    out.append((i, "dcp.core imports only dcp.core.* and dcp.errors"))
    return out


def torch_violations(imports: dict[str, list[Import]]) -> list[tuple[Import, str]]:
    """Each import of torch outside the tensor adapter, with the rule."""
    out = []
    for module, found in sorted(imports.items()):
        for i in found:
            if not _within(i.target, "torch"):
                continue
            if _within(module, "dcp.core") and module not in TORCH_IN_CORE:
                out.append((i, f"in dcp/core only {' and '.join(TORCH_IN_CORE)} know torch"))
            elif _within(module, "planners"):
                out.append((i, "planners see shapes, offsets and dtype names, never torch"))
    return out


def mindspore_violations(imports: dict[str, list[Import]]) -> list[tuple[Import, str]]:
    """Each import of mindspore outside the MindSpore adapter, or in it at
    load time, with the rule."""
    out = []
    for module, found in sorted(imports.items()):
        for i in found:
            if not _within(i.target, "mindspore"):
                continue
            if module != MINDSPORE_ADAPTER:
                out.append((i, f"only {MINDSPORE_ADAPTER} knows mindspore"))
            elif not i.deferred:
                out.append((i, "mindspore is imported inside functions only (lazily)"))
    return out


# ------------------------------------------------------------------ the tree


def _tree() -> dict[str, list[Import]]:
    imports = scan(ROOT)
    # guard against a vacuous pass (a package moved, the scan found nothing)
    assert {*TORCH_IN_CORE, "dcp.core.planner", "dcp.core.storage", "planners.save",
            "planners.load", "storage_plugins.posix"} <= set(imports), sorted(imports)
    return imports


def test_no_import_cycles():
    found = cycles(_tree())
    assert not found, "import cycles (load-time edges):\n" + "\n\n".join(
        "\n".join(map(str, group)) for group in found)


def _lines(violations: list[tuple[Import, str]]) -> str:
    return "\n".join(f"{i}: {rule}" for i, rule in violations)


def test_layers_import_only_downwards():
    found = layer_violations(_tree())
    assert not found, _lines(found)


def test_only_the_tensor_adapter_imports_torch():
    found = torch_violations(_tree())
    assert not found, _lines(found)


def test_only_the_mindspore_adapter_imports_mindspore_lazily():
    found = mindspore_violations(_tree())
    assert not found, _lines(found)


# --------------------------------------------- the checks themselves can fail


_BROKEN = {
    "dcp/__init__.py": "",
    "dcp/errors.py": "",
    "dcp/core/__init__.py": "",
    "dcp/core/tensors.py": "import torch\n",
    "dcp/core/devices.py": "import torch\n",
    "dcp/core/mindspore_tensors.py": "import torch\nimport mindspore\n"
                                     "def f():\n    from mindspore import Tensor\n",
    "dcp/core/boxes.py": "import numpy\nfrom torch import Tensor\n"
                         "from ..orchestration import save\n",
    "dcp/integrations/__init__.py": "",
    "dcp/integrations/trainer.py": "import dcp\nimport torchtitan\nfrom dcp.interop import x\n"
                                   "from dcp.core.metadata import M\n"
                                   "from dcp.orchestration import load\n",
    "dcp/manager/__init__.py": "from dcp.integrations import trainer\n",
    "dcp/core/lazy.py": "def f():\n    import dcp.core.lazy_back\n",
    "dcp/core/lazy_back.py": "import dcp.core.lazy\n",
    "dcp/core/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    import dcp.core.typed_back\n",
    "dcp/core/typed_back.py": "from dcp.core import typed\n",
    "dcp/orchestration/__init__.py": "",
    "dcp/orchestration/save.py": "from . import load\nimport storage_plugins.posix\n"
                                 "def f():\n    import mindspore.nn\n",
    "dcp/orchestration/load.py": "class L:\n    from dcp.orchestration.save import save\n",
    "planners/__init__.py": "",
    "planners/save.py": "import torch.distributed\nfrom dcp import core, save, errors\n"
                        "from dcp.core.boxes import volume\nfrom dcp.orchestration.save import x\n"
                        "from storage_plugins import posix\n",
    "storage_plugins/__init__.py": "",
    "storage_plugins/posix.py": "import dcp\nfrom typing import TYPE_CHECKING\n"
                                "if TYPE_CHECKING:\n    from dcp.tools import cli\n"
                                "def f():\n    import planners.save\n    import mindspore\n",
}


def test_each_check_reports_what_breaks_it(tmp_path):
    for name, text in _BROKEN.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    imports = scan(tmp_path)
    # a load-time cycle (class bodies run while loading); none through a
    # function body or a TYPE_CHECKING block
    assert [[str(e) for e in g] for g in cycles(imports)] == [[
        "dcp/orchestration/load.py:2 imports dcp.orchestration.save",
        "dcp/orchestration/save.py:1 imports dcp.orchestration.load"]]
    assert [str(i) for i, _ in layer_violations(imports)] == [
        "dcp/core/boxes.py:3 imports dcp.orchestration.save",
        "dcp/integrations/trainer.py:5 imports dcp.orchestration.load",
        "dcp/manager/__init__.py:1 imports dcp.integrations.trainer",
        "dcp/orchestration/save.py:2 imports storage_plugins.posix",
        "planners/save.py:4 imports dcp.orchestration.save",
        "planners/save.py:5 imports storage_plugins.posix",
        "storage_plugins/posix.py:4 imports dcp.tools",
        "storage_plugins/posix.py:6 imports planners.save"]
    assert [str(i) for i, _ in torch_violations(imports)] == [
        "dcp/core/boxes.py:2 imports torch",
        "planners/save.py:1 imports torch.distributed"]
    # the adapter's load-time import, and any import elsewhere (a deferred one too)
    assert [str(i) for i, _ in mindspore_violations(imports)] == [
        "dcp/core/mindspore_tensors.py:2 imports mindspore",
        "dcp/orchestration/save.py:4 imports mindspore.nn",
        "storage_plugins/posix.py:7 imports mindspore"]
