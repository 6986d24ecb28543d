"""The mini Table 5's measurement of one trained ``task=video_mini`` row (the task side of
:mod:`scripts.tables.table5_mini`, which trains the rows and writes ``results/table5_mini.md``):

- the eval loss is the run's held-out velocity loss (fixed times and noise: comparable across rows);
- prompt following (:mod:`tasks.video_gen.follow`) is checked on the run's 4 sample prompts and on all 32
  captions the data can draw, sampled with the run's ``sample.*`` settings (50 Euler steps, CFG);
- the sampling latency is the wall time of sampling the 4 sample prompts (one batch, 50 steps with CFG = 100
  forwards), timed here for every row under the same load: a 2-step warm-up, then the median of repeats.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from tasks.common.evaluation import load_run

from .follow import all_prompts, follow_report, sample_and_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
