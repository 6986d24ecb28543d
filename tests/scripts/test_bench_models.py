"""scripts/bench_models.py: runs a tiny grid, writes JSON + markdown with a machine header, skips by estimate."""

import json
import os

from scripts import bench_models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_attn_config_keeps_m_squared_below_n():
    assert bench_models.attn_config("mhla", 256, False)["num_blocks"] == 16
    assert bench_models.attn_config("mhla", 4096, False)["num_blocks"] == 16
    assert bench_models.attn_config("mhla", 64, False)["num_blocks"] == 4
    assert bench_models.attn_config("softmax", 64, False) == {"name": "softmax"}


def test_estimate_scales_with_tokens_and_model_size():
    s = bench_models.model_weight("DiT-S/2")
    prev = {"sec": 1.0, "n_tokens": 256, "weight": s}
    assert bench_models.estimate(prev, 1024, "mhla", "DiT-S/2") == 4.0
    assert bench_models.estimate(prev, 1024, "softmax", "DiT-S/2") == 16.0
    xl = bench_models.estimate(prev, 256, "linear", "DiT-XL/2")
    assert 15 < xl < 25  # 28 x 1152^2 / (12 x 384^2) = 21
    assert bench_models.estimate(None, 256, "mhla", "DiT-S/2") is None


def test_bench_models_tiny_run(tmp_path):
    rc = bench_models.main(["--models", "DiT-S/2", "--resolutions", "64", "128", "--attns", "softmax", "mhla",
                            "--modes", "fwd", "--repeats", "1", "--max-case-s", "1e-6", "--out-dir", str(tmp_path),
                            "--note", "test", "--allow-busy"])  # the test machine may be busy
    assert rc == 0
    data = json.loads((tmp_path / "models_cpu.json").read_text())
    assert {"cpu", "torch", "date", "batch", "precision"} <= set(data["header"])
    m = data["measurement"]  # the load around the timing, and the verdict
    assert len(m["load_before"]) == len(m["load_after"]) == 3 and isinstance(m["busy"], bool) and m["commit"]
    assert (" - BUSY" in (tmp_path / "models_cpu.md").read_text().splitlines()[0]) == m["busy"]
    rows = {(r["res"], r["attn"]): r for r in data["results"]}
    assert rows[(64, "mhla")]["images_per_s"] > 0 and rows[(64, "mhla")]["n_tokens"] == 16
    assert rows[(64, "mhla")]["attn_config"]["num_blocks"] == 4
    assert rows[(128, "softmax")]["images_per_s"] is None and "estimated" in rows[(128, "softmax")]["skipped"]
    md = (tmp_path / "models_cpu.md").read_text()
    assert "| DiT-S/2 | 64 | 16 | fwd |" in md and "skipped" in md


def test_video_mode_forwards_to_bench_video(monkeypatch):
    """``--mode video`` hands the remaining arguments to scripts/bench_video.py (the Wan2.1 step benchmark)."""
    from scripts import bench_video

    seen = {}
    monkeypatch.setattr(bench_video, "main", lambda argv=None: seen.setdefault("argv", argv))
    assert bench_models.main(["--mode", "video", "--preset", "cpu", "--device", "cpu"]) == 0
    assert seen["argv"] == ["--preset", "cpu", "--device", "cpu"]


def test_cpu_benchmarks_refuse_to_start_on_a_busy_machine(tmp_path, monkeypatch, capsys):
    """A load average that already says busy stops the benchmark before any timing (exit 2, nothing written),
    not after a whole run; --allow-busy measures anyway (the result is then written marked BUSY)."""
    from scripts import bench_ops
    from tasks.common import records

    monkeypatch.setattr(records, "load_average", lambda: [100.0, 100.0, 100.0])
    timed = []
    monkeypatch.setattr(bench_models, "measure_grid", lambda *a: timed.append(a) or [])
    argv = ["--models", "DiT-S/2", "--resolutions", "64", "--attns", "mhla", "--modes", "fwd", "--repeats", "1",
            "--out-dir", str(tmp_path)]
    assert bench_models.main(argv) == 2 and not timed
    assert "refusing to measure" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert bench_models.main([*argv, "--allow-busy"]) == 0 and len(timed) == 1
    assert " - BUSY" in (tmp_path / "models_cpu.md").read_text().splitlines()[0]
    monkeypatch.setattr(bench_ops, "run_case", lambda *a: timed.append(a))
    assert bench_ops.main(["--quick", "--out-dir", str(tmp_path / "ops")]) == 2 and len(timed) == 1
