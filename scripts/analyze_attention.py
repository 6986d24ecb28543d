#!/usr/bin/env python
"""The paper's Fig. 3 measure: rank and mean row entropy of the effective attention matrix.

    python scripts/analyze_attention.py                      # synthetic inputs (documented below)
    python scripts/analyze_attention.py --qk captured.pt     # {"q": [B, N, H, d], "k": [B, N, H, d]} raw q, k

For each head, the attention matrix A (rows sum to 1) is built for
  softmax: softmax(q k^T / sqrt(d));
  linear:  phi(q) phi(k)^T, rows normalised (phi = relu + 1e-6);
  MHLA:    mixing[b(t), b(s)] * phi(q_t) . phi(k_s), rows normalised, tokens on a square grid split into
           M blocks (block-major), locality-initialised mixing (the paper's init).
Rank: number of singular values above ``rtol * sigma_max`` (default rtol 1e-6, recorded).
Entropy: mean over rows of -sum_s A log A (natural log); uniform rows give log N.

Default inputs are SYNTHETIC: N = 256 tokens (16 x 16 grid, M = 16), d = 64, 4 heads, q and k i.i.d.
Gaussian with a fixed seed. They show the mechanism (rank <= d for linear attention), not the paper's
numbers, which come from a trained DeiT-T (linear 58.4 / 5.12, softmax 254.8 / 4.13, MHLA 233.4 / 4.06);
pass ``--qk`` with q, k captured from a trained model to compare like with like.
Writes ``results/analysis/attention_rank_entropy.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

PAPER = {"source": "MHLA paper Fig. 3, trained DeiT-T (not comparable with synthetic inputs)",
         "linear": {"rank": 58.4, "entropy": 5.12}, "softmax": {"rank": 254.8, "entropy": 4.13},
         "mhla": {"rank": 233.4, "entropy": 4.06}}


def attention_matrices(q: torch.Tensor, k: torch.Tensor, num_blocks: int, eps: float = 1e-6) -> dict:
    """Effective attention matrices ``[B, H, N, N]`` for softmax, linear and MHLA from raw ``q, k: [B, N, H, d]``.

    Tokens are in raster order on a square grid; MHLA uses the block layout of ``num_blocks`` blocks.
    """
    from mhla.layouts import layout_from_num_blocks  # noqa: PLC0415
    from mhla.mixing import mixing_init  # noqa: PLC0415
    from mhla.ops.reference import mhla_attention_matrix  # noqa: PLC0415

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


def rank_and_entropy(A: torch.Tensor, rtol: float = 1e-6) -> tuple[float, float]:
    """Mean (over batch and heads) numerical rank and mean row entropy of ``A: [B, H, N, N]``."""
    s = torch.linalg.svdvals(A)
    rank = (s > rtol * s[..., :1]).sum(-1).double().mean().item()
    ent = -(A * torch.log(A.clamp_min(1e-300))).sum(-1).mean().item()
    return rank, ent


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


def plot(results: dict, mats: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

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
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--qk", help="a .pt file with raw q, k [B, N, H, d]")
    p.add_argument("--num-blocks", type=int, default=16)
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "results", "analysis"))
    args = p.parse_args(argv)
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
           "command": "python scripts/analyze_attention.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "attention_rank_entropy.json"), "w") as f:
        json.dump(out, f, indent=2)
    plot(results, mats, os.path.join(args.out_dir, "attention_rank_entropy.png"))
    print(" | ".join(f"{k}: rank {v['rank']:.1f}, entropy {v['entropy']:.3f}" for k, v in results.items())
          + f" (N={n}, log N={math.log(n):.3f}; {source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
