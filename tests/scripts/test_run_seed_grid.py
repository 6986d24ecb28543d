"""scripts/run_seed_grid.py: a tiny grid runs end to end. (That each grid file composes the config of its committed
runs, key by key, is tests/scripts/test_grid_configs.py; that its table rebuilds from them, test_tables_rebuild.py.)"""

from __future__ import annotations

import json
import os

import pytest

from scripts import run_seed_grid as rsg


def test_seeds_of_and_filters():
    grid = {"variants": {"a": ["x=1"], "b": ["x=2"]}, "seeds": [0, 1, 2], "seeds_of": {"b": [0]}}
    assert rsg.runs_of(grid) == [("a", 0), ("b", 0), ("a", 1), ("a", 2)]
    assert rsg.runs_of(grid, ["b"]) == [("b", 0)]
    assert rsg.runs_of(grid, seeds=[1, 2]) == [("a", 1), ("a", 2)]
    with pytest.raises(SystemExit):
        rsg.runs_of(grid, ["c"])
    with pytest.raises(SystemExit, match=r"seeds \[1\]"):  # b has seed 0 only: asking it for 1 would train nothing
        rsg.runs_of(grid, ["b"], seeds=[1])
    with pytest.raises(SystemExit, match=r"seeds \[3\]"):
        rsg.runs_of(grid, seeds=[2, 3])


def test_seed_placeholder_in_overrides():
    """``{seed}`` in a grid override becomes each run's seed (a grid that continues another grid's runs)."""
    grid = {"common": ["task=mqar"], "variants": {"a": ["trainer.init_from=runs/a_s{seed}"]}}
    assert rsg.run_overrides(grid, "a", 2, "out")[:3] == ["task=mqar", "trainer.init_from=runs/a_s2", "seed=2"]
    assert rsg.run_overrides(grid, "a", 0, "out")[1] == "trainer.init_from=runs/a_s0"


def test_table_options_reach_the_table_command():
    """A grid's ``table`` keys become :mod:`scripts.tables.seed_grid` options: a perplexity grid is tabulated
    unscaled with lower values better; a grid without them gets neither option."""
    grid = {"title": "T", "out": "results/x", "table": {"metric": "val_ppl", "baseline": "a", "scale": 1.0,
                                                         "lower_is_better": True}}
    argv = rsg.table_argv(grid, os.path.join(rsg.ROOT, "configs", "grid", "x.yaml"), "")
    assert argv[argv.index("--scale") + 1] == "1.0" and "--lower-is-better" in argv
    plain = rsg.table_argv({**grid, "table": {"metric": "acc"}}, os.path.join(rsg.ROOT, "g.yaml"), "")
    assert "--scale" not in plain and "--lower-is-better" not in plain


def test_tiny_grid_runs_resumes_and_tabulates(tmp_path, capsys):
    grid = tmp_path / "tiny.yaml"
    out = tmp_path / "res" / "tiny"
    grid.write_text(f"""
title: tiny
out: {out}
runs_dir: {tmp_path / 'runs'}
common: [task=mqar, logger=none, trainer.max_steps=2, trainer.progress_bar=false, trainer.count_flops=false,
         data.num_train=64, data.num_test=32, data.batch_size=16, data.seq_len=32, data.num_kv_pairs=4]
variants:
  mhla: [attn=mhla]
  linear: [attn=linear]
seeds: [0, 1]
table: {{metric: acc, baseline: linear}}
""")
    assert rsg.main([str(grid), "--jobs", "2"]) == 0
    data = json.loads(open(f"{out}.json").read())
    assert sorted(data["runs"]) == ["linear_s0", "linear_s1", "mhla_s0", "mhla_s1"]
    for name in data["runs"]:  # each run's record is copied beside the table
        assert os.path.exists(os.path.join(f"{out}_runs", name, "run.json"))
    assert "mhla - linear" in open(f"{out}.md").read()
    record = json.load(open(os.path.join(f"{out}_runs", "mhla_s0", "run.json")))
    assert record["config"]["attn"]["mixing_init"] is None and record["attention"]["mixing_init"] == "uniform"
    # the model's defaults, named: the block size and the mixing init
    assert "| mhla | mhla, block auto, init=uniform, learnable" in open(f"{out}.md").read()
    capsys.readouterr()
    assert rsg.main([str(grid), "--dry-run"]) == 0  # every run is finished: nothing left to print
    assert capsys.readouterr().out == ""
    os.remove(os.path.join(f"{out}_runs", "mhla_s1", "run.json"))  # finished, not beside the table: copied back
    assert rsg.main([str(grid), "--dry-run"]) == 0
    assert capsys.readouterr().out == "" and os.path.exists(os.path.join(f"{out}_runs", "mhla_s1", "run.json"))
    os.remove(os.path.join(f"{out}_runs", "mhla_s1", "run.json"))
    os.remove(os.path.join(tmp_path, "runs", "mhla_s1", "run.json"))  # unfinished: the only run left to do
    assert rsg.main([str(grid), "--dry-run"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and "attn=mhla" in printed[0] and "seed=1" in printed[0]
