"""``make reproduce-table5``: run (or print) the Table 5 fine-tunes and sampling, write ``results/table5.md``.

    python -m tasks.video_gen.table5 --wan /data/Wan2.1-T2V-1.3B-Diffusers --data /data/videos [--run]

Without ``--run`` (or without the weights / data) it prints the commands of each row. The table holds the
paper's numbers, our measured per-step latency where a benchmark result exists
(``results/bench/video_wan1.3b_cuda.json`` from ``scripts/bench_video.py --preset wan1.3b``; the scaled-down
CPU result is listed separately), and marks the VBench columns as an external step (README).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = ("wan_flash", "wan_linear", "wan_mhla", "wan_mhla_hybrid")
BENCH_KEY = {"wan_flash": "softmax", "wan_linear": "linear", "wan_mhla": "mhla", "wan_mhla_hybrid": "mhla_hybrid"}


def commands(row: str, wan: str, data: str, gpus: int, prompts: str) -> list[str]:
    launch = f"torchrun --nproc_per_node={gpus} train.py" if gpus > 1 else "python train.py"
    run_dir = f"outputs/table5/{row}"
    return [
        f"{launch} experiment=table5/{row} model.pretrained={wan} data.root={data} hydra.run.dir={run_dir}",
        f"python -m tasks.video_gen.sample --ckpt {run_dir}/checkpoints/last.pt --wan {wan} --prompts {prompts} "
        f"--out results/video/samples",
    ]


def load_bench(name: str):
    path = os.path.join(ROOT, "results", "bench", name)
    return json.load(open(path)) if os.path.isfile(path) else None


def write_table(out: str) -> str:
    gpu, cpu = load_bench("video_wan1.3b_cuda.json"), load_bench("video_cpu_cpu.json")
    lines = ["# Table 5: Wan2.1-T2V-1.3B video generation (81 frames, 480 x 800, 31,500 tokens)", "",
             "Paper numbers beside ours. VBench (quality / semantic / total) is an EXTERNAL step: run VBench on the",
             "sample folders written by `python -m tasks.video_gen.sample` (README, video generation section).",
             "Fine-tuning needs the Wan2.1 weights and a video dataset on GPUs; neither was available here, so no",
             "VBench score of ours is reported.", "",
             "| attention | paper quality | paper semantic | paper total | paper latency (s) | ours VBench | "
             "ours step latency (ms, 1.3B, 31,500 tok) | ours speed-up | ours CPU scaled-down (ms) | CPU speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        p = yaml.safe_load(open(os.path.join(ROOT, "configs", "experiment", "table5", f"{row}.yaml")))["paper"]
        key = BENCH_KEY[row]
        cells = []
        for b in (gpu, cpu):
            r = b["results"].get(key) if b else None
            base = b["results"].get("softmax") if b else None
            cells += ([f"{r['median_s'] * 1e3:.1f}", f"{base['median_s'] / r['median_s']:.2f}x" if base else "-"]
                      if r else ["not measured", "-"])
        lines.append(f"| {p['row']} | {p['quality']} | {p['semantic']} | {p['total']} | {p['latency_s']} | external | "
                     + " | ".join(cells) + " |")
    lines += ["", "Paper latency: end-to-end sampling (50 steps with CFG); ours: one transformer forward (batch 1,",
              "no CFG), so compare ratios, not absolute values (paper: MHLA 166/81 = 2.05x, hybrid 1.61x)."]
    if gpu:
        lines.append(f"GPU benchmark: {gpu['device_name']}, {gpu['dtype']}, {gpu['tokens']} tokens.")
    if cpu:
        lines.append(f"CPU benchmark (scaled down, `--preset cpu`): {cpu['tokens']} tokens, {cpu['layers']} layers, "
                     f"{cpu['threads']} threads, measured on a shared, loaded 2-core machine.")
    text = "\n".join(lines) + "\n"
    with open(out, "w") as f:
        f.write(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wan", default=os.environ.get("WAN_PATH", ""), help="local Wan2.1-T2V-1.3B-Diffusers folder")
    ap.add_argument("--data", default=os.environ.get("VIDEO_DATA", ""), help="video folder (metadata.jsonl)")
    ap.add_argument("--prompts", default="prompts/vbench.txt", help="one prompt per line (VBench's prompt list)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--run", action="store_true", help="run the commands (else print them)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "table5.md"))
    args = ap.parse_args()
    ready = bool(args.wan and os.path.isdir(args.wan) and args.data and os.path.isdir(args.data))
    if not ready:
        print("Wan2.1 weights (--wan / WAN_PATH) or video data (--data / VIDEO_DATA) missing: printing the commands. "
              "Download Wan-AI/Wan2.1-T2V-1.3B-Diffusers to a local folder.")
    for row in ROWS:
        for cmd in commands(row, args.wan or "/path/to/Wan2.1-T2V-1.3B-Diffusers", args.data or "/path/to/videos",
                            args.gpus, args.prompts):
            print(("RUN  " if ready and args.run else "TODO ") + cmd)
            if ready and args.run:
                subprocess.run(cmd, shell=True, check=True, cwd=ROOT)
    print(write_table(args.out))
    print(f"wrote {args.out}; latency: python scripts/bench_video.py --preset wan1.3b --device cuda")


if __name__ == "__main__":
    sys.exit(main())
