"""Cross-attention on the video mini model: softmax (Wan's own) vs MHLA cross-attention vs linear
cross-attention.

    python -m scripts.tables.cross_mini --seeds 0 1 2     # results/video/cross_mini.{md,json,png}
    python -m scripts.tables.cross_mini --latency-only    # the latency part alone
    python -m scripts.tables.cross_mini --plot-only       # rewrite the md and picture from the .json

Rows (``ROWS``): ``python train.py task=video_mini attn_cross=<row> seed=S`` (the same model, data, steps and
sampling as the mini Table 5's MHLA row; only the text cross-attention changes; docs/cross_attention.md).
Then, in this process, one row after the other:

- **eval loss**: the run's held-out velocity loss (fixed times and noise: comparable across rows);
- **prompt following** (:mod:`tasks.video_gen.follow`): all 32 captions the data can draw, sampled with the
  run's ``sample.*`` settings (50 Euler steps, CFG 4), noise seed 0;
- **latency at a long condition** (``--lengths``, default 512, 4096, 16384 tokens): one denoiser forward
  of the model (random init, the trained video size, batch 2 as one CFG step), condition embeddings of that
  length; every row built in this process, warm-up forwards, then ``--repeats`` rounds that time each row once
  in turn (median and min), all inside one load guard (:class:`tasks.common.records.Measurement`): a busy
  machine is refused unless ``--allow-busy`` (then marked BUSY).

The results file is written through :func:`tasks.common.results.write_result` (``<out>.md``, ``.json``,
``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from tasks.common.evaluation import load_run
from tasks.common.launch import read_notes, run_parallel, run_training
from tasks.common.plots import pyplot, save_figure
from tasks.common.records import Measurement
from tasks.common.stats import mean_std, paired_lines, paired_summary
from tasks.common.utils import load_average, system_info
from tasks.video_gen.follow import SEED_METRICS, all_prompts, sample_and_check

from .registry import ROOT

ROWS = {  # row -> its overrides of task=video_mini (attn_cross: configs/attn_cross/)
    "softmax": ["attn_cross=native"],
    "mhla_cross": ["attn_cross=mhla_cross"],
    "linear_cross": ["attn_cross=linear_cross"],
}
LABELS = {"softmax": "softmax (Wan's own)", "mhla_cross": "MHLA cross (2x2x2 query x 3 key blocks)",
          "linear_cross": "linear cross"}


# ---------------------------------------------------------------------------------------- training
def run_row(row: str, seed: int, args) -> dict:
    """Train one row with ``train.py``; its record (command, seconds, metrics, run folder)."""
    run_dir = os.path.join(args.out_dir, f"{row}_s{seed}")
    rec = run_training(["task=video_mini", *ROWS[row], f"seed={seed}", "logger=none",
                        "trainer.progress_bar=false", f"hydra.run.dir={run_dir}", *args.extra],
                       threads=args.threads)
    rec.update(row=row, seed=seed, run_dir=os.path.abspath(run_dir))
    return rec


@torch.no_grad()
def follow_row(rec: dict) -> dict:
    """Prompt following of a trained row on all 32 captions (its own ``sample.*`` settings)."""
    cfg, task, model, info = load_run(os.path.join(rec["run_dir"], "checkpoints", "last.pt"))
    s = cfg.sample
    kw = dict(num_steps=int(s.num_steps), guidance_scale=float(s.guidance_scale), shift=float(s.shift))
    report = sample_and_check(task, model, all_prompts(), info.device, **kw)
    report.pop("videos")
    return {"all_follow": report, "sample_settings": kw}


# ----------------------------------------------------------------------------------------- latency
def build_row_model(row: str, extra: list[str]):
    """The video mini model of ``row`` (random init, seed 0) and its task, composed as ``train.py`` would."""
    from hydra import compose, initialize_config_dir  # noqa: PLC0415

    from tasks.common.config import register_resolvers  # noqa: PLC0415
    from tasks.common.task import task_class  # noqa: PLC0415

    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["task=video_mini", *ROWS[row], *extra])
    torch.manual_seed(0)
    task = task_class(cfg)(cfg)
    return task.build_model().eval(), task, cfg


@torch.no_grad()
def measure_latency(rows: list[str], lengths: list[int], args) -> list[dict]:
    """Median / min seconds of one denoiser forward per (row, condition length); rows timed in turn each
    round."""
    models = {row: build_row_model(row, args.latency_extra) for row in rows}
    out = []
    for length in lengths:
        inputs = {}
        for row, (model, task, cfg) in models.items():
            g = torch.Generator().manual_seed(length)
            x = torch.randn(task.latent_shape(2), generator=g)
            text = torch.randn(2, length, int(cfg.model.text_dim), generator=g)  # condition embeddings
            inputs[row] = (x, torch.tensor([0.3, 0.7]), text)
        for _ in range(args.warmup):
            for row, (model, _, _) in models.items():
                model(*inputs[row])
        times = {row: [] for row in models}
        for _ in range(args.repeats):
            for row, (model, _, _) in models.items():
                t0 = time.perf_counter()
                model(*inputs[row])
                times[row].append(time.perf_counter() - t0)
        for row, ts in times.items():
            out.append({"row": row, "length": length, "tokens": int(inputs[row][0][0, 0].numel()),
                        "median_s": statistics.median(ts), "min_s": min(ts),
                        "times_s": [round(t, 5) for t in ts]})
            print(f"latency {row} at {length} condition tokens: median {1e3 * out[-1]['median_s']:.1f} ms",
                  flush=True)
    return out


# ---------------------------------------------------------------------------------------- writing
def fmt(xs: list[float], pct: bool = False, digits: int = 4) -> str:
    if not xs:
        return "-"
    m, s = mean_std(xs)
    if pct:
        return f"{100 * m:.0f} ± {100 * s:.0f}% (n={len(xs)})"
    return f"{m:.{digits}f} ± {s:.{digits}f} (n={len(xs)})"


def to_markdown(data: dict) -> str:
    records, latency, machine = data["records"], data.get("latency") or [], data["machine"]
    lengths = sorted({r["length"] for r in latency})
    lat = {(r["row"], r["length"]): r for r in latency}
    rows = [r for r in ROWS if any(rec["row"] == r for rec in records) or any(k[0] == r for k in lat)]
    head = ("| cross-attention | eval loss | all 32 captions followed | shape told apart (32) | "
            + " | ".join(f"forward, {n} condition tokens (ms; vs softmax)" for n in lengths) + " |")
    lines = [
        "# Cross-attention on the video mini model: softmax vs MHLA cross vs linear cross (CPU)", "",
        "Each row: `python train.py task=video_mini attn_cross=<row> seed=S` (the 4-layer, width-64 "
        "Wan-shaped model in pixel space, MHLA self-attention, 8 frames x 16 x 16 px = 512 tokens; the "
        "captions are 3 words, one token each; only the text cross-attention changes; "
        "docs/cross_attention.md). Eval loss: held-out velocity MSE at fixed times and noise. Prompt "
        "following (`tasks/video_gen/follow.py`) on all 32 captions (4 colours x 2 shapes x 4 directions, "
        "noise seed 0) with the run's sampling settings. Mean ± std over seeds.", "",
        "Latency: one denoiser forward (batch 2, one CFG step) of the random-init model at the trained video "
        "size with a condition of that many embedding tokens, every row built in one process and timed in "
        "turn "
        f"({machine.get('warmup', '?')} warm-up rounds, {machine.get('repeats', '?')} timed rounds, median), "
        f"{machine.get('latency_threads', '?')} thread(s).", "",
        f"Command: `{machine.get('command', '?')}`"
        + (f"; the training runs: `{machine['training_command']}`" if machine.get("training_command") else ""), "",
        f"Machine: {json.dumps({k: v for k, v in machine.items() if k != 'command'})}", "",
        head, "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        recs = [rec for rec in records if rec["row"] == r and "error" not in rec and "all_follow" in rec]
        failed = [rec for rec in records if rec["row"] == r and "error" in rec]
        cells = [fmt([rec["metrics"]["loss"] for rec in recs]),
                 fmt([rec["all_follow"]["followed"] for rec in recs], pct=True),
                 fmt([rec["all_follow"]["shape_ok"] for rec in recs], pct=True)]
        if failed and not recs:
            cells = [f"failed ({len(failed)})", "", ""]
        for n in lengths:
            m, soft = lat.get((r, n)), lat.get(("softmax", n))
            cells.append("-" if m is None else f"{1e3 * m['median_s']:.1f}"
                         + (f" ({soft['median_s'] / m['median_s']:.2f}x)" if soft else ""))
        lines.append(f"| {LABELS[r]} | " + " | ".join(cells) + " |")
    paired = data["paired"] if "paired" in data else paired_summary(records, PAIRS, SEED_METRICS)
    lines += paired_lines(paired)
    lines += ["", "Raw records (per seed: metrics, per-caption checks, commands; latency: every timed "
              f"forward): `{os.path.basename(data['stem'])}.json`."]
    if data.get("notes"):
        lines += ["", "## Reading", "", data["notes"].strip()]
    return "\n".join(lines) + "\n"


PAIRS = (("mhla_cross", "softmax"), ("mhla_cross", "linear_cross"), ("linear_cross", "softmax"))


def latency_ratios(latency: list[dict]) -> dict:
    """``{"a/b": {length: median a / median b}}`` for softmax over each linear-cost row and MHLA cross over
    linear cross (how much faster the second is; the md's "vs softmax" column is the first kind)."""
    med = {(r["row"], r["length"]): r["median_s"] for r in latency}
    out = {}
    for a, b in (("softmax", "mhla_cross"), ("softmax", "linear_cross"), ("mhla_cross", "linear_cross")):
        ratios = {str(n): med[(a, n)] / med[(b, n)] for (row, n) in med if row == a and (b, n) in med}
        if ratios:
            out[f"{a}/{b}"] = ratios
    return out


def plot(data: dict, path: str) -> None:
    latency = data.get("latency") or []
    if not latency:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for row in ROWS:
        pts = sorted((r["length"], 1e3 * r["median_s"]) for r in latency if r["row"] == row)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=LABELS[row])
    ax.set_xscale("log")
    ax.set_xlabel("condition tokens")
    ax.set_ylabel("forward (ms, median)")
    ax.set_title("video mini model, batch 2, CPU", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def write(data: dict, args, measurement: dict | None = None) -> None:
    """Write the results files; ``measurement``: the latency's fresh load-guard record (judged here: a busy
    one is refused unless ``--allow-busy``). Later writes carry it in ``data["measurement"]`` (a BUSY mark
    stays)."""
    from tasks.common.results import write_result  # noqa: PLC0415

    record = {k: v for k, v in data.items() if not (k == "measurement" and measurement is not None)}
    record["paired"] = paired_summary(data.get("records", []), PAIRS, SEED_METRICS)
    record["latency_ratios"] = latency_ratios(data.get("latency") or [])
    write_result(data["stem"], to_markdown(record), record, lambda p: plot(data, p),
                 measurement=measurement, allow_busy=args.allow_busy)
    if measurement is not None:
        data["measurement"] = measurement


# ------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="training runs at a time")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per training run, and for the sampling")
    ap.add_argument("--latency-threads", type=int, default=None,
                    help="threads for the latency (default: all)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 16384], help="condition lengths timed")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--allow-busy", action="store_true",
                    help="write a latency measured on a busy machine (marked BUSY)")
    ap.add_argument("--latency-only", action="store_true", help="only the latency part (no training)")
    ap.add_argument("--no-latency", action="store_true", help="only the training part")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "video", "cross_mini"), help="output stem")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "outputs", "cross_mini"), help="run folders")
    ap.add_argument("--resume", action="store_true", help="keep the rows and seeds already in <out>.json")
    ap.add_argument("--plot-only", action="store_true", help="rewrite the md and picture from <out>.json")
    ap.add_argument("--notes", default="", help="reading paragraph, or @file")
    ap.add_argument("--latency-extra", nargs="*", default=[], help="Hydra overrides of the timed models only")
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides for every training run")
    args = ap.parse_args(argv)
    argv_list = list(argv if argv is not None else sys.argv[1:])
    command = f"python -m scripts.tables.cross_mini {' '.join(argv_list)}".rstrip()
    data = {"stem": args.out, "records": [], "latency": [],
            "notes": read_notes(args.notes) if args.notes else "",
            "machine": {**system_info(), "load_avg": load_average(), "jobs": args.jobs,
                        "threads": args.threads,
                        "command": command}}
    if (args.resume or args.plot_only) and os.path.isfile(args.out + ".json"):
        saved = json.load(open(args.out + ".json"))
        saved["stem"] = args.out
        if args.notes:
            saved["notes"] = data["notes"]
        data = saved
    if args.plot_only:
        write(data, args)
        print(f"wrote {args.out}.md")
        return 0
    if not args.no_latency:
        threads = args.latency_threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        data["machine"].update(latency_threads=threads, warmup=args.warmup, repeats=args.repeats,
                               latency_command=command)
        with Measurement(threads=threads) as m:
            data["latency"] = measure_latency(args.rows, args.lengths, args)
        write(data, args, m.record)  # the latency is on disk before the long training part
    if not args.latency_only:
        data["machine"]["training_command"] = command
        torch.set_num_threads(args.threads)
        done = {(r["row"], r["seed"]) for r in data["records"] if "error" not in r and "all_follow" in r}
        data["records"] = [r for r in data["records"] if (r["row"], r["seed"]) in done]
        todo = [(row, seed) for seed in args.seeds for row in args.rows if (row, seed) not in done]

        def on_done(item, rec):
            if "error" not in rec:
                rec.update(follow_row(rec))  # sampled as each run ends (the runs share the cores)
            data["records"].append(rec)
            write(data, args)
            if "error" in rec:
                return f"{item[0]} seed {item[1]}: FAILED {rec['error_tail']}"
            return (f"{item[0]} seed {item[1]}: eval loss {rec['metrics']['loss']:.4f}, "
                    f"{rec['all_follow']['followed']:.0%} of 32 captions followed ({rec['seconds']:.0f} s)")

        run_parallel(lambda item: run_row(*item, args), todo, args.jobs, "cross-attention mini runs", on_done)
    data["machine"]["load_avg_end"] = load_average()
    write(data, args)
    print(f"wrote {args.out}.md, .json")
    return 0 if all("error" not in r for r in data["records"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
