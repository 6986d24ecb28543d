"""The results file of the conversion experiment (:mod:`scripts.tables.conversion`): tables from its
``.json``, the verdict of each paired comparison, a reading generated from those numbers (:func:`reading`),
and the hand-written notes ``<stem>_reading.md`` when there are some (no numbers in them: the numbers come
from the JSON).

    python -m scripts.tables.conversion_report results/conversion/mnist       # rewrite mnist.md from mnist.json
    (``python -m scripts.tables.conversion ... --report-only`` rewrites the .png too; every file goes
    through the one results writer, :func:`tasks.common.results.write_result`)
"""

from __future__ import annotations

import json
import os
import sys

from tasks.common.results import write_result
from tasks.common.stats import ordering_winner

ARM_KEYS = ("a", "b", "c")


def fmt(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def mean_std(arm: dict, digits: int) -> str:
    """``mean ± std`` of an arm, or its one value when it has one seed (no spread to show)."""
    if len(arm["values"]) < 2:
        return f"{fmt(arm['mean'], digits)} (one seed)"
    return f"{fmt(arm['mean'], digits)} ± {fmt(arm['std'], digits)}"


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


def ordering(summary: dict, key: str) -> str:
    """The project's holds / level rule (:func:`tasks.common.stats.ordering_verdict`: the better mean ahead by
    more than 2 pooled std) for ``key`` (``"a-b"``), from the arms' values in the JSON; the teacher is one run
    (no spread), so its comparisons are level by this rule."""
    x, y = key.split("-")
    values = {k: list(summary["arms"][k]["values"]) for k in (x, y) if k != "teacher"}
    if len(values) < 2:
        return "level (one teacher run: no spread)"
    winner = ordering_winner(values[x], values[y], higher_is_better=summary["higher_is_better"])
    return "level" if winner is None else f"holds: ({x if winner == 'a' else y}) ahead"


def _compare(s: dict, key: str, what: str, d: int) -> str:
    """One reading line for the paired difference ``key``: the per-seed mean, its interval and the verdict."""
    p = s["paired"][key]
    x, y = key.split("-")
    interval = (f", 95% interval [{fmt(p['ci95'][0], d)}, {fmt(p['ci95'][1], d)}]" if p.get("ci95") else
                " (one seed: no interval)")
    if p.get("ci95") is None:
        word = "not decided (one seed)"
    elif p["level"]:
        word = "**level**: the difference does not clear the seed noise"
    else:
        ahead = (p["mean"] > 0) == s["higher_is_better"]
        word = f"**({x}) {'ahead' if ahead else 'behind'}**: the interval excludes 0"
    return (f"- {what}: ({x}) - ({y}) = {fmt(p['mean'], d)} on average over the seeds{interval}; {word}. "
            f"By the gap-over-2-pooled-std rule: {ordering(s, key)}.")


def reading(s: dict) -> list[str]:
    """The ``## Reading`` lines, every number taken from the summary (the JSON)."""
    d = 3 if s["metric"] == "val_ppl" else 2
    arms, t, gap = s["arms"], s["teacher"]["value"], s["rel_mse"]
    better = "higher" if s["higher_is_better"] else "lower"
    dist = [g for g in gap["distilled"] if g is not None]
    arm = lambda k: f"({k}) {mean_std(arms[k], d)}"  # noqa: E731

    def side(k: str) -> str:  # where arm k's mean ends relative to the teacher
        gap_k = s["paired"][f"teacher-{k}"]["mean"]
        if gap_k == 0:
            return "level with"
        return "worse than" if (gap_k > 0) == s["higher_is_better"] else "better than"

    past = "better than" in (side("a"), side("b"))

    return [
        "## Reading (generated from the JSON by scripts/tables/conversion_report.py)",
        "",
        f"- Starting point: the softmax teacher reaches {fmt(t, d)} ({s['metric_label']}, {better} is "
        f"better) after {s['teacher'].get('steps') or 'its'} steps. Swapping its attention for MHLA with "
        f"every weight kept and no training gives {fmt(s['converted_no_training'], d)}; "
        f"{s['distill_steps']} distillation steps alone (the rest of the network frozen) give "
        f"{fmt(s['distilled_no_finetune']['mean'], d)} on average, and take the attention gap from "
        f"{fmt(gap['converted'], 3)} to {fmt(sum(dist) / len(dist) if dist else None, 3)} (relative MSE of "
        "the layer outputs).",
        f"- At {s['total_steps']} steps each: {arm('a')}, {arm('b')}, {arm('c')}"
        + (f" (mean ± std over {len(s['seeds'])} seeds)." if len(s["seeds"]) > 1 else "."),
        _compare(s, "a-b", "What distillation adds over converting and fine-tuning", d),
        _compare(s, "b-c", "What the teacher's weights add over MHLA from scratch", d),
        _compare(s, "a-c", "The whole recipe against MHLA from scratch", d),
        f"- Distance to the teacher: teacher - (a) = {fmt(s['paired']['teacher-a']['mean'], d)}, "
        f"teacher - (b) = {fmt(s['paired']['teacher-b']['mean'], d)} (one teacher run: only the arm's seeds "
        f"vary): on average (a) ends {side('a')} the teacher and (b) {side('b')} it."
        + (" (a) and (b) keep training the whole network after the teacher's own steps, so ending better "
           "than the teacher says the teacher was not trained out, not that MHLA beats softmax."
           if past else ""),
        f"- Scope: {len(s['seeds'])} seed(s) per arm, one teacher (seed 0) shared by (a) and (b), small step "
        "counts sized for a shared 2-core CPU; the ranking at these budgets says nothing about longer "
        "schedules. (c) does not get the teacher's steps; (a) and (b) do, which is the point of converting a "
        "model one already has.",
    ]


def markdown(summary: dict, stem: str) -> str:
    """The .md of the results file ``<stem>``: tables, verdicts and reading from ``summary`` (its JSON), then
    the hand-written notes ``<stem>_reading.md`` when there are some."""
    s = summary
    d = 3 if s["metric"] == "val_ppl" else 2
    seeds = s["seeds"]
    blank = [""] * (len(seeds) - 1)
    machine, load = s["machine"], s["load_average_1min"]
    lines = [
        f"# Converting a softmax {s['task']} model to MHLA: distil + fine-tune vs fine-tune vs scratch",
        "",
        f"Command: `{s['command']}` (`scripts/tables/conversion.py`; every run's own command and resolved "
        "config are in the JSON, the commands below).",
        "",
        f"Machine: {machine.get('cpu')} ({machine.get('cpu_count')} cores), torch {machine.get('torch')}, "
        f"one thread per run, at most {s.get('jobs', 2)} runs at a time "
        f"(nice {s.get('nice', 'not recorded')}), "
        "shared with other jobs (1-min load average at the runs' starts: "
        f"{load['min']:.1f}-{load['max']:.1f}); commit {str(s['code'].get('commit'))[:10]}"
        f"{' (uncommitted changes)' if s['code'].get('dirty') else ''}; {s['seconds'] / 3600:.2f} h wall.",
        "",
        f"Steps: D = {s['distill_steps']} distillation steps, F = {s['finetune_steps']} fine-tuning steps; "
        f"every arm ends after D + F = {s['total_steps']} optimizer steps. The teacher (softmax, seed 0, the "
        f"task's recipe) trained {s['teacher'].get('steps') or 'its default'} steps before (a) and (b) "
        "start.",
        "",
        f"## Result ({s['metric_label']}, {len(seeds)} seeds: {', '.join(map(str, seeds))})",
        "",
        "| model | " + " | ".join(f"seed {x}" for x in seeds) + " | mean ± std |",
        "|---|" + "---|" * len(seeds) + "---|",
        "| softmax teacher (seed 0) | " + " | ".join([fmt(s["teacher"]["value"], d), *blank])
        + f" | {fmt(s['teacher']['value'], d)} |",
        "| converted, no training | " + " | ".join([fmt(s["converted_no_training"], d), *blank])
        + f" | {fmt(s['converted_no_training'], d)} |",
        "| converted + distilled (D), no fine-tuning | "
        + " | ".join(fmt(v, d) for v in s["distilled_no_finetune"]["values"])
        + f" | {fmt(s['distilled_no_finetune']['mean'], d)} |",
    ]
    for k in ARM_KEYS:
        arm = s["arms"][k]
        lines.append(f"| **({k}) {arm['name']}** | " + " | ".join(fmt(v, d) for v in arm["values"])
                     + f" | **{mean_std(arm, d)}** |")
    lines += [
        "",
        "Attention gap (MSE of the converted layers' outputs / mean square of the teacher's, teacher inputs, "
        f"two eval batches): converted {fmt(s['rel_mse']['converted'], 3)}, after D distillation steps "
        + ", ".join(fmt(v, 3) for v in s["rel_mse"]["distilled"]) + ".",
        "",
        "## Paired differences (per seed, then mean and 95% t interval over the seeds)",
        "",
        "| difference | " + " | ".join(f"seed {x}" for x in seeds)
        + " | mean | 95% interval | verdict (paired t) | gap > 2 pooled std |",
        "|---|" + "---|" * len(seeds) + "---|---|---|---|",
    ]
    for key, p in s["paired"].items():
        interval = (f"[{fmt(p['ci95'][0], d)}, {fmt(p['ci95'][1], d)}]" if p.get("ci95") else "n/a")
        lines.append(f"| {key} | " + " | ".join(fmt(v, d) for v in p["diffs"]) + f" | {fmt(p['mean'], d)} | "
                     f"{interval} | {verdict(s, key)} | {ordering(s, key)} |")
    lines += ["", "(teacher-a, teacher-b: the single teacher run against each seed of the arm; the interval "
              "is over the arm's seeds only.)", "", "## Runs", ""]
    for name, recs in s["runs"].items():
        for r in recs:
            secs = r.get("seconds")
            took = f" ({secs:.0f} s)" if isinstance(secs, (int, float)) else ""
            lines.append(f"- {name}: `{r['command']}`{took}")
    lines[lines.index("## Runs") - 1:lines.index("## Runs") - 1] = ["", *reading(s)]
    notes = stem + "_reading.md"
    if os.path.exists(notes):
        with open(notes) as f:
            lines += ["", f.read().rstrip()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    stem = sys.argv[1]
    with open(stem + ".json") as f:
        write_result(stem, markdown(json.load(f), stem), None)
