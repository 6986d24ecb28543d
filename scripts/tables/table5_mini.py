"""Mini Table 5 on a CPU: the video_mini model with softmax, MHLA, the MHLA hybrid (and linear) attention.

    python scripts/reproduce_table.py --table 5 --scale mini       # results/table5_mini.md (make reproduce-table5 SCALE=mini)
    python scripts/reproduce_table.py --table 5 --scale mini -- --seeds 0 1 --resume   # add a seed to the rows run
    python scripts/reproduce_table.py --table 5 --scale mini --plot-only   # rewrite the md from the .json

Each row is ``python train.py task=video_mini <row overrides> seed=S`` (the same model, data, steps and
sampling; only the self-attention changes), ``--jobs`` at a time; each record keeps its run's ``run.json`` as
``run`` (the resolved config, commit, machine and load). Then, in this process and one row after the other, each
row is measured by :func:`measure_row` (eval loss, prompt following on its 4 sample
prompts and all 32 captions, and the sampling latency of its sample prompts, timed for every row under the same
load; the load before and after the timings is the .json's ``measurement``, and a busy one marks the table BUSY).

The latency at the paper's token count (31,500 tokens: 81 frames at 480 x 800 through Wan's VAE and patching)
comes from ``scripts/bench_video.py`` on this CPU, one denoiser step: the mini model at 31,500 tokens
(``--preset mini_31k``) and three of Wan2.1-1.3B's layers at full width (``--preset wan1.3b_3layers``), read
from ``results/bench/video_<preset>_cpu.json`` (``--bench`` measures them first). The paper's 2.1x is
end-to-end sampling (166 s / 81 s) on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from tasks.common.evaluation import load_run
from tasks.common.fileio import atomic_write
from tasks.common.launch import mean_std, read_notes, run_parallel, run_training
from tasks.common.plots import pyplot, save_figure
from tasks.common.records import Measurement, wait_until_settled
from tasks.common.results import write_result
from tasks.common.stats import paired_lines, paired_summary
from tasks.common.utils import load_average, system_info
from tasks.video_gen.follow import SEED_METRICS, all_prompts, follow_report, sample_and_check
from tasks.video_gen.media import to_uint8_frames

from .registry import ROOT
from .table5 import load_bench

COMMAND = "python scripts/reproduce_table.py --table 5 --scale mini"  # + " -- <this driver's arguments>"
ROWS = {  # row -> its overrides of task=video_mini (the paper's Table 5 rows, trained equally)
    "softmax": ["attn=softmax"],
    "linear": ["attn=linear"],
    "mhla": ["attn=mhla"],
    "mhla_hybrid": ["attn=mhla", "attn.layers=hybrid"],
}
LABELS = {"softmax": "softmax (FlashAttention row)", "linear": "linear", "mhla": "MHLA (every layer)",
          "mhla_hybrid": "MHLA hybrid (layer 2 of 4 softmax)"}
PAIRS = (("mhla", "linear"), ("mhla", "softmax"), ("linear", "softmax"), ("mhla_hybrid", "softmax"),
         ("mhla_hybrid", "mhla"))  # the rows compared seed by seed
PAPER_LATENCY_S = {"softmax": 166, "linear": 82, "mhla": 81, "mhla_hybrid": 103}  # Table 5, 50 steps + CFG, GPU
BENCH_PRESETS = ("mini_31k", "wan1.3b_3layers")
MINI_VS_FULL = (  # the mini rows keep task=video_mini's attention settings; the full Table 5 (wan_finetune) differs
    "Where the mini rows differ from the full Table 5 (`configs/task/wan_finetune.yaml`, `configs/experiment/table5/`): "
    "the mini linear row has no normalizer and an output RMSNorm, like the MHLA rows (task=video_mini's attention "
    "settings), while the full Linear row is normalised without an output RMSNorm (the authors' release); the mini "
    "hybrid keeps softmax at layer 2 of its 4 layers (i % 3 == 2), the full one at layers 0, 3, ..., 27 of 30 "
    "(i % 3 == 0, the release's linear_attn_idx); batch 8 here, 4 per GPU there.")


def run_row(row: str, seed: int, args) -> dict:
    """Train one row with ``train.py``; returns its record (command, seconds, metrics) plus the run folder."""
    run_dir = os.path.join(args.out_dir, f"{row}_s{seed}")
    rec = run_training(["task=video_mini", *ROWS[row], f"seed={seed}", "logger=none", "trainer.progress_bar=false",
                        f"hydra.run.dir={run_dir}", *args.extra], threads=args.threads)
    rec.update(row=row, seed=seed, run_dir=os.path.relpath(run_dir, ROOT))
    return rec


# ---------------------------------------------------------------------------- measuring a trained row
# The sampling latency is the wall time of sampling the 4 sample prompts: one batch, 50 steps with CFG = 100
# forwards, timed here for every row under the same load.
def checkpoint_of(rec: dict) -> str:
    """The trained row's last checkpoint (``rec["run_dir"]`` is relative to the repository root)."""
    return os.path.join(ROOT, rec["run_dir"], "checkpoints", "last.pt")


