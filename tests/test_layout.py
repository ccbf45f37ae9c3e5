"""The package's shape: no import cycle at import time, and every kernel in `asyncexec/ops/`, which imports
only torch and itself."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import asyncexec

PKG = Path(asyncexec.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, module_level: bool) -> set[str]:
    """The asyncexec modules `path` imports at module level, or anywhere (inside functions too); never
    counting `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    nodes: list[ast.AST] = []
    if module_level:
        for node in tree.body:
            nodes += node.body if isinstance(node, (ast.If, ast.Try)) else [node]
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {name for name in found if name == "asyncexec" or name.startswith("asyncexec.")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_back_at_import_time() -> None:
    graph = {
        m: {d for d in _imports(p, module_level=True) if d in MODULES and d != m} for m, p in MODULES.items()
    }
    assert _cycles(graph) == []


def test_no_cycle_through_lazy_imports_but_the_executor_factory() -> None:
    # `Executor.get_class` imports the executor it returns (which subclasses `Executor`) when asked
    factory = {
        "asyncexec.executor.uniproc",
        "asyncexec.executor.multiproc",
        "asyncexec.executor.ray_executor",
    }
    graph = {
        m: {d for d in _imports(p, module_level=False) if d in MODULES and d != m} for m, p in MODULES.items()
    }
    graph["asyncexec.executor.abstract"] -= factory
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_kernel_lives_in_ops_which_imports_only_torch_and_itself() -> None:
    assert sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.cpp")) == [
        "ops/csrc/bf16_gemm.cpp",
        "ops/csrc/int4_gemm.cpp",
        "ops/csrc/int8_gemm.cpp",
        "ops/csrc/int8_gemv.cpp",
        "ops/csrc/paged_decode.cpp",
    ]
    registering = sorted(_module(p) for p in PKG.rglob("*.py") if 'Library("asyncexec"' in p.read_text())
    assert registering and all(m.startswith("asyncexec.ops.") for m in registering), registering
    for m, p in MODULES.items():
        if m.startswith("asyncexec.ops"):
            foreign = {d for d in _imports(p, module_level=False) if not d.startswith("asyncexec.ops")}
            assert foreign == set(), f"{m} imports {foreign}"


def test_the_top_level_shows_the_layers() -> None:
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    assert {"core", "engine", "entrypoints", "executor", "ipc", "ops", "quantization", "worker"} <= set(
        packages
    )
    loose = sorted(p.stem for p in PKG.glob("*.py") if not p.stem.startswith("__"))
    moved = {old.rpartition(".")[2] for old in asyncexec.MOVED_MODULES}
    assert not moved & set(loose), "a moved module's old file is back at the top level"
    assert "models" not in loose, "tiny test models live in asyncexec.testing"


@pytest.mark.parametrize("old", sorted(asyncexec.MOVED_MODULES))
def test_a_moved_module_imports_under_its_old_name_as_the_same_module(old: str) -> None:
    new = asyncexec.MOVED_MODULES[old]
    assert importlib.import_module(old) is importlib.import_module(new)
    module = sys.modules[new]
    assert module.__name__ == new and module.__spec__ is not None and module.__spec__.name == new


def test_old_import_paths_keep_working() -> None:
    from asyncexec.models import make_tiny_model  # type: ignore[import-not-found,unused-ignore]
    from asyncexec.scheduler import Scheduler as OldScheduler  # type: ignore[import-not-found,unused-ignore]

    from asyncexec.core.scheduler import Scheduler
    from asyncexec.testing import make_tiny_model as new_make

    assert OldScheduler is Scheduler and make_tiny_model is new_make
