#!/usr/bin/env python
"""How selective a trained write gate is (issue 50, ``attn.write_gate``): for passkey runs, the gate ``g`` each token
writes with on passkey examples of ``--length`` tokens (the model's own forward, every layer's
:class:`mhla.layers.WriteGate` read by a hook), per layer, over heads and examples: the share of filler tokens written
with ``g = 0``, the mean gate of the filler, of the needle (its prefix, digits and suffix), of its digits and of the
question, and ``filler mass at 1M``: what 1,048,576 filler tokens write (their mean gate times 1,048,576) over what the
needle writes (the sum of its gates). Below 1 the needle outweighs a million tokens of filler in the state (up to the
sizes of ``phi(k)`` and ``v``, which the gate does not see); a gate that never writes 0 leaves it growing with the
length. Per digit of the passkey (in order): each layer's mean gate on it (and its lowest head's), and the
model's answer accuracy on it, so a model that recalls all but one digit shows which one and what its gates wrote.
The filler split into its numbers (tokens whose text holds a digit) and its words: each one's mean gate, and the
numbers' share of what the filler writes, so a gate that writes the filler's numbers as it writes the passkey shows.

    python scripts/write_gate_stats.py wg_s0=outputs/<grid>/passkey_mhla_m8_ones_wg_nope_s0 ... \\
        --out results/language/write_gate_stats

Writes ``<out>.md`` and ``.json`` (each run's record: commit, clean-tree flag, machine, load, resolved config and
attention; the machine's load around the whole computation).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mhla.layers import WriteGate  # noqa: E402
from scripts.mqar_extrapolation import group  # noqa: E402
from tasks.common.checkpoint import find_checkpoint, load_run_checkpoint  # noqa: E402
from tasks.common.evaluation import load_run  # noqa: E402
from tasks.common.launch import read_notes  # noqa: E402
from tasks.common.records import RUN_RECORD_KEYS, Measurement, read_run_record  # noqa: E402
from tasks.common.results import rewrite_result, write_result  # noqa: E402
from tasks.common.utils import system_info  # noqa: E402
from tasks.language.long_context import PasskeyLMTask, filler_tokens, number_ids, passkey_batch  # noqa: E402

MILLION = 1_048_576
PARTS = ("filler", "needle", "digits", "question")
COLUMNS = ("filler_zero", *PARTS, "filler_mass_1m")


def part_masks(batch: dict, fmt, length: int) -> dict[str, torch.Tensor]:
    """``{part: [B, L] bool}`` of a passkey batch (:func:`tasks.language.long_context.passkey_batch`): the needle
    (prefix + digits + suffix), its digits, the question (the tail before the answer) and the filler."""
    B = batch["input_ids"].shape[0]
    pos = torch.arange(length)[None, :].expand(B, length)
    start = batch["needle_pos"][:, None]
    needle = (pos >= start) & (pos < start + fmt.needle_len)
    d0 = start + len(fmt.prefix)
    digits = (pos >= d0) & (pos < d0 + fmt.digits)
    tail = pos >= length - fmt.tail_len
    question = tail & (pos < length - fmt.digits)
    return {"filler": ~(needle | tail), "needle": needle, "digits": digits, "question": question}


@torch.no_grad()
def gate_stats(model, filler: np.ndarray, fmt, length: int, depths, examples: int, seed: int = 0,
               answer_acc: list | None = None, numbers: np.ndarray | None = None) -> list[dict]:
    """Per layer (the model's WriteGates in order): ``{"layer", "filler_zero", "filler", "needle", "digits",
    "question", "filler_mass_1m", "digit_gates", "digit_gates_min_head"}`` over ``examples`` passkey examples of
    ``length`` tokens at each depth (``filler_mass_1m`` None for a layer that writes nothing of the needle;
    ``digit_gates [P]``: the mean gate on the needle's i-th digit over heads and examples, ``digit_gates_min_head
    [P]``: the lowest head's). When ``answer_acc`` is a list, the model's accuracy on each answer digit ``[P]``
    (its argmax at the position that predicts it) is appended to it. With ``numbers`` (the filler's number token ids,
    :func:`tasks.language.long_context.number_ids`) each row also has ``"numbers_in_filler"`` (their share of the
    filler's tokens), ``"filler_numbers"`` and ``"filler_words"`` (the mean gate of the filler's numbers and of the
    rest; None where there are none) and ``"numbers_share"`` (the numbers' share of the filler's summed gate; None
    where the filler writes nothing)."""
    gates = [(name, m) for name, m in model.named_modules() if isinstance(m, WriteGate)]
    if not gates:
        raise SystemExit("the model has no write gate (attn.write_gate)")
    seen: dict[str, list] = {name: [] for name, _ in gates}
    hooks = [m.register_forward_hook(lambda mod, inp, out, name=name: seen[name].append(out.float()))
             for name, m in gates]
    rng = np.random.default_rng([seed, int(length)])
    masks: list[dict] = []
    hits = []  # [B, P]: answer digit recalled
    try:
        for depth in depths:
            batch = passkey_batch(filler, fmt, length, [depth] * examples, rng)
            logits = model(batch["input_ids"].to(next(model.parameters()).device)).logits
            masks.append(part_masks(batch, fmt, length))
            if numbers is not None:
                masks[-1]["numbers"] = masks[-1]["filler"] & torch.from_numpy(np.isin(batch["input_ids"].numpy(),
                                                                                      numbers))
            hits.append(logits[:, batch["targets_at"]].argmax(-1).cpu() == batch["answer"])
    finally:
        for h in hooks:
            h.remove()
    if answer_acc is not None:
        answer_acc.extend(torch.cat(hits).float().mean(0).tolist())
    rows = []
    for name, _ in gates:
        g = torch.cat(seen[name])  # [n, L, H]
        mask = {p: torch.cat([m[p] for m in masks]) for p in PARTS}
        mean = {p: float(g[mask[p]].mean()) for p in PARTS}
        needle_sum = float(g[mask["needle"]].sum()) / mask["needle"].shape[0] / g.shape[-1]  # per example, head
        on_digits = g[mask["digits"]].view(-1, fmt.digits, g.shape[-1]).mean(0)  # [P, H], the digits in order
        rows.append({"layer": name, "filler_zero": float((g[mask["filler"]] == 0).float().mean()), **mean,
                     "filler_mass_1m": mean["filler"] * MILLION / needle_sum if needle_sum > 0 else None,
                     "digit_gates": on_digits.mean(1).tolist(),
                     "digit_gates_min_head": on_digits.min(1).values.tolist()})
        if numbers is not None:
            num = torch.cat([m["numbers"] for m in masks])
            words = mask["filler"] & ~num
            filler_sum, num_sum = float(g[mask["filler"]].sum()), float(g[num].sum())
            rows[-1].update({"numbers_in_filler": float(num.sum()) / float(mask["filler"].sum()),
                             "filler_numbers": float(g[num].mean()) if num.any() else None,
                             "filler_words": float(g[words].mean()) if words.any() else None,
                             "numbers_share": num_sum / filler_sum if filler_sum > 0 else None})
    return rows


def _cell(key: str, x: float | None) -> str:
    if x is None:  # a layer that writes nothing of the needle (filler mass: no ratio)
        return "-"
    if key == "filler_zero":
        return f"{100 * x:.1f}%"
    if key == "filler_mass_1m":
        return f"{x:.3g}"
    return f"{x:.3f}"


def _mean(xs: list) -> float | None:
    """The mean of the values that are not None (None when none is)."""
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def markdown(record: dict) -> str:
    lines = ["# Write gates of trained passkey models", "",
             f"Made by `{record['command']}`. {record['examples']} examples at each of the depths "
             f"{', '.join(str(d) for d in record['depths'])}, {record['length']:,} tokens, evaluation seed "
             f"{record['seed']}. Per layer, over heads and examples: the share of filler tokens written with g = 0, "
             "the mean gate of the filler, of the needle (prefix, digits, suffix), of its digits and of the "
             "question, and what 1,048,576 filler tokens write over what the needle writes (`filler mass at 1M`; "
             "below 1 the needle outweighs a million tokens of filler in the state, up to the sizes of phi(k) and "
             "v). Machine and load: the .json.", "",
             "| run | layer | filler g = 0 | filler | needle | digits | question | filler mass at 1M |",
             "|---|---|---|---|---|---|---|---|"]
    for g, members in record["groups"].items():
        for key, rows in members.items():
            for r in rows:
                lines.append(f"| {g}/{key} | {r['layer']} | " + " | ".join(_cell(c, r[c]) for c in COLUMNS) + " |")
    lines += ["", "Mean over the seeds of a group, per layer:", "",
              "| group | layer | n | filler g = 0 | filler | needle | digits | question | filler mass at 1M |",
              "|---|---|---|---|---|---|---|---|---|"]
    for g, members in record["groups"].items():
        runs = list(members.values())
        for i, r0 in enumerate(runs[0]):
            cells = [_cell(c, _mean([run[i][c] for run in runs])) for c in COLUMNS]
            lines.append(f"| {g} | {r0['layer']} | {len(runs)} | " + " | ".join(cells) + " |")
    split = [(f"{g}/{key}", r) for g, members in record["groups"].items() for key, rows in members.items()
             for r in rows if "filler_numbers" in r]  # records written before the split have none
    if split:
        lines += ["", "The filler's numbers (tokens whose text holds a digit) and its words: their share of the filler's "
                  "tokens, each one's mean gate, and the numbers' share of what the filler writes (its summed gate):",
                  "", "| run | layer | numbers in the filler | gate on numbers | gate on words | numbers' share of the "
                  "filler's writes |", "|---|---|---|---|---|---|"]
        for run, r in split:
            share = "-" if r["numbers_share"] is None else f"{100 * r['numbers_share']:.1f}%"
            lines.append(f"| {run} | {r['layer']} | {100 * r['numbers_in_filler']:.1f}% | "
                         f"{_cell('filler', r['filler_numbers'])} | {_cell('filler', r['filler_words'])} | {share} |")
    if record.get("answer_acc"):  # records written before the per-digit view have neither
        lines += ["", "Per digit of the passkey, in order: the mean gate on the needle's digit over heads and "
                  "examples (the lowest head's mean in brackets), and the model's accuracy on that answer digit:", "",
                  "| run | layer | gate on digits 1 .. P (lowest head) |", "|---|---|---|"]
        for g, members in record["groups"].items():
            for key, rows in members.items():
                for r in rows:
                    cells = ", ".join(f"{a:.3f} ({b:.3f})" for a, b in zip(r["digit_gates"], r["digit_gates_min_head"]))
                    lines.append(f"| {g}/{key} | {r['layer']} | {cells} |")
        lines += ["", "| run | answer accuracy on digits 1 .. P |", "|---|---|"]
        for run, acc in record.get("answer_acc", {}).items():
            lines.append(f"| {run} | " + ", ".join(f"{100 * a:.1f}%" for a in acc) + " |")
    if record.get("notes"):
        lines += ["", "## Reading", "", record["notes"].strip()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="name=run_dir (name_s<seed> groups seeds)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--examples", type=int, default=4, help="examples per depth")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="the record's stem")
    ap.add_argument("--notes", default="", help="a reading (text or @file)")
    ap.add_argument("--notes-only", action="store_true", help="rewrite <out>.md from its .json with --notes")
    ap.add_argument("--allow-busy", action="store_true")
    args = ap.parse_args(argv)
    notes = read_notes(args.notes)
    if args.notes_only:
        rewrite_result(args.out, markdown, None, notes)
        return 0
    if not args.runs:
        raise SystemExit("give name=run_dir runs")
    torch.set_num_threads(args.threads)
    runs = dict(r.split("=", 1) for r in args.runs)
    record = {"command": "python scripts/write_gate_stats.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "length": args.length, "depths": args.depths, "examples": args.examples, "seed": args.seed,
              "groups": {}, "runs": {}, "answer_acc": {}, "notes": notes, "machine": system_info("cpu")}
    with Measurement(threads=args.threads) as load:
        for g, members in group(runs).items():
            for key, path in members.items():
                ckpt = str(find_checkpoint(path))
                cfg, task, model, _ = load_run(ckpt, ["trainer.device=cpu"])
                if not isinstance(task, PasskeyLMTask):
                    raise SystemExit(f"{g}/{key}: not a passkey run")
                _, val, tok, _ = task.data()
                acc: list = []
                filler = filler_tokens(val.tokens, tok.eos_token_id)
                rows = gate_stats(model.eval(), filler, task.fmt(), args.length, args.depths, args.examples,
                                  args.seed, answer_acc=acc, numbers=number_ids(filler, tok))
                record["groups"].setdefault(g, {})[str(key)] = rows
                record["answer_acc"][f"{g}/{key}"] = acc
                run = read_run_record(path) or {}
                step = int(load_run_checkpoint(ckpt, mmap=True)["step"])  # the training step of the weights read
                record["runs"][f"{g}/{key}"] = {"path": str(path), "checkpoint": ckpt, "step": step,
                                                **{k: run[k] for k in RUN_RECORD_KEYS if k in run}}
                print(f"{g}/{key}: " + "; ".join(f"{r['layer']} zero {100 * r['filler_zero']:.1f}% mass@1M "
                                                f"{_cell('filler_mass_1m', r['filler_mass_1m'])}" for r in rows),
                      flush=True)
    write_result(args.out, markdown(record), record, measurement=load.record, allow_busy=args.allow_busy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
