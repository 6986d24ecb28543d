"""``sys.path`` is edited only where a program starts: ``train.py``, ``eval.py``, ``tests/conftest.py``, and
the command-line scripts ``scripts/<name>.py`` by their one two-line guard (run as a file, the checkout's root
takes the place of ``scripts/`` on the path). Everything else is imported through the installed packages
(``mhla``, ``models``, ``tasks``, ``scripts``: ``pip install -e .``) and runs with ``python -m``
(``tasks.conversion.distill``, ``scripts.tables.<name>``)."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("mhla", "models", "tasks", "scripts", "tests", "examples")
ENTRY_POINTS = {"train.py", "eval.py", os.path.join("tests", "conftest.py")}
#: the guard of a command-line script, as ``ast.unparse`` writes it
SCRIPT_GUARD = ("if __name__ == '__main__' and (not __package__):\n"
                "    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))")


def python_files():
    yield from (f for f in os.listdir(ROOT) if f.endswith(".py"))
    for top in SOURCES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            yield from (os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py"))


def is_sys_path(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def sys_path_edits(tree: ast.AST) -> list[ast.stmt]:
    """The statements that change ``sys.path``: a method call on it (``insert``, ``append``, ...), or an
    assignment to it or to one of its items."""
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Attribute) and is_sys_path(node.value.func.value):
            edits.append(node)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if is_sys_path(target) or (isinstance(target, ast.Subscript) and is_sys_path(target.value)):
                    edits.append(node)
    return edits


def script_guards(tree: ast.Module) -> list[ast.stmt]:
    """The top-level ``if`` statements of a module that are exactly :data:`SCRIPT_GUARD`."""
    return [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node) == SCRIPT_GUARD]


def edits_outside_entry_points(path: str, root: str = ROOT) -> list[str]:
    """``file:line`` of every ``sys.path`` edit of ``path`` that is not an entry point's: in a command-line
    script (``scripts/<name>.py``), any edit but the guard's."""
    if path in ENTRY_POINTS:
        return []
    with open(os.path.join(root, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    allowed = set()
    if os.path.dirname(path) == "scripts":
        allowed = {id(stmt) for guard in script_guards(tree) for stmt in guard.body}
    return [f"{path}:{e.lineno}" for e in sys_path_edits(tree) if id(e) not in allowed]


def test_sys_path_is_edited_only_by_the_entry_points():
    found = [where for path in python_files() for where in edits_outside_entry_points(path)]
    assert not found, f"sys.path edited outside the entry points: {found}"


@pytest.mark.parametrize("code, path, found", [
    ("import sys\nsys.path.insert(0, '/x')\n", os.path.join("tasks", "x.py"), True),
    ("import sys\nsys.path[0] = '/x'\n", os.path.join("mhla", "x.py"), True),
    ("import sys\nsys.path += ['/x']\n", os.path.join("tests", "helpers", "x.py"), True),
    ("import sys\nprint(sys.path)  # sys.path.insert(0, ROOT)\n", os.path.join("tasks", "x.py"), False),
    ("import os, sys\n" + SCRIPT_GUARD + "\n", os.path.join("scripts", "x.py"), False),
    ("import os, sys\n" + SCRIPT_GUARD + "\n", os.path.join("scripts", "tables", "x.py"), True),
    ("import os, sys\n" + SCRIPT_GUARD.replace("sys.path[0] =", "sys.path.insert(0,").replace("__file__)))",
                                                 "__file__))))") + "\n", os.path.join("scripts", "x.py"), True),
])
def test_the_check_finds_an_edit(tmp_path, code, path, found):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(code)
    assert bool(edits_outside_entry_points(path, str(tmp_path))) is found


@pytest.mark.parametrize("command", [
    [os.path.join("scripts", "run_seed_grid.py"), "--help"],
    ["-m", "scripts.run_seed_grid", "--help"],
    ["-m", "scripts.tables.seed_grid", "--help"],
    ["-m", "tasks.conversion.distill", "--help"],
])
def test_programs_without_the_edits_start_from_another_folder(tmp_path, command):
    """The files that lost their ``sys.path`` edits start from a folder outside the checkout (the packages come
    from the install)."""
    if not command[0].startswith("-"):
        command = [os.path.join(ROOT, command[0]), *command[1:]]
    out = subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
