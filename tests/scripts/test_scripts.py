"""Benchmark and analysis scripts: they run, and what they measure has the properties it must have."""

import json
import math
import os
import subprocess
import sys

from scripts import analyze_attention, bench_ops
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_analysis_properties():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 64, 2, 16, generator=g), torch.randn(2, 64, 2, 16, generator=g)
    mats = analyze_attention.attention_matrices(q, k, num_blocks=4)
    for A in mats.values():
        torch.testing.assert_close(A.sum(-1), torch.ones_like(A.sum(-1)))
    r_lin, _ = analyze_attention.rank_and_entropy(mats["linear"])
    r_mh, _ = analyze_attention.rank_and_entropy(mats["mhla"])
    assert r_lin <= 16  # linear attention: rank <= d
    assert r_mh > r_lin  # MHLA restores rank
    uniform = torch.full((1, 1, 64, 64), 1 / 64)
    _, ent = analyze_attention.rank_and_entropy(uniform)
    assert ent == pytest.approx(math.log(64))


def test_analysis_script_writes_outputs(tmp_path):
    assert analyze_attention.main(["--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "attention_rank_entropy.json").read_text())
    assert data["results"]["linear"]["rank"] <= data["d"]
    assert (tmp_path / "attention_rank_entropy.png").stat().st_size > 1000


def test_release_loop_reimplementation_matches_ours():
    assert bench_ops.check_release_equivalence(None) < 1e-9


def test_plain_chunked_form_is_causal_linear_attention():
    assert bench_ops.check_plain_equivalence() < 1e-9


def test_bench_causal_overhead_quick_run(tmp_path):
    """--causal-overhead: MHLA and linear against the plain chunked form, side by side, in one process."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_ops.py"), "--causal-overhead",
                           "--quick", "--seq-lens", "128", "--allow-busy", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "causal_overhead_cpu_quick.json").read_text())
    (rec,) = data["records"]
    assert rec["T"] == 128 and rec["mhla_over_plain_fwdbwd"] > 0 and rec["linear_over_plain_fwd"] > 0
    assert data["header"]["loadavg_start"] and data["header"]["loadavg_end"]
    m = data["measurement"]
    assert m["load_before"] == data["header"]["loadavg_start"] and "commit" in m
    assert "MHLA / plain fwd+bwd" in (tmp_path / "causal_overhead_cpu_quick.md").read_text()


def test_bench_quick_run(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_ops.py"), "--quick",
                           "--seq-lens", "256", "--allow-busy", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "ops_cpu_quick.json").read_text())
    ops = {(r["op"], r["causal"]) for r in data["records"] if not r.get("skipped")}
    assert ops == {("mhla", False), ("linear", False), ("sdpa", False), ("mhla", True), ("linear", True),
                   ("plain_linear", True), ("sdpa", True), ("release_loop", True)}
    assert data["header"]["cpu_count"] >= 1
    assert (tmp_path / "ops_cpu_quick.md").read_text().startswith("# Op benchmark")
    assert data["measurement"]["busy_rule"]


def test_bench_ops_refuses_a_busy_machine(tmp_path, monkeypatch):
    """Every mode of bench_ops: a busy machine (tasks.common.records.BUSY_RULE) refuses the run before it
    starts unless --allow-busy; nothing is written."""
    from tasks.common import records

    monkeypatch.setattr(records, "load_average", lambda: [100.0, 100.0, 100.0])
    for mode in ([], ["--varlen"], ["--causal-overhead"]):
        assert bench_ops.main([*mode, "--quick", "--seq-lens", "128", "--out-dir", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())
