#!/usr/bin/env python
"""The paper's Fig. 3 measure: rank and mean row entropy of the effective attention matrix.

    python scripts/analyze_attention.py --ckpt RUN_A RUN_B RUN_C   # trained models (the real measure)
    python scripts/analyze_attention.py                            # SANITY CHECK on synthetic q, k
    python scripts/analyze_attention.py --qk captured.pt           # {"q": [B, N, H, d], "k": [B, N, H, d]}

``--ckpt`` (a run directory or a ``.pt`` written by ``train.py``; any number of them, typically the softmax,
linear and MHLA runs of one proxy): each model runs on the first ``--batch`` images of its own evaluation set,
forward hooks capture every attention layer's q and k (after the projection and the qk norm, before the
feature map), and each layer's OWN effective attention matrix is built, as in the paper:
  softmax: softmax(q k^T / sqrt(d));
  linear:  phi(q) phi(k)^T, rows normalised (phi = the layer's feature map);
  MHLA:    Mc[b(t), b(s)] phi(q_t) . phi(k_s), rows normalised, with the layer's LEARNED mixing matrix Mc and
           its block layout (tokens are block-major inside MHLA layers; rank and entropy ignore the order).
It reports the mean over images and heads per layer and over all layers, writes
``results/analysis/trained_rank_entropy.json`` and ``.png``, and prints a table. Layers with prefix tokens
(class tokens) use their grid tokens only.

Without ``--ckpt`` the three matrices are built from ONE set of SYNTHETIC q, k (N = 256 tokens on a 16 x 16
grid, M = 16, d = 64, 4 heads, i.i.d. Gaussian, fixed seed, locality-initialised mixing). That shows the
mechanism (rank <= d for linear attention), not the paper's numbers; it is kept as a labelled sanity check and
writes ``results/analysis/attention_rank_entropy.json`` and ``.png``.

Rank: number of singular values above ``rtol * sigma_max`` (default rtol 1e-6, recorded).
Entropy: mean over rows of -sum_s A log A (natural log); uniform rows give log N.
Paper (trained DeiT-T, N = 256): linear 58.4 / 5.12, softmax 254.8 / 4.13, MHLA 233.4 / 4.06.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
from omegaconf import OmegaConf

from mhla.layers import LinearAttention, MultiHeadLinearAttention, SoftmaxAttention
from mhla.layouts import ceil_div, layout_from_num_blocks
from mhla.mixing import mixing_init
from mhla.ops import mhla_attention_matrix
from tasks.common.results import write_result
from tasks.common.checkpoint import find_checkpoint, run_folder
from tasks.common.evaluation import load_run
from tasks.common.launch import mean_std
from tasks.common.plots import pyplot, save_figure
from tasks.common.records import code_version, read_run_record
from tasks.common.utils import load_average, system_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAPER = {"source": "MHLA paper Fig. 3, trained DeiT-T (not comparable with synthetic inputs)",
         "linear": {"rank": 58.4, "entropy": 5.12}, "softmax": {"rank": 254.8, "entropy": 4.13},
         "mhla": {"rank": 233.4, "entropy": 4.06}}


def attention_matrices(q: torch.Tensor, k: torch.Tensor, num_blocks: int, eps: float = 1e-6) -> dict:
    """Effective attention matrices ``[B, H, N, N]`` for softmax, linear and MHLA from raw ``q, k: [B, N, H, d]``.

    Tokens are in raster order on a square grid; MHLA uses the block layout of ``num_blocks`` blocks.
    """
    q, k = q.double(), k.double()
    B, N, H, d = q.shape
    side = int(round(math.sqrt(N)))
    grid = (side, side) if side * side == N else (N,)
    layout = layout_from_num_blocks(grid, num_blocks)
    soft = torch.softmax(torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d), dim=-1)
    fq, fk = torch.relu(q) + eps, torch.relu(k) + eps
    lin = torch.einsum("bthd,bshd->bhts", fq, fk)
    lin = lin / lin.sum(-1, keepdim=True)
    mixing = mixing_init("locality", layout.block_distances(), dtype=torch.float64)
    perm, inv = layout.permutation(), layout.inverse_permutation()
    A = mhla_attention_matrix(fq[:, perm], fk[:, perm], mixing, layout.block_size, eps=0.0)
    mh = A[:, :, inv][:, :, :, inv]  # back to raster order (rank and entropy do not depend on the order)
    return {"softmax": soft, "linear": lin, "mhla": mh}


def ranks(A: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor:
    """Numerical rank ``[B, H]`` of each matrix of ``A: [B, H, N, N]`` (singular values > ``rtol * max``)."""
    s = torch.linalg.svdvals(A)
    return (s > rtol * s[..., :1]).sum(-1).double()


def row_entropy(A: torch.Tensor) -> torch.Tensor:
    """Row entropies (nats) ``[..., N]`` of ``A: [..., N, N]`` with rows summing to 1."""
    return -(A * torch.log(A.clamp_min(1e-300))).sum(-1)


def mean_entropy(A: torch.Tensor) -> float:
    """Mean row entropy (nats) of ``A: [..., N, N]`` with rows summing to 1."""
    return row_entropy(A).mean().item()


def rank_and_entropy(A: torch.Tensor, rtol: float = 1e-6) -> tuple[float, float]:
    """Mean (over batch and heads) numerical rank and mean row entropy of ``A: [B, H, N, N]``."""
    return ranks(A, rtol).mean().item(), mean_entropy(A)


def load_qk(path: str | None, seed: int = 0, n: int = 256, d: int = 64, heads: int = 4):
    """Raw ``q, k: [B, N, H, d]`` from a ``.pt`` file, or the documented synthetic inputs."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--qk {path} does not exist; save {{'q': q, 'k': k}} with torch.save")
        data = torch.load(path, map_location="cpu")
        if not isinstance(data, dict) or "q" not in data or "k" not in data:
            raise ValueError(f"{path} must hold a dict with 'q' and 'k' ([B, N, H, d] raw, pre-feature-map)")
        q, k = data["q"], data["k"]
        if q.dim() != 4 or q.shape != k.shape:
            raise ValueError(f"q and k must both be [B, N, H, d]; got {tuple(q.shape)} and {tuple(k.shape)}")
        return q.float(), k.float(), f"file:{path}"
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n, heads, d, generator=g), torch.randn(1, n, heads, d, generator=g),
            f"synthetic gaussian N={n} d={d} heads={heads} seed={seed}")


