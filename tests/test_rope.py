"""RoPE (mhla.rope): the rotation against a plain formula, its defining properties, the placement vocabulary,
and the language model's and the diffusers adapter's placements against each other."""

from __future__ import annotations

import types

import pytest
import torch

from mhla.adapters.diffusers import MHLAAttnProcessor
from mhla.rope import ROPE_PLACEMENTS, apply_rope, rope_and_feature_map, rope_placement
from models.lm import ROPE_PLACEMENTS as LM_ROPE_PLACEMENTS
from models.lm import MHLALMConfig
from models.lm.modeling_mhla_lm import _LMAttentionMixin, build_lm_attention, rope_cos_sin


def angles(n: int, pairs: int, offset: int = 0, base: float = 50.0) -> torch.Tensor:
    """fp64 ``[n, pairs]``: position ``offset + i`` times a geometric set of frequencies."""
    freqs = base ** (-torch.arange(pairs, dtype=torch.float64) / pairs)
    return (offset + torch.arange(n, dtype=torch.float64))[:, None] * freqs


def tables(ang: torch.Tensor, interleaved: bool, dtype=torch.float64):
    """``cos, sin [N, 1, D]`` for angles ``[N, D/2]`` in the layout ``apply_rope`` expects."""
    full = ang.repeat_interleave(2, dim=-1) if interleaved else torch.cat([ang, ang], dim=-1)
    return full.cos()[:, None].to(dtype), full.sin()[:, None].to(dtype)


