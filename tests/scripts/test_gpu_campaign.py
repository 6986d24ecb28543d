"""scripts/gpu_campaign.py: the GPU campaign of issue 46, run here in its dry mode (the same code on the CPU, tiny
shapes): the record's structure, the partial record after every case, the goals, and the time-boxing (a stage or
case that does not fit is recorded as not run, never dropped)."""

import json
import math
import os
import subprocess
import sys
import time

import pytest

from scripts import gpu_campaign as gc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOAL_IDS = {"nc_fwd_long", "nc_fwd_4k", "nc_fwdbwd", "causal_vs_noncausal", "causal_scaling", "vs_fla", "vs_sdpa",
            "d128_vs_d64", "cpu_bound"}
CASE_STATUSES = ("ok", "failed", "skipped", "not run", "cut", "pending", "running")


def run_campaign(out_dir, *args, timeout=600):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_campaign.py"), "--dry",
                           "--out-dir", str(out_dir), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def check_record(out_dir, stages):
    """The final files exist, the partial one is gone, and every stage, case, goal and check is well formed."""
    assert not (out_dir / gc.PARTIAL).exists()
    state = json.loads((out_dir / gc.FINAL_JSON).read_text())
    assert state["complete"] and state["dry"]
    for key in ("hostname", "python", "torch", "triton", "commit", "dirty", "loadavg", "date"):
        assert key in state["header"]
    assert [s["name"] for s in state["stages"]] == stages
    for st in state["stages"]:
        assert st["status"].startswith(("done", "cut", "failed", "not run")), st["status"]
        for c in st["cases"]:
            assert c["status"].startswith(CASE_STATUSES[:5]), c  # nothing left pending or running
    assert {g["id"] for g in state["goals"]} == GOAL_IDS
    assert all(g["status"] in ("met", "not met", "not measured") for g in state["goals"])
    md = (out_dir / gc.FINAL_MD).read_text()
    assert "Goals (issue 46 item 5)" in md and "DRY RUN" in md
    for g in state["goals"]:
        assert g["goal"] in md
    return state


@pytest.mark.slow
def test_dry_campaign_runs_every_stage_and_writes_the_record(tmp_path):
    proc = run_campaign(tmp_path, "--budget-s", "90")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = check_record(tmp_path, list(gc.STAGE_NAMES))
    assert "Goals (issue 46 item 5)" in proc.stdout  # printed last
    assert (tmp_path / gc.LOG).exists()
    started = [s for s in state["stages"] if not s["status"].startswith("not run")]
    assert started, "no stage got any time"


