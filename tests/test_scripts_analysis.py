"""analyze_attention.py input loading (--qk files) and the MHLA rank bound."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import analyze_attention  # noqa: E402


def test_load_qk_file_roundtrip_and_errors(tmp_path):
    q, k = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    good = tmp_path / "qk.pt"
    torch.save({"q": q, "k": k}, good)
    q2, k2, source = analyze_attention.load_qk(str(good))
    assert torch.equal(q2, q) and torch.equal(k2, k) and source.startswith("file:")
    bad = tmp_path / "bad.pt"
    torch.save({"q": q}, bad)
    with pytest.raises(ValueError, match="'q' and 'k'"):
        analyze_attention.load_qk(str(bad))
    torch.save({"q": q, "k": k[:, :8]}, bad)
    with pytest.raises(ValueError, match=r"\[B, N, H, d\]"):
        analyze_attention.load_qk(str(bad))
    with pytest.raises(FileNotFoundError):
        analyze_attention.load_qk(str(tmp_path / "missing.pt"))


def test_mhla_rank_bounded_by_blocks_times_d():
    # 64 tokens on an 8 x 8 grid, M = 4 blocks of 16 tokens, d = 2: rank <= sum_b min(16, d) = 8 (SPEC 1.6),
    # while linear attention stays <= d.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 64, 1, 2, generator=g), torch.randn(1, 64, 1, 2, generator=g)
    mats = analyze_attention.attention_matrices(q, k, num_blocks=4)
    r_lin, _ = analyze_attention.rank_and_entropy(mats["linear"])
    r_mh, _ = analyze_attention.rank_and_entropy(mats["mhla"])
    assert r_lin <= 2
    assert 2 < r_mh <= 8
