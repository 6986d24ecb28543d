"""Every results writer draws its plot (``<stem>.png`` beside ``<stem>.md``) from a small fake record set, and
its ``--plot-only`` redraws the plot from the ``.json`` alone (no benchmark, no training)."""

import argparse
import json
import os

from scripts import bench_generation, bench_models, bench_ops, bench_video, reproduce_table
from scripts.tables import figures, table5, writers
from scripts.tables.registry import Cell


def assert_png(path, min_bytes=5000):
    """A real, non-trivial PNG: the signature, and more than an empty canvas's bytes."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > min_bytes, (path, len(data))


def redraws(path, fn):
    """``fn()`` (a ``--plot-only`` call) rewrites ``path`` after it was removed."""
    os.remove(path)
    fn()
    assert_png(path)


def test_helper_splits_rows_into_groups_and_bars():
    assert figures.split_row("dit_b2_256_mhla", "DiT-B/2 256 MHLA (CPE+gate)") == ("DiT-B/2 256", "MHLA (CPE+gate)")
    assert figures.split_row("deit_t_384_mhla", "DeiT-T 384px MHLA") == ("DeiT-T 384px", "MHLA")
    assert figures.split_row("deit_t_linear", "DeiT-T Linear") == ("deit_t", "DeiT-T Linear")
    assert figures.split_row("mystery", "") == ("mystery", "mystery")
    assert figures.strip_common_prefix(["DeiT-T Linear", "DeiT-T MHLA"]) == ["Linear", "MHLA"]
    assert figures.strip_common_prefix(["MHLA-VLT-T", "MAViT-T*"]) == ["MHLA-VLT-T", "MAViT-T*"]


def test_bench_ops_plot(tmp_path):
    recs = [{"op": op, "causal": causal, "T": T, "M": 4, "block_size": T // 4, "fwd_ms": f * T / 1000,
             "fwdbwd_ms": 3 * f * T / 1000, "peak_mem_mb": T / 100}
            for causal in (False, True) for op, f in (("mhla", 1.0), ("linear", 0.8), ("sdpa", 4.0))
            for T in (256, 1024, 4096)]
    recs.append({"op": "sdpa", "causal": True, "T": 16384, "skipped": "skipped (est. 999s)"})
    out = {"header": {"device": "cpu", "cpu": "test"}, "command": "python scripts/bench_ops.py",
           "settings": {"batch": 1, "heads": 2, "dim": 16, "dtype": "fp32"}, "release_loop_max_abs_diff": 0.0,
           "records": recs}
    stem = bench_ops.write_results(str(tmp_path / "ops_cpu"), out)
    assert_png(stem + ".png", 20000)
    assert "Plot: `ops_cpu.png`" in open(stem + ".md").read()
    redraws(stem + ".png", lambda: bench_ops.main(["--plot-only", "--out-dir", str(tmp_path)]))


def test_bench_models_plot(tmp_path):
    rows = []
    for m in ("DiT-S/2", "DiT-XL/2"):
        for res in (64, 128):
            for a in ("softmax", "linear", "mhla"):
                for mode in ("fwd", "train"):
                    row = {"model": m, "res": res, "n_tokens": (res // 16) ** 2, "attn": a, "mode": mode, "batch": 1}
                    sec = 0.01 * (res / 64) ** (2 if a == "softmax" else 1)
                    rows.append({**row, "sec": None, "images_per_s": None, "skipped": "estimated 9 s per call x 3"}
                                if m == "DiT-XL/2" else {**row, "sec": sec, "images_per_s": 1 / sec})
    data = {"header": {"device": "cpu", "cpu": "test", "cpu_count": 2, "torch": "x", "torch_threads": 1,
                       "date": "today", "batch": 1, "precision": "fp32", "repeats": 1}, "time_method": "t",
            "results": rows}
    stem = bench_models.write_results(data, str(tmp_path / "models_cpu"))
    assert_png(stem + ".png", 20000)
    assert "Plot: `models_cpu.png`" in open(stem + ".md").read()
    redraws(stem + ".png", lambda: bench_models.main(["--plot-only", "--out-dir", str(tmp_path)]))


def test_bench_generation_plot(tmp_path):
    rows = [{"preset": p, "attn": a, "context": L, "ms_per_token": f * (L / 1e3 if a == "softmax" else 1.0),
             "ms_per_token_iqr": [f, f], "cache_bytes": L * 100 if a == "softmax" else 1000,
             "cache_mib": (L * 100 if a == "softmax" else 1000) / 2**20}
            for p in ("small", "340m") for L in (1024, 4096) for a, f in (("mhla", 1.0), ("softmax", 2.0),
                                                                          ("linear", 0.9))]
    rows.append({"preset": "340m", "attn": "softmax", "context": 65536, "error": "OOM"})
    data = {"machine": {"device": "cpu"}, "command": "python scripts/bench_generation.py", "busy": None,
            "settings": {"device": "cpu", "dtype": "fp32", "batch": 1, "new_tokens": 4, "repeats": 1,
                         "warmup": 0, "fill": "synthetic"}, "rows": rows}
    stem = bench_generation.write_results(data, str(tmp_path))
    assert_png(stem + ".png", 20000)
    assert "Plot: `generation_cpu.png`" in open(stem + ".md").read()
    redraws(stem + ".png", lambda: bench_generation.main(["--plot-only", "--out", str(tmp_path)]))


def test_bench_video_plot_and_its_name(tmp_path):
    assert bench_video.out_name("cpu", "cpu") == "video_cpu"  # not video_cpu_cpu
    assert bench_video.out_name("wan1.3b", "cuda") == "video_wan1.3b_cuda"
    assert bench_video.out_name("cpu", "cuda") == "video_cpu_cuda"
    info = {"preset": "cpu", "device": "cpu", "device_name": "cpu", "threads": 1, "dtype": "torch.float32",
            "tokens": 64, "grid": [1, 8, 8], "blocks": [1, 2, 2], "layers": 1, "torch": "x", "warmup": 0, "iters": 1,
            "results": {v: {"median_s": s, "min_s": s, "iters": 1, "peak_mem_gib": None}
                        for v, s in (("softmax", 2.0), ("linear", 1.0), ("mhla", 0.5))}}
    stem = bench_video.write_results(info, str(tmp_path / bench_video.out_name("cpu", "cpu")))
    assert_png(stem + ".png")
    md = open(stem + ".md").read()
    assert "| mhla | 500.0 | 4.00x |" in md and "Plot: `video_cpu.png`" in md
    redraws(stem + ".png", lambda: bench_video.main(["--plot-only", "--out", str(tmp_path), "--device", "cpu"]))


def test_cell_table_plot_and_plot_only(tmp_path):
    """writers.write_table draws results/<table>[_mini].png (paper vs ours, grouped); --plot-only redraws it."""
    rows = []
    for size, fid in (("S", 68.4), ("XL", 19.5)):
        for attn, row, f in (("softmax", "SA", 1.0), ("linear", "Linear", 1.3), ("mhla", "MHLA", 0.9)):
            cell = Cell(f"dit_{size.lower()}2_256_{attn}", [], {"table": "3a", "row": f"DiT-{size}/2 256 {row}",
                                                               "fid": round(fid * f, 2)}, "test")
            rows.append((cell, {"kind": "generation", "metrics": {"loss": 0.09 * f, "mse": 0.08 * f},
                                "params_M": 0.3, "seconds": 1.0}))
    args = argparse.Namespace(scale="mini", results_dir=str(tmp_path), argv=["--table", "3a"], seeds=None)
    md = writers.write_table("3a", args, rows)
    assert_png(str(tmp_path / "table3_mini.png"), 15000)
    assert "Plot: `table3_mini.png`" in open(md).read()
    redraws(str(tmp_path / "table3_mini.png"), lambda: reproduce_table.main(
        ["--table", "3a", "--scale", "mini", "--plot-only", "--results-dir", str(tmp_path)]))
    assert json.load(open(tmp_path / "table3_mini.json"))["rows"][0]["cell"] == "dit_s2_256_softmax"


def test_table5_plot_only_with_a_measurement(tmp_path, monkeypatch):
    rows = [(r, {"row": name, "quality": 80, "semantic": 70, "total": 78, "latency_s": lat}, 0)
            for r, name, lat in (("wan_flash", "FlashAttention", 166), ("wan_linear", "Linear", 82),
                                 ("wan_mhla", "MHLA", 81), ("wan_mhla_hybrid", "MHLA Hybrid", 103))]
    monkeypatch.setattr(table5, "paper_rows", lambda: rows)
    monkeypatch.setattr(table5, "load_bench", lambda name: None)
    out = tmp_path / "table5.md"
    table5.write_table(str(out))  # the paper's numbers alone: no plot, no Plot line
    assert not (tmp_path / "table5.png").exists() and "Plot:" not in out.read_text()
    cpu = {"tokens": 64, "layers": 1, "threads": 1,
           "results": {k: {"median_s": s} for k, s in (("softmax", 4.0), ("linear", 2.0), ("mhla", 1.0))}}
    monkeypatch.setattr(table5, "load_bench", lambda name: cpu if name == "video_cpu.json" else None)
    table5.write_table(str(out))
    assert_png(str(tmp_path / "table5.png"))
    assert "Plot: `table5.png`" in out.read_text() and "| MHLA | 80 | 70 | 78 | 81 | external |" in out.read_text()
    saved = json.loads((tmp_path / "table5.json").read_text())  # the table's record beside it
    assert [r["row"] for r in saved["rows"]][2] == "wan_mhla" and saved["rows"][2]["ours"]["cpu_speedup"] == 4.0
    redraws(str(tmp_path / "table5.png"), lambda: table5.main(["--plot-only", "--out", str(out)]))