def test_exhausted_budget_marks_every_stage_not_run(tmp_path):
    proc = run_campaign(tmp_path, "--budget-s", "1", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = check_record(tmp_path, list(gc.STAGE_NAMES))
    for st in state["stages"]:
        assert st["status"].startswith("not run: out of time"), st
    assert all(g["status"] == "not measured" for g in state["goals"])
    assert "not run: out of time" in (tmp_path / gc.FINAL_MD).read_text()


def tiny_state(out_dir, **ops):
    """A partial record as the orchestrator writes it, with the dry settings narrowed by ``ops``."""
    settings = gc.campaign_settings(dry=True)
    settings["ops"].update(ops)
    state = {"dry": True, "settings": settings, "header": {},
             "stages": [{"name": n, "status": "running", "cases": []} for n in gc.STAGE_NAMES]}
    gc.save_state(str(out_dir), state)
    return state


def test_ops_stage_rewrites_the_partial_record_after_every_case(tmp_path, monkeypatch):
    tiny_state(tmp_path, dims=[16], seq_lens=[64, 128])
    monkeypatch.setattr(gc, "SECONDARY_OPS", {False: ["linear"], True: []})  # fewer cases: a 2-core CI machine
    snapshots = []
    save = gc.save_state

    def spy(out_dir, state, name=gc.PARTIAL):
        save(out_dir, state, name)
        on_disk = json.loads((tmp_path / name).read_text())
        snapshots.append([c["status"].split(":")[0] for c in gc.stage_entry(on_disk, "ops")["cases"]])

    monkeypatch.setattr(gc, "save_state", spy)
    rec = gc.Recorder(str(tmp_path), "ops", deadline=time.time() + 600)
    gc.stage_ops(rec)
    planned = [s for s in snapshots if s]
    assert set(planned[0]) == {"pending"}, "the plan is written before any case runs"
    n_cases = len(planned[0])
    assert n_cases == len(gc.op_plan(rec.settings["ops"]))
    done = [sum(st not in ("pending", "running") for st in snap) for snap in planned]
    assert done[-1] == n_cases
    assert all(b - a in (0, 1) for a, b in zip(done, done[1:])), "one case at a time reaches the disk"
    final = gc.stage_entry(gc.load_state(str(tmp_path)), "ops")
    ok = [c for c in final["cases"] if c["status"] == "ok"]
    assert ok and all(c["ms"] > 0 and c["floor_bytes"] > 0 for c in ok)
    assert {c["op"] for c in ok} >= {"mhla", "mhla_window", "sdpa", "linear"}
    fla = [c for c in final["cases"] if c["op"].startswith("fla_")]
    assert all(c["status"].startswith(("skipped", "ok")) for c in fla)
    # forwards at D 16 come before any forward+backward
    order = [c["pass"] for c in final["cases"]]
    assert order == sorted(order, key=lambda p: p == "fwdbwd")


def test_a_case_that_does_not_fit_the_stage_is_recorded_not_run(tmp_path):
    tiny_state(tmp_path)
    rec = gc.Recorder(str(tmp_path), "ops", deadline=time.time() + 1.0)
    ran = []
    assert rec.run("fits", 0.0, lambda: ran.append(1) or {"x": 1}) == {"case": "fits", "status": "ok",
                                                                         "wall_s": pytest.approx(0, abs=1), "x": 1}
    assert rec.run("too_long", 30.0, lambda: ran.append(2) or {}) is None
    assert rec.run("raises", 0.0, lambda: 1 / 0) is None
    cases = {c["case"]: c["status"] for c in gc.stage_entry(gc.load_state(str(tmp_path)), "ops")["cases"]}
    assert ran == [1]
    assert cases["fits"] == "ok"
    assert cases["too_long"].startswith("not run: out of time")
    assert cases["raises"].startswith("failed: ZeroDivisionError")


def test_a_stopped_stage_marks_what_it_left():
    state = {"stages": [{"name": "ops", "cases": [{"case": "a", "status": "ok"}, {"case": "b", "status": "running"},
                                                   {"case": "c", "status": "pending"}]}]}
    gc.finish_stage(state, "ops", None, True, 12.0)
    st = state["stages"][0]
    assert st["status"].startswith("cut")
    assert [c["status"].split(":")[0] for c in st["cases"]] == ["ok", "cut", "not run"]


def test_unused_time_goes_to_the_later_stages():
    ops, tests, rest = gc.STAGES[0], gc.STAGES[1], list(gc.STAGES[2:])
    full = gc.allotted_s(ops, [tests, *rest], 480.0, dry=False)
    assert full == pytest.approx(480 * ops.budget_s / sum(s.budget_s for s in gc.STAGES))
    # the same stage later, with more time left than the nominal budgets of what remains: it gets more
    assert gc.allotted_s(tests, rest, 400.0, dry=False) > tests.budget_s
    # little time left: the earlier stage gets its minimum before the later ones get anything
    assert gc.stage_share(ops, [tests, *rest], 25.0, dry=False) == ops.min_s
    assert gc.stage_share(ops, [tests, *rest], ops.min_s - 1, dry=False) < ops.min_s


def op_rec(op, causal, kind, T, ms, D=64, pct=None):
    return {"case": gc.op_case_id(D, kind, causal, op, T), "status": "ok", "op": op, "causal": causal,
            "pass": kind, "T": T, "D": D, "ms": ms, "pct_floor_datasheet": pct, "pct_floor_copy": pct}


def goals_of(records, datasheet=3350.0):
    state = {"settings": gc.campaign_settings(dry=False),
             "stages": [{"name": "ops", "info": {"datasheet_GBps": datasheet}, "cases": records}]}
    return {g["id"]: g for g in gc.goals(state)}


def test_goals_read_the_op_records():
    recs = [op_rec("mhla", False, "fwd", 4096, 1.0, pct=40.0), op_rec("mhla", False, "fwd", 16384, 2.0, pct=55.0),
            op_rec("mhla", False, "fwd", 65536, 6.0, pct=45.0), op_rec("sdpa", False, "fwd", 1024, 0.2),
            op_rec("mhla", False, "fwd", 1024, 0.8), op_rec("sdpa", False, "fwd", 4096, 2.0),
            op_rec("mhla_window", True, "fwd", 4096, 1.4), op_rec("mhla_window", True, "fwd", 65536, 28.0),
            op_rec("fla_linear", True, "fwd", 4096, 1.0), op_rec("mhla", False, "fwd", 4096, 2.1, D=128)]
    g = goals_of(recs)
    assert g["nc_fwd_4k"]["status"] == "met"  # 40% >= 35%
    assert g["nc_fwd_long"]["status"] == "not met" and "45" in g["nc_fwd_long"]["measured"]  # 64k: 45% < 50%
    assert g["nc_fwdbwd"]["status"] == "not measured"
    assert g["causal_vs_noncausal"]["status"] == "not met"  # 28 / 6 at 64k
    assert g["causal_scaling"]["status"] == "not met"  # 28 / 1.4 = 20x > 17x
    assert g["vs_fla"]["status"] == "not met" and g["vs_fla"]["values"]["D 64 fwd T 4096"] == pytest.approx(1.4)
    assert g["vs_sdpa"]["status"] == "not met" and "T 1024" in g["vs_sdpa"]["measured"]  # 0.8 / 0.2
    assert g["d128_vs_d64"]["status"] == "met"  # 2.1 / 1.0 <= 2.2
    assert g["cpu_bound"]["status"] == "not measured"
    good = [op_rec("mhla_window", True, "fwd", 4096, 1.0), op_rec("mhla_window", True, "fwd", 65536, 16.0),
            op_rec("mhla", False, "fwd", 4096, 0.9), op_rec("mhla", False, "fwd", 65536, 12.0),
            op_rec("fla_linear", True, "fwd", 4096, 0.9), op_rec("fla_linear", True, "fwd", 65536, 14.0)]
    g = goals_of(good)
    assert g["causal_scaling"]["status"] == "met" and g["vs_fla"]["status"] == "met"
    assert g["causal_vs_noncausal"]["status"] == "met"  # 1.11x and 1.33x


def test_bf16_tracks_fp32_by_the_rule():
    fp32 = [2.0 - 0.05 * i for i in range(20)]
    assert gc.track_verdict([x * 1.02 for x in fp32], fp32, 20)["tracks"]
    assert not gc.track_verdict([x * 1.2 for x in fp32], fp32, 20)["tracks"]
    nan = gc.track_verdict(fp32[:-1] + [math.nan], fp32, 20)
    assert not nan["bf16_finite"] and not nan["tracks"]
    assert not gc.track_verdict(fp32[:10], fp32, 20)["tracks"]  # a run that stopped early


def test_the_gpu_tests_are_found_wherever_they_live():
    files = gc.gpu_test_files()
    assert any(f.endswith("test_kernels_triton.py") for f in files)
    assert all("pytest.mark.gpu" in open(os.path.join(ROOT, f)).read() for f in files)


def test_train_runs_read_their_losses_and_name_their_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "params": 3}\n{"step": 1, "train/loss": 2.5}\n'
                                            '{"step": 2, "train/loss": 2.25}\n')
    assert gc.train_losses(str(tmp_path)) == [2.5, 2.25]
    log = tmp_path / "stdout.log"
    log.write_text("step 1\nValueError: q, k, v must share a dtype\n\n"
                   "Set the environment variable HYDRA_FULL_ERROR=1\n")
    assert gc.error_line(log) == "ValueError: q, k, v must share a dtype"
    cmd = gc.train_command("lm_mini", "bf16", 20, "cuda", str(tmp_path), dry=False)
    assert "trainer.precision=bf16" in cmd and "logger=none" in cmd and f"data.cache_dir={tmp_path}/cache" in cmd


