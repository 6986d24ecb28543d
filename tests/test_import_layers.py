"""The import structure of the package ``mhla``: no import circles, the ops import downwards only, and the
optional Triton kernels stay out of ``import mhla``.

The graph is read from the sources (``ast``), not from a running interpreter, and counts every import of a
module of ``mhla``, lazy ones (inside functions) included. A module imports:

* the module it names (``from .state import X`` -> ``state``; ``from . import chunk`` -> ``chunk``;
  ``from .ops import X`` -> the package ``ops``, i.e. its ``__init__``), and
* the ``__init__`` of every package it enters that is not one of its own ancestors: importing
  ``mhla.ops.causal`` from ``mhla.kernels`` runs ``mhla/ops/__init__.py`` first, while a module's own
  ancestors are already initialised when it runs.

A circle in that graph is an import circle: two modules that need each other (at import time, or through a
lazy import, where the first one to be imported sees the other half-initialised).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def package_modules(package_dir: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the package at ``package_dir`` (packages are their
    ``__init__.py``)."""
    top = package_dir.name
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if any(p == "__pycache__" for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((top, *parts))] = path
    return out


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """``[(base module, names imported from it)]`` of one import statement, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    return [(base, [alias.name for alias in node.names])]


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` (module docstring: what an import counts as)."""
    modules = package_modules(package_dir)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for base, names in _imported_names(node, module, is_package):
                targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
                if len(targets) < len(names) or not names:  # a name of the package itself, or `import base`
                    targets.append(base)
                for target in targets:
                    if target not in modules:
                        continue  # outside the package (torch, triton, ...)
                    parts = target.split(".")
                    entered = {".".join(parts[:i]) for i in range(1, len(parts))} - ancestors
                    graph[module].add(target)
                    graph[module].update(p for p in entered if p in modules)
        graph[module].discard(module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle ``[a, b, ..., a]`` of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


GRAPH = import_graph(ROOT / "mhla")


def test_no_import_circles_in_mhla():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_graph_sees_lazy_and_package_imports():
    """The graph holds the edges the checks rely on (a parsing slip would make every check pass)."""
    assert "mhla.ops.mhla.triton.backend" in GRAPH["mhla.ops.mhla.api"]  # lazy, inside _triton_backend
    assert "mhla.ops.mhla.triton" in GRAPH["mhla.ops.mhla.api"]  # entering the package runs its __init__
    assert {"mhla.ops.mhla.state", "mhla.ops.utils", "mhla.layouts"} <= GRAPH["mhla.ops.mhla.chunk"]
    assert {"mhla.ops.utils", "mhla.ops"} <= GRAPH["mhla.baselines"]  # `from .ops.utils import ...`


def test_shared_utils_import_nothing_of_the_ops():
    for module, targets in GRAPH.items():
        if module.startswith("mhla.ops.utils"):
            above = {t for t in targets if t.startswith("mhla.ops") and not t.startswith("mhla.ops.utils")}
            assert not above, f"{module} imports {sorted(above)}"


def test_kernels_do_not_reach_the_dispatcher():
    """The Triton package imports downwards (state, torch paths, utils), never the entry point above it. The one
    exception is ``compile_check``, a command-line tool that drives the public op to see which kernel variants it
    launches; nothing in the package imports it."""
    tool = "mhla.ops.mhla.triton.compile_check"
    assert not [m for m in GRAPH if tool in GRAPH[m]], f"{tool} is a tool: no module may import it"
    for module in GRAPH:
        if module.startswith("mhla.ops.mhla.triton") and module != tool:
            up = reachable(GRAPH, module) & {"mhla.ops.mhla.api", "mhla.ops.mhla", "mhla.ops", "mhla"}
            assert not up, f"{module} reaches {sorted(up)}"


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / next(iter(files)).split("/")[0]


def test_the_check_finds_circles(tmp_path):
    """The check fails on the two circles the ops had: a lazy import between two modules, and kernels that
    import back into the package whose entry point dispatches to them (through that package's __init__)."""
    lazy = _write_package(tmp_path / "a", {
        "pkg/__init__.py": "",
        "pkg/causal.py": "from .validation import check\nclass State: ...\n",
        "pkg/validation.py": """
            def check(state):
                from .causal import State

                return isinstance(state, State)
        """,
    })
    assert find_cycle(import_graph(lazy)) == ["pkg.causal", "pkg.validation", "pkg.causal"]
    packages = _write_package(tmp_path / "b", {
        "pkg/__init__.py": "from .ops import attention\n",
        "pkg/ops/__init__.py": "from .api import attention\n",
        "pkg/ops/api.py": "def attention():\n    from ..kernels import backend\n",
        "pkg/ops/causal.py": "",
        "pkg/kernels/__init__.py": "",
        "pkg/kernels/backend.py": "from ..ops.causal import State\n",
    })
    cycle = find_cycle(import_graph(packages))
    assert cycle is not None and "pkg.ops" in cycle and "pkg.kernels.backend" in cycle
    nested = _write_package(tmp_path / "c", {  # the layout of mhla.ops.mhla: kernels below the entry point
        "pkg/__init__.py": "from .op import attention\n",
        "pkg/op/__init__.py": "from .api import attention\n",
        "pkg/op/api.py": "from .state import State\ndef attention():\n    from .triton import backend\n",
        "pkg/op/state.py": "class State: ...\n",
        "pkg/op/triton/__init__.py": "",
        "pkg/op/triton/backend.py": "from ..state import State\n",
    })
    assert find_cycle(import_graph(nested)) is None


def _python(code: str, **env) -> str:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, **env}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout.strip()


def test_import_mhla_does_not_import_triton():
    """``import mhla`` (and a torch-path call) imports neither triton nor the kernels: they load lazily, on
    the first call that asks for them (``backend="triton"``, or ``"auto"`` on CUDA tensors)."""
    out = _python(
        "import sys, torch, mhla\n"
        "q = torch.rand(1, 8, 2, 4)\n"
        "mhla.mhla_attention(q, q, q, torch.ones(2, 2), 4, backend='torch')\n"
        "lazy = ('triton', 'mhla.ops.mhla.triton')\n"
        "print(sorted(m for m in sys.modules if m in lazy or m.startswith(tuple(p + '.' for p in lazy))))\n"
    )
    assert out == "[]"


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_without_triton_the_ops_fall_back_to_torch(interpret):
    """No triton installed (an import of it fails): ``auto`` resolves to torch and runs, ``triton`` is
    refused with the documented message; the same under ``TRITON_INTERPRET=1``."""
    out = _python(
        "import sys; sys.modules['triton'] = None  # `import triton` raises ImportError\n"
        "import torch, mhla\n"
        "from mhla.ops import BACKENDS, resolve_backend\n"
        "q = torch.rand(1, 8, 2, 4)\n"
        "assert resolve_backend('auto', q) == 'torch', resolve_backend('auto', q)\n"
        "o = mhla.mhla_attention(q, q, q, torch.ones(2, 2), 4, causal=True)\n"
        "try:\n"
        "    resolve_backend('triton', q)\n"
        "except ValueError as err:\n"
        "    print(BACKENDS, 'needs the fused kernels' in str(err), tuple(o.shape))\n",
        TRITON_INTERPRET=interpret,
    )
    assert out == "('auto', 'torch', 'reference', 'triton') True (1, 8, 2, 4)"