@torch.no_grad()
def measure_row(rec: dict, repeats: int = 3) -> dict:
    """Sample a trained row (``rec["run_dir"]``, relative to the repository root): prompt following on its sample
    prompts and on all 32 captions, sampling latency of its sample prompts (one 2-step warm-up, then the median of
    ``repeats`` timed samplings, every time kept), and the frames of its sample prompts (for the picture)."""
    cfg, task, model, info = load_run(checkpoint_of(rec))
    s = cfg.sample
    kw = dict(num_steps=int(s.num_steps), guidance_scale=float(s.guidance_scale), shift=float(s.shift))
    prompts = list(s.prompts)
    task.generate(model, prompts[:1], info.device, seed=0, progress=False, **{**kw, "num_steps": 2})  # warm-up
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        videos = task.generate(model, prompts, info.device, seed=int(s.get("seed", 0)), batch_size=len(prompts),
                               progress=False, **kw)
        times.append(time.perf_counter() - t0)
    latency = statistics.median(times)
    sample_report = follow_report(videos, prompts)
    everything = sample_and_check(task, model, all_prompts(), info.device, **kw)
    everything.pop("videos")
    return {"latency_s": round(latency, 3), "latency_times_s": [round(t, 3) for t in times],
            "sample_follow": sample_report, "all_follow": everything,
            "frames": videos, "num_sample_prompts": len(prompts), "sample_prompts": prompts, "sample_settings": kw}


def bench(preset: str, threads: int, allow_busy: bool = False, warmup: int = 1, iters: int = 3) -> None:
    """One denoiser step at 31.5k tokens (``scripts/bench_video.py``): ``warmup`` untimed steps, then ``iters``."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_video.py"), "--preset", preset, "--device", "cpu",
           "--warmup", str(warmup), "--iters", str(iters), *(["--allow-busy"] if allow_busy else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def command(argv: list[str]) -> str:
    """The command that runs this driver with ``argv``."""
    return f"{COMMAND} -- {' '.join(argv)}" if argv else COMMAND


def fmt(xs: list[float], pct: bool = False, digits: int = 4) -> str:
    if not xs:
        return "-"
    m, s = mean_std(xs)
    if pct:
        return f"{100 * m:.0f} ± {100 * s:.0f}%" + (f" (n={len(xs)})" if len(xs) > 1 else "")
    return f"{m:.{digits}f} ± {s:.{digits}f}" + f" (n={len(xs)})"


def ratio_cell(bench: dict | None, row: str) -> str:
    if not bench or row not in bench["results"] or "softmax" not in bench["results"]:
        return "not measured"
    r = bench["results"]
    return f"{r[row]['median_s']:.1f} s ({r['softmax']['median_s'] / r[row]['median_s']:.2f}x)"


def timed_latencies(recs: list[dict]) -> list[float]:
    """The sampling latencies of the records timed in the table's last measuring process (not ``latency_stale``)."""
    return [rec["latency_s"] for rec in recs if not rec.get("latency_stale")]