def test_triton_cases_are_checked_against_the_torch_path():
    import argparse

    pytest.importorskip("triton")
    cargs = argparse.Namespace(batch=1, heads=2, dim=16, dtype="fp32", block=64, backend="triton", threads=0,
                               repeats=1, budget_s=0.01, device="cpu")
    assert gc.diff_to_torch("mhla", False, 64, cargs, "cpu") < 1e-5
    assert gc.diff_to_torch("mhla_window", True, 80, cargs, "cpu") < 1e-5


def test_the_traffic_model_is_read_for_the_mhla_op():
    o = gc.campaign_settings(dry=False)["ops"]
    fwd = gc.modelled_traffic("mhla", False, "fwd", o, 64, 4096, 64)
    both = gc.modelled_traffic("mhla", False, "fwdbwd", o, 64, 4096, 64)
    if fwd is None:
        pytest.skip("no traffic model (mhla.ops.mhla.triton.traffic) in this checkout")
    assert fwd["bytes"] >= gc.floor_bytes(o, 64, 4096, "fwd") and both["bytes"] > fwd["bytes"]
    assert both["launches"] > fwd["launches"] >= 1
    assert gc.modelled_traffic("sdpa", False, "fwd", o, 64, 4096, 64) is None
    # the LM's compact rows: the window the benchmark's rows have, so bytes grow linearly in T past the window
    win = [gc.modelled_traffic("mhla_window", True, "fwd", o, 64, T, 64)["bytes"] for T in (4096, 16384)]
    dense = gc.modelled_traffic("mhla", True, "fwd", o, 64, 4096, 64)["bytes"]
    assert 3.9 < win[1] / win[0] < 4.1 and win[0] < 1.5 * dense  # the fused banded mix: at the dense causal path's level
    # the opt-in half summaries: fewer bytes, the same launches
    for op, causal in (("mhla", False), ("mhla_window", True)):
        full, half = (gc.modelled_traffic(name, causal, "fwd", o, 64, 4096, 64) for name in (op, op + "_half"))
        assert half["bytes"] < full["bytes"] and half["launches"] == full["launches"], op


