"""results/params.md / .json (``make params``): every table cell's parameters and GMACs beside the paper's, with
the counting convention stated; a cell whose paper number is more than 3% off ours fails here unless the cell
marks it as an assumption (``assumptions.size`` / ``assumptions.flops``)."""

from __future__ import annotations

import json
import os

import pytest
from scripts.tables import config, params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEM = os.path.join(ROOT, "results", "params")


@pytest.fixture(scope="module")
def committed():
    with open(STEM + ".json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def cells():
    return params.all_cells()


def test_every_cell_is_in_the_table(committed, cells):
    rows = {(r["table"], r["cell"]) for r in committed["rows"]}
    assert rows == {(t, c.name) for t, c in cells}
    assert not [r for r in committed["rows"] if r.get("error")]


def test_no_paper_number_is_off_without_an_assumption(committed, cells):
    """The cells' current paper numbers and assumptions against the committed counts (a paper number or an
    assumption changed since `make params` is checked too)."""
    ours = {(r["table"], r["cell"]): r for r in committed["rows"]}
    checked, off = 0, []
    for table, cell in cells:
        r = ours[(table, cell.name)]
        paper = cell.paper or {}
        row = {"assumptions": {k: v for k, v in config.cell_assumptions(cell).items() if k in ("size", "flops")},
               "deviation": {"params": params.deviation(paper.get("params_M"), r["params_M"]),
                             "gmacs": params.deviation(paper.get("gflops"), (r.get("gmacs") or {}).get("no_attention"))}}
        checked += sum(v is not None for v in row["deviation"].values())
        if "OFF" in params.check(row):
            off.append(f"{table}/{cell.name}: {params.check(row)}")
        assert r["check"] == params.check(row), f"{table}/{cell.name}: results/params.json is stale (make params)"
    assert not off, off
    assert checked >= 25  # Table 2's params and GFLOPs, Tables 4, 5, 6's sizes


def test_the_check_can_fail():
    def row(paper_m, ours_m, **notes):
        return {"assumptions": notes, "deviation": {"params": params.deviation(paper_m, ours_m), "gmacs": None}}

    assert params.check(row(6.5, 7.25)) == "params 10.8%: OFF, not marked"  # InLine with DeiT-T's 3 heads
    assert params.check(row(6.1, 6.37)) == "params 4.9%: OFF, not marked"  # FLatten's encoding at 256 tokens
    assert params.check(row(6.5, 7.25, size="why")) == "params 10.8%: assumption (size)"
    assert params.check(row(6.5, 6.51)) == "ok" and params.check(row(None, 6.5)) == ""
    assert params.deviation(1.1, 1.074) == 0.0  # the paper prints one decimal: 1.074 reads 1.1
    assert params.deviation(340, 349.6) == pytest.approx(10 / 340)


def test_committed_counts_are_current(committed):
    """A few cells counted again now: the committed numbers are what the command gives."""
    rows = {(r["table"], r["cell"]): r for r in committed["rows"]}
    for table, name in (("2", "deit_t_inline"), ("2", "deit_t_focused"), ("2", "vlt_t_mhla"), ("6", "gdn")):
        cell = next(c for t, c in params.all_cells([table]) if c.name == name)
        cfg, _ = config.compose(cell.overrides)
        fresh = params.count_model(cfg)
        assert fresh["params"] / 1e6 == pytest.approx(rows[(table, name)]["params_M"], rel=1e-9), name
        assert fresh["gmacs"]["no_attention"] == pytest.approx(rows[(table, name)]["gmacs"]["no_attention"],
                                                               rel=1e-6), name
    # the Table 2 baselines are the paper's models
    assert rows[("2", "deit_t_inline")]["params_M"] == pytest.approx(6.51, abs=0.01)
    assert rows[("2", "deit_t_focused")]["params_M"] == pytest.approx(6.22, abs=0.01)


def test_the_file_states_command_machine_and_convention():
    with open(STEM + ".md") as f:
        text = f.read()
    assert "Command: `make params`" in text and "Machine: {" in text
    assert "without the attention matmuls" in text and "leave the attention matmuls out" in text
    assert "| table | cell | row | paper params (M) | ours params (M) | paper GFLOPs |" in text
    assert "Cells off by more than 3% without an assumption: none." in text
