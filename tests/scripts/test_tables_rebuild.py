"""The committed tables are what their builders write from the committed data, byte for byte.

Seed grids: every ``configs/grid/*.yaml`` whose ``<out>_runs/`` is committed is tabulated again from those runs
by :mod:`scripts.tables.seed_grid`, with the command line :mod:`scripts.run_seed_grid` gives it
(:func:`scripts.run_seed_grid.table_argv`), into a temporary folder laid out like the checkout (its ``<out>_runs``
and ``<out>_reading.md`` linked to the committed ones, so the paths written into the table are the same), and the
new ``<out>.md`` / ``.json`` must equal the committed ones. The .png is not drawn (its bytes depend on matplotlib).
A table edited by hand, a run record changed after the table was written, or a table writer that no longer writes
what is committed fails here; the fix is ``python scripts/run_seed_grid.py <grid> --table-only``.

Tables whose runs are not committed (their checkpoints or run folders are not in the repository) but whose .json
is: :data:`FROM_JSON`, each rewritten by its builder's own rewrite option from the committed .json (and the reading
file it names), which evaluates nothing, and compared in the same way. A reading edited without writing the table
again fails here (the table's reading section is the reading file's text). :data:`NOT_REBUILT` names the committed
tables that no builder of today writes again from what is committed, and why.
"""

from __future__ import annotations

import difflib
import glob
import importlib
import json
import os
import shutil
import sys
from dataclasses import dataclass

import pytest

import tasks.common.results
from scripts import run_seed_grid as rsg
from scripts.tables import seed_grid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRIDS = sorted(glob.glob(os.path.join(ROOT, "configs", "grid", "*.yaml")))


def first_difference(committed: str, rebuilt: str, name: str) -> str:
    """The first lines of a unified diff between a committed file and its rebuild (for the failure message)."""
    diff = difflib.unified_diff(committed.splitlines(True), rebuilt.splitlines(True), f"committed {name}",
                                f"rebuilt {name}", n=1)
    return "".join(list(diff)[:30])


def rebuild_grid_table(grid_path: str, where: str, runs: str | None = None) -> str:
    """Write the grid's table under ``where`` (a stand-in for the checkout's root) from ``runs`` (default: the
    committed ``<out>_runs``), as ``run_seed_grid.py <grid> --table-only`` writes it; returns its stem there."""
    grid = rsg.load_grid(grid_path)
    out = grid["out"]
    os.makedirs(os.path.join(where, os.path.dirname(out)), exist_ok=True)
    os.symlink(runs or os.path.join(ROOT, f"{out}_runs"), os.path.join(where, f"{out}_runs"))
    reading = f"{out}_reading.md"
    if os.path.exists(os.path.join(ROOT, reading)):
        os.symlink(os.path.join(ROOT, reading), os.path.join(where, reading))
    notes = f"@{reading}" if os.path.exists(os.path.join(ROOT, reading)) else ""
    here = os.getcwd()
    os.chdir(where)  # the table's paths (its runs, its stem) are relative to the checkout, as the grid's are
    try:
        seed_grid.main(rsg.table_argv(grid, grid_path, notes))
    finally:
        os.chdir(here)
    return os.path.join(where, out)


def committed_grids() -> list[str]:
    return [p for p in GRIDS if os.path.isdir(os.path.join(ROOT, f"{rsg.load_grid(p)['out']}_runs"))]


@pytest.fixture
def no_png(monkeypatch):
    """The table without its figure: the .md and .json are compared, the picture is not drawn."""
    monkeypatch.setattr(seed_grid, "plot", lambda *args, **kwargs: None)


@pytest.mark.parametrize("path", committed_grids(), ids=os.path.basename)
def test_seed_grid_table_rebuilds_from_its_committed_runs(path, tmp_path, no_png):
    stem = rebuild_grid_table(path, str(tmp_path))
    out = rsg.load_grid(path)["out"]
    for ext in (".md", ".json"):
        with open(os.path.join(ROOT, out + ext)) as f:
            committed = f.read()
        with open(stem + ext) as f:
            rebuilt = f.read()
        assert rebuilt == committed, (f"{out}{ext} is not what its committed runs give (python scripts/"
                                      f"run_seed_grid.py {os.path.relpath(path, ROOT)} --table-only):\n"
                                      + first_difference(committed, rebuilt, out + ext))
    assert not os.path.exists(stem + ".png")


def test_a_changed_run_changes_the_rebuilt_table(tmp_path, no_png):
    """The comparison can fail: one run's final metric changed in a copy of the runs gives another table."""
    path = os.path.join(ROOT, "configs", "grid", "mqar_n512.yaml")
    out = rsg.load_grid(path)["out"]
    runs = tmp_path / "runs"
    shutil.copytree(os.path.join(ROOT, f"{out}_runs"), runs)
    record_path = runs / "linear_s0" / "run.json"
    record = json.loads(record_path.read_text())
    before = record["metrics"]["acc"]
    record["metrics"]["acc"] = before + 0.01  # one point more
    record_path.write_text(json.dumps(record))
    stem = rebuild_grid_table(path, str(tmp_path / "checkout"), str(runs))
    with open(os.path.join(ROOT, out + ".md")) as f:
        committed = f.read()
    with open(stem + ".md") as f:
        rebuilt = f.read()
    assert rebuilt != committed
    assert f"s0: {100 * (before + 0.01):.1f}, s1" in rebuilt and f"s0: {100 * before:.1f}, s1" in committed


