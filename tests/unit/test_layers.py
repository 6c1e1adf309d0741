"""The layering rules, checked on the source with :mod:`ast` (no import runs).

Layers, lowest first: ``fedsched`` (the library every service uses) < ``services`` (one package
per service) < ``fedapp`` (the composition: runtime, CLI, replay, reports). Rules:

(a) nothing under ``fedsched/`` imports ``services`` or ``fedapp``;
(b) nothing under ``services/`` imports ``fedapp``;
(c) one service does not import another (what two services share lives in ``fedsched``);
(d) the scheduling core (``services/scheduler/core``) imports no I/O module;
(e) no import cycle among the project's modules, counting imports inside functions and under
    ``TYPE_CHECKING`` (a cycle there is still two modules that need each other).

The checker functions are tested on small synthetic trees first, so a broken checker cannot
pass silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fedsched", "services", "fedapp")
IO_MODULES = frozenset({"nats", "grpc", "grpc_health", "grpc_reflection", "clickhouse_connect", "chdb", "asyncio",
                        "socket", "subprocess", "urllib", "http", "requests"})


# --------------------------------------------------------------------------- the checker


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file for every ``.py`` under ``root/<package>`` (``pkg/__init__.py``
    is module ``pkg``)."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) for every import anywhere in the file (module level,
    functions, ``TYPE_CHECKING`` blocks); ``from a import b`` gives ``a.b`` (``b`` may be a
    module or a name in ``a``; ``from a import *`` gives ``a``); relative imports are made
    absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.extend((node.lineno, base if alias.name == "*" else f"{base}.{alias.name}") for alias in node.names)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: first line}. An imported name points at the
    longest project module that prefixes it (``from a import b``: ``a.b`` when that is a module,
    else ``a``); importing ``a.b`` does not count as importing package ``a`` (its ``__init__``
    runs, but that is not a dependency the code chose)."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        deps: dict[str, int] = {}
        for line, name in imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.setdefault(name, line)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as ``[m1, m2, ..., m1]``, or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        colour[start] = GREY
        while stack:
            node, todo = stack[-1]
            if not todo:
                colour[node] = BLACK
                stack.pop()
                continue
            nxt = todo.pop(0)
            if colour.get(nxt, BLACK) == GREY:
                path = [n for n, _ in stack]
                return path[path.index(nxt):] + [nxt]
            if colour.get(nxt) == WHITE:
                colour[nxt] = GREY
                stack.append((nxt, sorted(graph[nxt])))
    return None


def layer_violations(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Every broken rule (a)-(d) as ``file:line: rule: imported name``."""
    problems: list[str] = []
    for module, path in module_files(root, packages).items():
        top = module.split(".")
        where = path.relative_to(root)
        for line, name in imported_names(module, path):
            head = name.split(".")
            if top[0] == "fedsched" and head[0] in ("services", "fedapp"):
                problems.append(f"{where}:{line}: fedsched imports {head[0]}: {name}")
            if top[0] == "services" and head[0] == "fedapp":
                problems.append(f"{where}:{line}: a service imports fedapp: {name}")
            if (top[0] == "services" and head[0] == "services" and len(top) > 1 and len(head) > 1
                    and head[1] != top[1]):
                problems.append(f"{where}:{line}: services.{top[1]} imports another service: {name}")
            if top[:3] == ["services", "scheduler", "core"] and head[0] in IO_MODULES:
                problems.append(f"{where}:{line}: the scheduling core imports an I/O module: {name}")
    return sorted(set(problems))


# --------------------------------------------------------------------------- the checker can fail


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "fedsched/__init__.py": "",
        "fedsched/a.py": "from fedsched.b import thing\n",
        "fedsched/b.py": "import json\n\ndef thing():\n    from fedsched import a\n    return a\n",
        "fedsched/c.py": "from fedsched import b\n",
    })
    graph = import_graph(module_files(root, ("fedsched",)))
    assert graph["fedsched.c"] == {"fedsched.b": 1}
    assert find_cycle(graph) == ["fedsched.a", "fedsched.b", "fedsched.a"]


def test_checker_finds_a_relative_import_cycle_and_passes_a_dag(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "services/__init__.py": "",
        "services/x/__init__.py": "",
        "services/x/one.py": "from .two import f\n",
        "services/x/two.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import one\n",
    })
    assert find_cycle(import_graph(module_files(root, ("services",)))) == [
        "services.x.one", "services.x.two", "services.x.one"]
    (root / "services/x/two.py").write_text("import os\n")
    assert find_cycle(import_graph(module_files(root, ("services",)))) is None


def test_checker_reports_each_layer_rule(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "fedsched/__init__.py": "",
        "fedsched/ok.py": "from fedsched import errors\n",
        "fedsched/bad.py": "def f():\n    from services.scheduler import core\n",
        "services/__init__.py": "",
        "services/admission/rules.py": "from services.scheduler.core.quota import QuotaBook\nimport fedapp.cli\n",
        "services/scheduler/core/decide.py": "import asyncio\nfrom services.scheduler.core import fit\n",
        "fedapp/__init__.py": "from services.admission import rules\n",
    })
    assert layer_violations(root) == [
        "fedsched/bad.py:2: fedsched imports services: services.scheduler.core",
        "services/admission/rules.py:1: services.admission imports another service: "
        "services.scheduler.core.quota.QuotaBook",
        "services/admission/rules.py:2: a service imports fedapp: fedapp.cli",
        "services/scheduler/core/decide.py:1: the scheduling core imports an I/O module: asyncio",
    ]


# --------------------------------------------------------------------------- the project


def test_the_project_keeps_its_layers() -> None:
    assert set(module_files(ROOT)) >= {"fedsched.events", "services.scheduler.core.decide", "fedapp.runtime"}
    problems = layer_violations(ROOT)
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_the_project_has_no_import_cycle() -> None:
    graph = import_graph(module_files(ROOT))
    assert sum(len(deps) for deps in graph.values()) > 100  # the graph was really built
    cycle = find_cycle(graph)
    if cycle:
        steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle:\n  " + "\n  ".join(steps))


def test_no_test_module_imports_another_test_module() -> None:
    """Shared test code lives in ``tests/builders.py`` (functions) and ``conftest.py`` (fixtures);
    a test module importing another couples two test files (issue 9, item 5)."""
    tests = module_files(ROOT, ("tests",))
    shared = {"tests", "tests.builders", "tests.conftest", "tests.contract.conftest", "tests.contract.proxy",
              "tests.contract.writer_proc"}
    bad = [f"{mod}:{line} imports {name}" for mod, path in tests.items()
           for line, name in imported_names(mod, path)
           if name.startswith("tests.") and not any(name == s or name.startswith(s + ".") for s in shared)]
    assert not bad, "\n".join(bad)
