"""The paper's numbers quoted in the configs and results files are docs/paper_tables.md's (issue 47).

docs/paper_tables.md is the source: every markdown table of a ``## Table <id>`` section that has a ``cell`` column is
read; each other column whose header names a ``paper:`` key in backticks (``paper top-1 (`top1`)``) holds that cell's
number, blank where the paper's number is not sourced. For every such table:

- each cell's ``paper:`` block (its experiment config; Table 3b's extra cell, Tables 7a / 7b's derived cells and
  Table 14's benchmark from scripts/tables/registry.py) has the same number under that key, and none where the
  docs' cell is blank;
- every cell of the table appears in the docs, and every number of its ``paper:`` blocks is in a column of the docs;
- the results files that print the paper beside ours (``results/table6|8|5|3_mini.json``, ``results/params.json``)
  carry the same blocks.

The paper-silent choices the Table 6 / 8 models make (release layer, mixing-matrix weight decay, token budget) are
config values whose ``assumptions:`` entries reach those results files.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import yaml

from scripts.tables import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "paper_tables.md")
NOT_NUMBERS = ("table", "row")  # the ``paper:`` keys that are labels, not numbers
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# ------------------------------------------------------------------------------------------ the docs' tables
def doc_tables() -> dict[str, list[tuple[list[str], list[list[str]]]]]:
    """``{table id: [(header, rows), ...]}``: the markdown tables of each ``## Table <id>`` section."""
    out: dict[str, list] = {}
    table = None
    current: list[list[str]] | None = None
    with open(DOC) as f:
        lines = f.read().splitlines()
    for line in lines + [""]:
        heading = re.match(r"^## Table (\w+)\s*$", line)
        if line.startswith("## "):
            table = heading.group(1) if heading else None
        if line.startswith("|") and table:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if current is None:
                current = [cells]
            elif not set("".join(cells)) <= set("-: "):
                current.append(cells)
            continue
        if current is not None:
            out.setdefault(table, []).append((current[0], current[1:]))
            current = None
    return out


def number(text: str):
    """The number of a docs cell (``**75.8**``, ``75.8 (= ...)``), or None when it is blank."""
    m = NUMBER.search(text.replace("**", ""))
    return float(m.group()) if m else None


def doc_numbers(table: str) -> dict[str, dict[str, float | None]]:
    """``{cell: {paper key: number or None}}`` of the docs' tables with a ``cell`` column in ``## Table <table>``."""
    out: dict[str, dict] = {}
    for header, rows in doc_tables().get(table, []):
        if "cell" not in header:
            continue
        col = header.index("cell")
        keys = {i: re.search(r"`([A-Za-z_0-9]+)`", h).group(1) for i, h in enumerate(header)
                if i != col and re.search(r"`([A-Za-z_0-9]+)`", h)}
        for row in rows:
            names = re.findall(r"`([^`]+)`", row[col])
            assert len(names) == 1, f"Table {table}: one cell per row in the `cell` column, got {row[col]!r}"
            assert names[0] not in out, f"Table {table}: cell {names[0]} is listed twice"
            out[names[0]] = {key: number(row[i]) for i, key in keys.items()}
    return out


# ------------------------------------------------------------------------------------------ the paper blocks
def config_paper(path: str) -> dict:
    with open(path) as f:
        return (yaml.safe_load(f) or {}).get("paper") or {}


def paper_blocks(table: str) -> dict[str, dict]:
    """``{cell: paper block}`` where the configs and the registry keep them."""
    if table in ("5", "6", "8"):
        return {os.path.splitext(os.path.basename(p))[0]: config_paper(p)
                for p in sorted(glob.glob(os.path.join(ROOT, "configs", "experiment", f"table{table}", "*.yaml")))}
    if table == "14":
        b = registry.BENCH["14"]
        return {f"m{m}": {"latency_ms": v, "memory_gb": b["paper_memory_gb"][m]} for m, v in b["paper"].items()}
    return {c.name: c.paper for c in registry.table_cells(table)}


TABLES = ["2", "3a", "3b", "4", "5", "6", "7a", "7b", "8", "11", "12", "13", "14"]


def numbers_of(block: dict) -> dict:
    return {k: v for k, v in block.items() if k not in NOT_NUMBERS and v is not None}


def test_the_docs_have_a_checked_table_for_every_paper_table():
    tables = doc_tables()
    for table in TABLES:
        assert doc_numbers(table), f"docs/paper_tables.md: ## Table {table} has no table with a `cell` column"
    assert set(TABLES) <= set(tables)


