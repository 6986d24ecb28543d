#!/usr/bin/env python
"""Readings bound to their data: every decimal number and every verdict word of a reading names where it comes from.

A *reading* is the hand-written part of a results file: what follows its ``## Reading`` heading (the writers put
the ``--notes`` text, often kept in ``<stem>_reading.md``, there). Beside ``results/<...>/<stem>.md`` sits its
*binding*, ``<stem>.reading.bind``, which the markdown never shows (a plain-text file: section lines, ``  - ``
entries taken as written, ``#`` comment lines)::

    # the records it quotes besides the .json beside the .md (``record``), named, relative to this file
    files:
      n256: seeds_n256.json
    # every decimal number of the reading, in reading order: "quoted = expression" or "quoted ~ setting: / paper: ..."
    numbers:
      - 77.5 = 100 * where(results, variant="linear_noconv", seed=1).acc
      - 30.5 = paired(variants.mhla_lm.by_seed, variants.linear.by_seed).mean
      - 0.01 ~ setting: the mixing matrix's lr factor
    # every verdict word of the reading, in order: "word = rule" or "word ~ why this use is not a verdict"
    verdicts:
      - level = ordering_word(variants.mhla_lm.by_seed, variants.linear.by_seed)
      - level ~ prose: "at the 5% level", a significance level

The check (:func:`check`):

- **Numbers.** The reading's decimal numbers (:data:`DECIMAL`: a number with a decimal point; integers -- years,
  steps, seeds, counts -- are not bound) are, in order, the ``numbers`` entries' quoted values, and each entry's
  expression, evaluated on the records, prints as the quoted number at the decimals it is quoted with
  (``f"{value:.{d}f}"``; the rounding is Python's, of the value as stored). No other number of the JSON can stand
  in for it: the expression is one path (or arithmetic over paths), so a changed record or a changed reading fails.
  A number that is not a result (a recipe's setting, the paper's number) is marked ``~ setting: ...`` or
  ``~ paper: ...`` and is not looked up.
- **Verdict words.** Every word of :data:`VERDICT_WORDS` in the reading is, in order, a ``verdicts`` entry's word.
  An entry ``word = rule`` evaluates the rule on the records (:func:`ordering_word`: a gap of the means over two
  pooled standard deviations, 3 seeds a side; :func:`ci_word`: a paired 95% interval that clears zero;
  :func:`convergence_word` / :func:`converged`: the written convergence rule), and the result must be the word
  typed. An entry ``word ~ reason`` marks a use of the word that is not a verdict (``at the 5% level``). A verdict
  a rule cannot give (one seed against one teacher run, a per-seed remark) is worded without these words.
- Not read: inline code (text between backticks) and the cells of a markdown table column whose header says
  ``paper`` (the paper's numbers).

Expressions are Python expressions over the records, evaluated by :func:`evaluate` (no ``eval``): a name is a key
of ``record`` (the default record), ``record`` itself or a name of ``files``; ``a.b`` and ``a["b"]`` read a key
(``a[0]`` reads a list's item or the key ``"0"``); ``+ - * /``, numbers, lists ``[a, b]`` and the functions of
:data:`FUNCTIONS`. A record's ``notes`` (its copy of the reading) cannot be read: it is not evidence.

    python -m scripts.tables.readings                    # check every bound reading; exit 1 on a problem
    python -m scripts.tables.readings results/mqar.md    # the same for one reading
    python -m scripts.tables.readings --draft results/mqar.md   # a first binding to review (numbers found by value)
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import math
import os
import re
import statistics
import sys

from tasks.common.stats import convergence_word as _convergence_word
from tasks.common.stats import mean_std, ordering_winner, paired_difference, pooled_std
from tasks.common.stats import ordering_word as _ordering_word

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d+(?![\w.]*\d)")
CODE = re.compile(r"`[^`]*`")
VERDICT_WORDS = ("holds", "level", "reversed", "converged", "still gaining", "better", "worse")
VERDICT = re.compile(r"\b(" + "|".join(w.replace(" ", r"\s+") for w in VERDICT_WORDS) + r")\b", re.I)
SUFFIX = ".reading.bind"
# "q ~ setting: ...": a number of the recipe (an lr factor, a model's size), "q ~ paper: ...": the paper's number
SETTING = ("setting:", "paper:")
# the readings that are checked the old way (any JSON number rounding to the quoted one): owned by other work
UNBOUND: dict[str, str] = {
}


# -- the reading ----------------------------------------------------------------------------------------------

def reading(md: str) -> str:
    """The hand-written part of a results file: what follows ``## Reading`` up to the next ``## `` heading (a
    later ``## Notes ...`` section is read too; all of a ``*_reading.md``), without inline code and without the
    cells of ``paper`` columns."""
    text = md.split("## Reading", 1)[1] if "## Reading" in md else md
    out, paper_cols, skip = [], set(), False
    for line in text.split("\n"):
        if line.startswith("## "):  # a later section: generated (## Runs) unless it is more notes
            skip = not line.startswith(("## Reading", "## Notes"))
            continue
        if skip:
            continue
        if line.lstrip().startswith("|"):
            cells = line.strip().strip("|").split("|")
            if all(set(c.strip()) <= set("-: ") for c in cells):  # the separator row
                out.append(line)
                continue
            if any("paper" in c.lower() for c in cells) and not paper_cols:  # a header naming paper columns
                paper_cols = {i for i, c in enumerate(cells) if "paper" in c.lower()}
            line = "|" + "|".join(c for i, c in enumerate(cells) if i not in paper_cols) + "|"
        else:
            paper_cols = set()
        out.append(line)
    return CODE.sub("", "\n".join(out))


def numbers(text: str) -> list[str]:
    """The decimal numbers of a reading, in order, as written."""
    return DECIMAL.findall(text)


def words(text: str) -> list[str]:
    """The verdict words of a reading, in order (lower case, one space)."""
    return [" ".join(w.lower().split()) for w in VERDICT.findall(text)]


# -- expressions ----------------------------------------------------------------------------------------------

class BindingError(Exception):
    """An expression that does not evaluate on its records."""


def _seq(x) -> list[float]:
    if isinstance(x, dict):
        x = list(x.values())
    return [float(v) for v in x]


def _by_seed(x) -> dict:
    """A per-seed dict ``{seed: value}``: a dict as it is, a list as ``{index: value}``."""
    return dict(x) if isinstance(x, dict) else dict(enumerate(x))


def where(items: list, **match):
    """The one item of ``items`` (dicts) whose fields equal ``match``; an error unless exactly one does."""
    hits = [it for it in items if all(it.get(k) == v for k, v in match.items())]
    if len(hits) != 1:
        raise BindingError(f"where({match}): {len(hits)} items match, not 1")
    return hits[0]


def by_seed(items: list, field: str, **match) -> dict:
    """``{seed: item[field]}`` over the items (dicts with a ``seed``) whose fields equal ``match`` (``field`` may
    be dotted: ``"metrics.top1"``)."""
    def get(it):
        for key in field.split("."):
            it = it[key]
        return it

    out = {it["seed"]: get(it) for it in items if all(it.get(k) == v for k, v in match.items())}
    if not out:
        raise BindingError(f"by_seed({field!r}, {match}): no item matches")
    return out


def over(by: dict, field: str) -> list:
    """Each of a dict's values' (seeds') dotted ``field`` (``"relative.512.buckets.4.acc"``: digits index lists)."""
    vals = []
    for it in by.values():
        for key in field.split("."):
            it = _key(it, int(key) if key.isdigit() and isinstance(it, list) else key)
        vals.append(float(it))
    return vals


def mean_over(by: dict, field: str) -> float:
    """The mean of :func:`over`: a field's mean over the seeds."""
    return statistics.fmean(over(by, field))


def pluck(items: list, field: str, **match) -> list:
    """``[item[field], ...]`` over the items whose fields equal ``match`` (``field`` may be dotted)."""
    out = []
    for it in items:
        if all(it.get(k) == v for k, v in match.items()):
            for key in field.split("."):
                it = it[key]
            out.append(it)
    if not out:
        raise BindingError(f"pluck({field!r}, {match}): no item matches")
    return out


def paired(a, b) -> dict:
    """:func:`tasks.common.stats.paired_difference` of two per-seed dicts (``a - b``): ``mean``, ``std``,
    ``ci95`` (``[lo, hi]``), ``diffs``, ``n``."""
    out = paired_difference(_by_seed(a), _by_seed(b))
    out["ci95"] = list(out["ci95"]) if out["ci95"] is not None else None
    return out


def ordering_word(a, b, higher: bool = True) -> str:
    """``holds`` / ``reversed`` / ``level``: :func:`tasks.common.stats.ordering_word` (a gap of the means over
    two pooled standard deviations, 3 seeds a side) on two sides' per-seed values."""
    return _ordering_word(_seq(a), _seq(b), higher)


def better_word(a, b, higher: bool = True) -> str:
    """The same rule as a comparison of ``a`` with ``b``: ``better``, ``worse`` or ``level``."""
    return {"a": "better", "b": "worse", None: "level"}[ordering_winner(_seq(a), _seq(b), higher)]


def ci_word(a, b, higher: bool = True) -> str:
    """``better`` / ``worse`` when the paired 95% interval of ``a - b`` clears zero (in the metric's direction),
    else ``level``."""
    d = paired(a, b)
    if not d["ci95"]:
        return "level"
    lo, hi = d["ci95"]
    if lo > 0 or hi < 0:
        return "better" if (lo > 0) == higher else "worse"
    return "level"


def ci_holds(a, b, higher: bool = True) -> str:
    """``holds`` when the paired 95% interval of ``a - b`` clears zero in ``a``'s favour, ``reversed`` when in
    ``b``'s, else ``level``."""
    return {"better": "holds", "worse": "reversed", "level": "level"}[ci_word(a, b, higher)]


def convergence_word(gains, values, higher: bool = True) -> str:
    """:func:`tasks.common.stats.convergence_word`: ``converged``, ``still gaining`` or ``-``."""
    return _convergence_word(_seq(gains), _seq(values), higher)


def converged(row: dict, higher: bool = True) -> str:
    """The convergence rule on a seed-grid row (``by_seed`` and ``last_gain.by_seed``)."""
    return convergence_word(row["last_gain"]["by_seed"], row["by_seed"], higher)


def at(curve, step):
    """The value of a ``[[step, value], ...]`` curve at ``step``."""
    hits = [v for s, v in curve if s == step]
    if len(hits) != 1:
        raise BindingError(f"at({step}): {len(hits)} points")
    return hits[0]


def pooled(a, b) -> float:
    """The gap of the means ``mean(a) - mean(b)`` in pooled standard deviations (the unit of the ordering rule)."""
    return (statistics.fmean(_seq(a)) - statistics.fmean(_seq(b))) / pooled_std(_seq(a), _seq(b))


def round_noise(rounds: list) -> float:
    """How far one setting's time moved from round to round of a benchmark: ``max over settings of
    max / min - 1`` over its rounds (``rounds``: lists of rows with ``M`` and ``ms``), as scripts/auto_m.py reads it."""
    per = {}
    for rnd in rounds:
        for r in rnd:
            per.setdefault(r["M"], []).append(r["ms"])
    return max(max(v) / min(v) - 1 for v in per.values() if len(v) > 1)


def time_word(ratio: float, noise: float) -> str:
    """A time against a reference as ``ratio`` (time / reference): ``slower`` / ``faster`` when it is off by more
    than ``noise`` (a fraction), else ``level``."""
    gap = ratio - 1
    return "slower" if gap > noise else "faster" if -gap > noise else "level"


def pooled_sd(a, b) -> float:
    """:func:`tasks.common.stats.pooled_std` of two sides' per-seed values."""
    return pooled_std(_seq(a), _seq(b))


def every(*words) -> str:
    """The word the rules give when they all give the same one (one word said of several rows), else ``mixed``."""
    return words[0] if len(set(words)) == 1 else "mixed"


def rel(a, b) -> float:
    """The relative change of ``a`` against ``b``, in percent: ``100 (a / b - 1)``."""
    return 100.0 * (float(a) / float(b) - 1.0)


FUNCTIONS = {
    "mean": lambda x: statistics.fmean(_seq(x)),
    "std": lambda x: mean_std(_seq(x))[1],
    "min": lambda *x: min(_seq(x[0]) if len(x) == 1 else x),
    "max": lambda *x: max(_seq(x[0]) if len(x) == 1 else x),
    "abs": abs, "len": len, "values": lambda d: list(d.values()), "sqrt": math.sqrt,
    # reading records
    "where": where, "by_seed": by_seed, "pluck": pluck, "over": over, "mean_over": mean_over, "at": at,
    # statistics over seeds
    "paired": paired, "rel": rel, "pooled": pooled, "pooled_sd": pooled_sd, "round_noise": round_noise,
    # rules that give a verdict word
    "ordering_word": ordering_word, "better_word": better_word, "ci_word": ci_word, "ci_holds": ci_holds,
    "convergence_word": convergence_word, "converged": converged, "time_word": time_word, "every": every,
    "True": True, "False": False,
}
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


def _key(obj, key):
    if key == "notes":
        raise BindingError("a record's notes are its reading: not evidence for it")
    if isinstance(obj, list):
        if not isinstance(key, (int, slice)):
            raise BindingError(f"a list indexed by {key!r}")
        return obj[key]
    if isinstance(obj, dict):
        for k in (key, str(key)):
            if k in obj:
                return obj[k]
    raise BindingError(f"no key {key!r}")


def evaluate(expr: str, names: dict):
    """The value of ``expr`` over ``names`` (a record's top-level keys, ``record``, the binding's other files)."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            if node.id in FUNCTIONS:
                return FUNCTIONS[node.id]
            raise BindingError(f"unknown name {node.id!r}")
        if isinstance(node, ast.Attribute):
            return _key(ev(node.value), node.attr)
        if isinstance(node, ast.Subscript):
            return _key(ev(node.value), ev(node.slice))
        if isinstance(node, ast.Slice) and node.step is None:  # the first seeds of a list: over(...)[:3]
            return slice(*(None if b is None else int(ev(b)) for b in (node.lower, node.upper)))
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(x) for x in node.elts]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
            return FUNCTIONS[node.func.id](*[ev(a) for a in node.args],
                                           **{k.arg: ev(k.value) for k in node.keywords})
        raise BindingError(f"not allowed in a binding: {ast.dump(node)[:60]}")

    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except BindingError:
        raise
    except (SyntaxError, KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
        raise BindingError(f"{type(e).__name__}: {e}") from None


def printed(value, quoted: str) -> str:
    """``value`` at the decimals of ``quoted`` (a ``-0.0`` prints as ``0.0``)."""
    digits = len(quoted.split(".")[1]) if "." in quoted else 0  # (an integer is never quoted: a mismatch)
    out = f"{float(value):.{digits}f}"
    return out[1:] if out.startswith("-") and float(out) == 0 and not quoted.startswith("-") else out


# -- bindings -------------------------------------------------------------------------------------------------

def binding_path(md_path: str) -> str:
    """``<stem>.reading.bind`` beside ``<stem>.md``."""
    return md_path[:-3] + SUFFIX


def load_binding(path: str) -> dict:
    """Read a binding file: ``files:`` (``  name: path`` lines), ``numbers:`` and ``verdicts:`` (``  - entry``
    lines); ``#`` starts a comment line. An entry is the rest of its line, taken as written (no quoting)."""
    out = {"files": {}, "numbers": [], "verdicts": []}
    section = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            text = line.rstrip("\n")
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            if not text.startswith(" "):
                section = text.rstrip(":").strip()
                if section not in out:
                    raise BindingError(f"{path}:{n}: unknown section {section!r}")
            elif section == "files":
                name, rel_path = text.strip().split(":", 1)
                out["files"][name.strip()] = rel_path.strip()
            elif section and text.strip().startswith("- "):
                out[section].append(text.strip()[2:].strip())
            else:
                raise BindingError(f"{path}:{n}: {text!r}")
    return out


def names_for(md_path: str, binding: dict) -> dict:
    """The names an expression may use: the record's top-level keys, ``record`` and the binding's files."""
    here = os.path.dirname(md_path)

    def load(rel_path):
        with open(os.path.join(here, rel_path), encoding="utf-8") as f:
            return json.load(f)

    record = load(os.path.basename(md_path)[:-3] + ".json")
    names = dict(record) if isinstance(record, dict) else {}
    names["record"] = record
    for name, rel_path in binding["files"].items():
        names[name] = load(rel_path)
    return names


def split_entry(entry, seps: str) -> tuple[str, str, str]:
    """``"lhs = rhs"`` -> ``(lhs, "=", rhs)``; the first of ``seps`` that occurs."""
    text = str(entry)
    for i, ch in enumerate(text):
        if ch in seps:
            return text[:i].strip(), ch, text[i + 1:].strip()
    raise BindingError(f"{text!r}: no {' or '.join(seps)}")


def check(md: str, binding: dict, names: dict) -> list[str]:
    """The problems of one reading against its binding (empty when every number and word is bound and right)."""
    text = reading(md)
    problems = []
    quoted = numbers(text)
    bound = []
    for entry in binding["numbers"]:
        try:
            bound.append(split_entry(entry, "=~"))
        except BindingError as e:
            problems.append(f"numbers: {e}")
    if [q for q, _, _ in bound] != quoted:
        problems.append(_first_mismatch("numbers", quoted, [q for q, _, _ in bound]))
    for q, sep, expr in bound:
        if sep == "~":
            if not expr.startswith(SETTING):
                problems.append(f"{q} ~ {expr}: a number not read from a record must say {' or '.join(SETTING)}")
            continue
        try:
            value = evaluate(expr, names)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise BindingError(f"is {type(value).__name__}, not a number")
            if printed(value, q) != q:
                problems.append(f"{q} = {expr}: the data print {printed(value, q)} ({value!r})")
        except BindingError as e:
            problems.append(f"{q} = {expr}: {e}")
    typed = words(text)
    entries = []
    for entry in binding["verdicts"]:
        try:
            entries.append(split_entry(entry, "=~"))
        except BindingError as e:
            problems.append(f"verdicts: {e}")
    if [" ".join(w.lower().split()) for w, _, _ in entries] != typed:
        problems.append(_first_mismatch("verdict words", typed, [w for w, _, _ in entries]))
    for word, sep, rule in entries:
        if sep == "~":
            if not rule:
                problems.append(f"{word} ~ : say why this use is not a verdict")
            continue
        try:
            got = evaluate(rule, names)
        except BindingError as e:
            problems.append(f"{word} = {rule}: {e}")
            continue
        if str(got).lower() != word.lower():
            problems.append(f"{word} = {rule}: the rule gives {got!r}")
    return problems


def _first_mismatch(what: str, typed: list, bound: list) -> str:
    for i, (t, b) in enumerate(zip(typed, bound)):
        if t != b:
            return f"{what}: the reading's #{i + 1} is {t!r}, the binding's {b!r}"
    return f"{what}: the reading has {len(typed)}, the binding {len(bound)}"


def check_file(md_path: str) -> list[str]:
    """:func:`check` on ``results/<...>/<stem>.md`` with its ``<stem>.reading.bind``."""
    with open(md_path, encoding="utf-8") as f:
        md = f.read()
    bpath = binding_path(md_path)
    if not os.path.exists(bpath):
        text = reading(md) if "## Reading" in md else ""
        return [f"no binding {os.path.basename(bpath)}"] if numbers(text) or words(text) else []
    binding = load_binding(bpath)
    return check(md, binding, names_for(md_path, binding))


def reading_files(root: str = ROOT) -> list[str]:
    """Every results file with a reading (relative paths)."""
    out = []
    for md in sorted(glob.glob(os.path.join(root, "results", "**", "*.md"), recursive=True)):
        if md.endswith("_reading.md") or "_runs" + os.sep in md:
            continue
        with open(md, encoding="utf-8") as f:
            if "## Reading" in f.read():
                out.append(os.path.relpath(md, root))
    return out


# -- drafting a binding ---------------------------------------------------------------------------------------

_ID_FIELDS = ("variant", "row", "cell", "attn", "name", "arm", "M", "seed", "seq_len", "num_kv_pairs", "length",
              "steps", "block_size", "rule", "model", "task")


def _ident(key) -> str:
    import keyword
    if isinstance(key, str) and key.isdigit():
        return f"[{key}]"
    return f".{key}" if isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key) else f"[{key!r}]"


