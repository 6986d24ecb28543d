"""Length extrapolation of trained ``task=lm_mini`` language models: per-position perplexity beyond the
training length, and (for MHLA) the extension rules of the causal mixing matrix past its learned rows.

Each run (``name=run_dir`` or ``name=run_dir/checkpoints/last.pt``) is loaded with
``tasks.common.evaluation.load_run`` (as ``eval.py`` loads it). The held-out text is the LM data's validation
split (the packed token file: validation documents joined by EOS), cut into consecutive windows of ``L``
tokens for every evaluation length ``L``. The loss of each target position is averaged over the windows and
then over position buckets.

MHLA rows past the learned ``M = max_learned_blocks`` ones follow an *extension rule*. The rules compared here
are applied to the same checkpoint (no retraining) by setting every ``MixingMatrix``'s ``extension`` option
(:func:`mhla.mixing.extend_causal_mixing`) while the model is evaluated, then restoring it. With ``L`` the learned
``[M, M]`` matrix, ``i >= M`` the query block, ``b <= i`` the key block, ``d = i - b``:

    relative     (the default before these runs) W[i, b] = L[M-1, M-1-d] for d <= M-1, else L[M-1, 0] (every far block).
    last_row     W[i, b] = L[M-1, min(b, M-1)]: the last learned row in absolute columns; blocks past M-1 take
                 its diagonal coefficient.
    uniform_far  as relative inside the window d <= M-1; the far blocks (d > M-1) share ONE far coefficient
                 L[M-1, 0] uniformly (each gets L[M-1, 0] / (i - M + 1)), so the row mass stays bounded
                 (the library default since these measurements).
    window       as relative inside the window; far blocks get 0 (sliding window of M blocks).
    sqrt_far     as relative inside the window; each far block gets L[M-1, 0] / sqrt(i - M + 1) (their share grows
                 as the square root of their count: between uniform_far and relative).
    mass_matched the relative rule rescaled so each extended row sums to the last learned row's sum.

Usage:
    make length-extrapolation [SEED=0]      # trains the three models below (~5 min), then evaluates (~2 min)
    python scripts/length_extrapolation.py --train outputs/lenx --seed 0 --out results/language/length_extrapolation
    python scripts/length_extrapolation.py mhla=outputs/lenx/mhla linear=outputs/lenx/linear \\
        softmax=outputs/lenx/softmax --lengths 256 512 1024 2048 4096 --out results/language/length_extrapolation

``--train DIR`` first trains, into ``DIR/<attn>``, every model of :data:`TRAIN_ATTNS` that has no checkpoint
there yet (:func:`train_commands`: ``task=lm_mini`` at 256 tokens, batch 8, so the tokens per step and the
token budget match lm_mini), two at a time with one thread each, then evaluates them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import re
import sys
import time

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
import torch.nn.functional as F

from mhla.mixing import EXTENSION_RULES, EXTENSION_RULES_TEXT, check_extension, mixing_matrices
from mhla.registry import Needs, benchmarked, takes_option
from tasks.common.checkpoint import find_checkpoint, load_run_checkpoint, model_weights
from tasks.common.config import import_config_attentions
from tasks.common.evaluation import load_run
from tasks.common.plots import pyplot, save_figure
from tasks.common.records import RUN_RECORD_KEYS, Measurement, read_run_record
from tasks.common.results import read_parts, write_result
from tasks.common.utils import system_info

BUCKET_EDGES = (0, 256, 512, 1024, 2048, 4096, 8192, 16384)
# the attentions that declare ``benchmark = True`` and decode causally (mhla/registry.py), MHLA first
import_config_attentions()  # the attentions defined outside the package (configs/attn/*.yaml's module:)
TRAIN_ATTNS = tuple(benchmarked(Needs(causal=True, decoding=True))[::-1])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------ training
def train_commands(train_dir: str, seed: int, extra: list[str] = ()) -> dict[str, list[str]]:
    """``{attn: train.py command}`` for the models of :data:`TRAIN_ATTNS` without a checkpoint in ``train_dir``."""
    out = {}
    for attn in TRAIN_ATTNS:
        run_dir = os.path.join(train_dir, attn)
        try:
            find_checkpoint(run_dir)
            continue  # trained already
        except FileNotFoundError:
            pass
        out[attn] = [sys.executable, os.path.join(ROOT, "train.py"), "task=lm_mini", f"attn={attn}",
                     "data.seq_len=256", "data.batch_size=8", f"seed={seed}", "logger=none",
                     "trainer.progress_bar=false", f"hydra.run.dir={os.path.abspath(run_dir)}", *extra]
    return out


def train_missing(train_dir: str, seed: int, jobs: int = 2, extra: list[str] = ()) -> dict[str, str]:
    """Train the missing models (``jobs`` at a time, one thread each; logs in ``DIR/<attn>.log``) and return
    ``{attn: run_dir}`` for all of :data:`TRAIN_ATTNS`."""
    import subprocess  # noqa: PLC0415

    from tasks.common.launch import run_parallel  # noqa: PLC0415

    os.makedirs(train_dir, exist_ok=True)
    commands = train_commands(train_dir, seed, extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(attn):
        t0 = time.time()
        with open(os.path.join(train_dir, f"{attn}.log"), "w") as log_file:
            rc = subprocess.run(commands[attn], cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT).returncode
        return {"rc": rc, "seconds": round(time.time() - t0, 1)}

    failed = []

    def done(attn, rec):
        if rec["rc"]:
            failed.append(attn)
        return f"trained {attn}: exit {rec['rc']} ({rec['seconds']} s; log {train_dir}/{attn}.log)"

    run_parallel(run, list(commands), jobs, "length extrapolation: training", done)
    if failed:
        raise SystemExit(f"training failed for {', '.join(failed)}: see {train_dir}/<attn>.log")
    return {attn: os.path.join(train_dir, attn) for attn in TRAIN_ATTNS}


# ------------------------------------------------------------------------------------ extension rules
@contextlib.contextmanager
def extension_rule(model, rule: str):
    """Within the block, every causal ``MixingMatrix`` of ``model`` extends past its learned rows by ``rule``."""
    check_extension(rule)
    mats = list(mixing_matrices(model).values())
    saved = [m.extension for m in mats]
    for m in mats:
        m.extension = rule
    try:
        yield
    finally:
        for m, old in zip(mats, saved):
            m.extension = old


def rules_for(model, rules: list[str] | None) -> list[str]:
    """The extension rules to evaluate an MHLA ``model`` under: ``rules``, or when None every rule of
    :data:`mhla.mixing.EXTENSION_RULES` and the rule the model was built with (its config's, when not among them:
    e.g. the cap that ``uniform_far:auto`` resolved to)."""
    if rules is not None:
        return list(rules)
    own = model.config.attn.get("mixing_extension")
    return list(EXTENSION_RULES) + ([own] if own and own not in EXTENSION_RULES else [])


# -------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def per_position_loss(model, tokens: np.ndarray, length: int, tokens_per_batch: int = 8192,
                      max_windows: int | None = None) -> tuple[np.ndarray, int]:
    """Mean next-token loss at each target position ``1..length-1`` over consecutive windows of ``tokens``.

    Returns ``(loss [length - 1], windows)``; entry ``p`` is the loss of predicting token ``p + 1``.
    """
    n_win = len(tokens) // length
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    if n_win < 1:
        raise ValueError(f"{len(tokens)} tokens hold no window of {length}")
    x_all = torch.from_numpy(np.asarray(tokens[:n_win * length]).astype(np.int64)).view(n_win, length)
    bs = max(1, tokens_per_batch // length)
    total = torch.zeros(length - 1, dtype=torch.float64)
    device = next(model.parameters()).device
    for s in range(0, n_win, bs):
        x = x_all[s:s + bs].to(device)
        logits = model(x, use_cache=False).logits[:, :-1].float()
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        total += loss.view(x.shape[0], length - 1).sum(0).double().cpu()
    return (total / n_win).numpy(), n_win


def bucket_ppl(loss: np.ndarray, edges=BUCKET_EDGES) -> dict:
    """``{"a-b": ppl}`` over target positions ``[a, b)`` (target position = index + 1)."""
    pos = np.arange(1, len(loss) + 1)
    out = {}
    for a, b in zip(edges[:-1], edges[1:]):
        m = (pos >= a) & (pos < b)
        if m.any():
            out[f"{a}-{b}"] = float(math.exp(loss[m].mean()))
    return out


def position_losses(entry: dict, length: int) -> np.ndarray:
    """The ``length - 1`` per-position losses of a curve entry; from a ``--compact-json`` entry, its 32-position
    means repeated (exact for buckets of a multiple of 32 positions, up to the last, shorter one)."""
    if "loss" in entry:
        return np.asarray(entry["loss"])
    return np.repeat(np.asarray(entry["loss_per_32_positions"]), 32)[:length - 1]


def fine_buckets(loss: np.ndarray, width: int) -> tuple[list[float], list[float]]:
    """Bucket centres and perplexities over ``width``-token position buckets (for the plot)."""
    xs, ys = [], []
    for a in range(0, len(loss), width):
        seg = loss[a:a + width]
        xs.append(a + 1 + (len(seg) - 1) / 2)
        ys.append(float(math.exp(seg.mean())))
    return xs, ys


def mixing_summary(model) -> list[dict]:
    """Per MHLA layer: the learned matrix, how far it moved from its init, the last learned row."""
    out = []
    for layer, m in mixing_matrices(model).items():
        with torch.no_grad():
            w = m.learned().float().cpu()
            init = m.initial_raw().float()
            init = (init.clamp(0, m.max_value) if m.parameterization == "clamp" else
                    torch.nn.functional.softplus(init) if m.parameterization == "softplus" else init.exp())
            init = init.tril() if m.causal else init
        out.append({"module": f"{layer}.mixing", "M": m.num_blocks, "init": m.init, "param": m.parameterization,
                    "max_abs_change_from_init": float((w - init).abs().max()),
                    "last_row": [round(float(v), 4) for v in w.reshape(-1, m.num_blocks, m.num_blocks)[0, -1]],
                    "last_row_sum": float(w.reshape(-1, m.num_blocks, m.num_blocks)[0, -1].sum())})
    return out


def graft_into_mhla(model, linear_ckpt: str) -> None:
    """Load a linear-attention run's weights into an MHLA model of the same shape and reset every mixing
    matrix to its init (causal uniform ``1/(i+1)``): inside the learned size this IS the linear model (the
    output RMSNorm removes the per-row scale), past it the extension rule decides which blocks are mixed."""
    missing, unexpected = model.load_state_dict(model_weights(load_run_checkpoint(linear_ckpt), "ema"), strict=False)
    if unexpected or any("mixing" not in k for k in missing):
        raise ValueError(f"{linear_ckpt} does not fit this MHLA model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for m in mixing_matrices(model).values():
            m.raw.copy_(m.initial_raw().to(m.raw))


def evaluate_runs(runs: dict, lengths: list[int], rules: list[str] | None, tokens_per_batch: int,
                  max_windows: int | None, log=print) -> dict:
    results = {"runs": {}, "curves": {}, "mixing": {}}
    for name, path in runs.items():
        graft = None
        if "+" in path:  # "mhla_run+linear_run": MHLA architecture, the linear run's weights, mixing at its init
            path, graft = path.split("+", 1)
        ckpt = str(find_checkpoint(path))
        cfg, task, model, _ = load_run(ckpt, ["trainer.device=cpu"])
        if graft is not None:
            graft_into_mhla(model, find_checkpoint(graft))
        _, val_ds = task.build_datasets()
        tokens = np.asarray(val_ds.tokens)
        attn = str(cfg.attn.name)
        info = {"checkpoint": ckpt if graft is None else f"{ckpt} + weights of {find_checkpoint(graft)}",
                "attn": attn if graft is None else "linear weights in MHLA (mixing at init)", "train_seq_len": int(cfg.data.seq_len),
                "block_size": int(model.config.attn.get("block_size", 0)), "val_tokens": int(len(tokens))}
        extends = takes_option(attn, "mixing_extension")  # MHLA: its mixing has extension rules past the learned rows
        run_rules = rules_for(model, rules) if extends else ["-"]
        if extends:
            results["mixing"][name] = mixing_summary(model)
        for rule in run_rules:
            key = name if rule == "-" else f"{name}/{rule}"
            results["curves"][key] = {}
            ctx = extension_rule(model, rule) if rule != "-" else contextlib.nullcontext()
            with ctx:
                for L in lengths:
                    t0 = time.time()
                    loss, n_win = per_position_loss(model, tokens, L, tokens_per_batch, max_windows)
                    ent = {"windows": n_win, "ppl": float(math.exp(loss.mean())), "buckets": bucket_ppl(loss),
                           "loss": [round(float(v), 5) for v in loss], "seconds": round(time.time() - t0, 1)}
                    results["curves"][key][str(L)] = ent
                    log(f"{key:24s} L={L:5d} windows={n_win:4d} ppl={ent['ppl']:9.2f} "
                        f"buckets={ {k: round(v, 1) for k, v in ent['buckets'].items()} } ({ent['seconds']} s)")
        run_dir = os.path.dirname(os.path.dirname(ckpt))  # <run>/checkpoints/last.pt
        run = read_run_record(run_dir) or {}  # the trainer's run.json: commit, dirty, machine, load, config
        results["runs"][name] = {**info, **{k: run[k] for k in RUN_RECORD_KEYS if k in run}}
    return results


# ---------------------------------------------------------------------------------------- reports
def seed_groups(keys) -> dict[str, list[str]]:
    """``{"<variant>/<rule>": [keys]}``: the curves of runs named ``<variant>_s<seed>`` grouped over their seeds
    (other names are their own group)."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        name, sep, rule = key.partition("/")
        stem = re.sub(r"_s\d+$", "", name)
        groups.setdefault(stem + sep + rule, []).append(key)
    return groups


