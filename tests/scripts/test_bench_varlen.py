"""bench_ops.py --varlen: the variable-length benchmark runs, checks (a) == (c) and writes its json / md."""

import json
import math
import os
import subprocess
import sys

from scripts import bench_ops
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_varlen_lengths_split():
    lengths = bench_ops.varlen_lengths(4096, 8, 64)
    assert len(lengths) == 8 and sum(lengths) == 4096 and min(lengths) >= 1
    assert min(lengths) == bench_ops.VARLEN_SHORT_DOC < 64  # one very short document
    assert all(n % 64 for n in lengths[:-1])  # documents end inside blocks (the last may by chance not)
    assert lengths == bench_ops.varlen_lengths(4096, 8, 64)  # seeded
    with pytest.raises(ValueError):
        bench_ops.varlen_lengths(4096, 1, 64)


def test_varlen_quick_run(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_ops.py"), "--varlen", "--quick", "--allow-busy",
           "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "varlen_cpu_quick.json").read_text())
    md = (tmp_path / "varlen_cpu_quick.md").read_text()
    assert md.startswith("# Variable-length batch") and "load average" in md
    assert data["records"] and data["header"]["loadavg_start"] is not None
    for r in data["records"]:
        assert r["backend"] == "torch" and r["N"] == 8 and sum(r["lengths"]) == r["total_T"]
        assert r["max_abs_diff_a_c"] < 1e-4 and r["grad_max_rel_diff_a_c"] < 1e-4
        for key in ("a_over_b_fwd", "a_over_b_fwdbwd", "c_over_a_fwd", "c_over_a_fwdbwd"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0
        assert f"| torch | {r['total_T']} | 8 |" in md
