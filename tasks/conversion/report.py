"""The results file of the conversion experiment (:mod:`tasks.conversion.experiment`): tables from its ``.json``,
the verdict of each paired comparison, and the hand-written reading ``<stem>_reading.md`` when there is one.

    python -m tasks.conversion.report results/conversion/mnist       # rewrite mnist.md from mnist.json
"""

from __future__ import annotations

import json
import os
import sys

from tasks.common.fileio import atomic_write

ARM_KEYS = ("a", "b", "c")


def fmt(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def verdict(summary: dict, key: str) -> str:
    """One sentence for the paired difference ``key`` (``"a-b"``: arm a minus arm b)."""
    p = summary["paired"][key]
    x, y = key.split("-")
    better = "higher" if summary["higher_is_better"] else "lower"
    name = lambda k: "the teacher" if k == "teacher" else f"({k})"  # noqa: E731
    if p.get("ci95") is None:
        return f"{name(x)} vs {name(y)}: no interval (one seed): not a verdict"
    if p["level"]:
        return f"{name(x)} vs {name(y)}: level (the 95% interval of the difference contains 0)"
    first_better = (p["mean"] > 0) == summary["higher_is_better"]
    winner, loser = (x, y) if first_better else (y, x)
    return f"{name(winner)} is better than {name(loser)} ({better} is better; the 95% interval excludes 0)"


def write_markdown(summary: dict, path: str) -> str:
    s = summary
    d = 3 if s["metric"] == "val_ppl" else 2
    seeds = s["seeds"]
    lines = [
        f"# Converting a softmax {s['task']} model to MHLA: distil + fine-tune vs fine-tune vs scratch",
        "",
        f"Command: `{s['command']}` (`tasks/conversion/experiment.py`; every run's own command is in the JSON and "
        "below).",
        "",
        f"Machine: {s['machine'].get('cpu')} ({s['machine'].get('cpu_count')} cores), torch "
        f"{s['machine'].get('torch')}, one thread per run, at most two runs at a time under `nice`, shared with "
        f"other jobs (1-min load average at the runs' starts: {s['load_average_1min']['min']:.1f}-"
        f"{s['load_average_1min']['max']:.1f}); commit {str(s['code'].get('commit'))[:10]}"
        f"{' (uncommitted changes)' if s['code'].get('dirty') else ''}; {s['seconds'] / 3600:.2f} h wall.",
        "",
        f"Steps: D = {s['distill_steps']} distillation steps, F = {s['finetune_steps']} fine-tuning steps; every "
        f"arm ends after D + F = {s['total_steps']} optimizer steps. The teacher (softmax, seed 0, the task's "
        f"default recipe) trained {s['teacher'].get('steps') or 'its default'} steps before (a) and (b) start.",
        "",
        f"## Result ({s['metric_label']}, {len(seeds)} seeds: {', '.join(map(str, seeds))})",
        "",
        "| model | " + " | ".join(f"seed {x}" for x in seeds) + " | mean ± std |",
        "|---|" + "---|" * len(seeds) + "---|",
        f"| softmax teacher (seed 0) | " + " | ".join([fmt(s["teacher"]["value"], d)] + [""] * (len(seeds) - 1))
        + f" | {fmt(s['teacher']['value'], d)} |",
        f"| converted, no training | " + " | ".join([fmt(s["converted_no_training"], d)] + [""] * (len(seeds) - 1))
        + f" | {fmt(s['converted_no_training'], d)} |",
        f"| converted + distilled (D), no fine-tuning | "
        + " | ".join(fmt(v, d) for v in s["distilled_no_finetune"]["values"])
        + f" | {fmt(s['distilled_no_finetune']['mean'], d)} |",
    ]
    for k in ARM_KEYS:
        arm = s["arms"][k]
        lines.append(f"| **({k}) {arm['name']}** | " + " | ".join(fmt(v, d) for v in arm["values"])
                     + f" | **{fmt(arm['mean'], d)} ± {fmt(arm['std'], d)}** |")
    lines += [
        "",
        f"Attention gap (MSE of the converted layers' outputs / mean square of the teacher's, teacher inputs, two "
        f"eval batches): converted {fmt(s['rel_mse']['converted'], 3)}, after D distillation steps "
        + ", ".join(fmt(v, 3) for v in s["rel_mse"]["distilled"]) + ".",
        "",
        "## Paired differences (per seed, then mean and 95% t interval over the seeds)",
        "",
        "| difference | " + " | ".join(f"seed {x}" for x in seeds) + " | mean | 95% interval | verdict |",
        "|---|" + "---|" * len(seeds) + "---|---|---|",
    ]
    for key, p in s["paired"].items():
        interval = (f"[{fmt(p['ci95'][0], d)}, {fmt(p['ci95'][1], d)}]" if p.get("ci95") else "n/a")
        lines.append(f"| {key} | " + " | ".join(fmt(v, d) for v in p["diffs"]) + f" | {fmt(p['mean'], d)} | "
                     f"{interval} | {verdict(s, key)} |")
    lines += ["", "(teacher-a, teacher-b: the single teacher run against each seed of the arm; the interval is over "
              "the arm's seeds only.)", "", "## Runs", ""]
    for name, recs in s["runs"].items():
        for r in recs:
            secs = r.get("seconds")
            lines.append(f"- {name}: `{r['command']}`" + (f" ({secs:.0f} s)" if isinstance(secs, (int, float)) else ""))
    reading = os.path.splitext(path)[0] + "_reading.md"
    if os.path.exists(reading):
        with open(reading) as f:
            lines += ["", f.read().rstrip()]
    text = "\n".join(lines) + "\n"
    atomic_write(path, lambda tmp: open(tmp, "w").write(text))
    return path


if __name__ == "__main__":
    stem = sys.argv[1]
    with open(stem + ".json") as f:
        write_markdown(json.load(f), stem + ".md")
