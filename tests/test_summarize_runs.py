"""scripts/summarize_runs.py: runs that differ only in seed= form one row with mean ± std."""

import json
import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    from scripts import summarize_runs  # noqa: PLC0415

    return summarize_runs


def _fake_run(path, overrides, ppl=None):
    os.makedirs(path / ".hydra")
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    with open(path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 10, "eval/val_ppl": 999.0}) + "\n")
        if ppl is not None:
            f.write(json.dumps({"step": 20, "final/val_ppl": ppl}) + "\n")


def test_seeds_are_grouped(tmp_path):
    sr = _script()
    base = ["task=lm_mini", "attn=mhla", "logger=none"]
    for seed, ppl in ((0, 10.0), (1, 12.0), (2, None)):
        _fake_run(tmp_path / f"mhla_s{seed}", [*base, f"seed={seed}", f"hydra.run.dir=x{seed}"], ppl)
    _fake_run(tmp_path / "linear_s0", ["task=lm_mini", "attn=linear", "seed=0"], 20.0)
    (tmp_path / "not_a_run").mkdir()
    out = tmp_path / "summary"
    assert sr.main([str(p) for p in sorted(tmp_path.iterdir())] + ["--out", str(out), "--notes", "reading"]) == 0
    rows = {r["command"]: r for r in json.loads((tmp_path / "summary.json").read_text())["rows"]}
    mhla = rows["python train.py task=lm_mini attn=mhla"]
    assert mhla["n"] == 2 and mhla["mean"] == pytest.approx(11.0) and mhla["std"] == pytest.approx(2 ** 0.5)
    assert [r["seed"] for r in mhla["runs"]] == [0, 1, 2] and mhla["runs"][2]["value"] is None
    assert rows["python train.py task=lm_mini attn=linear"]["n"] == 1
    md = (tmp_path / "summary.md").read_text()
    assert "| `python train.py task=lm_mini attn=mhla` | 0: 10, 1: 12, 2: unfinished | 11 ± 1.4 | 2 |" in md
    assert md.rstrip().endswith("reading")
    with pytest.raises(SystemExit):
        sr.main([str(tmp_path / "not_a_run"), "--out", str(out)])