@pytest.mark.parametrize("table", TABLES)
def test_config_paper_blocks_are_the_docs_numbers(table):
    docs, blocks = doc_numbers(table), paper_blocks(table)
    assert sorted(docs) == sorted(blocks), (f"Table {table}: the docs' cells {sorted(docs)} are not the table's "
                                            f"cells {sorted(blocks)}")
    columns = {k for row in docs.values() for k in row}
    wrong = []
    for cell, quoted in docs.items():
        ours = numbers_of(blocks[cell])
        missing = sorted(set(ours) - columns)
        if missing:
            wrong.append(f"{cell}: paper {missing} has no column in the docs")
        for key, value in quoted.items():
            have = ours.get(key)
            if value is None and have is not None:
                wrong.append(f"{cell}.{key}: the config quotes {have}, the docs leave it blank")
            elif value is not None and (have is None or abs(float(have) - value) > 1e-9):
                wrong.append(f"{cell}.{key}: the docs say {value}, the config {have}")
    assert not wrong, f"Table {table} (docs/paper_tables.md is the source):\n" + "\n".join(wrong)


def test_a_changed_number_is_caught(monkeypatch):
    """The comparison can fail: one number changed in a config's block is reported."""
    real = paper_blocks("2")
    changed = {k: dict(v) for k, v in real.items()}
    changed["deit_t_mhla"]["top1"] = 75.9
    monkeypatch.setattr(__import__(__name__), "paper_blocks", lambda table: changed)
    with pytest.raises(AssertionError, match="deit_t_mhla.top1: the docs say 75.8, the config 75.9"):
        test_config_paper_blocks_are_the_docs_numbers("2")


# ---------------------------------------------------------------------------------------- the results files
RESULTS = {"6": "results/table6.json", "8": "results/table8.json", "5": "results/table5.json",
           "3a": "results/table3_mini.json"}


@pytest.mark.parametrize("table", sorted(RESULTS))
def test_results_file_quotes_the_configs(table):
    path = os.path.join(ROOT, RESULTS[table])
    with open(path) as f:
        rows = json.load(f)["rows"]
    blocks = paper_blocks(table)
    for row in rows:
        name = row.get("cell") or row.get("row")
        assert numbers_of(row["paper"]) == numbers_of(blocks[name]), (
            f"{RESULTS[table]} row {name}: its paper numbers are not its config's (regenerate it)")
        assert row["paper"].get("row") == blocks[name].get("row"), f"{RESULTS[table]} row {name}: stale label"


def test_params_table_quotes_the_configs():
    with open(os.path.join(ROOT, "results", "params.json")) as f:
        record = json.load(f)
    rows = record["rows"] if isinstance(record, dict) else record
    checked = 0
    for row in rows:
        table, cell = str(row.get("table")), row.get("cell")
        if table not in ("2", "3a", "4", "5", "6", "13"):
            continue
        block = paper_blocks(table).get(cell)
        if block is None:
            continue
        for key in ("params_M", "gflops"):
            if f"paper_{key}" in row:
                assert row[f"paper_{key}"] == block.get(key), f"results/params.json {cell} paper {key}"
                checked += 1
    assert checked


# ------------------------------------------------------------------------ paper-silent choices reach the results
@pytest.mark.parametrize("stem", ["results/table6.md", "results/table8.md"])
def test_lm_assumptions_reach_the_results_file(stem):
    """The LM's release choices (init, RoPE placement, gate), the mixing matrix's weight decay and the token-budget
    conflict are config values with ``assumptions:`` entries, printed in the Table 6 / 8 files."""
    from scripts.tables.config import compose  # noqa: PLC0415

    cfg, _ = compose(["experiment=table6/mhla"])
    assert cfg.attn.mixing_init == "uniform" and cfg.attn.rope == "after_feature_map" and cfg.attn.gate is True
    assert cfg.optim.mixing_weight_decay == 0.0
    with open(os.path.join(ROOT, stem)) as f:
        text = f.read()
    for topic in ("token_budget", "mixing_weight_decay", "mixing_init", "rope", "gate"):
        assert f"({topic}): ASSUMPTION" in text, f"{stem} does not print the assumption {topic} (regenerate it)"
        assert topic in cfg.assumptions


def test_mixing_weight_decay_default_is_stated():
    """``optim.mixing_weight_decay``: 0 by default (tasks/common/optim.py), an assumption where the rest decays."""
    from scripts.tables.config import compose  # noqa: PLC0415
    from tasks.common.optim import GROUP_WEIGHT_DECAY, group_settings  # noqa: PLC0415

    assert GROUP_WEIGHT_DECAY == 0.0 and group_settings({}, "mixing")["weight_decay"] == 0.0
    assert group_settings({"mixing_weight_decay": 0.05}, "mixing")["weight_decay"] == 0.05
    with pytest.raises(ValueError, match="mixing_weight_decay"):
        group_settings({"mixing_weight_decay": -1.0}, "mixing")
    for overrides in (["experiment=table2/deit_t_mhla"], ["experiment=table6/mhla"]):
        cfg, _ = compose(overrides)
        assert cfg.optim.weight_decay > 0 and cfg.optim.mixing_weight_decay == 0.0
        assert "mixing_weight_decay" in cfg.assumptions