# ------------------------------------------------------------------------------ tables rewritten from their .json
@dataclass(frozen=True)
class FromJson:
    """A committed table (``stem``.md / .json) and the rewrite that writes it from its .json: ``module``'s
    ``entry`` with ``argv`` (``{tmp}``: the temporary checkout), run in a temporary checkout that holds a copy of
    the .json and links to the committed ``reads`` (the reading files the rewrite takes)."""
    stem: str
    module: str
    entry: str
    argv: tuple[str, ...]
    reads: tuple[str, ...] = ()
    root_default: bool = False  # the builder's default --out is under its module's ROOT: point ROOT at {tmp}


def _recorded_argv(stem: str) -> tuple[str, ...]:
    """The command line (``argv``) stored in a run_mqar table's .json: the rewrite that wrote the committed file."""
    with open(os.path.join(ROOT, stem + ".json")) as f:
        return tuple(json.load(f)["argv"])


def _mqar(stem: str, reading: str) -> FromJson:
    return FromJson(stem, "scripts.tables.mqar", "main", _recorded_argv(stem), (reading,))


def _extrapolation(stem: str) -> FromJson:
    return FromJson(stem, "scripts.mqar_extrapolation", "main",
                    ("--plot-only", "--out", stem, "--notes", f"@{stem}_reading.md"), (f"{stem}_reading.md",))


FROM_JSON = [
    _mqar("results/mqar", "results/mqar/conv_reading.md"),
    _mqar("results/mqar/no_conv", "results/mqar/no_conv_reading.md"),
    _mqar("results/mqar/lr1e-3", "results/mqar/lr1e-3_reading.md"),
    _extrapolation("results/mqar/extrapolation_n256"),
    _extrapolation("results/mqar/extrapolation_n512"),
    FromJson("results/table2_mini", "scripts.tables.proxy2", "main_proxy2",
             ("--plot-only", "--out", "results/table2_mini", "--notes", "@results/table2_mini_reading.md"),
             ("results/table2_mini_reading.md",)),
    FromJson("results/table5_mini", "scripts.tables.table5_mini", "main",  # the argv its md names as the rewrite
             ("--plot-only", "--notes", "@results/video/table5_mini_reading.md"),
             ("results/video/table5_mini_reading.md",), root_default=True),
    FromJson("results/table3_mini", "scripts.reproduce_table", "main",
             ("--table", "3a", "--scale", "mini", "--rewrite", "--results-dir", "{tmp}/results")),
    FromJson("results/table11_mini", "scripts.reproduce_table", "main",
             ("--table", "11", "--scale", "mini", "--rewrite", "--results-dir", "{tmp}/results")),
]

# committed table -> why no test writes it again from what is committed
NOT_REBUILT = {
    "results/mqar_mini": "its header was written by hand after the runs (\"Made before the task's current defaults\"), "
                         "and its .json keeps no --out or machine: the rewrite gives another header",
    "results/conversion/mnist": "its \"Notes on how this file was made\" section is hand-written under the generated "
                                "table, and the builder has moved since (tasks/conversion -> scripts/tables)",
    "results/conversion/lm_mini": "as results/conversion/mnist",
    "results/auto_m": "its sweep and benchmark records are in outputs/auto_m (not committed)",
}


def _without_pictures(monkeypatch) -> None:
    """Every table writer imported so far writes its .md and .json, not its .png (matplotlib's bytes vary)."""
    real = tasks.common.results.write_result

    def write_result(stem, md, record, plot=None, **kwargs):
        return real(stem, md, record, None, **kwargs)

    monkeypatch.setattr(tasks.common.results, "write_result", write_result)
    for name, module in list(sys.modules.items()):
        if name.startswith("scripts") and getattr(module, "write_result", None) is real:
            monkeypatch.setattr(module, "write_result", write_result)


def rewrite_from_json(case: FromJson, tmp: str, monkeypatch) -> str:
    """Run ``case``'s rewrite in the temporary checkout ``tmp``; returns the table's stem there."""
    module = importlib.import_module(case.module)
    _without_pictures(monkeypatch)
    for path in (case.stem + ".json", *case.reads):
        os.makedirs(os.path.join(tmp, os.path.dirname(path)), exist_ok=True)
    shutil.copy(os.path.join(ROOT, case.stem + ".json"), os.path.join(tmp, case.stem + ".json"))
    for path in case.reads:
        os.symlink(os.path.join(ROOT, path), os.path.join(tmp, path))
    if case.root_default:
        monkeypatch.setattr(module, "ROOT", tmp)
    monkeypatch.chdir(tmp)
    getattr(module, case.entry)([a.replace("{tmp}", tmp) for a in case.argv])
    return os.path.join(tmp, case.stem)


@pytest.mark.parametrize("case", FROM_JSON, ids=lambda c: c.stem)
def test_table_rewrites_from_its_committed_json(case, tmp_path, monkeypatch):
    stem = rewrite_from_json(case, str(tmp_path), monkeypatch)
    for ext in (".md", ".json"):
        with open(os.path.join(ROOT, case.stem + ext)) as f:
            committed = f.read()
        with open(stem + ext) as f:
            rebuilt = f.read()
        assert rebuilt == committed, (f"{case.stem}{ext} is not what {case.module} writes from its .json ("
                                      f"{' '.join(case.argv)}):\n"
                                      + first_difference(committed, rebuilt, case.stem + ext))
    assert not os.path.exists(stem + ".png")


def test_every_listed_table_is_committed():
    """The lists name committed tables (a table renamed or removed is taken off them)."""
    for stem in [c.stem for c in FROM_JSON] + list(NOT_REBUILT):
        assert os.path.exists(os.path.join(ROOT, stem + ".md")), stem
    assert not {c.stem for c in FROM_JSON} & set(NOT_REBUILT)