def write_outputs(records: list[dict], args) -> None:
    stem = args.out
    rows = [r for r in ROWS if any(rec["row"] == r for rec in records)]
    benches = {p: load_bench(f"video_{p}_cpu.json") for p in BENCH_PRESETS}
    by_row = {r: [rec for rec in records if rec["row"] == r and "error" not in rec] for r in rows}
    soft_lat = timed_latencies(by_row.get("softmax", []))
    head = ("| attention | eval loss | sample prompts followed | all 32 captions followed | shape told apart (32) | "
            "sampling latency, 4 prompts (s) | vs softmax | 31.5k tokens, mini model: one step (vs softmax) | "
            "31.5k tokens, 3 Wan2.1-1.3B layers: one step (vs softmax) | paper latency, s (vs FlashAttention) |")
    lines = [
        "# Mini Table 5: video_mini with softmax, MHLA, MHLA hybrid and linear attention (CPU)", "",
        "Each row: `python train.py task=video_mini <row> seed=S` (the 4-layer, width-64 Wan-shaped model in pixel "
        "space, 8 frames x 16 x 16 px = 512 tokens, the same steps, data and sampling; only the self-attention "
        f"changes), trained {args.machine.get('jobs', '?')} at a time with "
        f"{args.machine.get('threads_per_run_and_sampling', '?')} thread(s) each. Eval loss: held-out velocity MSE "
        "at fixed times and noise. Prompt following "
        "(`tasks/video_gen/follow.py`): colour in every frame, centroid moves the asked way by >= 8% of the frame, "
        "more along than across; on the run's 4 sample prompts and on all 32 captions (4 colours x 2 shapes x 4 "
        "directions, noise seed 0). Sampling latency: the 4 sample prompts in one batch, 50 Euler steps with CFG "
        "(100 forwards), timed in this process for every row, one after the other, with the same threads, after a "
        "2-step warm-up: the median of the repeats (`latency_times_s` in the .json; 1 in runs before repeats). "
        "A seed whose run folder was gone when the table was last timed keeps its earlier latency in the .json "
        "(`latency_stale`) and is left out of the latency columns (their n says how many seeds were timed). "
        "Mean ± std over seeds.", "",
        (f"Command: `{args.machine['command']}` (this file rewritten by `{command(args.argv)}`)"
         if args.plot_only and args.machine.get("command") else f"Command: `{command(args.argv)}`"), "",
        f"Machine: {json.dumps(args.machine)}", "",
        head, "|" + "---|" * (head.count("|") - 1),
    ]
    summary = {}  # per row: the table's numbers (means and stds over seeds, ratios), kept in the .json
    for r in rows:
        recs = by_row[r]
        if not recs:
            lines.append(f"| {LABELS[r]} | failed | | | | | | | | |")
            continue
        lat = timed_latencies(recs)
        stat = {name: dict(zip(("mean", "std"), mean_std(xs)), n=len(xs)) for name, xs in (
            ("eval_loss", [rec["metrics"]["loss"] for rec in recs]), ("latency_s", lat),
            ("all_followed", [rec["all_follow"]["followed"] for rec in recs]),
            ("shape_ok", [rec["all_follow"]["shape_ok"] for rec in recs])) if xs}
        if soft_lat and lat:
            stat["latency_speedup_vs_softmax"] = mean_std(soft_lat)[0] / mean_std(lat)[0]
        for p, b in benches.items():
            if b and r in b["results"] and "softmax" in b["results"]:
                med, soft = b["results"][r]["median_s"], b["results"]["softmax"]["median_s"]
                stat[f"bench_{p}"] = {"median_s": med, "speedup_vs_softmax": soft / med}
        stat["paper_latency_s"] = PAPER_LATENCY_S[r]
        summary[r] = stat
        speed = f"{stat['latency_speedup_vs_softmax']:.2f}x" if "latency_speedup_vs_softmax" in stat else "-"
        n_sample = recs[0]["num_sample_prompts"]
        sample = " / ".join(f"{round(rec['sample_follow']['followed'] * n_sample)}/{n_sample}" for rec in recs)
        paper = f"{PAPER_LATENCY_S[r]} ({PAPER_LATENCY_S['softmax'] / PAPER_LATENCY_S[r]:.2f}x)"
        lines.append(
            f"| {LABELS[r]} | {fmt([rec['metrics']['loss'] for rec in recs])} | {sample} | "
            f"{fmt([rec['all_follow']['followed'] for rec in recs], pct=True)} | "
            f"{fmt([rec['all_follow']['shape_ok'] for rec in recs], pct=True)} | {fmt(lat, digits=2)} | {speed} | "
            f"{ratio_cell(benches['mini_31k'], r)} | {ratio_cell(benches['wan1.3b_3layers'], r)} | {paper} |")
    paired = paired_summary(records, PAIRS, SEED_METRICS)
    lines += paired_lines(paired)
    lines += ["", "31.5k-token columns: one denoiser forward (batch 1, no CFG) on this CPU in fp32, from "
              "`scripts/bench_video.py --preset mini_31k` and `--preset wan1.3b_3layers` "
              "(`results/bench/video_<preset>_cpu.json`; "
              + "; ".join(f"{p}: {b['machine'].get('date', '?')}, {b['threads']} threads" if b else f"{p}: not run"
                          for p, b in benches.items())
              + "). The Wan2.1 column times 3 of its 30 layers at full width (one period of the hybrid), so its "
              "ratios are those of the full model's step; the paper's 2.05x (MHLA) and 1.61x (hybrid) are end-to-end "
              "sampling on a GPU, including the VAE and the text encoder, which no attention speeds up.", "",
              MINI_VS_FULL, "",
              f"Frames: `{os.path.basename(stem)}_frames.png` (each row's lowest seed timed with the table: one row "
              f"per sample prompt, its 8 frames left to right). Raw records: `{os.path.basename(stem)}.json`."]
    if args.notes:
        lines += ["", "## Reading", "", args.notes.strip()]
    keep = [{k: v for k, v in rec.items() if k != "frames"} for rec in records]
    # the load around the latency timing marks the table BUSY when busy (a table of trained rows is not refused)
    bench_files = {p: {"file": f"results/bench/video_{p}_cpu.json", "date": b["machine"].get("date"),
                       "threads": b.get("threads")} for p, b in benches.items() if b}
    record = {"machine": args.machine, **args.record_notes,
              **({"measurement": args.measurement} if args.measurement else {}),
              "summary": summary, "paired": paired, "benchmarks": bench_files, "results": keep}
    write_result(stem, "\n".join(lines) + "\n", record, indent=1)


