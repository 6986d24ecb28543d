"""The conversion experiment: a softmax teacher converted to MHLA, three ways, at equal steps, over seeds.

    python -m scripts.tables.conversion --task mnist  --distill-steps 100 --finetune-steps 368 --seeds 0 1 2
    python -m scripts.tables.conversion --task lm_mini --distill-steps 100 --finetune-steps 200 --seeds 0 1
    2

Arms (every one ends after ``D + F`` optimizer steps; the teacher's own steps come before (a) and (b)):

* (a) convert + distil ``D`` steps (:mod:`tasks.conversion.distill`) + fine-tune ``F`` steps (``train.py ...
  attn=mhla trainer.init_from=<distilled>``);
* (b) convert + fine-tune ``D + F`` steps (from the converted model, ``distill.steps=0``);
* (c) MHLA from scratch, ``D + F`` steps (``train.py ... attn=mhla``).

Fine-tuning and training from scratch use the task's default recipe (optimizer, peak lr, warmup, cosine) with
``trainer.max_steps`` set to their step count. The teacher is ``train.py <task> attn=softmax seed=0`` at the
task's default recipe (``--teacher`` reuses a finished run). Runs go to ``--runs`` (one folder each; a folder
that already holds a finished run's ``run.json`` is read, not run again), ``--jobs`` at a time, one thread
each, under ``nice -n <--nice>`` (default 0: a fair share beside other users' runs; 10 yields to them).
Results: ``--out``.md / .json / .png: mean ± std per arm, the paired differences over seeds with a 95%
t interval ("level" when it contains 0), the teacher beside them, the commands, the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from tasks.common.launch import parse_final, run_parallel
from tasks.common.records import RUN_RECORD_KEYS, code_version, read_run_record
from tasks.common.results import write_result
from tasks.common.stats import mean_std, paired_difference
from tasks.common.utils import load_average, system_info

from .conversion_report import markdown
from .registry import ROOT

#: per task: train.py overrides that select it, the metric compared, whether higher is better, its label
TASKS = {
    "mnist": {"overrides": ["task=mnist"], "metric": "top1", "higher": True, "label": "test top-1 (%)",
              "scale": 100.0},
    "lm_mini": {"overrides": ["task=lm_mini"], "metric": "val_ppl", "higher": False,
                "label": "val perplexity", "scale": 1.0},
}
COMMON = ["logger=none", "trainer.progress_bar=false"]
ARMS = {"a": "convert + distil + fine-tune", "b": "convert + fine-tune", "c": "MHLA from scratch"}
def run_command(cmd: list[str], run_dir: str, threads: int) -> dict:
    """Run ``cmd`` (train.py or the distillation entry point, writing ``run_dir``), or read the finished run
    there."""
    record = read_run_record(run_dir)
    shown = " ".join(cmd[3:] if cmd[:2] == ["nice", "-n"] else cmd).replace(sys.executable, "python")
    shown = shown.replace(os.path.join(ROOT, "train.py"), "train.py").replace(ROOT + os.sep, "")
    if record is None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if proc.returncode != 0 or parse_final(proc.stdout) is None:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            return {"command": shown, "error": tail, "seconds": round(time.time() - t0, 1)}
        record = read_run_record(run_dir)
        if record is None:
            return {"command": shown, "error": f"no run.json in {run_dir}"}
    return {"command": shown, "run_dir": os.path.relpath(run_dir, ROOT), "seconds": record.get("seconds"),
            "metrics": record.get("metrics", {}),
            "run": {k: record.get(k)
                    for k in RUN_RECORD_KEYS}}


#: the niceness of every run (``--nice``)
NICE = [0]


def train_cmd(overrides: list[str]) -> list[str]:
    return ["nice", "-n", str(NICE[0]), sys.executable, os.path.join(ROOT, "train.py"), *overrides]


def distill_cmd(overrides: list[str]) -> list[str]:
    return ["nice", "-n", str(NICE[0]), sys.executable, "-m", "tasks.conversion.distill", *overrides]


def plan(args) -> tuple[dict, list]:
    """The teacher job and the per-seed jobs ``(key, [(cmd, run_dir), ...])`` (a chain runs in order)."""
    spec, runs = TASKS[args.task], os.path.abspath(args.runs)
    D, F = args.distill_steps, args.finetune_steps
    task = spec["overrides"] + COMMON + list(args.extra)
    teacher_dir = os.path.abspath(args.teacher) if args.teacher else os.path.join(runs, "teacher_softmax_s0")
    teacher = ("teacher", [(train_cmd(task + list(args.teacher_extra) + ["attn=softmax", "seed=0",
                                                                        f"hydra.run.dir={teacher_dir}"]),
                            teacher_dir)])
    steps = ["trainer.max_epochs=null"]
    distill = [f"teacher={teacher_dir}", "attn=mhla", f"distill.lr={args.distill_lr}", *args.distill_extra]
    jobs = []
    convert_dir = os.path.join(runs, "b_convert")
    convert = distill_cmd(distill + ["distill.steps=0", "seed=0", "evaluate=[teacher,converted]",
                                     f"hydra.run.dir={convert_dir}"])
    jobs.append(("b_convert", [(convert, convert_dir)]))
    for s in args.seeds:
        a_d, a_f = os.path.join(runs, f"a_distill_s{s}"), os.path.join(runs, f"a_finetune_s{s}")
        jobs.append((f"a{s}", [
            (distill_cmd(distill + [f"distill.steps={D}", f"seed={s}", "evaluate=[distilled]",
                                    f"hydra.run.dir={a_d}"]), a_d),
            (train_cmd(task + ["attn=mhla", f"seed={s}", f"trainer.init_from={a_d}", f"trainer.max_steps={F}",
                               *steps, f"hydra.run.dir={a_f}"]), a_f)]))
        b_f = os.path.join(runs, f"b_finetune_s{s}")
        b = train_cmd(task + ["attn=mhla", f"seed={s}", f"trainer.init_from={convert_dir}",
                              f"trainer.max_steps={D + F}", *steps, f"hydra.run.dir={b_f}"])
        jobs.append((f"b{s}", [(b, b_f)]))
        c_d = os.path.join(runs, f"c_scratch_s{s}")
        c = train_cmd(task + ["attn=mhla", f"seed={s}", f"trainer.max_steps={D + F}", *steps,
                              f"hydra.run.dir={c_d}"])
        jobs.append((f"c{s}", [(c, c_d)]))
    return teacher, jobs


def run_jobs(teacher, jobs, args) -> dict:
    records = {}
    records["teacher"] = [run_command(cmd, d, args.threads) for cmd, d in teacher[1]]
    last = records["teacher"][-1]
    print(f"teacher: {last.get('metrics') or last.get('error')}", flush=True)
    if "error" in records["teacher"][-1]:
        raise SystemExit(f"teacher failed:\n{records['teacher'][-1]['error']}")
    first, rest = jobs[0], jobs[1:]  # the converted model (b) is needed by every b fine-tune
    records[first[0]] = [run_command(cmd, d, args.threads) for cmd, d in first[1]]

    def chain(job):
        out = []
        for cmd, d in job[1]:
            rec = run_command(cmd, d, args.threads)
            out.append(rec)
            if "error" in rec:
                break
        return out

    def done(job, recs):
        records[job[0]] = recs
        last = recs[-1]
        return f"{job[0]}: {last.get('metrics') or last.get('error')}"

    run_parallel(chain, rest, args.jobs, f"conversion {args.task}", done)
    return records


def paired(a: dict, b: dict) -> dict:
    """:func:`tasks.common.stats.paired_difference` of ``a[s] - b[s]`` over the seeds, with ``level``: True
    when its 95% interval contains 0 (the difference does not clear the seed noise)."""
    p = paired_difference(a, b)
    return {**p, "level": not p["excludes_zero"]}


def summarize(records: dict, args) -> dict:
    spec = TASKS[args.task]
    key, scale = spec["metric"], spec["scale"]
    def value(rec: dict, k: str = key) -> float | None:
        return rec["metrics"][k] * scale if rec.get("metrics") and k in rec["metrics"] else None

    teacher = value(records["teacher"][-1])
    teacher_steps = None
    ckpt = os.path.join(ROOT, records["teacher"][-1]["run_dir"], "checkpoints", "last.pt")
    if os.path.exists(ckpt):
        import torch  # noqa: PLC0415

        teacher_steps = int(torch.load(ckpt, map_location="cpu", weights_only=False)["step"])
    conv = records["b_convert"][-1]
    arms = {}
    for arm in ARMS:
        vals = {s: value(records[f"{arm}{s}"][-1]) for s in args.seeds}
        if any(v is None for v in vals.values()):
            errors = [records[f"{arm}{s}"][-1].get("error") for s in args.seeds]
            raise SystemExit(f"arm {arm}: a run failed: {errors}")
        m, sd = mean_std(list(vals.values()))
        arms[arm] = {"name": ARMS[arm], "values": list(vals.values()), "mean": m, "std": sd, "by_seed": vals}
    distilled = [value(records[f"a{s}"][0], f"distilled_{key}") for s in args.seeds]
    pairs = {f"{x}-{y}": paired(arms[x]["by_seed"], arms[y]["by_seed"])
             for x, y in (("a", "b"), ("a", "c"), ("b", "c"))}
    for arm in ("a", "b"):
        pairs[f"teacher-{arm}"] = paired({s: teacher for s in args.seeds}, arms[arm]["by_seed"])
    loads = [r["run"]["load_before"][0] for recs in records.values() for r in recs if r.get("run")
             and r["run"].get("load_before")]
    return {
        "task": args.task, "metric": key, "metric_label": spec["label"], "higher_is_better": spec["higher"],
        "distill_steps": args.distill_steps, "finetune_steps": args.finetune_steps,
        "total_steps": args.distill_steps + args.finetune_steps, "seeds": args.seeds,
        "distill_lr": args.distill_lr,
        "teacher": {"value": teacher, "steps": teacher_steps,
                    "metrics": records["teacher"][-1]["metrics"],
                    "command": records["teacher"][-1]["command"]},
        "converted_no_training": value(conv, f"converted_{key}"),
        "distilled_no_finetune": {"values": distilled, "mean": mean_std(distilled)[0]},
        "rel_mse": {"converted": conv["metrics"].get("rel_mse_before"),
                    "distilled": [records[f"a{s}"][0]["metrics"].get("rel_mse_after") for s in args.seeds]},
        "arms": arms, "paired": pairs,
        "load_average_1min": {"min": min(loads), "max": max(loads)} if loads else None,
        "runs": records,
    }


def plot(summary: dict, path: str) -> None:
    from tasks.common.plots import pyplot, save_figure  # noqa: PLC0415

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    names = [f"({a}) {summary['arms'][a]['name']}" for a in ARMS]
    for i, a in enumerate(ARMS):
        arm = summary["arms"][a]
        ax.bar(i, arm["mean"], yerr=arm["std"], color=f"C{i}", alpha=0.7, capsize=4)
        ax.scatter([i] * len(arm["values"]), arm["values"], color="k", s=12, zorder=3)
    ax.axhline(summary["teacher"]["value"], color="k", ls="--", lw=1, label="softmax teacher")
    vals = [v for a in ARMS for v in summary["arms"][a]["values"]] + [summary["teacher"]["value"]]
    lo, hi = min(vals), max(vals)
    ax.set_ylim(lo - 0.15 * (hi - lo + 1e-9), hi + 0.15 * (hi - lo + 1e-9))
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel(summary["metric_label"])
    ax.set_title(f"{summary['task']}: softmax -> MHLA at {summary['total_steps']} steps "
                 f"(D={summary['distill_steps']}, F={summary['finetune_steps']}), "
                 f"{len(summary['seeds'])} seeds",
                 fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--distill-steps", type=int, required=True)
    p.add_argument("--finetune-steps", type=int, required=True)
    p.add_argument("--distill-lr", type=float, default=1e-3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--teacher", help="a finished train.py run of the softmax teacher (else trained here)")
    p.add_argument("--runs", default=None, help="folder of the runs [outputs/conversion/<task>]")
    p.add_argument("--out", default=None, help="results file stem [results/conversion/<task>]")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--nice", type=int, default=0,
                   help="niceness of the runs (0: a fair share of a shared machine)")
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every train.py run (smoke tests)")
    p.add_argument("--teacher-extra", nargs="*", default=[], help="overrides for the teacher's run only")
    p.add_argument("--distill-extra", nargs="*", default=[], help="overrides for the distillation runs")
    p.add_argument("--report-only", action="store_true", help="rewrite the .md and .png from the .json")
    args = p.parse_args(argv)
    NICE[0] = args.nice
    args.runs = args.runs or os.path.join(ROOT, "outputs", "conversion", args.task)
    args.out = args.out or os.path.join(ROOT, "results", "conversion", args.task)
    if args.report_only:  # the .md and .png again from the .json (which is not rewritten)
        with open(args.out + ".json") as f:
            summary = json.load(f)
        write_result(args.out, markdown(summary, args.out), None, lambda png: plot(summary, png))
        return
    started, load_before, code = time.time(), load_average(), code_version()  # the code the runs start from
    teacher, jobs = plan(args)
    records = run_jobs(teacher, jobs, args)
    summary = summarize(records, args)
    shown = " ".join(argv if argv is not None else sys.argv[1:])
    summary.update(command="python -m scripts.tables.conversion " + shown, nice=args.nice, jobs=args.jobs,
                   machine=system_info(), code=code, load_before=load_before, load_after=load_average(),
                   seconds=round(time.time() - started, 1))
    write_result(args.out, markdown(summary, args.out), summary, lambda png: plot(summary, png), default=str)
    print(f"wrote {args.out}.json / .png / .md", flush=True)


if __name__ == "__main__":
    main()
