#!/usr/bin/env python
"""Where does a trained MHLA model's long-context recall live: in its mixing matrices or in the rest of it?

A control for the recipes of issue 50 (docs/long_context.md): two MHLA passkey models of one seed, ``base`` (say the
base recipe) and ``trained`` (say one state-passed at 1,024 tokens), and the two models made by swapping their
mixing matrices (every :class:`mhla.mixing.MixingMatrix` parameter, nothing else), all evaluated on the passkey test
(``tasks.language.long_context.evaluate_passkey``, chunked prefill) under one extension rule:

    base                      the base model
    trained                   the trained model
    base + trained mixing     what the trained mixing alone gives
    trained + base mixing     what the trained model keeps without its mixing

If the recall gained by ``trained`` survives in ``trained + base mixing`` and does not appear in ``base + trained
mixing``, it lives in the projections, convolutions and MLPs (the features), not in the mixing.

``--equal-weights`` is the second control, on single runs (``seed=RUN`` instead of pairs): each model as trained,
with every layer's coefficients made equal over distance (:func:`mhla.mixing.with_equal_weights`: rows tied by
distance or free, the ``clamp`` parameterisation), and with the ``--keep-near`` nearest kept and the rest equal:
how much of the recall the learned shape of the window carries, without training.

    python scripts/mixing_transplant.py --equal-weights 0=RUN 1=RUN --lengths 4096 --out OUT

    python scripts/mixing_transplant.py 0=BASE_RUN:TRAINED_RUN 1=...:... --lengths 256 1024 \\
        --out results/language/long_context_transplant

Writes ``<out>.md`` / ``.json`` (:func:`tasks.common.results.write_result`, with the machine's load:
:class:`tasks.common.records.Measurement`; ``--allow-busy`` writes a busy machine's record marked BUSY).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from mhla.mixing import mixing_matrices, with_equal_weights  # noqa: E402
from scripts.length_extrapolation import extension_rule  # noqa: E402
from scripts.long_context import DEPTHS  # noqa: E402
from tasks.common.checkpoint import find_checkpoint  # noqa: E402
from tasks.common.evaluation import load_run  # noqa: E402
from tasks.common.launch import read_notes  # noqa: E402
from tasks.common.records import Measurement  # noqa: E402
from tasks.common.results import rewrite_result, write_result  # noqa: E402
from tasks.common.utils import system_info  # noqa: E402
from tasks.language.long_context import evaluate_passkey, filler_tokens  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("base", "trained", "base + trained mixing", "trained + base mixing")


@torch.no_grad()
def with_mixing_of(model, donor):
    """A copy of ``model`` whose every mixing matrix holds ``donor``'s parameters (the same layers, shapes and
    parameterisation; an error otherwise)."""
    out = copy.deepcopy(model)
    mine, theirs = mixing_matrices(out), mixing_matrices(donor)
    if not mine or list(mine) != list(theirs):
        raise ValueError(f"the two models' mixing matrices differ: {list(mine)} vs {list(theirs)}")
    for name, m in mine.items():
        src = dict(theirs[name].named_parameters())
        dst = dict(m.named_parameters())
        if {k: p.shape for k, p in dst.items()} != {k: p.shape for k, p in src.items()}:
            raise ValueError(f"{name}: the mixing parameters differ in name or shape")
        for k, p in dst.items():
            p.copy_(src[k])
    return out


def equal_weight_variants(model, keep_near: int) -> dict:
    return {"trained": model, "equal weights": with_equal_weights(model),
            f"nearest {keep_near} kept, the rest equal": with_equal_weights(model, keep_near)}


def variants(base, trained) -> dict:
    """The four models of a pair, named by :data:`VARIANTS`."""
    return dict(zip(VARIANTS, (base, trained, with_mixing_of(base, trained), with_mixing_of(trained, base))))


def evaluate_pair(base_run: str | None, trained_run: str, args) -> dict:
    """``{variant: {str(L): evaluate_passkey record}}`` for one seed's pair of runs (``base_run`` None: the
    ``--equal-weights`` variants of ``trained_run``)."""
    _, task, trained, _ = load_run(str(find_checkpoint(trained_run)), ["trainer.device=cpu"])
    if base_run is None:
        models = equal_weight_variants(trained, args.keep_near)
    else:
        _, _, base, _ = load_run(str(find_checkpoint(base_run)), ["trainer.device=cpu"])
        models = variants(base, trained)
    _, val, tok, _ = task.data()
    filler, fmt = filler_tokens(val.tokens, tok.eos_token_id), task.fmt()
    out = {}
    for name, model in models.items():
        out[name] = {}
        for L in args.lengths:
            with extension_rule(model, args.rule):
                rec = evaluate_passkey(model, filler, fmt, L, args.depths, examples_per_depth=args.examples,
                                       batch_size=args.batch_size, prefill_chunk=args.prefill_chunk, seed=args.seed)
            out[name][str(L)] = rec
            print(f"  {name:>22} L={L:6d} acc={100 * rec['acc']:5.1f}%", flush=True)
    return out


def markdown(record: dict) -> str:
    Ls, seeds = record["lengths"], record["seeds"]
    names = list(record["pairs"][seeds[0]])  # the variants, in the order they were evaluated
    head = "| model | n | " + " | ".join(f"{int(L):,}" for L in Ls) + " |\n|---|---|" + "---|" * len(Ls)
    rows = []
    for v in names:
        cells = []
        for L in Ls:
            accs = [100 * record["pairs"][s][v][L]["acc"] for s in seeds]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            cells.append(f"{statistics.fmean(accs):.1f} ± {sd:.1f}")
        rows.append(f"| {v} | {len(seeds)} | " + " | ".join(cells) + " |")
    depth = []
    for v in names:
        depth.append(f"\n**{v}**\n\n| depth | " + " | ".join(f"{int(L):,}" for L in Ls) + " |\n|---|"
                     + "---|" * len(Ls))
        for i, d in enumerate(record["settings"]["depths"]):
            depth.append(f"| {d:.2f} | " + " | ".join(
                f"{round(100 * statistics.fmean(record['pairs'][s][v][L]['depths'][i]['acc'] for s in seeds))}"
                for L in Ls) + " |")
    pairs = "\n".join(f"- seed {s}: " + (f"base `{p['base']}`, " if p.get("base") else "") + f"trained `{p['trained']}`"
                      for s, p in record["runs"].items())
    equal = record["settings"].get("equal_weights")
    title = ("Where the recall lives: MHLA's per-distance coefficients made equal" if equal else
             "Where the recall lives: MHLA mixing matrices swapped between two runs")
    what = ("Each model is evaluated as trained and with its distance-tied coefficients made equal over distance "
            "(all, or past the nearest ones kept), no training." if equal else
            "Each model is evaluated as trained and with the other run's mixing matrices (every mixing parameter, "
            "nothing else).")
    return "\n".join([
        f"# {title}", "",
        f"Made by `{record['command']}`. Passkey accuracy (%, all 5 digits), mean ± std over the seeds; "
        f"{record['settings']['examples']} examples per depth, extension rule `{record['settings']['rule']}`. "
        + what, "", head, *rows, "", "Accuracy by depth of the fact (mean over the seeds):", *depth, "",
        "Runs:", "", pairs, "", "## Reading", "", record.get("notes") or "(none)", ""])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pairs", nargs="*", help="seed=BASE_RUN:TRAINED_RUN (--equal-weights: seed=RUN)")
    ap.add_argument("--equal-weights", action="store_true",
                    help="evaluate each run as trained and with its per-distance coefficients made equal")
    ap.add_argument("--keep-near", type=int, default=8, help="--equal-weights: nearest distances kept as trained")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rule", default="uniform_far")
    ap.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS))
    ap.add_argument("--examples", type=int, default=8, help="per depth and length")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="seed of the evaluation examples")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "language", "long_context_transplant"))
    ap.add_argument("--notes", default="", help="reading paragraph (or @file)")
    ap.add_argument("--allow-busy", action="store_true")
    ap.add_argument("--plot-only", action="store_true", help="rewrite <out>.md from <out>.json")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        rewrite_result(args.out, markdown, notes=read_notes(args.notes))
        print(f"rewrote {args.out}.md")
        return 0
    if not args.pairs:
        raise SystemExit("give seed=BASE_RUN:TRAINED_RUN pairs, or seed=RUN with --equal-weights (or --plot-only)")
    torch.set_num_threads(args.threads)
    runs = {}
    for p in args.pairs:
        seed, _, rest = p.partition("=")
        if args.equal_weights:
            if not (seed and rest) or ":" in rest:
                raise SystemExit(f"with --equal-weights a run is seed=RUN, got {p!r}")
            runs[seed] = {"trained": rest}
            continue
        base, _, trained = rest.partition(":")
        if not (seed and base and trained):
            raise SystemExit(f"a pair is seed=BASE_RUN:TRAINED_RUN, got {p!r}")
        runs[seed] = {"base": base, "trained": trained}
    with Measurement(threads=args.threads) as m:
        pairs = {}
        for seed, p in runs.items():
            print(f"seed {seed}: " + (f"{p['base']} / " if p.get("base") else "") + p["trained"], flush=True)
            pairs[seed] = evaluate_pair(p.get("base"), p["trained"], args)
    record = {"command": "python scripts/mixing_transplant.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": system_info("cpu"), "notes": read_notes(args.notes), "runs": runs, "seeds": list(runs),
              "lengths": [str(L) for L in args.lengths], "pairs": pairs,
              "settings": {k: getattr(args, k) for k in ("rule", "depths", "examples", "batch_size", "prefill_chunk",
                                                         "seed", "threads", "equal_weights", "keep_near")}}
    write_result(args.out, markdown(record), record, measurement=m.record, allow_busy=args.allow_busy)
    print(f"wrote {args.out}.md / .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
