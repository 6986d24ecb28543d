"""The one writer of results files: every table and benchmark writes ``<stem>.md`` (its table and reading),
``<stem>.json`` (the records the table is made from) and ``<stem>.png`` (its plot) through :func:`write_result`.

    from tasks.common.results import write_result
    from tasks.common.records import Measurement

    with Measurement(threads=torch.get_num_threads()) as m:      # a benchmark: commit and load around the timing
        rows = measure()
    write_result(stem, to_markdown(rows), {"rows": rows}, lambda png: plot(rows, png),
                 measurement=m.record, allow_busy=args.allow_busy)

Each file is written whole (:func:`tasks.common.fileio.atomic_write`: a reader, or a table rewritten after every
run, never shows half of one); the plot is drawn last, by ``plot(path)`` (``tasks.common.plots.save_figure`` writes
it whole too). A benchmark passes its :class:`~tasks.common.records.Measurement` record: it is stored in the
.json as ``measurement`` (commit, load before and after, busy or not), a busy one is refused
(:class:`BusyMachine`, nothing is written) unless ``allow_busy``, and then its .md says BUSY under its title.
A record rewritten from its .json (``--plot-only``, ``--rewrite``) keeps its ``measurement`` and its BUSY mark.

Standard library only (and :mod:`tasks.common.fileio`), so that every script can import it cheaply.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from tasks.common.fileio import atomic_write


class BusyMachine(RuntimeError):
    """A benchmark measured on a busy machine, refused by :func:`write_result` (``--allow-busy`` writes it, marked)."""


def write_text(path: str, text: str) -> str:
    """Write one text file whole (:func:`tasks.common.fileio.atomic_write`); returns ``path``."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def write_json(path: str, record, indent: int | None = 1, default=None) -> str:
    """``record`` as JSON, whole (``indent``: the layout the file has always had; None: one line)."""
    return write_text(path, json.dumps(record, indent=indent, default=default))


def load_summary(measurement: dict) -> str:
    """``1-minute load average 0.12 before, 1.95 after, on 2 CPUs with 2 thread(s) of its own``."""
    def first(x):
        return f"{x[0]:.2f}" if isinstance(x, (list, tuple)) and x else "?"

    return (f"1-minute load average {first(measurement.get('load_before'))} before, "
            f"{first(measurement.get('load_after'))} after, on {measurement.get('cpu_count')} CPUs with "
            f"{measurement.get('threads')} thread(s) of its own"
            + (f"; other processes used {measurement['other_cpu_frac']:.0%} of the CPUs during it"
               if measurement.get("other_cpu_frac") is not None else ""))


BUSY_WRITTEN = "written with `--allow-busy`"  # why a busy measurement was written (a script's own reason instead)


def busy_note(measurement: dict, written: str = BUSY_WRITTEN) -> str:
    """The line a BUSY results file carries under its title (``written``: why it was written anyway)."""
    return (f"**BUSY**: measured while the machine was busy ({load_summary(measurement)}; {written}). Its times "
            "are not comparable with a run on an idle machine; rerun it idle.")


def mark_busy(md: str, measurement: dict, written: str = BUSY_WRITTEN) -> str:
    """``md`` with ``BUSY`` on its title line and :func:`busy_note` under it (each once)."""
    lines = md.split("\n")
    i = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
    if i is None:
        return md if "**BUSY**" in md else f"{busy_note(measurement, written)}\n\n{md}"
    if "**BUSY**" not in md:
        lines[i + 1:i + 1] = ["", busy_note(measurement, written)]
    if not lines[i].endswith(" - BUSY"):
        lines[i] += " - BUSY"
    return "\n".join(lines)


def busy_refusal(stem: str, measurement: dict) -> str:
    """Why :func:`write_result` refused a measurement, and what to do."""
    return (f"{stem}: not written: the machine was busy ({load_summary(measurement)}; "
            f"{measurement.get('busy_rule', 'tasks.common.records.BUSY_RULE')}). Rerun on an idle machine, or pass "
            "--allow-busy to write it marked BUSY.")