def write_plot(results: dict, path: str, width: int = 256, length: int | None = None) -> None:
    """Per-position perplexity at ``length`` tokens (default: the longest length every curve has), one line per
    run and rule, or per variant and rule averaged over its seeds (the mean loss: :func:`seed_groups`)."""
    plt = pyplot()

    curves = results["curves"]
    if length is None:
        length = min(max(int(L) for L in by) for by in curves.values())
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, keys in seed_groups(curves).items():
        L = str(length) if all(str(length) in curves[k] for k in keys) else max(curves[keys[0]], key=int)
        loss = np.mean([position_losses(curves[k][L], int(L)) for k in keys], axis=0)
        xs, ys = fine_buckets(loss, width)
        seeds = f"{len(keys)} seeds, " if len(keys) > 1 else ""
        ax.plot(xs, ys, label=f"{label} ({seeds}L={L})", lw=1.4,
                ls="-" if "/" not in label or label.endswith("/relative") else "--")
    train_len = max(r["train_seq_len"] for r in results["runs"].values())
    ax.axvline(train_len, color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"token position ({width}-token buckets)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"Per-position validation perplexity, trained at {train_len} tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path, dpi=120)


def markdown(results: dict, command: str, header: dict, notes: str = "") -> str:
    lines = ["# Length extrapolation (lm_mini-sized models, trained at 256 tokens)", "",
             f"Command: `{command}`", ""] + [f"- part: `{p_['command']}` ({p_['seconds']} s)" for p_ in
                                              results.get("parts", [])] + ["",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in header.items()), ""]
    for name, info in results["runs"].items():
        lines.append(f"- `{name}`: {info['attn']}, trained at {info['train_seq_len']} tokens, block size "
                     f"{info['block_size']}, checkpoint `{info['checkpoint']}`, {info['val_tokens']:,} validation tokens")
    buckets = [f"{a}-{b}" for a, b in zip(BUCKET_EDGES[:-1], BUCKET_EDGES[1:])]
    all_lengths = sorted({int(L) for by in results["curves"].values() for L in by})
    for L in [x for x in all_lengths if x >= 2048] or all_lengths[-1:]:
        keys = [k for k, by in results["curves"].items() if str(L) in by]
        used = [b for b in buckets if any(b in results["curves"][k][str(L)]["buckets"] for k in keys)]
        wins = sorted({results["curves"][k][str(L)]["windows"] for k in keys})
        lines += ["", f"## Perplexity per position bucket at L = {L} ({'/'.join(map(str, wins))} windows)", "",
                  "| model / rule | " + " | ".join(used) + " |", "|---|" + "---|" * len(used)]
        for k in keys:
            e = results["curves"][k][str(L)]
            lines.append(f"| {k} | " + " | ".join(f"{e['buckets'][b]:.1f}" if b in e["buckets"] else ""
                                                    for b in used) + " |")
    lengths = sorted({int(L) for by in results["curves"].values() for L in by})
    lines += ["", "## Whole-window perplexity by evaluation length", "",
              "| model / rule | " + " | ".join(str(L) for L in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for key, by_len in results["curves"].items():
        lines.append(f"| {key} | " + " | ".join(f"{by_len[str(L)]['ppl']:.1f}" if str(L) in by_len else ""
                                                for L in lengths) + " |")
    if results.get("mixing"):
        lines += ["", "## Learned MHLA mixing matrices", ""]
        for name, layers in results["mixing"].items():
            for lay in layers:
                lines.append(f"- `{name}` {lay['module']}: M={lay['M']}, init={lay['init']}, param={lay['param']}, "
                             f"max |W - init| = {lay['max_abs_change_from_init']:.4f}, last learned row "
                             f"{lay['last_row']} (sum {lay['last_row_sum']:.3f})")
    if notes:
        lines += ["", notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="name=run_dir (or name=path/to/last.pt)")
    p.add_argument("--train", metavar="DIR", default=None,
                   help="train the missing mhla / linear / softmax models into DIR/<attn>, then evaluate them")
    p.add_argument("--seed", type=int, default=0, help="with --train: the training seed")
    p.add_argument("--jobs", type=int, default=2, help="with --train: trainings at a time (one thread each)")
    p.add_argument("--train-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="with --train: Hydra overrides added to every training (e.g. optim.mixing_lr_scale=0.01)")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--rules", nargs="+", default=None, type=check_extension, metavar="RULE",
                   help=f"extension rules: {EXTENSION_RULES_TEXT} (default: every named rule and the model's own)")
    p.add_argument("--tokens-per-batch", type=int, default=8192)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--out", default="results/language/length_extrapolation",
                   help="writes <out>.json, <out>.md, <out>.png")
    p.add_argument("--notes", default="", help="a file whose text is appended to the markdown (the reading)")
    p.add_argument("--compact-json", action="store_true",
                   help="store 32-position bucket means of the losses instead of every position")
    p.add_argument("--merge", action="store_true",
                   help="the positional arguments are .json files of earlier runs of this script (evaluated in "
                        "parallel processes): merge them and write the report, without evaluating")
    args = p.parse_args(argv)
    if not args.runs and not args.train:
        p.error("give runs (name=run_dir ...), --merge with .json files, or --train DIR")
    header = system_info("cpu")
    command = "python scripts/length_extrapolation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    measurement = None  # an evaluation's conditions (a merge keeps its parts')
    if args.merge:
        parts, kept = read_parts(args.runs)
        results = {k: {key: v for part in parts for key, v in part.get(k, {}).items()}
                   for k in ("runs", "curves", "mixing")}
        results.update({k: v for k, v in kept.items() if v is not None})  # parts, seconds, measurement
    else:
        runs = dict(r.split("=", 1) for r in args.runs)
        if args.train:
            runs = {**train_missing(args.train, args.seed, args.jobs, args.train_overrides), **runs}
        with Measurement(threads=torch.get_num_threads()) as m:
            results = evaluate_runs(runs, args.lengths, args.rules, args.tokens_per_batch, args.max_windows)
        measurement = m.record
        results["seconds"] = measurement["seconds"]
    results["command"], results["system"] = command, header
    full = copy.deepcopy(results) if args.compact_json else results  # the plot reads the per-position losses
    if args.compact_json:  # per-position losses -> 32-token bucket means (the full curves are large)
        for by_len in results["curves"].values():
            for e in by_len.values():
                if "loss" in e:
                    loss = np.asarray(e.pop("loss"))
                    e["loss_per_32_positions"] = [round(float(loss[a:a + 32].mean()), 4) for a in range(0, len(loss), 32)]
    notes = open(args.notes).read() if args.notes and os.path.exists(args.notes) else ""
    # perplexities do not depend on the load: a busy machine's record is written, marked BUSY (its seconds are not
    # comparable with an idle machine's)
    write_result(args.out, markdown(results, command, header, notes), results, lambda png: write_plot(full, png),
                 indent=None, measurement=measurement, allow_busy=True,
                 busy_written="written all the same: its perplexities do not depend on the load, its seconds do")
    print(f"wrote {args.out}.md / .json / .png ({results['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
