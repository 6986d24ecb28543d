"""docs/adding_a_table.md, followed: its experiment configs are the repository's (``examples/configs/``), and
with them in the configs plus its one registry entry, the new table is in ``--list``, in ``make help``, in the
README's index, reachable through ``make reproduce-table99``, and runs end to end (``train.py`` stood in for:
each cell's command and the results file with the paper's number beside ours are checked, not the training)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from scripts import reproduce_table as rt
from scripts.tables import config, registry, runner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "adding_a_table.md")
EXAMPLE = os.path.join(ROOT, "examples", "configs", "experiment", "table99")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", open(DOC).read(), flags=re.S)


def the_entry() -> registry.Table:
    """The page's registry entry (its one ``python`` block: a ``Table(...)`` line of ``TABLES``)."""
    (block,) = _blocks("python")
    return eval(block.strip().rstrip(","), {"Table": registry.Table})  # noqa: S307  (the page's own text)


def test_the_page_shows_the_example_configs_as_they_are():
    shown = _blocks("yaml")
    for name in sorted(os.listdir(EXAMPLE)):
        assert open(os.path.join(EXAMPLE, name)).read() in shown, f"docs/adding_a_table.md shows another {name}"
    assert the_entry().id == "99" and the_entry().folder == "table99"


@pytest.fixture
def table99(tmp_path, monkeypatch):
    """The repository's configs with the example's experiment folder added (a copy made of links), and the
    page's entry in ``TABLES``: what a contributor has after following the page."""
    configs = tmp_path / "configs"
    configs.mkdir()
    for entry in os.listdir(registry.CONFIGS):
        if entry != "experiment":
            (configs / entry).symlink_to(os.path.join(registry.CONFIGS, entry))
    (configs / "experiment").mkdir()
    for entry in os.listdir(registry.EXPERIMENTS):
        (configs / "experiment" / entry).symlink_to(os.path.join(registry.EXPERIMENTS, entry))
    shutil.copytree(EXAMPLE, configs / "experiment" / "table99")
    monkeypatch.setattr(registry, "CONFIGS", str(configs))
    monkeypatch.setattr(registry, "EXPERIMENTS", str(configs / "experiment"))
    monkeypatch.setattr(config, "CONFIGS", str(configs))
    spec = the_entry()
    monkeypatch.setitem(registry.TABLES, spec.id, spec)
    return spec


def test_the_new_table_is_listed_everywhere(table99, capsys):
    assert rt.main(["--list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 99 |"))
    assert "`configs/experiment/table99/`" in row and "`make reproduce-table99 [SCALE=mini]`" in row
    assert "`results/table99[_mini].md`" in row
    assert row in registry.readme_with_index(open(registry.README).read())  # the README row
    assert rt.main(["--make-help"]) == 0
    assert re.search(r"^make reproduce-table99 +\[SCALE=mini\] - Table 99: example", capsys.readouterr().out,
                     re.MULTILINE)
    assert [c.name for c in registry.table_cells("99")] == ["deit_t_cosine", "deit_t_mhla"]


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_reaches_the_new_table():
    out = subprocess.run(["make", "-n", "reproduce-table99", "SCALE=mini", "EXTRA=trainer.max_steps=2"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "scripts/reproduce_table.py --table 99 --scale mini -- trainer.max_steps=2" in " ".join(out.split())


def test_the_new_table_runs_and_writes_its_results(table99, tmp_path, monkeypatch):
    runs = []

    def train(overrides, threads=None, launcher=None):  # stands in for train.py
        runs.append(overrides)
        return {"command": "python train.py " + " ".join(overrides), "seconds": 1.0,
                "metrics": {"top1": 0.5 + 0.1 * len(runs)}, "params_M": 1.0}

    monkeypatch.setattr(runner, "run_training", train)
    assert rt.main(["--table", "99", "--scale", "mini", "--results-dir", str(tmp_path / "results"),
                    "--", "trainer.max_steps=2"]) == 0
    assert [r[0] for r in runs] == ["experiment=table99/deit_t_cosine", "experiment=table99/deit_t_mhla"]
    assert all("scale=mini/deit_t" in r and "trainer.max_steps=2" in r for r in runs)
    text = (tmp_path / "results" / "table99_mini.md").read_text()
    mhla = next(line for line in text.splitlines() if "DeiT-T MHLA" in line)
    assert "75.8" in mhla and "70.0" in mhla  # the paper's number beside ours (the second run: top-1 0.7)