def test_half_summary_ops_run_the_same_case_with_the_option(monkeypatch):
    """``mhla_half`` / ``mhla_window_half``: the case of ``mhla`` / ``mhla_window`` with MHLA_SUMMARY_DTYPE=input
    set during the call only (on a CPU the torch path runs, which has no such option: the same output)."""
    import argparse

    import torch

    from mhla.ops.mhla.triton.utils import SUMMARY_DTYPE_ENV as ENV
    from scripts.bench_ops import make_case, with_half_summaries

    monkeypatch.delenv(ENV, raising=False)
    seen = []
    call = with_half_summaries(lambda: seen.append(os.environ.get(ENV)) or 7)
    assert call() == 7 and seen == ["input"] and ENV not in os.environ
    monkeypatch.setenv(ENV, "fp32")
    call()
    assert seen == ["input", "input"] and os.environ[ENV] == "fp32"
    cargs = argparse.Namespace(batch=1, heads=2, dim=16, dtype="fp32", block=16, backend="torch", threads=0,
                               repeats=1, budget_s=0.01, device="cpu")
    for op, causal in (("mhla", False), ("mhla_window", True)):
        fn, _, info = make_case(op, causal, 64, cargs, "cpu")
        half, _, half_info = make_case(op + "_half", causal, 64, cargs, "cpu")
        assert half_info == {**info, "summaries": "input dtype"}
        assert torch.equal(half(), fn())
