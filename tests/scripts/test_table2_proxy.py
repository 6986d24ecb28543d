"""The seeded Table 2 CPU proxy (``make reproduce-table2 SCALE=mini``): its statistics and one end-to-end run."""

from __future__ import annotations

import json
import os

import pytest
from scripts import reproduce_table as rt
from scripts.tables import proxy2, registry, runner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rec(attn, seed, top1):
    return {"attn": attn, "seed": seed, "metrics": {"top1": top1}, "seconds": 1.0}


def test_stats_and_ordering_on_hand_records():
    recs = [_rec("mhla", 0, 0.97), _rec("mhla", 1, 0.95), _rec("softmax", 0, 0.94), _rec("softmax", 1, 0.94),
            _rec("linear", 0, 0.90), _rec("linear", 1, 0.92), {"attn": "mala", "seed": 0, "error": "boom"}]
    stats = proxy2.proxy2_stats(recs)
    assert set(stats) == {"mhla", "softmax", "linear"}  # failed runs do not count
    mean, std, n, accs = stats["mhla"]
    assert (round(mean, 6), n, accs) == (96.0, 2, pytest.approx([97.0, 95.0]))
    assert std == pytest.approx(2 ** 0.5)
    lines = proxy2.proxy2_ordering(stats)
    # MHLA leads softmax by exactly 2 pooled std (sqrt((2 + 0) / 2) = 1): not more than two, so that step is level
    assert "MHLA - softmax: +2.00 pp (+2.0 pooled std)" in lines[1]
    # softmax leads linear by 3 pooled std, but on 2 seeds a side no step can hold (tasks.common.stats.MIN_SEEDS)
    assert "**level**" in lines[0] and "MHLA > softmax: level" in lines[0] and "softmax > linear: level" in lines[0]
    stats["softmax"] = (94.0, 0.0, 3, [94.0, 94.0, 94.0])
    stats["linear"] = (91.0, 1.0, 3, [90.0, 92.0, 91.0])
    stats["mhla"] = (96.5, 0.5, 3, [97.0, 96.5, 96.0])  # 3 seeds a side: gaps 2.5 and 3 over pooled std 0.35, 0.71
    assert "**holds**" in proxy2.proxy2_ordering(stats)[0]
    stats["linear"] = (95.0, 0.0, 3, [95.0, 95.0, 95.0])  # linear 1 point above softmax, no spread: reversed
    lines = proxy2.proxy2_ordering(stats)
    assert "**does not hold**" in lines[0] and "softmax > linear: reversed" in lines[0]
    assert "needs" in proxy2.proxy2_ordering({"mhla": stats["mhla"]})[0]


def test_proxy_rows_name_real_table2_cells_and_cover_every_attention():
    cells = dict(registry.cells("2"))
    assert all(cell in cells for cell in proxy2.PROXY2_ROWS.values())
    attns = {c.split("_", 2)[-1] for c in cells if c.startswith("deit_")}
    assert attns == set(proxy2.PROXY2_ROWS)


def test_make_reproduce_table2_mini_end_to_end(tmp_path):
    """Three attentions, two training steps each: the table, the plot and Fig. 3 on the trained models."""
    out = tmp_path / "t2"
    argv = ["--table", "2", "--scale", "mini", "--attns", "softmax", "linear", "mhla", "--seeds", "0",
            "--steps", "2", "--warmup", "1", "--batch", "16", "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
            "--", "data.limit=64", "data.eval_limit=32"]
    assert rt.main(argv) == 0
    data = json.loads((tmp_path / "t2.json").read_text())
    assert sorted(r["attn"] for r in data["records"]) == ["linear", "mhla", "softmax"]
    assert all(r["curve"] and 0 <= r["metrics"]["top1"] <= 1 for r in data["records"])
    assert all("model.patch_size=2" in r["command"] and "model.token_blocks=16" in r["command"]
               for r in data["records"])
    md = (tmp_path / "t2.md").read_text()
    assert "| mhla | deit_t_mhla | 75.8 |" in md and "## Ordering" in md and "| rala |" in md  # rala: not run
    assert (tmp_path / "t2.png").stat().st_size > 0
    fig3 = json.loads((tmp_path / "analysis" / "trained_rank_entropy.json").read_text())
    models = {m["attention"]: m for m in fig3["models"]}
    assert set(models) == {"softmax", "linear", "mhla"} and all(m["N"] == 256 for m in models.values())
    # linear attention's matrix is phi(Q) phi(K)^T: rank <= head dim (32); softmax's is generically full
    assert all(lay["rank"] <= 32 for lay in models["linear"]["layers"])
    assert models["softmax"]["rank"] > 32 and models["mhla"]["rank"] > 32
    # --resume keeps the finished runs and runs nothing new
    assert rt.main([*argv[:-3], "--resume", "--no-analyze"]) == 0
    assert len(json.loads((tmp_path / "t2.json").read_text())["records"]) == 3


def test_run_cell_composes_mini_overrides_and_reports_failures(monkeypatch):
    """Other tables' mini cells go through the shared launcher with the table's proxy overrides."""
    import argparse

    seen = {}

    def fake(overrides, threads=None, launcher=None):
        seen["overrides"] = overrides
        if "data.limit=9" in overrides:  # the run fails
            return {"command": "x", "seconds": 1.0, "error": "boom", "error_tail": "Traceback\nboom"}
        return {"command": "x", "seconds": 1.0, "metrics": {"loss": 0.5, "mse": 0.1}, "params_M": 0.2}

    monkeypatch.setattr(runner, "run_training", fake)
    args = argparse.Namespace(scale="mini", extra=["data.limit=8"], gpus=0, fid_ref=None)
    res = runner.run_cell("3", "dit_s2_512_mhla", args)
    assert res["cell"] == "dit_s2_512_mhla" and res["metrics"]["loss"] == 0.5
    over = seen["overrides"]
    # the proxy comes from the config tree: 512-px cells -> configs/scale/mini/dit_s_512.yaml (16x16 tokens, M = 16)
    assert over[0] == "experiment=table3/dit_s2_512_mhla" and "scale=mini/dit_s_512" in over
    assert over[-1] == "data.limit=8"
    args.extra = ["data.limit=9"]
    res = runner.run_cell("2", "deit_t_mhla", args)
    assert res["error"] == "boom" and "error_tail" not in res
    seen.clear()
    args.extra = ["no_such_key=1"]  # an override that does not compose is reported without starting a run
    res = runner.run_cell("2", "deit_t_mhla", args)
    assert "does not compose" in res["error"] and not seen
