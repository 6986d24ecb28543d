"""Sample videos from a trained checkpoint (or the pretrained Wan2.1) into a folder named by the settings.

    python -m tasks.video_gen.sample --ckpt outputs/table5/wan_mhla/checkpoints/last.pt \
        --wan /data/Wan2.1-T2V-1.3B-Diffusers --prompts prompts.txt --out results/video/samples
    python -m tasks.video_gen.sample --ckpt outputs/video_mini_run/checkpoints/last.pt   # the CPU mini model

Defaults are the paper's / Wan's: 50 Euler steps, CFG 5.0, shift 3.0. Writes
``<out>/<run>_steps50_cfg5.0_shift3.0_seed0/<index>_<prompt slug>.mp4`` and ``.gif`` (one per prompt, the
layout VBench's custom-prompt mode reads: point VBench at that folder; docs/tasks/video.md). ``--encode-only`` writes the
UMT5 embeddings of the prompts to ``--text-emb-dir`` and stops (precomputed text embeddings).
"""

from __future__ import annotations

import argparse
import os
import re

import torch
from omegaconf import OmegaConf

from tasks.common.checkpoint import run_config
from tasks.video_gen.media import save_gif, save_mp4
from tasks.video_gen.task import VideoGenTask


def slug(text: str, n: int = 60) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "_", text).strip("_")[:n] or "empty"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="checkpoints/last.pt of a train.py run (holds its config)")
    ap.add_argument("--wan", default=None, help="local Wan2.1 diffusers folder (VAE, text encoder); overrides the run's")
    ap.add_argument("--prompts", nargs="+", default=None, help="prompts, or one .txt file with one prompt per line")
    ap.add_argument("--out", default="results/video/samples")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cfg", type=float, default=5.0)
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--fps", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    ap.add_argument("--text-emb-dir", default=None)
    ap.add_argument("--encode-only", action="store_true")
    args = ap.parse_args(argv)

    state = torch.load(args.ckpt, map_location="cpu", weights_only=False)
    cfg = run_config(state)
    if args.wan:
        cfg.model.pretrained = args.wan
    if args.text_emb_dir:
        cfg.data.text_emb_dir = args.text_emb_dir
    prompts = args.prompts or list(cfg.get("sample", {}).get("prompts", []))
    if len(prompts) == 1 and prompts[0].endswith(".txt"):
        with open(prompts[0]) as f:
            prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise SystemExit("no prompts: pass --prompts 'a cat ...' or --prompts file.txt")
    device = torch.device(args.device)
    task = VideoGenTask(cfg)
    if args.encode_only:
        task.prompts(device)(prompts + [""])
        print(f"cached {len(prompts) + 1} embeddings in {cfg.data.text_emb_dir}")
        return
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    model = task.build_model()
    model.load_state_dict(state["model"])
    model = model.to(device, dtype).eval()
    run = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(args.ckpt))))
    folder = os.path.join(args.out, f"{run}_steps{args.steps}_cfg{args.cfg}_shift{args.shift}_seed{args.seed}")
    videos = task.generate(model, prompts, device, num_steps=args.steps, guidance_scale=args.cfg, shift=args.shift,
                           seed=args.seed, batch_size=args.batch_size)
    for i, (p, v) in enumerate(zip(prompts, videos)):
        stem = os.path.join(folder, f"{i:04d}_{slug(p)}")
        save_mp4(v, stem + ".mp4", fps=args.fps)
        save_gif(v, stem + ".gif", fps=args.fps)
    with open(os.path.join(folder, "prompts.txt"), "w") as f:
        f.write("\n".join(prompts) + "\n")
    print(f"wrote {len(videos)} videos to {folder}")


if __name__ == "__main__":
    main()
