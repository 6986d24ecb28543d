"""bench_ops.py helpers that the quick run in test_scripts.py does not pin down: spread, busy flag, rendering."""

import os

import pytest

from scripts import bench_ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rec(op, T, ms, **extra):
    return {"op": op, "causal": False, "T": T, "M": 4, "block_size": T // 4, "fwd_ms": ms / 3,
            "fwdbwd_ms": ms, "peak_mem_mb": 1.0, **extra}


def test_quartiles():
    assert bench_ops.quartiles([5.0]) == [5.0, 5.0]
    lo, hi = bench_ops.quartiles([1.0, 2.0, 3.0, 4.0, 100.0])
    assert 1.0 <= lo <= 2.0 <= 3.0 <= hi <= 100.0


def test_busy_cpu_reading_is_monotone():
    a = bench_ops.busy_cpu_s()
    if a is None:  # not Linux
        return
    sum(i * i for i in range(200_000))
    assert bench_ops.busy_cpu_s() >= a


def test_markdown_ratios_spread_and_busy_flag():
    recs = [_rec("mhla", 1024, 12.0, fwdbwd_ms_iqr=[11.0, 13.0], other_cpu_frac=0.0),
            _rec("linear", 1024, 10.0),  # an older record without spread renders as n/a
            _rec("sdpa", 1024, 60.0, other_cpu_frac=0.5),
            {"op": "sdpa", "causal": False, "T": 4096, "skipped": "skipped (est. 99s)"}]
    md = bench_ops.to_markdown({"device": "cpu"}, recs, "python scripts/bench_ops.py", 0.0)
    assert "| 1024 | 1.20x | 5.0x |" in md  # MHLA / linear and SDPA / MHLA at fwd+bwd
    assert "11.0-13.0" in md and "n/a" in md
    assert "60.00 (busy)" in md and "WARNING" in md
    assert "skipped (est. 99s)" in md


def test_ops_filter_and_quick_seq_lens():
    a = bench_ops.parse_args(["--quick", "--ops", "mhla", "linear"])
    assert a.ops == ["mhla", "linear"] and a.seq_lens == [256, 512]
    assert bench_ops.parse_args(["--quick", "--seq-lens", "128"]).seq_lens == [128]
    assert bench_ops.parse_args([]).seq_lens == [1024, 4096, 16384, 65536]


def test_gpu_defaults_and_cpu_defaults():
    """GPU mode is the issue's setting (bf16, B=8, H=16, T 1k..64k, Triton MHLA); CPU keeps the small one."""
    gpu = bench_ops.parse_args(["--device", "cuda"])
    assert (gpu.batch, gpu.heads, gpu.dtype, gpu.backend) == (8, 16, "bf16", "triton")
    assert gpu.seq_lens[0] == 1024 and gpu.seq_lens[-1] == 65536
    cpu = bench_ops.parse_args([])
    assert (cpu.batch, cpu.heads, cpu.dtype, cpu.backend) == (1, 8, "fp32", "torch")
    assert bench_ops.parse_args(["--device", "cuda", "--batch", "2"]).batch == 2


def test_fastest_linear_and_roofline_rendering():
    recs = [_rec("mhla", 1024, 12.0, fwd_frac_of_copy_bw=0.71), _rec("linear", 1024, 20.0),
            _rec("fla_linear", 1024, 10.0), _rec("sdpa", 1024, 60.0)]
    md = bench_ops.to_markdown({"device": "cuda", "copy_bandwidth_GBps": 3000.0}, recs, "cmd", 0.0)
    assert "| 1024 | 1.20x | 5.0x |" in md  # against fla (the faster linear), not ours
    assert "71% of copy BW" in md and "Roofline" in md


def test_min_bytes_moved():
    args = bench_ops.parse_args(["--batch", "2", "--heads", "3", "--dim", "4", "--dtype", "bf16"])
    assert bench_ops.min_bytes_moved({"T": 5}, args) == 4 * 2 * 5 * 3 * 4 * 2


def test_cuda_runs_in_one_process_cpu_refuses_it():
    """On CUDA every case runs in the parent (a subprocess per case costs ~15 s: it spent a whole GPU lease);
    on a CPU the peak-RSS reading needs a fresh process per case, so --in-process is refused there."""
    assert bench_ops.parse_args(["--device", "cuda"]).in_process is True
    assert bench_ops.parse_args(["--device", "cuda", "--no-in-process"]).in_process is False
    assert bench_ops.parse_args([]).in_process is False
    with pytest.raises(SystemExit):
        bench_ops.parse_args(["--in-process"])


def test_in_process_case_measures_and_reports_failures(monkeypatch):
    args = bench_ops.parse_args(["--device", "cuda", "--quick"])
    args.device, args.dtype, args.backend = "cpu", "fp32", "torch"  # the in-process path, timed on this CPU
    rec, failure = bench_ops.measure_case("linear", False, 128, args, [])
    assert failure is None and rec["T"] == 128 and rec["fwd_ms"] > 0 and rec["repeats"] >= 3

    def oom(*a, **k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 40.00 GiB\nmore detail")

    monkeypatch.setattr(bench_ops, "run_case", oom)
    assert bench_ops.measure_case("linear", False, 128, args, []) == (
        None, "CUDA out of memory. Tried to allocate 40.00 GiB")


def test_a_run_cut_short_keeps_its_records(tmp_path, monkeypatch):
    """<stem>.partial.json holds every case measured before the run stopped; the full write removes it."""
    import json

    calls = []

    def fake(op, causal, T, args, passthrough):
        calls.append((op, causal, T))
        if len(calls) == 3:
            raise KeyboardInterrupt  # the run stops mid-way (Ctrl-C; a time limit kills it the same way)
        return {"op": op, "causal": causal, "T": T, "M": 4, "fwd_ms": 1.0, "fwdbwd_ms": 2.0,
                "peak_mem_mb": 1.0, "repeats": 3}, None

    monkeypatch.setattr(bench_ops, "measure_case", fake)
    argv = ["--quick", "--seq-lens", "128", "--ops", "linear", "sdpa", "mhla", "--out-dir", str(tmp_path),
            "--allow-busy"]
    with pytest.raises(KeyboardInterrupt):
        bench_ops.main(argv)
    stem = tmp_path / "ops_cpu_quick_linear-sdpa-mhla"
    part = json.loads((tmp_path / (stem.name + ".partial.json")).read_text())
    assert part["complete"] is False and [r["op"] for r in part["records"]] == [c[0] for c in calls[:2]]
    monkeypatch.setattr(bench_ops, "measure_case", lambda op, causal, T, args, passthrough: (
        {"op": op, "causal": causal, "T": T, "M": 4, "fwd_ms": 1.0, "fwdbwd_ms": 2.0, "peak_mem_mb": 1.0,
         "repeats": 3}, None))
    assert bench_ops.main(argv) == 0
    assert (tmp_path / (stem.name + ".json")).exists() and not (tmp_path / (stem.name + ".partial.json")).exists()