# ------------------------------------------------------------------------------------ trained models
def capture_qk(model, x) -> list[tuple[object, torch.Tensor, torch.Tensor]]:
    """Run ``model(x)`` once; return ``(layer, q, k)`` for every softmax / linear / MHLA layer, in model order.

    ``q, k: [B, N, H, d]`` are the outputs of the layer's qk norms (after the projection, before the feature
    map; in the order the layer works in: block-major inside MHLA layers).
    """
    layers = [m for m in model.modules() if isinstance(m, (SoftmaxAttention, LinearAttention,
                                                          MultiHeadLinearAttention))]
    if not layers:
        raise ValueError("the model has no mhla softmax / linear / MHLA attention layer to analyse")
    if any(layer.rope != "none" for layer in layers):
        raise ValueError("layers with rotary embeddings (language models) need the model's rotary tables; "
                         "--ckpt analyses the vision models (classification runs)")
    seen, handles = {}, []
    for i, layer in enumerate(layers):
        handles.append(layer.q_norm.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__((i, "q"), out)))
        handles.append(layer.k_norm.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__((i, "k"), out)))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return [(layer, seen[(i, "q")].double(), seen[(i, "k")].double()) for i, layer in enumerate(layers)]


def own_attention_matrix(layer, q: torch.Tensor, k: torch.Tensor) -> tuple[str, torch.Tensor]:
    """``(kind, A [B, H, N, N])``: the layer's own effective attention matrix over its grid tokens (rows sum to 1)."""
    P = layer.num_prefix_tokens
    q, k = q[:, P:], k[:, P:]
    causal = layer.causal
    if isinstance(layer, MultiHeadLinearAttention):
        fq, fk = layer.feature_map(q), layer.feature_map(k)
        N = q.shape[1]
        if causal:
            C = layer.block_size
            mixing = layer.mixing(ceil_div(N, C)).detach().double()
            return "mhla", mhla_attention_matrix(fq, fk, mixing, C, causal=True, eps=0.0)
        layout = layer.layout_for(layer._grid_for(N, None))  # the layer works in its block-major order
        mixing = layer.mixing().detach().double()
        return "mhla", mhla_attention_matrix(fq, fk, mixing, layout.block_size, eps=0.0)
    if isinstance(layer, LinearAttention):
        fq, fk = layer.feature_map(q), layer.feature_map(k)
        w = torch.einsum("bthd,bshd->bhts", fq, fk)
        if causal:
            w = w.tril()
        return "linear", w / w.sum(-1, keepdim=True)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return "softmax", torch.softmax(scores, dim=-1)