def saved_machine(md_path: str) -> dict | None:
    """The ``Machine: {...}`` line of a results file written before its .json kept the machine (None if none)."""
    if not os.path.exists(md_path):
        return None
    with open(md_path) as f:
        line = next((x for x in f if x.startswith("Machine: {")), None)
    return json.loads(line.split(": ", 1)[1]) if line else None


def write_result(stem: str, md: str | None, record: dict | list | None, plot: Callable[[str], object] | None = None,
                 *, measurement: dict | None = None, allow_busy: bool = False, indent: int | None = 1,
                 default=None, busy_written: str = BUSY_WRITTEN) -> str:
    """Write ``<stem>.json`` (``record``), ``<stem>.md`` (``md``) and ``<stem>.png`` (``plot(<stem>.png)``); any
    of them may be None (not written). Returns ``stem``.

    Args:
        stem: the path without its extension (``results/bench/models_cpu``); its folder is created.
        md: the markdown, written as given.
        record: what the table is made from (JSON-able; ``default`` converts the rest, e.g. ``str``).
        plot: draws the figure at the path it is given (and may draw more beside it, e.g. ``<stem>_curves.png``).
        measurement: a benchmark's :class:`tasks.common.records.Measurement` record, stored in ``record`` as
            ``measurement``. A record that already holds one (rewritten from its .json) is judged by it.
        allow_busy: write a busy measurement anyway, marked BUSY; without it a busy one raises
            :class:`BusyMachine` and nothing is written.
        busy_written: the BUSY note's reason for writing it (a script that always writes gives its own).
        indent: the .json's indent (None: one line).
    """
    if measurement is not None:
        if not isinstance(record, dict):
            raise TypeError("a measurement is stored in a dict record")
        record = {**record, "measurement": measurement}
    stored = record.get("measurement") if isinstance(record, dict) else None
    if stored and stored.get("busy"):
        if measurement is not None and not allow_busy:
            raise BusyMachine(busy_refusal(stem, stored))
        if md is not None:
            md = mark_busy(md, stored, busy_written)
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    if record is not None:
        write_json(stem + ".json", record, indent=indent, default=default)
    if md is not None:
        write_text(stem + ".md", md)
    if plot is not None:
        plot(stem + ".png")
    return stem


def rewrite_result(stem: str, markdown: Callable[[dict], str], plot: Callable[[dict, str], object] | None = None,
                   notes: str | None = None) -> dict:
    """Rewrite ``<stem>.md`` (``markdown(record)``) and ``<stem>.png`` (``plot(record, png)``, when given) from
    ``<stem>.json``, the scripts' ``--plot-only``: the record's reading is replaced by ``notes`` when given (and the
    .json rewritten with it); its stored measurement still marks a busy record BUSY. Returns the record."""
    with open(stem + ".json") as f:
        record = json.load(f)
    if notes:
        record["notes"] = notes
    write_result(stem, markdown(record), record, None if plot is None else lambda png: plot(record, png))
    return record


def read_parts(paths) -> tuple[list[dict], dict]:
    """The records at ``paths`` (one script's evaluations run in parallel processes, each written by
    :func:`write_result`) and what their merge keeps of each: ``(records, {"parts": [{"json", "command",
    "seconds", "measurement"}], "seconds": their sum, "measurement": the first part's conditions, busy when any
    part was (None when no part was measured)})``. The caller joins the records' contents. A record that is itself
    a merge (it has ``parts``) adds its own parts, so a record grown by another seed keeps every evaluation's
    command."""
    records, parts = [], []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
        rec = records[-1]
        if rec.get("parts"):
            parts += rec["parts"]
            continue
        seconds = rec.get("seconds", (rec.get("measurement") or {}).get("seconds"))
        parts.append({"json": str(path), "command": rec.get("command"), "seconds": seconds,
                      "measurement": rec.get("measurement")})
    measured = [p["measurement"] for p in parts if p["measurement"]]
    measurement = {**measured[0], "busy": any(m.get("busy") for m in measured)} if measured else None
    return records, {"parts": parts, "seconds": sum(p["seconds"] or 0 for p in parts), "measurement": measurement}
