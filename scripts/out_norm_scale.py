#!/usr/bin/env python
"""Is a run's per-head output norm normalising, or is its epsilon setting the scale? The attention output's size
just before the output RMSNorm, at initialisation and after training.

The LM's attention ends with ``RMSNorm(o)`` per head (``out_norm``, the paper's LM setting), whose epsilon
(1e-6) is added to the mean square: where ``rms(o)`` is far below ``sqrt(eps)`` the norm multiplies ``o`` by
about ``1 / sqrt(eps)`` instead of bringing it to unit size, so the output keeps its raw scale. That raw scale is
where MHLA and linear attention differ at initialisation: the LM's ``uniform`` mixing init gives block row ``i``
the weights ``1 / (i + 1)``, so with the same projections the queries of the last of ``M`` blocks get ``1 / M``
of linear attention's output. This script measures both, per layer, over the first and the last ``--window``
tokens of the first ``--examples`` items of a run's evaluation split:

    python scripts/out_norm_scale.py mhla=RUN_DIR linear=RUN_DIR --out results/mqar/out_norm_scale

Each run's model is built as ``train.py`` builds it (the run's stored config, ``seed_everything`` of its seed or
``trainer.init_seed``) for the initial weights, and loaded from its last checkpoint for the trained ones. The
record keeps, per run, weights and layer: ``rms_first``, ``rms_last`` and the norm's ``sqrt_eps``.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from tasks.common.checkpoint import find_checkpoint  # noqa: E402
from tasks.common.evaluation import load_run  # noqa: E402
from tasks.common.launch import read_notes  # noqa: E402
from tasks.common.records import RUN_RECORD_KEYS, code_version, read_run_record  # noqa: E402
from tasks.common.results import rewrite_result, write_result  # noqa: E402
from tasks.common.trainer import weights_seed  # noqa: E402
from tasks.common.utils import seed_everything, system_info  # noqa: E402


@torch.no_grad()
def output_scale(model, input_ids: torch.Tensor, window: int) -> list[dict]:
    """Per attention layer with an output RMSNorm: ``{"layer", "rms_first", "rms_last", "sqrt_eps"}``, the root
    mean square of the norm's input ``o [B, T, H, Dv]`` over the first and the last ``window`` positions of
    ``input_ids [B, T]`` (mean over batch, heads and positions)."""
    norms = [m.out_norm for m in model.modules() if isinstance(getattr(m, "out_norm", None), torch.nn.RMSNorm)]
    rows, hooks = [], []
    for i, norm in enumerate(norms):
        def hook(mod, inp, out, i=i):
            rms = inp[0].float().pow(2).mean(-1).sqrt()  # [B, T, H]
            rows.append({"layer": i, "rms_first": rms[:, :window].mean().item(),
                         "rms_last": rms[:, -window:].mean().item(),
                         "sqrt_eps": float(mod.eps if mod.eps is not None else torch.finfo(inp[0].dtype).eps) ** 0.5})
        hooks.append(norm.register_forward_hook(hook))
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return rows


def measure_run(run_dir: str, examples: int, window: int) -> dict:
    """``{"init": rows, "trained": rows, "attn_name", "seed", "checkpoint"}`` of :func:`output_scale` for one
    ``train.py`` run, on the first ``examples`` items of its evaluation split, with the run's own record (its
    commit, machine, load and resolved config: :data:`RUN_RECORD_KEYS`)."""
    ckpt = str(find_checkpoint(run_dir))
    cfg, task, trained, _ = load_run(ckpt, ["trainer.device=cpu"])
    _, eval_ds = task.build_datasets()
    x = torch.stack([eval_ds[i][0] for i in range(min(examples, len(eval_ds)))])
    seed_everything(weights_seed(cfg))  # as train.py draws the initial weights
    init = task.build_model().eval()
    run = read_run_record(run_dir) or {}  # the trainer's run.json: commit, machine, load, resolved config
    return {"checkpoint": ckpt, "attn_name": trained.config.attn_name, "seed": int(cfg.seed),
            "init": output_scale(init, x, window), "trained": output_scale(trained, x, window),
            **{k: run[k] for k in RUN_RECORD_KEYS if k in run}}


def markdown(record: dict) -> str:
    s = record["settings"]
    lines = ["# The attention output's scale before the output RMSNorm", "",
             f"Made by `{record['command']}`: the first {s['examples']} evaluation items of each run, the first and "
             f"the last {s['window']} positions. RMS of the norm's input (mean over batch, heads, positions); "
             "`sqrt(eps)` is the scale below which the norm stops normalising. No times: the figures do not depend on "
             f"the machine's load. Commit {record.get('commit')} (dirty: {record.get('dirty')}).", "",
             "| run | attention | weights | layer | RMS, first positions | RMS, last positions | sqrt(eps) | "
             "last / sqrt(eps) |", "|---|---|---|---|---|---|---|---|"]
    for name, run in record["runs"].items():
        for weights in ("init", "trained"):
            for r in run[weights]:
                lines.append(f"| {name} | {run['attn_name']} | {weights} | {r['layer']} | {r['rms_first']:.2e} | "
                             f"{r['rms_last']:.2e} | {r['sqrt_eps']:.0e} | {r['rms_last'] / r['sqrt_eps']:.2g} |")
    if record.get("notes"):
        lines += ["", "## Reading", "", record["notes"].strip()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="name=run_dir")
    ap.add_argument("--examples", type=int, default=16)
    ap.add_argument("--window", type=int, default=16, help="positions at each end")
    ap.add_argument("--out", required=True)
    ap.add_argument("--notes", default="", help="reading paragraph (or @file)")
    ap.add_argument("--plot-only", action="store_true", help="rewrite <out>.md from <out>.json (no figure)")
    args = ap.parse_args(argv)
    if args.plot_only:
        rewrite_result(args.out, markdown, None, read_notes(args.notes))
        return 0
    if not args.runs:
        raise SystemExit("give name=run_dir runs")
    torch.set_num_threads(1)
    runs = {name: measure_run(path, args.examples, args.window)
            for name, path in (r.split("=", 1) for r in args.runs)}
    command = "python scripts/out_norm_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"runs": runs, "command": command, "machine": system_info("cpu"), **code_version(),
              "notes": read_notes(args.notes),
              "settings": {"examples": args.examples, "window": args.window}}
    write_result(args.out, markdown(record), record)
    print(f"wrote {args.out}.md / .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