def analyze_checkpoint(path: str, batch: int, rtol: float) -> dict:
    """Rank and entropy of every attention layer of the trained model at ``path`` on ``batch`` eval inputs."""
    ckpt = str(find_checkpoint(path))
    cfg, task, model, info = load_run(ckpt, ["trainer.device=cpu"])
    _, eval_ds = task.build_datasets()
    samples = [eval_ds[i] for i in range(min(batch, len(eval_ds)))]
    x = task.collate(samples)[0]
    layers = []
    for i, (layer, q, k) in enumerate(capture_qk(model, x)):
        kind, A = own_attention_matrix(layer, q, k)
        r = ranks(A, rtol)                                                # [B, H]
        ent = row_entropy(A).mean(-1)                                     # [B, H]
        layers.append({"layer": i, "kind": kind, "rank": r.mean().item(), "entropy": ent.mean().item(),
                       "rank_per_head": r.mean(0).tolist(), "entropy_per_head": ent.mean(0).tolist(),
                       "N": A.shape[-1], "heads": A.shape[1]})
    kinds = sorted({lay["kind"] for lay in layers})
    run = run_folder(ckpt).name if ckpt.endswith(".pt") else ckpt
    record = read_run_record(run_folder(ckpt)) or {}
    return {"checkpoint": ckpt, "run": run, "seed": cfg.get("seed"), "run_commit": record.get("commit"),
            "config": OmegaConf.to_container(cfg, resolve=True),
            "attention": cfg.attn.name if "attn" in cfg else "/".join(kinds),
            "kinds": kinds, "images": x.shape[0], "layers": layers,
            "rank": sum(lay["rank"] for lay in layers) / len(layers),
            "entropy": sum(lay["entropy"] for lay in layers) / len(layers),
            "N": layers[0]["N"], "max_entropy_logN": math.log(layers[0]["N"])}