def pair_index(d: int, interleaved: bool) -> tuple[list[int], list[int]]:
    """Channel indices ``(a_p, b_p)`` of each rotated pair ``p``."""
    if interleaved:
        return list(range(0, d, 2)), list(range(1, d, 2))
    return list(range(d // 2)), list(range(d // 2, d))


def reference(x: torch.Tensor, ang: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Plain formula in fp64: pair p = (a, b) -> (x_a cos - x_b sin, x_a sin + x_b cos), angle ang[n, p]."""
    x = x.double()
    out = torch.empty_like(x)
    c, s = ang.cos()[:, None], ang.sin()[:, None]  # [N, 1, D/2]
    for p, (a, b) in enumerate(zip(*pair_index(x.shape[-1], interleaved))):
        xa, xb = x[..., a], x[..., b]
        out[..., a] = xa * c[..., p] - xb * s[..., p]
        out[..., b] = xa * s[..., p] + xb * c[..., p]
    return out


# ------------------------------------------------------------------------------------------- rotation
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("n", [1, 7, 13])
def test_matches_plain_formula_fp32(interleaved, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, 3, 10, generator=g)
    ang = angles(n, 5, offset=3)
    cos, sin = tables(ang, interleaved, torch.float32)
    y = apply_rope(x, cos, sin, interleaved=interleaved)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), reference(x, ang, interleaved), rtol=1e-5, atol=1e-5)
    # upcast=True: same values, the dtype of x
    y_up = apply_rope(x, cos, sin, interleaved=interleaved, upcast=True)
    torch.testing.assert_close(y_up, y, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("n", [5, 11])
def test_matches_plain_formula_bf16(interleaved, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, 3, 8, generator=g).bfloat16()
    ang = angles(n, 4)
    ref = reference(x, ang, interleaved)  # exact rotation of the bf16 inputs
    cos32, sin32 = tables(ang, interleaved, torch.float32)
    cos16, sin16 = tables(ang, interleaved, torch.bfloat16)
    # bf16 x with fp32 tables: torch promotion -> fp32 math and output (an LM under autocast)
    y = apply_rope(x, cos32, sin32, interleaved=interleaved)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    # upcast=True: fp32 math, bf16 output (the diffusers adapter)
    y = apply_rope(x, cos32, sin32, interleaved=interleaved, upcast=True)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)
    # bf16 x and bf16 tables: bf16 math (a bf16 LM); error from rounding the tables and the products
    y = apply_rope(x, cos16, sin16, interleaved=interleaved)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_preserves_the_norm_of_each_pair(interleaved):
    x = torch.randn(3, 9, 2, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ang = angles(9, 6, offset=1000)  # large positions: many full turns
    y = apply_rope(x, *tables(ang, interleaved), interleaved=interleaved)
    a, b = pair_index(12, interleaved)
    torch.testing.assert_close(y[..., a] ** 2 + y[..., b] ** 2, x[..., a] ** 2 + x[..., b] ** 2)
    assert not torch.allclose(y, x)


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_depend_only_on_relative_position(interleaved):
    """<R_m q, R_n k> is a function of m - n: the score matrix of fixed q, k over positions is Toeplitz."""
    g = torch.Generator().manual_seed(1)
    n, d = 11, 8
    q = torch.randn(d, dtype=torch.float64, generator=g).expand(1, n, 1, d)  # the same q at every position
    k = torch.randn(d, dtype=torch.float64, generator=g).expand(1, n, 1, d)
    cos, sin = tables(angles(n, d // 2), interleaved)
    qr = apply_rope(q, cos, sin, interleaved=interleaved)
    kr = apply_rope(k, cos, sin, interleaved=interleaved)
    s = torch.einsum("md,nd->mn", qr[0, :, 0], kr[0, :, 0])  # s[m, n] = <R_m q, R_n k>
    torch.testing.assert_close(s[1:, 1:], s[:-1, :-1])  # s[m + 1, n + 1] == s[m, n]
    torch.testing.assert_close(s.diagonal(), (q[0, 0, 0] @ k[0, 0, 0]).expand(n))  # m == n: no rotation
    assert s.std() > 0.1


def test_layouts_are_one_rotation_up_to_a_channel_permutation():
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ang = angles(7, 4)
    perm = torch.stack([torch.arange(4), torch.arange(4) + 4], dim=-1).flatten()  # half-split -> interleaved
    half = apply_rope(x, *tables(ang, False))
    inter = apply_rope(x[..., perm], *tables(ang, True), interleaved=True)
    torch.testing.assert_close(inter, half[..., perm], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------- placement
def test_one_placement_vocabulary():
    assert LM_ROPE_PLACEMENTS is ROPE_PLACEMENTS
    assert rope_placement("after") == "after_feature_map" and rope_placement("before") == "before_feature_map"
    assert all(rope_placement(p) == p for p in ROPE_PLACEMENTS)
    with pytest.raises(ValueError, match="rope must be one of"):
        rope_placement("sometimes")
    assert MHLAAttnProcessor("linear", rope="after").rope == "after_feature_map"  # old adapter spelling
    assert MHLAAttnProcessor("linear").rope == "before_feature_map"  # the adapter's default, unchanged
    assert MHLALMConfig(rope="before").rope == "before_feature_map"
    with pytest.raises(ValueError, match="rope"):
        MHLAAttnProcessor("linear", rope="middle")


def test_rope_and_feature_map_orders():
    q, k = torch.randn(2, 2, 5, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cos, sin = tables(angles(5, 2), False)
    rot = lambda t: apply_rope(t, cos, sin)  # noqa: E731
    phi = torch.relu
    qb, kb, qpb, kpb = rope_and_feature_map(q, k, phi, rot, "before_feature_map")
    torch.testing.assert_close(qb, phi(rot(q)))
    assert qpb is qb and kpb is kb
    qa, ka, qpa, kpa = rope_and_feature_map(q, k, phi, rot, "after")
    torch.testing.assert_close(qa, rot(phi(q)))
    torch.testing.assert_close(qpa, phi(q))  # un-rotated features for a positive normaliser
    for placement in ROPE_PLACEMENTS:  # no feature map (softmax): one rotation whatever the placement
        qs = rope_and_feature_map(q, k, None, rot, placement)[0]
        torch.testing.assert_close(qs, q if placement == "none" else rot(q))
    torch.testing.assert_close(rope_and_feature_map(q, k, phi, None, "after_feature_map")[0], phi(q))


# ------------------------------------------------------------------- LM path vs diffusers adapter path
T, C, H, D = 12, 3, 2, 8  # 4 chunks of 3 tokens, 2 heads of 8


def lm_and_adapter(kind: str, placement: str, normalize: bool):
    """The same q, k, v through the LM's attention (causal) and the adapter's processor (non-causal).

    Returns the LM's ``o [B, T, H, Dv]``, ``{L: adapter o [B, L, H, Dv] on the first L tokens}`` for every
    prefix L of whole chunks, the raw projections and rotary tables, and the mixing matrix. The last token
    of a prefix sees the same keys either way (causal or not), so there the two must agree.
    """
    cfg = MHLALMConfig(attn_type=kind, vocab_size=11, hidden_size=16, num_hidden_layers=1, num_heads=H,
                       key_dim_ratio=1.0, value_dim_ratio=1.0, block_size=C, max_position_embeddings=T,
                       rope=placement, rope_theta=30.0, normalize=normalize, output_gate=False)
    torch.manual_seed(0)
    layer = build_lm_attention(cfg).double()
    mc = None
    if kind == "mhla":
        with torch.no_grad():  # generic nonnegative mixing: every past chunk matters
            layer.mixing.raw.uniform_(0.05, 1.0, generator=torch.Generator().manual_seed(4))
        mc = layer.mixing(T // C).detach()
    x = torch.randn(2, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    cos, sin = rope_cos_sin(torch.arange(T), D, cfg.rope_theta, torch.float64)  # half-split [T, 1, D]
    with torch.no_grad():
        q, k, v = layer._project(x, (cos, sin))  # the LM's placement
        o_lm = layer._core(q, k, v, x, None, None, None)
        q0, k0, v0 = super(_LMAttentionMixin, layer)._project(x)  # raw projections, no phi, no rotation
    # the adapter takes interleaved pairs (Wan's tables, [1, N, 1, D]): the same rotation on permuted channels
    perm = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=-1).flatten()
    qi, ki, ci, si = q0[..., perm], k0[..., perm], cos[None, ..., perm], sin[None, ..., perm]
    o_ad = {}
    for L in range(C, T + 1, C):
        n = L // C
        proc = MHLAAttnProcessor(kind, blocks=(n,) if kind == "mhla" else None, feature_map=cfg.feature_map,
                                 normalize=normalize, rope=placement, eps=layer.eps)
        attn = types.SimpleNamespace(mhla_mixing=lambda n=n: mc[:n, :n]) if kind == "mhla" else None
        with torch.no_grad():
            o_ad[L] = proc.attend(attn, qi[:, :L], ki[:, :L], v0[:, :L], (L,), (ci[:, :L], si[:, :L]))
    return o_lm, o_ad, (q0, k0, v0, cos, sin), mc, layer.eps


AGREE = [(p, False) for p in ROPE_PLACEMENTS] + [("before_feature_map", True), ("none", True)]


@pytest.mark.parametrize("kind", ["linear", "mhla"])
@pytest.mark.parametrize("placement,normalize", AGREE)
def test_lm_and_diffusers_placements_agree(kind, placement, normalize):
    """Same placement name, same numbers: every placement without the normaliser, before / none with it."""
    o_lm, o_ad, *_ = lm_and_adapter(kind, placement, normalize)
    for L, o in o_ad.items():
        torch.testing.assert_close(o[:, -1], o_lm[:, L - 1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["linear", "mhla"])
def test_after_feature_map_normalizer_differs_as_documented(kind):
    """normalize=True with rope after the feature map: the LM divides by rope(phi(q)) . rope(phi(k)), the
    adapter by the un-rotated phi(q) . phi(k) (mhla.rope's docstring). Both against that definition."""
    o_lm, o_ad, (q0, k0, v0, cos, sin), mc, eps = lm_and_adapter(kind, "after_feature_map", True)
    phi = lambda t: torch.relu(t) + 1e-6  # noqa: E731  (feature_map="relu")
    qp, kp = phi(q0), phi(k0)
    qr, kr = apply_rope(qp, cos, sin), apply_rope(kp, cos, sin)
    for L, o in o_ad.items():
        t = L - 1
        w = torch.ones(L, dtype=torch.float64) if mc is None else mc[t // C, torch.arange(L) // C]  # [L]
        num = torch.einsum("bhd,bshd,s,bshe->bhe", qr[:, t], kr[:, :L], w, v0[:, :L])
        den_rot = torch.einsum("bhd,bshd,s->bh", qr[:, t], kr[:, :L], w)
        den_plain = torch.einsum("bhd,bshd,s->bh", qp[:, t], kp[:, :L], w)
        torch.testing.assert_close(o_lm[:, t], num / (den_rot + eps)[..., None], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(o[:, -1], num / (den_plain + eps)[..., None], rtol=1e-9, atol=1e-12)
        assert (den_plain > 0).all()
    assert not torch.allclose(o_ad[T][:, -1], o_lm[:, T - 1])
