"""Result plots, drawn next to their tables: matplotlib on the Agg backend, imported only when a plot is drawn
(matplotlib is heavy), the PNG written whole (:func:`~tasks.common.fileio.atomic_write`), and the two shapes
most results take: one line per method on log-log axes (time or memory against sequence length or
resolution), and bars grouped by setting (one group per model size, one bar per attention).

    plt = pyplot()
    fig, ax = plt.subplots()
    loglog_lines(ax, {"MHLA": [(1024, 3.4), (4096, 30.0)], "SDPA": [(1024, 11.7)]}, "T", "ms")
    save_figure(fig, "results/bench/ops_cpu.png")
"""

from __future__ import annotations

from tasks.common.fileio import atomic_write


def pyplot():
    """``matplotlib.pyplot`` on the off-screen Agg backend."""
    import matplotlib  # noqa: PLC0415  (matplotlib only where a plot is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def save_figure(fig, path: str, dpi: int = 100) -> str:
    """Lay out ``fig``, write it to ``path`` as a PNG (atomically: a reader never sees half an image), close it."""
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    pyplot().close(fig)
    return path


def colors_for(names) -> dict[str, str]:
    """One colour per name, in order (``C0``, ``C1``, ...): the same method has the same colour in every panel."""
    return {n: f"C{i % 10}" for i, n in enumerate(dict.fromkeys(names))}


def loglog_lines(ax, series: dict, xlabel: str, ylabel: str, title: str = "", colors: dict | None = None,
                 xbase: int = 2, xticks: dict | None = None) -> int:
    """One line per method: ``series`` maps a label to ``(x, y)`` points (points with ``y`` None or <= 0, e.g.
    skipped cases, are left out); log-log axes with the measured x values as ticks, or ``xticks`` (``{x:
    label}``: every x that was tried, so the axis spans the skipped ones too). Returns the lines drawn (an
    axis with none says so in its middle)."""
    colors = colors or colors_for(series)
    drawn, xs = 0, set()
    for label, pts in series.items():
        pts = sorted((x, y) for x, y in pts if y is not None and y > 0)
        if not pts:
            continue
        x, y = zip(*pts)
        ax.plot(x, y, "o-", label=label, color=colors.get(label), lw=1.4, ms=4)
        xs.update(x)
        drawn += 1
    if drawn:
        ax.set_xscale("log", base=xbase)
        ax.set_yscale("log")
        ticks = xticks or {x: f"{x:g}" for x in xs}
        ax.set_xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)])
        if len(ticks) > 1:
            lo, hi = min(ticks), max(ticks)
            ax.set_xlim(lo / (hi / lo) ** 0.06, hi * (hi / lo) ** 0.06)
        from matplotlib.ticker import NullLocator  # noqa: PLC0415

        ax.xaxis.set_minor_locator(NullLocator())  # only the measured x values as ticks
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return drawn


def grouped_bars(ax, groups: list[str], series: dict, ylabel: str, title: str = "", colors: dict | None = None,
                 annotate: str | None = None, log: bool = False, legend: str | None = "inside") -> None:
    """Bars grouped along x: ``series`` maps a bar label (an attention) to ``{group: value}`` where a value is a
    number or ``(mean, std)``. Only the bars a group has are drawn, side by side and centred on it, in the
    order of ``series``; one legend entry per label (``legend``: ``"inside"``, ``"outside"`` on the right, or
    None). ``annotate`` (a format such as ``"{:.2f}x"``) writes each value above its bar."""
    colors = colors or colors_for(series)
    seen = set()
    for gi, group in enumerate(groups):
        here = [(label, vals[group]) for label, vals in series.items() if vals.get(group) is not None]
        width = 0.8 / max(len(here), 1)
        for j, (label, v) in enumerate(here):
            mean, std = (v if isinstance(v, (tuple, list)) else (v, None))
            x = gi - 0.4 + width * (j + 0.5)
            ax.bar(x, mean, width * 0.92, yerr=std, capsize=3 if std else 0, color=colors.get(label),
                   label=None if label in seen else label)
            seen.add(label)
            if annotate:
                ax.annotate(annotate.format(mean), (x, mean), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 4 else 0, ha="right" if len(groups) > 4
                  else "center")
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if seen and legend:  # legend entries in the colours' order, not the order the bars were drawn in
        handles, labels = ax.get_legend_handles_labels()
        rank = {c: i for i, c in enumerate(colors)}
        pairs = sorted(zip(handles, labels), key=lambda hl: rank.get(hl[1], len(rank)))
        ax.legend(*zip(*pairs), fontsize=7, **({"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)}
                                               if legend == "outside" else {}))
    ax.grid(alpha=0.3, axis="y")
