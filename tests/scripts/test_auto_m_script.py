"""scripts/auto_m.py writes results/auto_m.{md,json,png} from saved runs and a benchmark (``--stage write``):
the rule's M is marked in both tables, the paired differences come from tasks/common/stats.py, and a
benchmark measured on a busy machine is refused unless ``--allow-busy``."""

from __future__ import annotations

import json

import pytest

from scripts import auto_m
from tasks.common.results import BusyMachine


def _save(tmp_path, busy: bool):
    recs = [{"M": m, "seed": s, "steps": 10, "command": "python train.py ...", "seconds": 1.0,
             "metrics": {"top1": 0.5 + 0.01 * m ** 0.5 + 0.003 * s}, "curve": [[5, 2.0], [10, 1.5]]}
            for s in (0, 1, 2) for m in (1, 4, 8)]
    (tmp_path / "sweep.json").write_text(json.dumps(recs))
    rows = [{"M": m, "blocks": [int(m ** 0.5)] * 2, "ms": 100.0 + m, "p25_ms": 99.0 + m, "p75_ms": 101.0 + m}
            for m in (4, 16, 64, 256)]
    load = [3.0, 3.0, 3.0] if busy else [0.1, 0.1, 0.1]
    meas = {"commit": "x", "load_before": load, "load_after": load, "cpu_count": 2, "threads": 2,
            "busy": busy}
    bench = {"model": "DiT-S/2", "res": 1024, "grid": [64, 64], "batch": 1, "repeats": 3, "threads": 2,
             "rows": rows, "rounds": [rows], "measurement": meas}
    (tmp_path / "bench.json").write_text(json.dumps(bench))


def test_write_stage_marks_the_rules_m_and_refuses_a_busy_benchmark(tmp_path):
    _save(tmp_path, busy=True)
    out = str(tmp_path / "auto_m")
    with pytest.raises(BusyMachine):
        auto_m.main(["--stage", "write", "--runs-dir", str(tmp_path), "--out", out])
    auto_m.main(["--stage", "write", "--runs-dir", str(tmp_path), "--out", out, "--allow-busy"])
    md = (tmp_path / "auto_m.md").read_text()
    assert "BUSY" in md and (tmp_path / "auto_m.png").exists()
    assert "| 4 **(rule)** | 4x4 | yes |" in md and "| 64 **(rule)** | 8x8 | yes |" in md
    data = json.loads((tmp_path / "auto_m.json").read_text())
    assert data["rule_m_sweep"] == 4 and data["rule_m_bench"] == 64 and data["measurement"]["busy"]
    by_m = {r["M"]: r for r in data["sweep"]}
    assert by_m[8]["diff"]["n"] == 3 and by_m[8]["verdict"] in ("higher", "level")
    assert "## Reading" in md and "the rule's M = 4 scores" in md


def test_write_stage_on_an_idle_benchmark(tmp_path):
    _save(tmp_path, busy=False)
    auto_m.main(["--stage", "write", "--runs-dir", str(tmp_path), "--out", str(tmp_path / "auto_m")])
    assert "BUSY" not in (tmp_path / "auto_m.md").read_text()
