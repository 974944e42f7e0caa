"""kvcache_client's modules import one another without a cycle, in any order.

Two checks: the graph of the package's runtime imports (module-level and inside
functions, not those under ``if TYPE_CHECKING:``) has no cycle, whatever Python would
tolerate today; and each module, imported first in a fresh interpreter with the package's
``__init__`` not yet run, imports and lets every other module import after it.
"""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

import kvcache_client

PACKAGE_DIR = Path(kvcache_client.__file__).resolve().parent
HAS_TORCH = importlib.util.find_spec("torch") is not None


def module_name(path: Path) -> str:
    parts = ("kvcache_client",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def runtime_imports(name: str) -> Set[str]:
    """The package's modules that ``name`` imports when it runs."""
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(name)
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:  # `from . import x` imports the module x
                if f"{base}.{alias.name}" in MODULES:
                    found.add(f"{base}.{alias.name}")
            if base in MODULES:
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(MODULES[name].read_text(), str(MODULES[name])))
    found.discard(name)
    return found


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def walk(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = walk(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = walk(start)
            if cycle:
                return cycle
    return None


def test_the_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_imports_have_no_cycle():
    # The package __init__ imports its modules; a module never imports its package back.
    graph = {name: runtime_imports(name) for name in MODULES}
    for name in graph:
        graph[name] = {m for m in graph[name] if MODULES[m].name != "__init__.py"
                       or not name.startswith(m + ".")}
    assert "kvcache_client.errors" in graph["kvcache_client._arrays"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# Runs in a fresh interpreter: the packages exist (their __path__) but their __init__ has
# not run, so `first` is imported before anything else of kvcache_client; then the rest.
_IMPORT_FIRST = """
import importlib, sys, types
root, first, names = sys.argv[1], sys.argv[2], sys.argv[3:]
for package in sorted({n for n in names if n == "kvcache_client" or n.endswith(".torch")}):
    module = types.ModuleType(package)
    module.__path__ = [root + "/" + "/".join(package.split(".")[1:])]
    sys.modules[package] = module
for name in [first] + [n for n in names if n != first]:
    if name in ("kvcache_client", "kvcache_client.torch"):
        continue  # their __init__: the normal import, checked below
    importlib.import_module(name)
"""


def _importable(name: str) -> bool:
    return HAS_TORCH or not name.startswith("kvcache_client.torch")


@pytest.mark.parametrize("first", [n for n in MODULES if _importable(n)
                                   and n not in ("kvcache_client", "kvcache_client.torch")])
def test_each_module_imports_first_in_a_fresh_interpreter(first):
    names = [n for n in MODULES if _importable(n)]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run([sys.executable, "-c", _IMPORT_FIRST, str(PACKAGE_DIR), first,
                             *names], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, f"importing {first} first:\n{result.stderr}"


def test_the_package_and_its_public_names_import():
    code = ("import kvcache_client as k\n"
            "missing = [n for n in k.__all__ if not hasattr(k, n)]\n"
            "assert not missing, missing\n"
            "assert 'kvcache_client.torch' not in __import__('sys').modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
