"""Small statistics for results tables over seeds: mean ± std, paired per-seed differences with a 95% interval,
and the "holds" / "level" verdict of an ordering.

    diff = paired_difference({0: 93.1, 1: 94.0, 2: 92.5}, {0: 91.0, 1: 92.2, 2: 92.9})
    diff["mean"], diff["ci95"]      # the mean of a - b over the seeds both have, and its t interval
    ordering_verdict(a_values, b_values)   # "holds" when mean(a) - mean(b) > 2 pooled std (3+ seeds a side)
    ordering_winner(a_values, b_values)    # "a" or "b" when that side is ahead by the same rule, else None
    ordering_word(a_values, b_values)      # the same as a verdict: "holds", "reversed" or "level"
    paired_lines(paired_summary(records, pairs, metrics))   # a markdown table of row pairs over the seeds
    mcnemar(a_correct, b_correct)          # do two classifiers differ on the same test examples?
"""

from __future__ import annotations

import math
import statistics

from scipy import stats as _stats


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def t_interval(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The ``level`` t interval of the mean of ``xs`` (None for fewer than 2 values)."""
    n = len(xs)
    if n < 2:
        return None
    m, s = mean_std(xs)
    half = _stats.t.ppf(0.5 + level / 2, n - 1) * s / math.sqrt(n)
    return float(m - half), float(m + half)


def paired_difference(a: dict, b: dict, level: float = 0.95) -> dict:
    """Per-seed differences ``a[s] - b[s]`` over the seeds both dicts have: ``{"seeds", "diffs", "mean", "std",
    "n", "ci95" (or None), "excludes_zero"}``."""
    seeds = sorted(set(a) & set(b))
    diffs = [float(a[s]) - float(b[s]) for s in seeds]
    if not diffs:
        return {"seeds": [], "diffs": [], "mean": None, "std": None, "n": 0, "ci95": None, "excludes_zero": False}
    m, s = mean_std(diffs)
    ci = t_interval(diffs, level)
    return {"seeds": seeds, "diffs": diffs, "mean": m, "std": s, "n": len(diffs), "ci95": ci,
            "excludes_zero": bool(ci is not None and (ci[0] > 0 or ci[1] < 0))}


def pooled_std(a: list[float], b: list[float]) -> float:
    """``sqrt((var(a) + var(b)) / 2)`` (sample variances; 0 when neither has two values)."""
    va = statistics.variance(a) if len(a) > 1 else 0.0
    vb = statistics.variance(b) if len(b) > 1 else 0.0
    return math.sqrt((va + vb) / 2)


MIN_SEEDS = 3  # the fewest values a side needs before an ordering can hold: two seeds give a spread of one gap


def ordering_verdict(a: list[float], b: list[float], k: float = 2.0, min_seeds: int = MIN_SEEDS) -> str:
    """``"holds"`` when ``mean(a) - mean(b)`` exceeds ``k`` pooled standard deviations (and is positive), else
    ``"level"``. With fewer than ``min_seeds`` values on a side the verdict is ``"level"`` whatever the gap: one
    value has no spread, and the spread of two is too unsteady to set the bar (the project asks 3 seeds at least)."""
    if len(a) < max(min_seeds, 2) or len(b) < max(min_seeds, 2):
        return "level"
    gap = statistics.fmean(a) - statistics.fmean(b)
    sd = pooled_std(a, b)
    return "holds" if gap > 0 and gap > k * sd else "level"


def ordering_winner(a: list[float], b: list[float], higher_is_better: bool = True, k: float = 2.0,
                    min_seeds: int = MIN_SEEDS) -> str | None:
    """The two-sided :func:`ordering_verdict`: ``"a"`` when ``a`` is better than ``b`` by more than ``k`` pooled
    standard deviations (higher values better, or lower with ``higher_is_better=False``), ``"b"`` the other way,
    ``None`` when level."""
    sign = 1.0 if higher_is_better else -1.0
    xs, ys = [sign * v for v in a], [sign * v for v in b]
    if ordering_verdict(xs, ys, k, min_seeds) == "holds":
        return "a"
    if ordering_verdict(ys, xs, k, min_seeds) == "holds":
        return "b"
    return None


def ordering_word(a: list[float], b: list[float], higher_is_better: bool = True) -> str:
    """:func:`ordering_winner` as a table's verdict on "a ahead of b": ``"holds"``, ``"reversed"`` (b ahead by
    the same rule: a baseline beating MHLA is said so) or ``"level"``."""
    return {"a": "holds", "b": "reversed", None: "level"}[ordering_winner(a, b, higher_is_better)]


CONVERGENCE_RULE = ("a row has converged when no seed changed at its last evaluation, or when it has 3 seeds or "
                    "more and the mean over its seeds of the last evaluation's gain (the change between a run's "
                    "last two evaluations, in the metric's direction) is at most the row's seed standard deviation; "
                    "with fewer seeds it is not decided (-)")


def convergence_word(gains: list[float], values: list[float], higher_is_better: bool = True,
                     min_seeds: int = MIN_SEEDS) -> str:
    """The written convergence rule (:data:`CONVERGENCE_RULE`) on one row of a seed grid.

    ``gains``: each seed's change between its last two evaluations; ``values``: each seed's final metric.
    Returns ``"converged"`` when every gain is exactly 0 (a plateau), or, with ``min_seeds`` seeds or more, when
    the mean gain (signed so that improving is positive) is at most the seed standard deviation of ``values``;
    ``"still gaining"`` when it is above; ``"-"`` with fewer seeds (two values give a spread too noisy to
    compare with: a 5-epoch row of two seeds passed the comparison and then gained more than it when trained
    longer)."""
    if gains and all(g == 0 for g in gains):
        return "converged"
    if len(gains) < min_seeds or len(values) < min_seeds:
        return "-"
    gain = mean_std(gains)[0] * (1.0 if higher_is_better else -1.0)
    return "converged" if gain <= mean_std(values)[1] else "still gaining"


def accuracy_se(accuracy: float, n: int) -> float:
    """The binomial standard error ``sqrt(p (1 - p) / n)`` of an accuracy ``p`` measured on ``n`` examples:
    how much the accuracy of ONE model moves from one test set of that size to another."""
    return math.sqrt(accuracy * (1.0 - accuracy) / n) if n else float("nan")


def mcnemar(a_correct, b_correct) -> dict:
    """McNemar's exact test of two classifiers scored on the same examples.

    Args:
        a_correct, b_correct: ``[n]`` booleans (lists or arrays), whether each model got example ``i`` right.

    Returns ``{"n", "both_right", "both_wrong", "only_a_right", "only_b_right", "p"}``: only the examples the
    two disagree on count, and ``p`` is the two-sided exact binomial probability of a split at least as uneven as
    ``only_a_right : only_b_right`` when either model is as likely to be the one that is right (1.0 when they
    never disagree). It tests the two trained models on this test set, not the two recipes: seed-to-seed
    variation is not in it."""
    a, b = [bool(x) for x in a_correct], [bool(x) for x in b_correct]
    if len(a) != len(b):
        raise ValueError(f"mcnemar: {len(a)} and {len(b)} examples; both models must be scored on the same "
                         "ones")
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    both = sum(x and y for x, y in zip(a, b))
    n_dis = only_a + only_b
    p = 1.0 if n_dis == 0 else float(_stats.binomtest(min(only_a, only_b), n_dis, 0.5).pvalue)
    return {"n": len(a), "both_right": both, "both_wrong": len(a) - both - n_dis, "only_a_right": only_a,
            "only_b_right": only_b, "p": p}


def paired_summary(records: list[dict], pairs, metrics) -> list[dict]:
    """Paired per-seed differences of a table's rows.

    For each ``(a, b)`` of ``pairs`` and each ``(name, value_of_record, higher_is_better, digits)`` of
    ``metrics``: :func:`paired_difference` of ``a - b`` over the seeds both rows have, and the verdict
    "<row> better" when :func:`ordering_winner` names one, else "level". ``records`` are a driver's run
    records (``{"row", "seed", ...}``); failed ones (``"error"``) are skipped, and a seed drops out of a
    metric its record lacks (as the old per-driver copy dropped a seed without its following check)."""
    per = {}
    for rec in records:
        if "error" not in rec:
            per.setdefault(rec["row"], {})[rec["seed"]] = rec
    out = []
    for a, b in pairs:
        if a not in per or b not in per:
            continue
        for name, get, higher_is_better, digits in metrics:
            va, vb = _values(per[a], get), _values(per[b], get)
            d = paired_difference(va, vb)
            if not d["n"]:
                continue
            winner = ordering_winner(list(va.values()), list(vb.values()), higher_is_better)
            verdict = "level" if winner is None else f"{a if winner == 'a' else b} better"
            out.append({"a": a, "b": b, "metric": name, "digits": digits, **d, "verdict": verdict})
    return out


def _values(by_seed: dict, get) -> dict:
    """``{seed: get(record)}`` over the seeds whose record has the metric (``get`` raises no KeyError)."""
    out = {}
    for seed, rec in by_seed.items():
        try:
            out[seed] = get(rec)
        except KeyError:
            continue
    return out


def paired_lines(paired: list[dict]) -> list[str]:
    """The markdown table of :func:`paired_summary`'s list, with its explaining line (empty when no two rows
    share a seed)."""
    out = []
    for p in paired:
        k = p["digits"]
        ci = "-" if p["ci95"] is None else f"[{p['ci95'][0]:.{k}f}, {p['ci95'][1]:.{k}f}]"
        per_seed = ", ".join(f"s{s}: {x:+.{k}f}" for s, x in zip(p["seeds"], p["diffs"]))
        out.append(f"| {p['a']} - {p['b']} | {p['metric']} | {p['n']} | {p['mean']:+.{k}f} | {ci} | "
                   f"{per_seed} | {p['verdict']} |")
    if not out:
        return []
    return ["", "Paired per-seed differences (same seed: same data order, init and sampling noise; 95% t "
            f"interval over the seeds; a row is better only with {MIN_SEEDS} seeds or more a side and a gap "
            "of the means over two pooled standard deviations, else level):", "",
            "| a - b | metric | seeds | mean diff | 95% interval | per seed | verdict |",
            "|---|---|---|---|---|---|---|",
            *out]