def plot_frames(frames: dict[str, list[torch.Tensor]], scores: dict[str, str], prompts: list[str], path: str) -> str:
    """One panel per row: its sample prompts (rows) x 8 frames (columns), titled with its scores."""
    plt = pyplot()
    fig, axes = plt.subplots(len(frames), 1, figsize=(8, 2.3 * len(frames)), squeeze=False)
    for ax, (row, videos) in zip(axes[:, 0], frames.items()):
        strips = [np.concatenate(list(to_uint8_frames(v)), axis=1) for v in videos]
        pad = np.full((1, strips[0].shape[1], 3), 255, dtype=np.uint8)
        img = np.concatenate([x for s in strips for x in (s, pad)][:-1], axis=0)
        ax.imshow(img, interpolation="nearest")
        ax.set_title(f"{LABELS[row]}: {scores[row]}", fontsize=9)
        h = strips[0].shape[0] + 1
        ax.set_yticks([h * i + h / 2 for i in range(len(prompts))], [p.removeprefix("a ") for p in prompts],
                      fontsize=7)
        ax.set_xticks([])
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--jobs", type=int, default=2, help="training runs at a time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per training run, and for the sampling")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "table5_mini"), help="output stem")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "outputs", "table5_mini"), help="run folders")
    ap.add_argument("--resume", action="store_true", help="keep the rows and seeds already in <out>.json")
    ap.add_argument("--bench", action="store_true", help="first measure the 31.5k-token steps (~20 min on 2 cores)")
    ap.add_argument("--allow-busy", action="store_true", help="--bench: keep a benchmark made on a busy machine")
    ap.add_argument("--bench-warmup", type=int, default=1, help="--bench: untimed steps first")
    ap.add_argument("--bench-iters", type=int, default=3, help="--bench: timed steps (median)")
    ap.add_argument("--latency-repeats", type=int, default=3,
                    help="timed samplings per row after a warm-up (the median is the latency)")
    ap.add_argument("--settle-s", type=float, default=180.0,
                    help="before the timing, wait at most this long for the load average to fall under the busy "
                         "line after the training runs (0: time at once)")
    ap.add_argument("--plot-only", action="store_true", help="rewrite the md from <out>.json (no picture)")
    ap.add_argument("--notes", default="", help="reading paragraph, or @file")
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.notes = read_notes(args.notes) if args.notes else ""
    args.machine = {**system_info(), "load_avg": load_average(), "jobs": args.jobs,
                    "threads_per_run_and_sampling": args.threads, "command": command(args.argv)}
    args.record_notes, args.measurement = {}, None
    records = []
    if (args.resume or args.plot_only) and os.path.isfile(args.out + ".json"):
        with open(args.out + ".json") as f:
            saved = json.load(f)
        records, args.machine = saved["results"], saved.get("machine", args.machine)
        args.record_notes = {k: v for k, v in saved.items() if k.startswith("note")}
        args.measurement = saved.get("measurement") if args.plot_only else None
    if args.plot_only:
        write_outputs(records, args)
        print(f"wrote {args.out}.md")
        return 0
    if args.bench:
        for preset in BENCH_PRESETS:
            # alone on the machine: every core
            bench(preset, os.cpu_count() or 1, args.allow_busy, args.bench_warmup, args.bench_iters)
    torch.set_num_threads(args.threads)
    partial = args.out + ".partial.json"  # runs trained since the last full write, so an interrupted table resumes
    if args.resume and os.path.isfile(partial):
        with open(partial) as f:
            keys = {(rec["row"], rec["seed"]) for rec in records}
            records += [rec for rec in json.load(f) if (rec["row"], rec["seed"]) not in keys]
    done = {(rec["row"], rec["seed"]) for rec in records if "error" not in rec}
    records = [rec for rec in records if (rec["row"], rec["seed"]) in done]
    todo = [(row, seed) for seed in args.seeds for row in args.rows if (row, seed) not in done]

    def on_done(item, rec):
        records.append(rec)
        kept = [r for r in records if "error" not in r]

        def dump(tmp):
            with open(tmp, "w") as f:
                json.dump(kept, f, indent=1)

        atomic_write(partial, dump)  # a kill mid-write leaves the previous partial record whole
        if "error" in rec:
            return f"{item[0]} seed {item[1]}: FAILED {rec['error_tail']}"
        return f"{item[0]} seed {item[1]}: eval loss {rec['metrics']['loss']:.4f} ({rec['seconds']:.0f} s)"

    run_parallel(lambda item: run_row(*item, args), todo, args.jobs, "Table 5 mini runs", on_done)
    # every row is sampled and timed here, one after the other, so the latencies share one machine state
    frames, scores = {}, {}
    trained = sorted((r for r in records if "error" not in r), key=lambda r: (r["seed"], list(ROWS).index(r["row"])))
    for rec in trained:  # a run folder that is gone cannot be timed again under this process's load
        rec.pop("latency_stale", None)
        if not os.path.isfile(checkpoint_of(rec)):
            rec["latency_stale"] = True
            print(f"{rec['row']} seed {rec['seed']}: no checkpoint in {rec['run_dir']}; its eval loss and following "
                  "are kept, its earlier latency is left out of the latency column", flush=True)
    if any(not r.get("latency_stale") for r in trained):
        wait_until_settled(args.settle_s)  # this table's own training runs just ended: their load lingers
    with Measurement(threads=args.threads) as load:
        for rec in (r for r in trained if not r.get("latency_stale")):
            measured = measure_row(rec, args.latency_repeats)
            videos = measured.pop("frames")
            rec.update(measured)
            n = rec["num_sample_prompts"]
            score = (f"{round(rec['sample_follow']['followed'] * n)}/{n} sample prompts, "
                     f"{rec['all_follow']['followed']:.0%} of 32 captions followed; eval loss "
                     f"{rec['metrics']['loss']:.4f}")
            if rec["row"] not in frames:  # the lowest seed's frames
                frames[rec["row"]], scores[rec["row"]] = videos, score
            print(f"{rec['row']} seed {rec['seed']}: {score}; sampling {rec['latency_s']:.2f} s", flush=True)
    args.measurement = load.record
    if frames:
        prompts = next(rec for rec in records if rec["row"] in frames)["sample_prompts"]
        print(f"wrote {plot_frames(frames, scores, prompts, args.out + '_frames.png')}")
    args.machine["load_avg_end"] = load_average()
    write_outputs(records, args)
    if os.path.isfile(partial):
        os.remove(partial)
    print(f"wrote {args.out}.md, .json")
    return 0 if all("error" not in rec for rec in records) else 1

