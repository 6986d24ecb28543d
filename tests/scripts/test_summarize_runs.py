"""scripts/summarize_runs.py: runs that differ only in seed= form one row with mean ± std."""

import json
import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    assert ("| `python train.py task=lm_mini attn=mhla` | no saved config: grouped by command | "
            "0: 10, 1: 12, 2: unfinished | 11 ± 1.4 | 2 |") in md
    assert md.rstrip().endswith("reading")
    with pytest.raises(SystemExit):
        sr.main([str(tmp_path / "not_a_run"), "--out", str(out)])


def _config(path, attn: dict, lr_scale: float = 1.0, seed: int = 0):
    """A saved resolved config (``.hydra/config.yaml``) of a run folder made by :func:`_fake_run`."""
    cfg = {"seed": seed, "logger": "none", "model": {"name": "lm_mini", "kind": "lm"}, "attn": attn,
           "optim": {"lr": 1e-3, "mixing_lr_scale": lr_scale},
           "trainer": {"max_steps": 10, "progress_bar": False}}
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_rows_are_models_not_override_strings(tmp_path):
    """Runs are grouped by their saved resolved settings: one command that resolved to two models (a default
    changed between its seeds) gives two rows; two spellings of one model give one row."""
    sr = _script()
    cmd = ["task=lm_mini", "attn=mhla"]
    _fake_run(tmp_path / "a_s0", [*cmd, "seed=0"], 10.0)
    _config(tmp_path / "a_s0", {"name": "mhla", "mixing_param": "clamp"}, lr_scale=0.01)
    _fake_run(tmp_path / "a_s1", [*cmd, "seed=1"], 30.0)  # the same command after the default became 1.0
    _config(tmp_path / "a_s1", {"name": "mhla", "mixing_param": "clamp"}, lr_scale=1.0, seed=1)
    _fake_run(tmp_path / "b_s2", [*cmd, "optim.mixing_lr_scale=0.01", "seed=2"], 12.0)  # spelled out
    _config(tmp_path / "b_s2", {"name": "mhla", "mixing_param": "clamp"}, lr_scale=0.01, seed=2)
    out = tmp_path / "summary"
    assert sr.main([str(tmp_path / n) for n in ("a_s0", "a_s1", "b_s2")] + ["--out", str(out)]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert len(rows) == 2
    rule, full = rows
    assert [r["seed"] for r in rule["runs"]] == [0, 2] and rule["mean"] == pytest.approx(11.0)
    assert rule["commands"] == ["python train.py task=lm_mini attn=mhla",
                                "python train.py task=lm_mini attn=mhla optim.mixing_lr_scale=0.01"]
    assert rule["differs"] == {"optim.mixing_lr_scale": 0.01}
    assert full["differs"] == {"optim.mixing_lr_scale": 1.0}
    assert [r["seed"] for r in full["runs"]] == [1]
    assert "`optim.mixing_lr_scale=0.01`" in (tmp_path / "summary.md").read_text()