def plot_trained(models: list[dict], path: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    attns = list(dict.fromkeys(m["attention"] for m in models))  # one colour per attention, one line per run
    for m in models:
        xs = [lay["layer"] for lay in m["layers"]]
        label = f"{m['attention']} {m.get('run', '')} (mean {m['rank']:.1f} / {m['entropy']:.2f})"
        color = f"C{attns.index(m['attention'])}"
        axes[0].plot(xs, [lay["rank"] for lay in m["layers"]], "o-", color=color, label=label, alpha=0.8)
        axes[1].plot(xs, [lay["entropy"] for lay in m["layers"]], "o-", color=color, label=label, alpha=0.8)
    n = models[0]["N"]
    axes[0].axhline(n, color="grey", ls=":", lw=1)
    axes[0].set_title(f"rank of the attention matrix (N = {n})")
    axes[1].axhline(math.log(n), color="grey", ls=":", lw=1)
    axes[1].set_title("mean row entropy (nats; dotted: uniform rows)")
    for ax in axes:
        ax.set_xlabel("layer")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def main_trained(args, argv) -> int:
    load_before, models = load_average(), []
    for path in args.ckpt:
        m = analyze_checkpoint(path, args.batch, args.rtol)
        models.append(m)
        print(f"{m['attention']:>10}: rank {m['rank']:.1f}, entropy {m['entropy']:.3f} (N={m['N']}, "
              f"log N={m['max_entropy_logN']:.3f}; per layer rank "
              + ", ".join(f"{lay['rank']:.1f}" for lay in m["layers"]) + f"; {m['checkpoint']})", flush=True)
    out = {"command": "python scripts/analyze_attention.py " + " ".join(argv), "rank_rtol": args.rtol,
           "images": args.batch, "models": models, "paper": PAPER, **code_version(), "machine": _system_info(),
           "load_before": load_before, "load_after": load_average()}
    stem = os.path.join(args.out_dir, args.name)
    write_result(stem, trained_md(out), out, lambda png: plot_trained(models, png), indent=2)
    print(f"wrote {stem}.json, .md, .png")
    return 0


def trained_md(out: dict) -> str:
    """The Fig. 3 table: mean rank / entropy per model beside the paper's, then every layer and head."""
    models = out["models"]
    n = models[0]["N"]
    lines = ["# Fig. 3 on trained models: rank and entropy of the effective attention matrix", "",
             f"Command: `{out['command']}`", "",
             f"Machine: {json.dumps(out['machine'])}", "",
             *([f"Commit {out['commit']}; load average before / after: {out['load_before']} / "
                f"{out['load_after']}. Each model's run config is in the JSON.", ""] if out.get("commit") else []),
             f"Each model runs on its first {out['images']} evaluation images; every layer's own matrix is built "
             f"from the captured q and k (N = {n} tokens, log N = {math.log(n):.3f}); rank counts singular values "
             f"above {out['rank_rtol']:g} x the largest. Means are over images, heads and layers. The paper's "
             "numbers are for DeiT-T on ImageNet (N = 256, head dim 64); the proxies here have their own head "
             "dim, which bounds linear attention's rank.", "",
             "| attention | run | rank (mean) | entropy (mean, nats) | paper rank | paper entropy |",
             "|---|---|---|---|---|---|"]
    for m in models:
        ref = PAPER.get(m["attention"], {})
        lines.append(f"| {m['attention']} | {m.get('run', '')} | {m['rank']:.1f} | {m['entropy']:.3f} | "
                     f"{ref.get('rank', '')} | {ref.get('entropy', '')} |")
    by_attn = {}
    for m in models:
        by_attn.setdefault(m["attention"], []).append(m)
    if any(len(v) > 1 for v in by_attn.values()):
        lines += ["", "Over runs (mean ± std):", "", "| attention | runs | rank | entropy |", "|---|---|---|---|"]
        for a, ms in by_attn.items():
            r = [m["rank"] for m in ms]
            e = [m["entropy"] for m in ms]
            (rm, rs), (em, es) = mean_std(r), mean_std(e)
            lines.append(f"| {a} | {len(ms)} | {rm:.1f} ± {rs:.1f} | {em:.3f} ± {es:.3f} |")
    lines += ["", "Per layer and head (rank / entropy):", "", "| attention | layer | " + " | ".join(
        f"head {h}" for h in range(models[0]["layers"][0]["heads"])) + " |",
        "|---|---|" + "---|" * models[0]["layers"][0]["heads"]]
    for m in models:
        for lay in m["layers"]:
            cells = [f"{r:.1f} / {e:.3f}" for r, e in zip(lay["rank_per_head"], lay["entropy_per_head"])]
            lines.append(f"| {m['attention']} {m.get('run', '')} | {lay['layer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _system_info() -> dict:
    return system_info()


def plot(results: dict, mats: dict, path: str) -> None:
    plt = pyplot()

    names = ["softmax", "linear", "mhla"]
    fig, axes = plt.subplots(1, 5, figsize=(20, 4))
    axes[0].bar(names, [results[n]["rank"] for n in names], color=["C0", "C1", "C2"])
    axes[0].set_title("mean rank")
    axes[1].bar(names, [results[n]["entropy"] for n in names], color=["C0", "C1", "C2"])
    axes[1].set_title("mean row entropy (nats)")
    for ax, n in zip(axes[2:], names):
        ax.imshow(mats[n][0, 0].float().numpy(), cmap="viridis")
        ax.set_title(f"{n}: head 0")
        ax.axis("off")
    save_figure(fig, path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="*", help="trained runs (run directories or .pt files) to analyse")
    p.add_argument("--batch", type=int, default=16, help="--ckpt: evaluation inputs per model")
    p.add_argument("--name", default="trained_rank_entropy", help="--ckpt: output stem under --out-dir")
    p.add_argument("--qk", help="a .pt file with raw q, k [B, N, H, d]")
    p.add_argument("--num-blocks", type=int, default=16)
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "results", "analysis"))
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.ckpt:
        return main_trained(args, argv)
    q, k, source = load_qk(args.qk, args.seed)
    mats = attention_matrices(q, k, args.num_blocks)
    results = {}
    for name, A in mats.items():
        rank, ent = rank_and_entropy(A, args.rtol)
        results[name] = {"rank": rank, "entropy": ent}
    n = q.shape[1]
    side = int(round(math.sqrt(n)))
    grid = [side, side] if side * side == n else [n]
    out = {"inputs": source, "N": n, "d": q.shape[-1], "heads": q.shape[2], "num_blocks": args.num_blocks,
           "grid": grid, "mixing": "locality init (row-normalised), tokens block-major on the grid",
           "rank_rtol": args.rtol, "max_entropy_logN": math.log(n), "results": results, "paper": PAPER,
           "command": "python scripts/analyze_attention.py " + " ".join(argv),
           "note": "SANITY CHECK on synthetic inputs: not the paper's measure (use --ckpt on trained models)"}
    write_result(os.path.join(args.out_dir, "attention_rank_entropy"), None, out, lambda png: plot(results, mats, png),
                 indent=2)
    print(" | ".join(f"{k}: rank {v['rank']:.1f}, entropy {v['entropy']:.3f}" for k, v in results.items())
          + f" (N={n}, log N={math.log(n):.3f}; {source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
