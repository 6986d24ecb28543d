"""Does a sampled moving-shape clip follow its prompt? Colour in every frame, motion along the asked axis, shape.

The mini task's prompts are ``"a <color> <shape> moving <direction>"`` (:mod:`tasks.video_gen.data`). A clip
``[3, F, H, W]`` in [-1, 1] follows its prompt when

- **colour**: in every frame, at least ``min_pixels`` pixels are of the asked colour (nearest colour of the
  palette + background, within ``color_tol``), and they are the majority of the frame's coloured pixels;
- **motion**: the centroid of those pixels moves the asked way by at least ``min_move`` x the frame size, from
  the first ``edge`` frames to the last ``edge`` frames (mean centroids);
- **axis**: it moves more along the asked direction than across it.

The shape is reported, not required: the fill ratio of the coloured pixels in their bounding box (a square fills
it, a circle about pi / 4 of it), averaged over frames, called a square above ``square_fill``. At 16 px (shapes of
radius 2-3 px) the two overlap; :func:`shape_separability` measures how well this rule tells the training
renders apart at a given size.

    from tasks.video_gen.follow import follow_report
    report = follow_report(videos, prompts)      # {"followed": 0.75, "per_prompt": [...], ...}
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from tasks.common.evaluation import load_run

from .data import COLORS, DIRECTIONS, SHAPES, MovingShapes

BACKGROUND = (-0.8, -0.8, -0.8)
# what a video table compares seed by seed (tasks.common.stats.paired_summary):
# (name, value of a run record, higher is better, digits)
SEED_METRICS = (("eval loss", lambda rec: rec["metrics"]["loss"], False, 4),
                ("captions followed (%)", lambda rec: 100 * rec["all_follow"]["followed"], True, 1))


def color_labels(video: torch.Tensor, color_tol: float = 0.9) -> torch.Tensor:
    """``[3, F, H, W]`` -> ``[F, H, W]`` long: index into ``list(COLORS)`` of each pixel's nearest palette colour,
    ``-1`` for the background or a pixel farther than ``color_tol`` from every colour."""
    palette = torch.tensor([BACKGROUND, *COLORS.values()], dtype=video.dtype, device=video.device)  # [1 + C, 3]
    dist = (video.permute(1, 2, 3, 0).unsqueeze(-2) - palette).norm(dim=-1)  # [F, H, W, 1 + C]
    best, idx = dist.min(dim=-1)
    labels = idx - 1  # background -> -1
    return torch.where(best <= color_tol, labels, torch.full_like(labels, -1))


def check_prompt(video: torch.Tensor, prompt: str, *, min_pixels: int = 4, min_move: float = 0.08,
                 edge: int = 2, color_tol: float = 0.9, square_fill: float = 0.9) -> dict:
    """One clip ``[3, F, H, W]`` against its prompt -> the three checks, the measurements and ``ok`` (all three)."""
    words = prompt.split()
    color, shape, direction = words[1], words[2], words[4]
    labels = color_labels(video.float(), color_tol)
    num_frames, height, width = labels.shape
    mask = labels == list(COLORS).index(color)  # [F, H, W]
    counts = mask.flatten(1).sum(1)
    colored = (labels >= 0).flatten(1).sum(1)
    color_ok = bool(((counts >= min_pixels) & (2 * counts > colored)).all())
    yy, xx = torch.meshgrid(torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32),
                            indexing="ij")
    m = mask.float()
    area = m.flatten(1).sum(1).clamp_min(1)
    cy, cx = (m * yy).flatten(1).sum(1) / area, (m * xx).flatten(1).sum(1) / area  # [F] centroids (px)
    seen = counts > 0
    if seen.sum() >= 2:
        idx = seen.nonzero().flatten()
        first, last = idx[:edge], idx[-edge:]
        dy = float(cy[last].mean() - cy[first].mean()) / height
        dx = float(cx[last].mean() - cx[first].mean()) / width
    else:
        dy = dx = 0.0
    ay, ax = DIRECTIONS[direction]
    along, across = ay * dy + ax * dx, abs(ax * dy - ay * dx)
    fills = []
    for f in range(num_frames):
        if counts[f] >= min_pixels:
            ys, xs = mask[f].nonzero(as_tuple=True)
            box = (int(ys.max() - ys.min()) + 1) * (int(xs.max() - xs.min()) + 1)
            fills.append(int(counts[f]) / box)
    fill = sum(fills) / len(fills) if fills else 0.0
    guess = "square" if fill >= square_fill else "circle"
    moved, axis = along >= min_move, along > across
    return dict(prompt=prompt, ok=bool(color_ok and moved and axis), color_ok=color_ok, moved=bool(moved),
                axis=bool(axis), along=round(along, 4), across=round(across, 4),
                min_pixels_seen=int(counts.min()), fill=round(fill, 3), shape_guess=guess,
                shape_ok=guess == shape)


def follow_report(videos, prompts: list[str], **kw) -> dict:
    """Clips ``[3, F, H, W]`` and their prompts -> ``{"followed": fraction ok, "shape_ok": fraction,
    "per_prompt": [check_prompt(...) per clip]}``."""
    per = [check_prompt(v, p, **kw) for v, p in zip(videos, prompts)]
    n = max(len(per), 1)
    return {"followed": sum(r["ok"] for r in per) / n, "shape_ok": sum(r["shape_ok"] for r in per) / n,
            "color_ok": sum(r["color_ok"] for r in per) / n, "moved": sum(r["moved"] for r in per) / n,
            "axis": sum(r["axis"] for r in per) / n, "per_prompt": per}


def all_prompts() -> list[str]:
    """Every caption the mini task can draw: 4 colours x 2 shapes x 4 directions = 32 prompts."""
    return [f"a {c} {s} moving {d}" for c in COLORS for s in SHAPES for d in DIRECTIONS]


def shape_separability(size: int = 16, num_frames: int = 8, n: int = 256, seed: int = 0, **kw) -> float:
    """Fraction of ``n`` training renders at ``size`` px whose shape :func:`check_prompt` guesses right: how far the
    fill-ratio rule can tell circles from squares at this resolution (0.5 = not at all)."""
    data = MovingShapes(n, num_frames=num_frames, size=size, seed=seed)
    return sum(check_prompt(data[i][0], data.caption(i), **kw)["shape_ok"] for i in range(n)) / n


def sample_and_check(task, model, prompts: list[str], device, *, seeds=(0,), num_steps: int = 50,
                     guidance_scale: float = 2.0, shift: float = 3.0, progress: bool = False) -> dict:
    """Sample every prompt once per seed with ``task.generate`` and check each clip: :func:`follow_report` over
    all ``len(prompts) x len(seeds)`` clips, plus ``"videos"`` (seed-major) for pictures."""
    videos, asked = [], []
    for seed in seeds:
        videos += task.generate(model, prompts, device, num_steps=num_steps, guidance_scale=guidance_scale,
                                shift=shift, seed=int(seed), batch_size=8, progress=progress)
        asked += prompts
    report = follow_report(videos, asked)
    report["videos"] = videos
    return report


def summary_line(report: dict) -> str:
    n = len(report["per_prompt"])
    return (f"prompt following: {round(report['followed'] * n)}/{n} clips followed (colour {report['color_ok']:.0%}, "
            f"moved {report['moved']:.0%}, axis {report['axis']:.0%}; shape told apart {report['shape_ok']:.0%})")


def main(argv=None) -> int:
    """``python -m tasks.video_gen.follow --ckpt RUN/checkpoints/last.pt [--all-prompts] [--seeds 0 1 2]``"""
    ap = argparse.ArgumentParser(description="Sample a video_mini checkpoint and check that its clips follow "
                                             "their prompts (tasks/video_gen/follow.py).")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--all-prompts", action="store_true", help="all 32 captions instead of the run's sample.prompts")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--cfg", type=float, default=None, help="guidance scale (default: the run's sample.guidance_scale)")
    ap.add_argument("--out", default=None, help="JSON report (default: <run>/follow[_all][_cfg<G>].json)")
    args = ap.parse_args(argv)
    cfg, task, model, info = load_run(args.ckpt)
    s = cfg.sample
    prompts = all_prompts() if args.all_prompts else list(s.prompts)
    cfg_scale = float(s.guidance_scale) if args.cfg is None else args.cfg
    report = sample_and_check(task, model, prompts, info.device, seeds=args.seeds, num_steps=int(s.num_steps),
                              guidance_scale=cfg_scale, shift=float(s.shift), progress=True)
    report.pop("videos")
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(args.ckpt)))
    name = "follow" + ("_all" if args.all_prompts else "") + ("" if args.cfg is None else f"_cfg{args.cfg:g}")
    out = args.out or os.path.join(run_dir, name + ".json")
    with open(out, "w") as f:
        json.dump({"ckpt": args.ckpt, "seeds": args.seeds, "guidance_scale": cfg_scale, **report}, f, indent=1)
    for r in report["per_prompt"]:
        print(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['prompt']}: along {r['along']:+.3f}, across {r['across']:.3f}, "
              f"min px {r['min_pixels_seen']}, fill {r['fill']:.2f} ({r['shape_guess']})")
    print(summary_line(report), f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
