"""``make reproduce-table5``: Table 5's rows (each row's config, its commands: fine-tune, then sample; the sampling
of the evaluation-only row), running or printing them, and ``results/table5.md``.

    python scripts/reproduce_table.py --table 5 -- --wan /data/Wan2.1-T2V-1.3B-Diffusers --data /data/videos [--run]
    python scripts/reproduce_table.py --table 5 --plot-only      # redraw results/table5.png
    python -m scripts.tables.table5 --sample-pretrained wan_flash --wan /data/Wan2.1-T2V-1.3B-Diffusers \
        --prompts prompts/vbench.txt          # an evaluation-only row: sample the pretrained weights

Each row is its experiment config (``configs/experiment/table5/<row>.yaml``, composed with Hydra). A row with
``task.finetune: false`` (FlashAttention: the paper evaluates the pretrained Wan2.1-T2V-1.3B, not fine-tuned) is
evaluation-only: no ``train.py`` command, its videos are sampled from ``model.pretrained`` directly
(:func:`sample_pretrained`, ``--sample-pretrained``). The other rows are fine-tuned, then sampled from their
checkpoint (``tasks.video_gen.sample``). Every row samples with its config's ``sample.*`` settings (steps, CFG,
shift, seed).

Without ``--run`` (or without the weights / data) it prints the commands of each row. The table holds the
paper's numbers, our measured per-step latency where a benchmark result exists
(``results/bench/video_wan1.3b_cuda.json`` from ``scripts/bench_video.py --preset wan1.3b``; the scaled-down
CPU result, ``results/bench/video_cpu.json``, is listed separately), and marks the VBench columns as an
external step (docs/tasks/video.md). ``results/table5.png`` sets the latency ratios side by side (``--plot-only``
redraws it); ``results/table5.json`` holds the rows, the benchmarks they quote and, after ``--run``, each row's
``run.json`` (resolved config, commit, machine, load).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

from omegaconf import OmegaConf

from tasks.common import results
from tasks.common.plots import grouped_bars, pyplot, save_figure
from tasks.common.records import read_run_record
from tasks.common.results import write_result

from .registry import CONFIGS, ROOT

ROWS = ("wan_flash", "wan_linear", "wan_mhla", "wan_mhla_hybrid")
SAMPLES = "results/video/samples"


def row_config(row: str, overrides=()):
    """The composed config of Table 5 row ``row`` (``experiment=table5/<row>`` plus ``overrides``)."""
    from hydra import compose, initialize_config_dir  # noqa: PLC0415

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=[f"experiment=table5/{row}", *overrides])


def finetunes(cfg) -> bool:
    """False for an evaluation-only row (``task.finetune: false``): sampled from the pretrained weights."""
    return bool(cfg.task.get("finetune", True))


def sample_settings(cfg) -> dict:
    s = cfg.sample
    return {"steps": int(s.num_steps), "cfg": float(s.guidance_scale), "shift": float(s.shift),
            "seed": int(s.get("seed", 0))}


def commands(row: str, wan: str, data: str, gpus: int, prompts: str, cfg=None) -> list[str]:
    cfg = row_config(row) if cfg is None else cfg
    if not finetunes(cfg):  # evaluation only: no fine-tuning, sample the pretrained weights
        return [f"python -m scripts.tables.table5 --sample-pretrained {row} --wan {wan} --prompts {prompts} "
                f"--samples-out {SAMPLES}"]
    launch = f"torchrun --nproc_per_node={gpus} train.py" if gpus > 1 else "python train.py"
    run_dir = f"outputs/table5/{row}"
    flags = " ".join(f"--{k} {v}" for k, v in sample_settings(cfg).items())
    return [
        f"{launch} experiment=table5/{row} model.pretrained={wan} data.root={data} hydra.run.dir={run_dir}",
        f"python -m tasks.video_gen.sample --ckpt {run_dir}/checkpoints/last.pt --wan {wan} --prompts {prompts} "
        f"{flags} --out {SAMPLES}",
    ]


def read_prompts(prompts) -> list[str]:
    """A list of prompts, or one ``.txt`` file with one prompt per line."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if len(prompts) == 1 and prompts[0].endswith(".txt"):
        with open(prompts[0], encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise SystemExit("no prompts: pass --prompts 'a cat ...' or --prompts file.txt")
    return prompts


def sample_pretrained(row: str, wan: str | None, prompts, out: str = SAMPLES, *, overrides=(), device=None,
                      dtype=None, batch_size: int = 1, progress: bool = True) -> str:
    """Sample an evaluation-only row (``task.finetune: false``) from its pretrained weights, no training.

    Writes ``<out>/<row>_steps<S>_cfg<G>_shift<s>_seed<n>/<index>_<prompt slug>.mp4`` / ``.gif`` and
    ``prompts.txt``, the layout ``tasks.video_gen.sample`` writes for the fine-tuned rows (VBench reads it).
    Returns that folder.
    """
    # torch and the Wan stack only here: writing the table and printing the commands need neither
    import torch  # noqa: PLC0415

    from tasks.video_gen.media import save_gif, save_mp4  # noqa: PLC0415
    from tasks.video_gen.sample import slug  # noqa: PLC0415
    from tasks.video_gen.task import VideoGenTask  # noqa: PLC0415

    cfg = row_config(row, [*overrides, *([f"model.pretrained={wan}"] if wan else [])])
    if finetunes(cfg):
        raise SystemExit(f"table5/{row} is fine-tuned (task.finetune=true): train it, then sample its checkpoint "
                         "with python -m tasks.video_gen.sample")
    prompts = read_prompts(prompts)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    task = VideoGenTask(cfg)
    model = task.build_model().to(device, dtype).eval()
    st = sample_settings(cfg)
    folder = os.path.join(out, f"{row}_steps{st['steps']}_cfg{st['cfg']}_shift{st['shift']}_seed{st['seed']}")
    videos = task.generate(model, prompts, device, num_steps=st["steps"], guidance_scale=st["cfg"],
                           shift=st["shift"], seed=st["seed"], batch_size=batch_size, progress=progress)
    fps = int(cfg.sample.get("fps", 16))
    for i, (p, v) in enumerate(zip(prompts, videos)):
        stem = os.path.join(folder, f"{i:04d}_{slug(p)}")
        save_mp4(v, stem + ".mp4", fps=fps)
        save_gif(v, stem + ".gif", fps=fps)
    with open(os.path.join(folder, "prompts.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(prompts) + "\n")
    print(f"wrote {len(videos)} videos of {row} (pretrained, not fine-tuned) to {folder}")
    return folder


def missing_row_inputs(wan: str | None, data: str | None) -> list[str]:
    """What the rows need and is not here (:func:`tasks.common.config.missing_inputs` of each row's config with
    ``--wan`` as ``model.pretrained`` and ``--data`` as ``data.root``), each message once."""
    from tasks.common.config import missing_inputs  # noqa: PLC0415

    given = [f"model.pretrained={wan}" if wan else "model.pretrained=null", f"data.root={data}" if data else
             "data.root=null"]
    return list(dict.fromkeys(m for row in ROWS for m in missing_inputs(row_config(row, given))))


def row_settings(cfg) -> str:
    """What distinguishes a row's self-attention and training, in words (for the results file)."""
    from models.wan import NATIVE, attention_layers  # noqa: PLC0415  (diffusers)

    from tasks.common.config import model_attention  # noqa: PLC0415

    a = model_attention(cfg)  # the attention as the model builds it (null options resolved)
    if a["name"] in NATIVE:  # Wan's own softmax processor
        attn = "softmax (the model's own SDPA / FlashAttention)"
    else:
        norm = ("normalised" if a.get("normalize") not in (False, None) else "no normalizer") + (
            ", output RMSNorm" if a.get("out_norm") else ", no output norm")
        layers = attention_layers(a, int(cfg.model.num_layers))
        soft = [i for i in range(int(cfg.model.num_layers)) if i not in layers]
        blocks = a.get("blocks")
        attn = (f"{a['name']} ({norm}, RoPE {a.get('rope')}" + (f", M = {math.prod(blocks)} blocks "
                                                                 f"{'x'.join(map(str, blocks))}" if blocks else "")
                + ")" + (f", softmax kept at layers {', '.join(map(str, soft))}" if soft else ", every layer"))
    train = (f"fine-tuned {int(cfg.trainer.max_steps)} steps at batch {int(cfg.data.batch_size)} per GPU"
             if finetunes(cfg) else "not fine-tuned")
    return f"{attn}; {train}"


BENCH_KEY = {"wan_flash": "softmax", "wan_linear": "linear", "wan_mhla": "mhla", "wan_mhla_hybrid": "mhla_hybrid"}


def load_bench(name: str):
    path = os.path.join(ROOT, "results", "bench", name)
    return json.load(open(path)) if os.path.isfile(path) else None


def paper_rows() -> list[tuple[str, dict, int]]:
    """``(row, paper numbers, fine-tuning steps or 0)`` per Table 5 row, from its experiment config."""
    out = []
    for row in ROWS:
        cfg = row_config(row)
        out.append((row, OmegaConf.to_container(cfg.paper, resolve=True),
                    int(cfg.trainer.max_steps) if finetunes(cfg) else 0))
    return out


def row_notes() -> list[str]:
    """Per row: its settings and its assumptions (``assumptions:`` of its config), as markdown lines."""
    from tasks.common.config import assumptions  # noqa: PLC0415

    lines = []
    for row in ROWS:
        cfg = row_config(row)
        lines.append(f"- {cfg.paper.row} (`experiment=table5/{row}`): {row_settings(cfg)}.")
        lines += [f"  - ASSUMPTION {k}: {v}" for k, v in assumptions(cfg).items()]
    return lines


def bench_conditions(b: dict) -> str:
    """How a benchmark's machine was: its measurement (commit, load) when it has one."""
    m = b.get("measurement")
    if not m:
        return "measured on a shared, loaded 2-core machine"
    return (f"measured on a {'BUSY' if m.get('busy') else 'idle'} machine ({results.load_summary(m)})")


def write_table(out: str) -> str:
    """``results/table5.md`` (``out``), ``.json`` (the rows, the benchmarks they quote, each row's ``run.json``
    where its run folder has one) and ``.png``; returns the markdown."""
    gpu, cpu = load_bench("video_wan1.3b_cuda.json"), load_bench("video_cpu.json")
    rows = paper_rows()
    lines = ["# Table 5: Wan2.1-T2V-1.3B video generation (81 frames, 480 x 800, 31,500 tokens)", "",
             "Paper numbers beside ours. VBench (quality / semantic / total) is an EXTERNAL step: run VBench on the",
             "sample folders written by `python -m tasks.video_gen.sample` (fine-tuned rows) and",
             "`python -m scripts.tables.table5 --sample-pretrained wan_flash` (docs/tasks/video.md).",
             "Fine-tuning needs the Wan2.1 weights and a video dataset on GPUs; neither was available here, so no",
             "VBench score of ours is reported.", "",
             "| attention | paper quality | paper semantic | paper total | paper latency (s) | ours VBench | "
             "ours step latency (ms, 1.3B, 31,500 tok) | ours speed-up | ours CPU scaled-down (ms) | CPU speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    records = []
    for row, p, steps in rows:
        key = BENCH_KEY[row]
        cells, ours = [], {}
        for name, b in (("gpu", gpu), ("cpu", cpu)):
            r = b["results"].get(key) if b else None
            base = b["results"].get("softmax") if b else None
            cells += ([f"{r['median_s'] * 1e3:.1f}", f"{base['median_s'] / r['median_s']:.2f}x" if base else "-"]
                      if r else ["not measured", "-"])
            if r:
                ours[f"{name}_step_ms"] = r["median_s"] * 1e3
                ours.update({f"{name}_speedup": base["median_s"] / r["median_s"]} if base else {})
        run = read_run_record(os.path.join(ROOT, "outputs", "table5", row))
        records.append({"row": row, "paper": p, "finetune_steps": steps, "ours": ours, **({"run": run} if run else {})})
        lines.append(f"| {p['row']} | {p['quality']} | {p['semantic']} | {p['total']} | {p['latency_s']} | external | "
                     + " | ".join(cells) + " |")
    lines += ["", "Rows: " + "; ".join(f"{p['row']}: fine-tuned {n} steps" if n else
                                       f"{p['row']}: the pretrained Wan2.1-T2V-1.3B, not fine-tuned "
                                       "(task.finetune=false)" for _, p, n in rows) + ".",
              "", "Paper latency: end-to-end sampling (50 steps with CFG); ours: one transformer forward (batch 1,",
              "no CFG), so compare ratios, not absolute values (paper: MHLA 166/81 = 2.05x, hybrid 1.61x)."]
    if gpu:
        lines.append(f"GPU benchmark: {gpu['device_name']}, {gpu['dtype']}, {gpu['tokens']} tokens.")
    if cpu:
        lines.append(f"CPU benchmark (scaled down, `--preset cpu`): {cpu['tokens']} tokens, {cpu['layers']} layers, "
                     f"{cpu['threads']} threads, {bench_conditions(cpu)}.")
    lines += ["", "Row settings and assumptions (where the paper is silent: the authors' release; each row's config "
              "lists them under `assumptions:`):", "", *row_notes(), "",
              "The CPU proxy (`make reproduce-table5 SCALE=mini`, results/table5_mini.md) keeps task=video_mini's own "
              "settings: its linear row has no normalizer and an output RMSNorm like its MHLA rows, and its hybrid "
              "keeps softmax at layer 2 of 4."]
    png = os.path.splitext(out)[0] + ".png"
    if gpu or cpu:
        lines += ["", f"Plot: `{os.path.basename(png)}` (speed-up over FlashAttention / softmax per attention: the "
                      "paper's sampling latency beside our per-step latency; redraw with `python "
                      "scripts/reproduce_table.py --table 5 --plot-only`)."]
    text = "\n".join(lines) + "\n"
    benches = {name: {"file": f"results/bench/{f}", "date": (b.get("machine") or {}).get("date"),
                      **({"measurement": b["measurement"]} if b.get("measurement") else {})}
               for name, f, b in (("gpu", "video_wan1.3b_cuda.json", gpu), ("cpu", "video_cpu.json", cpu)) if b}
    write_result(os.path.splitext(out)[0], text, {"table": "5", "rows": records, "benchmarks": benches},
                 (lambda path: plot_table5(rows, gpu, cpu, path)) if gpu or cpu else None, indent=2)
    return text


def plot_table5(rows: list[tuple[str, dict, int]], gpu: dict | None, cpu: dict | None, path: str) -> str | None:
    """Speed-up over the first row (FlashAttention / softmax) per attention, as grouped bars: the paper's
    end-to-end sampling latency, then ours per step (GPU at the paper's size, the scaled-down CPU model) where
    measured. Nothing is drawn (None) when no benchmark of ours exists: the paper's ratios alone need no plot."""
    if not (gpu or cpu):
        return None
    groups, series = ["paper: sampling\n(50 steps, CFG)"], {}
    for _, p, _ in rows:
        series.setdefault(p["row"], {})[groups[0]] = rows[0][1]["latency_s"] / p["latency_s"]
    for name, b in (("ours: one step, 1.3B\n31,500 tokens (GPU)", gpu),
                    (f"ours: one step, scaled down\n{(cpu or {}).get('tokens')} tokens (CPU)", cpu)):
        base = (b or {}).get("results", {}).get("softmax")
        if not base:
            continue
        groups.append(name)
        for row, p, _ in rows:
            r = b["results"].get(BENCH_KEY[row])
            if r:
                series[p["row"]][name] = base["median_s"] / r["median_s"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(3 + 2.6 * len(groups), 4.2))
    grouped_bars(ax, groups, series, "speed-up over FlashAttention / softmax", "Table 5: latency ratios (higher "
                 "is faster)", annotate="{:.2f}x", legend="outside")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.margins(y=0.12)
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wan", default=os.environ.get("WAN_PATH", ""), help="local Wan2.1-T2V-1.3B-Diffusers folder")
    ap.add_argument("--data", default=os.environ.get("VIDEO_DATA", ""), help="video folder (metadata.jsonl)")
    ap.add_argument("--prompts", default="prompts/vbench.txt", help="one prompt per line (VBench's prompt list)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--run", action="store_true", help="run the commands (else print them)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "table5.md"))
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw the plot beside --out (.png) from the paper's numbers and results/bench/video_*.json")
    ap.add_argument("--sample-pretrained", metavar="ROW",
                    help="sample an evaluation-only row (task.finetune=false) from --wan, then stop")
    ap.add_argument("--samples-out", default=SAMPLES, help="--sample-pretrained: folder of the sample folders")
    ap.add_argument("--batch-size", type=int, default=1, help="--sample-pretrained: prompts per sampling batch")
    args = ap.parse_args(argv)
    if args.sample_pretrained:
        if not (args.wan and os.path.isdir(args.wan)):
            raise SystemExit("--sample-pretrained needs the Wan2.1 weights: --wan /path/to/Wan2.1-T2V-1.3B-Diffusers")
        sample_pretrained(args.sample_pretrained, args.wan, args.prompts, args.samples_out,
                          batch_size=args.batch_size)
        return 0
    if args.plot_only:
        png = plot_table5(paper_rows(), load_bench("video_wan1.3b_cuda.json"), load_bench("video_cpu.json"),
                          os.path.splitext(args.out)[0] + ".png")
        print(f"wrote {png}" if png else "no benchmark of ours in results/bench: no plot")
        return 0
    missing = missing_row_inputs(args.wan, args.data)
    ready = not missing
    if missing:
        print("The rows' declared inputs (`inputs:` of configs/task/wan_finetune.yaml) are not all here: "
              + ("nothing runs" if args.run else "printing the commands") + ".\n- " + "\n- ".join(missing))
        if args.run:
            return 2
    for row in ROWS:
        for cmd in commands(row, args.wan or "/path/to/Wan2.1-T2V-1.3B-Diffusers", args.data or "/path/to/videos",
                            args.gpus, args.prompts):
            print(("RUN  " if ready and args.run else "TODO ") + cmd)
            if ready and args.run:
                subprocess.run(cmd, shell=True, check=True, cwd=ROOT)
    print(write_table(args.out))
    print(f"wrote {args.out}; latency: python scripts/bench_video.py --preset wan1.3b --device cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
