"""The plot beside a cell table (``results/<table>[_mini].png``): the paper's number and ours per cell as bars
grouped by setting (model size and resolution), one colour per attention / variant, drawn from the rows the
.json holds (:func:`plot_table`; ``reproduce_table.py --plot-only`` redraws it without running anything)."""

from __future__ import annotations

import json
import os
import re

from mhla.registry import PLOT_GROUP_OTHER, plot_group, plot_words
from tasks.common.config import import_config_attentions
from tasks.common.plots import colors_for, grouped_bars, pyplot, save_figure

from . import registry

import_config_attentions()  # the attentions defined outside the package (configs/attn/*.yaml's module:)
#: {word: attention}: the words that name an attention (its name, plot label and aliases, mhla/registry.py)
PLOT_WORDS = plot_words()
# the word of a cell name where its attention starts (deit_t_mhla -> group deit_t); native: a model's own
ATTENTION_WORDS = (*PLOT_WORDS, "native")
OURS_ORDER = ("top1", "fid", "loss", "mse", "top5", "fid_cfg", "sfid", "inception_score", "clip", "geneval")


def plot_note(table: str, mini: bool) -> str:
    """What the table's plot shows and how to redraw it (the ``Plot:`` line under the table)."""
    return ("the paper's number and ours per cell, grouped by model and resolution, one colour per attention; "
            f"redraw from the .json with `python scripts/reproduce_table.py --table {table}"
            + (" --scale mini" if mini else "") + " --plot-only`")


def split_row(cell: str, row: str) -> tuple[str, str]:
    """``(group, bar)`` of a cell: its paper row cut after the resolution (``DiT-B/2 256`` | ``MHLA + CPE``),
    else its name cut before the attention (``deit_t`` | the row), else the cell on its own."""
    words = row.split()
    for i, w in enumerate(words[:-1]):
        if i and re.fullmatch(r"\d+(px)?", w):
            return " ".join(words[:i + 1]), " ".join(words[i + 1:])
    parts = cell.split("_")
    for i, p in enumerate(parts):
        if i and p in ATTENTION_WORDS:
            return "_".join(parts[:i]), row or "_".join(parts[i:])
    return cell, row or cell


SIZES = {"T": 0, "S": 1, "B": 2, "L": 3, "XL": 4}


def group_order(group: str) -> tuple:
    """Groups left to right: by model family, then size (T < S < B < L < XL), then resolution."""
    size = re.search(r"[-_](T|S|B|L|XL)(?=[/_\d\s-]|$)", group, re.I)
    res = re.search(r"(?:^|[\s_])(\d{3,4})(?:px)?(?:$|[\s_])", group)
    return (re.split(r"[-_\s]", group)[0].lower(), SIZES.get(size.group(1).upper(), 9) if size else 9,
            int(res.group(1)) if res else 0, group)


def bar_order(label: str) -> int:
    """Bars within a group: softmax first, then linear, the other attentions, MHLA and its variants last (each
    attention's ``plot_group``), by the attention the label names first (``Focused linear`` is FLatten's)."""
    low = label.lower()
    found = [(m.start(), -len(word), PLOT_WORDS[word]) for word in PLOT_WORDS
             for m in [re.search(r"\b" + re.escape(word), low)] if m]
    return plot_group(min(found)[2]) if found else PLOT_GROUP_OTHER


def strip_common_prefix(labels: list[str]) -> list[str]:
    """Drop the leading words every label shares (``DeiT-T Linear``, ``DeiT-T MHLA`` -> ``Linear``, ``MHLA``)."""
    if len(labels) < 2:
        return labels
    split = [s.split() for s in labels]
    n = 0
    while all(len(w) > n + 1 for w in split) and len({w[n] for w in split}) == 1:
        n += 1
    return [" ".join(w[n:]) for w in split]


def metric_key(rows: list[dict], keys: tuple[str, ...], source: str) -> str | None:
    """The first of ``keys`` (else any key) with a number in some row's ``source`` dict."""
    have = [k for r in rows for k, v in (r.get(source) or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("table", "row")]
    return next((k for k in keys if k in have), have[0] if have else None)


def plot_table(table: str, rows: list[dict], path: str, mini: bool = False) -> str | None:
    """Bars of the paper's number (left) and ours (right, mean ± std with seeds) per cell, grouped by
    :func:`split_row`. ``rows`` are the .json's rows (``cell``, ``paper``, ``metrics``[, ``metrics_std``]).
    Returns ``path``, or None when no row has a number of ours (nothing is drawn)."""
    ours_key = metric_key(rows, OURS_ORDER, "metrics")
    if ours_key is None:
        return None
    paper_key = metric_key(rows, OURS_ORDER, "paper")
    groups: dict[str, list[tuple[str, dict]]] = {}
    for r in rows:
        g, bar = split_row(r["cell"], str((r.get("paper") or {}).get("row", "")))
        groups.setdefault(g, []).append((bar, r))
    groups = {g: groups[g] for g in sorted(groups, key=group_order)}
    panels = ([("paper", paper_key)] if paper_key else []) + [("ours", ours_key)]
    series: dict[str, dict] = {p: {} for p, _ in panels}
    for g, members in groups.items():
        for bar, (_, r) in zip(strip_common_prefix([b for b, _ in members]), members):
            for name, key in panels:
                src = r.get("paper" if name == "paper" else "metrics") or {}
                v = src.get(key)
                if isinstance(v, (int, float)):
                    scale = 100 if key in registry.PERCENT and name == "ours" else 1  # the paper's are in %
                    std = (r.get("metrics_std") or {}).get(key) if name == "ours" else None
                    series[name].setdefault(bar, {})[g] = (scale * v, scale * std) if std else scale * v
    for name in series:
        series[name] = dict(sorted(series[name].items(), key=lambda kv: (bar_order(kv[0]), kv[0])))
    colors = colors_for(sorted({bar for s in series.values() for bar in s}, key=lambda b: (bar_order(b), b)))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.0, 1.1 * len(groups) + 3) * len(panels) / 1.4, 4.6),
                             squeeze=False)
    for i, (ax, (name, key)) in enumerate(zip(axes[0], panels)):
        label = registry.LABELS.get(key, key) + (" %" if key in registry.PERCENT else "")
        grouped_bars(ax, list(groups), series[name], label, f"{name}: {label}", colors,
                     legend="outside" if i == len(panels) - 1 else None)
    spec = registry.table_spec(table)
    fig.suptitle(f"Table {spec.id}: {spec.title}" + (" - CPU PROXY, not the paper's setting" if mini else ""),
                 fontsize=10)
    return save_figure(fig, path)


def redraw(spec, args) -> int:
    """``--plot-only``: draw ``<stem>.png`` from ``<stem>.json`` (the table's saved rows); runs nothing."""
    stem = registry.stem_path(spec, args)
    if not os.path.exists(stem + ".json"):
        print(f"--plot-only: {stem}.json does not exist (run the table first)")
        return 2
    with open(stem + ".json") as f:
        rows = json.load(f).get("rows", [])
    out = plot_table(spec.id, rows, stem + ".png", mini=args.scale == "mini")
    print(f"wrote {out}" if out else f"{stem}.json has no numbers of ours: no plot")
    return 0