def _leaves(obj, path: str, out: list, long: int = 64):
    """``(expression, value)`` for every number of ``obj`` (lists of dicts addressed with :func:`where`)."""
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        out.append((path, float(obj)))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k != "notes":
                _leaves(v, path + _ident(k), out, long)
        rows = {k: v["by_seed"] for k, v in obj.items() if isinstance(v, dict) and isinstance(v.get("by_seed"), dict)}
        for a in rows:  # a seed grid's rows: their paired differences
            for b in rows:
                if a != b and len(set(rows[a]) & set(rows[b])) >= 2:
                    pe = f"paired({path.lstrip('.')}{_ident(a)}.by_seed, {path.lstrip('.')}{_ident(b)}.by_seed)"
                    d = paired(rows[a], rows[b])
                    out += [(pe + ".mean", d["mean"]), (pe + ".ci95[0]", d["ci95"][0]), (pe + ".ci95[1]", d["ci95"][1])]
                    out += [(pe + f".diffs[{i}]", x) for i, x in enumerate(d["diffs"])]
        vals = [v for v in obj.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if 2 <= len(vals) == len(obj):
            out.append((f"mean({path.lstrip('.')})", statistics.fmean(vals)))
            out.append((f"std({path.lstrip('.')})", mean_std(vals)[1]))
    elif isinstance(obj, list) and obj and all(isinstance(p, list) and len(p) == 2 for p in obj):
        steps = [p[0] for p in obj]
        if len(set(steps)) == len(steps) and len(obj) <= 4 * long:  # a [step, value] curve
            for st, v in obj:
                if isinstance(v, (int, float)):
                    out.append((f"at({path.lstrip('.')}, {st})", float(v)))
    elif isinstance(obj, list) and len(obj) <= long:
        for i, v in enumerate(obj):
            sel = None
            if isinstance(v, dict):
                fields = [f for f in _ID_FIELDS if isinstance(v.get(f), (str, int)) and not isinstance(v.get(f), bool)]
                for n in range(1, len(fields) + 1):
                    keys = fields[:n]
                    if sum(all(o.get(k) == v[k] for k in keys) for o in obj if isinstance(o, dict)) == 1:
                        sel = ", ".join(f"{k}={v[k]!r}" for k in keys)
                        break
            sub = f"where({path.lstrip('.')}, {sel})" if sel else f"{path}[{i}]"
            _leaves(v, sub, out, long)


def draft(md_path: str, files: dict | None = None) -> str:
    """A first binding of ``md_path``'s reading: each number bound to a path whose value prints as it (x 100 where
    that fits), choosing among several by the words around the number; unbound ones marked ``TODO``."""
    with open(md_path, encoding="utf-8") as f:
        md = f.read()
    binding = {"files": files or {}, "numbers": [], "verdicts": []}
    names = names_for(md_path, binding)
    cands = []
    for name, obj in [("", names["record"])] + [(n, names[n]) for n in (files or {})]:
        leaves = []
        _leaves(obj, name, leaves)
        cands += [(e.lstrip("."), v) for e, v in leaves]
    text = reading(md)
    lines = ["# The reading of %s, bound to its data (python -m scripts.tables.readings checks it)."
             % os.path.basename(md_path)]
    if files:
        lines += ["files:"] + [f"  {k}: {v}" for k, v in files.items()]
    lines.append("numbers:")
    prev = ""
    for m in DECIMAL.finditer(text):
        q = m.group(0)
        ctx = text[max(0, m.start() - 80):m.end() + 20].lower()
        hits = [(e, v) for e, v in cands if printed(v, q) == q] + \
               [(f"100 * {e}", v) for e, v in cands if printed(100 * v, q) == q]
        if not hits:
            lines.append(f"  - {q} = TODO")
            continue

        def score(h):
            toks = re.findall(r"[a-z_]+|\d+", h[0].lower())
            s = sum(2 for t in toks if len(t) > 1 and t in ctx and t not in ("where", "mean", "std", "by_seed"))
            common = len(os.path.commonprefix([prev, h[0]]))
            steps = re.findall(r"at\(.*, (\d+)\)$", h[0])
            if steps:
                s += 3 if re.search(r"\b" + f"{int(steps[0]):,}" + r"\b|\b" + steps[0] + r"\b", ctx) else -3
            if h[0].startswith("100 * ") and any(not e.startswith("100 * ") for e, _ in hits):
                s -= 1
            if re.search(r"\.(n|seed|steps|seconds|M)$", h[0]):
                s -= 4
            return (s, common, -len(h[0]))

        best = max(hits, key=score)
        prev = best[0]
        if len(hits) > 1:
            lines.append(f"  # {len(hits)} paths print {q}: check that this one is the one the sentence means")
        lines.append(f"  - {q} = {best[0]}")
    lines.append("verdicts:")
    for w in words(text):
        lines.append(f"  - {w} = TODO")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help="results/**/*.md (default: every bound reading)")
    ap.add_argument("--draft", action="store_true", help="print a first binding to review instead of checking")
    ap.add_argument("--file", action="append", default=[], help="NAME=path.json: another record (with --draft)")
    args = ap.parse_args(argv)
    if args.draft:
        for p in args.paths:
            print(draft(p, dict(f.split("=", 1) for f in args.file)), end="")
        return 0
    bad = 0
    for rel_path in args.paths or [p for p in reading_files() if p not in UNBOUND]:
        problems = check_file(os.path.join(ROOT, rel_path) if not os.path.isabs(rel_path) else rel_path)
        for p in problems:
            print(f"{rel_path}: {p}")
        bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
