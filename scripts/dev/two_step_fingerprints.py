#!/usr/bin/env python
"""Behaviour fingerprints of short training runs: did a refactor change what a run computes?

Runs ``train.py`` for 2 optimizer steps on the CPU with seed 0 for a list of task x attention commands
(:data:`RUNS`), each in its own process, and writes per run the final metrics, the printed ``attention:`` and
``model:`` lines (the resolved attention and the FLOP count), the record's ``attention`` (``run.json``) and a
sha256 of every tensor of the saved model (and EMA) state after the 2 steps, to a JSON file. Two such files
(before and after a change) are compared with ``--compare``: every run must be bit-identical.

    # on the code before the change (a clean worktree), then on the changed tree
    cd /path/to/old/tree && python /path/to/scripts/dev/two_step_fingerprints.py --out before.json
    cd /path/to/new/tree && python scripts/dev/two_step_fingerprints.py --out after.json
    python scripts/dev/two_step_fingerprints.py --compare before.json after.json

The tree that runs is the current folder (``--root``): its ``train.py``, with ``PYTHONPATH`` set to it, so that
its own ``mhla`` / ``models`` / ``tasks`` are imported (each file records where they came from).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Shared by every run: 2 steps, CPU, no logger, no progress bar.
COMMON = ["trainer.max_steps=2", "trainer.max_epochs=null", "trainer.device=cpu", "trainer.progress_bar=false",
          "logger=none", "seed=0"]
MNIST = ["task=mnist", "data.batch_size=4", "data.eval_batch_size=8", "data.limit=64", "data.eval_limit=8"]
MNIST_GEN = ["task=mnist_gen", "data.batch_size=4", "data.eval_batch_size=8", "data.limit=64", "data.eval_limit=8",
             "task.sample.grid=false", "trainer.eval_every_steps=null"]
VIDEO = ["task=video_mini", "data.batch_size=2", "data.eval_batch_size=2", "data.train_size=8", "data.eval_size=2",
         "sample.num_steps=2", "sample.prompts=[a red square moving right]"]
LM = ["task=lm_mini", "data.batch_size=2", "data.eval_batch_size=2", "data.max_documents=40",
      "trainer.eval_every_steps=null", "task.num_samples=1", "task.sample_tokens=4", "task.prompt_len=8"]
MQAR = ["task=mqar", "data.num_train=32", "data.num_test=8", "data.batch_size=8", "data.eval_batch_size=8"]
CLS_MINI = ["data.batch_size=4", "data.eval_batch_size=8", "data.limit=64", "data.eval_limit=8"]

#: name -> overrides (of configs/train.yaml)
RUNS: dict[str, list[str]] = {
    **{f"mnist_{a}": [*MNIST, f"attn={a}"] for a in
       ("mhla", "softmax", "linear", "focused", "inline", "mala", "rala", "gla", "cosine")},
    "mnist_mhla_cpe_gate": [*MNIST, "attn=mhla", "attn.cpe=true", "attn.gate=true"],
    "deit_t_mhla_mini": ["experiment=table2/deit_t_mhla", "scale=mini/deit_t", *CLS_MINI],
    "vlt_t_mhla_mini": ["experiment=table2/vlt_t_mhla", "scale=mini/vlt_t", *CLS_MINI],
    "mnist_gen_dit_mhla": [*MNIST_GEN, "attn=mhla"],
    "mnist_gen_dig_gla": [*MNIST_GEN, "model=dig_mnist", "attn=gla"],
    **{f"video_mini_{a}": [*VIDEO, f"attn={a}"] for a in ("softmax", "linear", "mhla")},
    "video_mini_linear_hybrid": [*VIDEO, "attn=linear", "attn.layers=hybrid"],
    "video_mini_mhla_xcross": [*VIDEO, "attn=mhla", "attn_cross=mhla_cross"],
    **{f"lm_mini_{a}": [*LM, f"attn={a}"] for a in ("mhla", "linear", "softmax")},
    **{f"mqar_{a}": [*MQAR, f"attn={a}"] for a in ("mhla", "linear")},
    "mqar_mhla_frozen_locality": [*MQAR, "attn=mhla", "attn.mixing_init=locality", "attn.mixing_learnable=false"],
}


def tensor_hashes(state, prefix: str = "") -> dict[str, str]:
    """``{dotted name: sha256 of the tensor's dtype, shape and bytes}`` of every tensor in a nested state."""
    import torch  # noqa: PLC0415

    out: dict[str, str] = {}
    if isinstance(state, torch.Tensor):
        t = state.detach().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[prefix] = h.hexdigest()
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(tensor_hashes(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(tensor_hashes(v, f"{prefix}.{i}"))
    return out


def line_starting(text: str, start: str) -> str | None:
    lines = [ln for ln in text.splitlines() if ln.startswith(start)]
    return lines[-1] if lines else None


def run_one(root: Path, name: str, overrides: list[str], work: Path, timeout: int) -> dict:
    import torch  # noqa: PLC0415

    run_dir = work / name
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, str(root / "train.py"), *COMMON, *overrides, f"hydra.run.dir={run_dir}",
           f"data.cache_dir={work / 'cache'}" if "task=lm_mini" in overrides else None]
    cmd = [c for c in cmd if c is not None]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    out = {"overrides": overrides, "rc": proc.returncode, "seconds": round(time.time() - t0, 1)}
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        out["error"] = text[-3000:]
        return out
    out["attention_line"] = line_starting(proc.stdout, "attention:")
    out["model_line"] = line_starting(proc.stdout, "model:")
    out["final"] = line_starting(proc.stdout, "final:")
    record = json.loads((run_dir / "run.json").read_text())
    out["metrics"] = record.get("metrics")
    out["record_attention"] = record.get("attention")
    state = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    out["step"] = state.get("step")
    out["tensors"] = tensor_hashes({"model": state["model"], "ema": state.get("ema")})
    return out


def where_imported(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = ("import json, mhla, models, tasks; print(json.dumps({m.__name__: m.__file__ for m in "
            "(mhla, models, tasks)}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    bad = 0
    keys = ("rc", "final", "metrics", "attention_line", "model_line", "record_attention", "step", "tensors")
    for name in sorted(set(a["runs"]) | set(b["runs"])):
        ra, rb = a["runs"].get(name), b["runs"].get(name)
        if ra is None or rb is None:
            print(f"{name}: only in {'the second' if ra is None else 'the first'}")
            bad += 1
            continue
        diffs = [k for k in keys if ra.get(k) != rb.get(k)]
        if ra.get("rc") != 0 or rb.get("rc") != 0:
            diffs.append("failed")
        if diffs:
            bad += 1
            detail = []
            for k in diffs:
                if k == "tensors":
                    ta, tb = ra.get("tensors") or {}, rb.get("tensors") or {}
                    changed = sorted(n for n in set(ta) | set(tb) if ta.get(n) != tb.get(n))
                    detail.append(f"tensors: {len(changed)} of {len(ta)} differ, e.g. {changed[:3]}")
                elif k != "failed":
                    detail.append(f"{k}: {ra.get(k)!r} != {rb.get(k)!r}")
                else:
                    detail.append(f"failed: {(ra.get('error') or rb.get('error') or '')[-600:]}")
            print(f"{name}: DIFFERENT\n  " + "\n  ".join(detail))
        else:
            print(f"{name}: identical ({len(ra['tensors'])} tensors, {ra['final']})")
    total = len(set(a["runs"]) | set(b["runs"]))
    print(f"{total - bad} of {total} runs bit-identical")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--root", default=".", help="the tree to run (its train.py and packages); default: here")
    p.add_argument("--only", nargs="*", help="run only these names")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two JSON files")
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("--out or --compare")
    root = Path(args.root).resolve()
    names = args.only or list(RUNS)
    result = {"root": str(root), "imported_from": where_imported(root), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="two_step_") as tmp:
        for name in names:
            r = run_one(root, name, RUNS[name], Path(tmp), args.timeout)
            result["runs"][name] = r
            print(f"{name}: rc={r['rc']} {r['seconds']}s {r.get('final') or (r.get('error') or '')[-400:]}",
                  flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    failed = [n for n, r in result["runs"].items() if r["rc"] != 0]
    print(f"{len(names) - len(failed)} of {len(names)} runs finished" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
