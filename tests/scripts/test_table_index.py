"""Every list of the paper tables comes from the table registry (``scripts/tables/registry.py``): the README's
index is what ``--list`` prints, ``make help`` prints the registry's lines, and the Makefile's one
``reproduce-%`` rule reaches every table with the make variables each one takes."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from scripts import reproduce_table as rt
from scripts.tables import builders, registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_make = pytest.mark.skipif(not shutil.which("make"), reason="needs make")


def make_n(*args: str) -> str:
    """The ``reproduce_table.py`` line that ``make -n <args>`` would run, spaces collapsed."""
    out = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return " ".join(next(line for line in out.splitlines() if "reproduce_table.py" in line).split())


def test_readme_index_is_the_registrys():
    text = open(registry.README, encoding="utf-8").read()
    assert registry.readme_with_index(text) == text, (
        "README.md's paper-tables index differs from scripts/tables/registry.py: run "
        "python scripts/reproduce_table.py --update-readme")
    block = text.split(registry.README_BEGIN)[1].split(registry.README_END)[0]
    assert block.strip() == registry.index_table()
    for spec in registry.TABLES.values():  # one row per table, with its command and results file
        row = next(line for line in block.splitlines() if line.startswith(f"| {spec.id} |"))
        assert registry.make_target(spec) in row and registry.results_files(spec).replace("|", "\\|") in row


def test_update_readme_rewrites_only_the_index(tmp_path):
    text = open(registry.README, encoding="utf-8").read()
    stale = tmp_path / "README.md"
    stale.write_text(text.replace("| 13 |", "| 13 (stale) |"), encoding="utf-8")
    assert registry.update_readme(str(stale)) is True
    assert stale.read_text(encoding="utf-8") == registry.readme_with_index(text)
    assert registry.update_readme(str(stale)) is False
    with pytest.raises(ValueError, match="paper tables"):
        registry.readme_with_index("# a README without the markers\n")


def test_list_and_make_help_print_the_registry(capsys):
    assert rt.main(["--list"]) == 0
    assert capsys.readouterr().out.strip() == registry.index_table()
    assert rt.main(["--make-help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for spec in registry.TABLES.values():
        line = next(line for line in lines if line.startswith(registry.make_target(spec) + " "))
        assert spec.title in line and registry.results_files(spec) in line


@needs_make
def test_make_help_shows_the_registrys_lines():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert registry.make_help() in out


@needs_make
def test_every_table_is_reachable_through_make():
    for spec in registry.TABLES.values():
        line = make_n(registry.make_target(spec).split()[-1], "SCALE=mini", "EXTRA=a=1 b=2")
        assert f"scripts/reproduce_table.py --table {spec.id} --scale mini -- " in line and line.endswith(" a=1 b=2")
    assert make_n("mqar", "SCALE=large").endswith("--table mqar --scale large --")


@needs_make
def test_the_tables_with_their_own_variables_keep_them():
    """What the README and ``make help`` document for Tables 5, 6, 8, 11, 14 reaches the runner."""
    assert make_n("reproduce-table5", "WAN_PATH=/w", "VIDEO_DATA=/d", "RUN=--run").endswith(
        "--table 5 --scale full -- --wan /w --data /d --run")
    assert make_n("reproduce-table6", "CKPT_DIR=/c", "LM_EVAL_DATA=/e", "WIKITEXT=/wt", "LAMBADA=/l").endswith(
        "--table 6 --scale full -- --ckpt-dir /c --lm-eval-data /e --wikitext /wt --lambada /l")
    assert make_n("reproduce-table6").endswith("--table 6 --scale full -- --ckpt-dir checkpoints/lm")
    assert make_n("reproduce-table8", "CKPT_DIR=/c", "LONGBENCH=/lb").endswith(
        "--table 8 --scale full -- --ckpt-dir /c --longbench /lb")
    assert make_n("reproduce-table11", "SEEDS=0 1 2", "REF=256=r.npz").endswith(
        "--table 11 --scale full --seeds 0 1 2 --fid-ref 256=r.npz --")
    assert make_n("reproduce-table14", "EXTRA=--bench-batch 8").endswith(
        "--table 14 --scale full -- --bench-batch 8")


def test_a_benchmark_tables_arguments_are_its_options(monkeypatch):
    """``make reproduce-table14 EXTRA='--bench-batch 8'`` puts the option after ``--``: a benchmark table takes
    no Hydra overrides, so the runner reads them as its own options."""
    seen = []
    monkeypatch.setattr(builders, "run_bench_table", lambda spec, args: seen.append((spec.id, args)) or 0)
    assert rt.main(["--table", "14", "--scale", "mini", "--", "--bench-batch", "8", "--device", "cpu"]) == 0
    (table, args), = seen
    assert table == "14" and args.bench_batch == 8 and args.device == "cpu" and args.extra == []
    with pytest.raises(SystemExit):  # an option it does not have is refused, not ignored
        rt.main(["--table", "14", "--", "--no-such-option"])
