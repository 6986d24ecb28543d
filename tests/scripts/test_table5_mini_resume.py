"""scripts/tables/table5_mini.py: a table interrupted between runs resumes from ``<out>.partial.json``."""

import copy
import json
import os

import pytest

from scripts.tables import table5_mini

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_interrupted_table_resumes_from_partial(monkeypatch, tmp_path):
    with open(os.path.join(ROOT, "results", "table5_mini.json")) as f:
        template = json.load(f)["results"][0]  # a committed record: every field the table reads
    out, runs = str(tmp_path / "t5"), str(tmp_path / "runs")
    trained = []

    def fake_run(row, seed, args, fail=()):
        if row in fail:
            raise RuntimeError(f"killed while training {row}")
        trained.append((row, seed))
        rec = copy.deepcopy(template)
        rec.update(row=row, seed=seed, run_dir=os.path.join(runs, f"{row}_s{seed}"))  # no checkpoint: not timed
        return rec

    argv = ["--rows", "softmax", "linear", "--seeds", "0", "--jobs", "1", "--out", out, "--out-dir", runs]
    monkeypatch.setattr(table5_mini, "run_row", lambda *a: fake_run(*a, fail=("linear",)))
    with pytest.raises(RuntimeError):
        table5_mini.main(argv)
    assert trained == [("softmax", 0)] and not os.path.exists(out + ".json")
    with open(out + ".partial.json") as f:
        assert [(r["row"], r["seed"]) for r in json.load(f)] == [("softmax", 0)]

    monkeypatch.setattr(table5_mini, "run_row", fake_run)
    assert table5_mini.main([*argv, "--resume"]) == 0
    assert trained == [("softmax", 0), ("linear", 0)]  # the finished row is not trained again
    with open(out + ".json") as f:
        assert sorted((r["row"], r["seed"]) for r in json.load(f)["results"]) == [("linear", 0), ("softmax", 0)]
    assert not os.path.exists(out + ".partial.json")
    # the rows compared seed by seed (one seed here: a difference, no interval, level)
    with open(out + ".md") as f:
        assert "| linear - softmax | eval loss | 1 | +0.0000 | - | s0: +0.0000 | level |" in f.read()
