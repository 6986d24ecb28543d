"""The cross-attention experiment driver (scripts/tables/cross_mini.py): its results files from records, and the
load guard of its latency (a busy measurement is refused unless --allow-busy, then marked BUSY)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tasks.common.results import BusyMachine
from tasks.common.stats import paired_lines, paired_summary
from scripts.tables import cross_mini
from tasks.video_gen.follow import SEED_METRICS


def _data(stem):
    rec = lambda row, seed, loss, fol: {"row": row, "seed": seed, "metrics": {"loss": loss},  # noqa: E731
                                        "all_follow": {"followed": fol, "shape_ok": 0.5}, "seconds": 1.0}
    return {"stem": stem, "notes": "", "machine": {"command": "python -m scripts.tables.cross_mini", "warmup": 1,
                                                   "repeats": 3, "latency_threads": 2},
            "records": [rec("softmax", 0, 0.20, 1.0), rec("softmax", 1, 0.22, 0.9), rec("mhla_cross", 0, 0.21, 1.0),
                        {"row": "linear_cross", "seed": 0, "error": "boom", "error_tail": "boom"}],
            "latency": [{"row": r, "length": n, "median_s": s, "min_s": s, "times_s": [s]}
                        for r, s in (("softmax", 0.4), ("mhla_cross", 0.2), ("linear_cross", 0.2)) for n in (512,)]}


def test_results_files(tmp_path):
    stem = str(tmp_path / "cross_mini")
    cross_mini.write(_data(stem), SimpleNamespace(allow_busy=False))
    md = open(stem + ".md").read()
    assert "| softmax (Wan's own) | 0.2100 ± 0.0141 (n=2) | 95 ± 7% (n=2) |" in md
    assert "| 200.0 (2.00x) |" in md and "failed (1)" in md
    assert json.load(open(stem + ".json"))["records"][0]["row"] == "softmax"


def test_busy_latency_refused_unless_allowed(tmp_path):
    stem = str(tmp_path / "cross_mini")
    busy = {"busy": True, "load_before": [3.0], "load_after": [3.0], "cpu_count": 2, "threads": 2}
    with pytest.raises(BusyMachine):
        cross_mini.write(_data(stem), SimpleNamespace(allow_busy=False), busy)
    data = _data(stem)
    cross_mini.write(data, SimpleNamespace(allow_busy=True), busy)
    cross_mini.write(data, SimpleNamespace(allow_busy=False))  # a later rewrite keeps the mark
    assert "- BUSY" in open(stem + ".md").read().splitlines()[0]


def test_paired_differences_and_verdicts():
    rec = lambda row, seed, loss, fol: {"row": row, "seed": seed, "metrics": {"loss": loss},  # noqa: E731
                                        "all_follow": {"followed": fol}}
    records = [rec("softmax", s, 0.30 + 0.01 * s, 0.5) for s in range(3)]
    records += [rec("mhla_cross", s, 0.20 + 0.01 * s + 0.001 * (s == 1), 0.5 + 0.25 * (s == 0)) for s in range(3)]
    lines = "\n".join(paired_lines(paired_summary(records, cross_mini.PAIRS, SEED_METRICS)))
    # loss: lower by 0.1 on every seed (tiny spread) -> mhla_cross better; following: one seed differs -> level
    assert "| mhla_cross - softmax | eval loss | 3 | -0.0997 |" in lines and "mhla_cross better" in lines
    assert "| mhla_cross - softmax | captions followed (%) | 3 | +8.3 |" in lines
    assert lines.count("| level |") == 1
    # one row: nothing to pair
    assert paired_lines(paired_summary(records[:3], cross_mini.PAIRS, SEED_METRICS)) == []


def test_paired_differences_are_in_the_json(tmp_path):
    stem = str(tmp_path / "cross_mini")
    cross_mini.write(_data(stem), SimpleNamespace(allow_busy=False))
    (loss, follow) = json.load(open(stem + ".json"))["paired"]
    assert (loss["a"], loss["b"], loss["metric"], loss["seeds"]) == ("mhla_cross", "softmax", "eval loss", [0])
    assert loss["mean"] == pytest.approx(0.01) and follow["mean"] == pytest.approx(0.0)
    ratios = json.load(open(stem + ".json"))["latency_ratios"]
    assert ratios["softmax/mhla_cross"]["512"] == pytest.approx(2.0)
    assert ratios["mhla_cross/linear_cross"]["512"] == pytest.approx(1.0)
