"""RoPE (mhla.rope): the rotation against a plain formula, its defining properties, the placement vocabulary,
and one layer's placements causal (the language model, half-split tables) and bidirectional (a diffusers host,
interleaved tables) against each other."""

from __future__ import annotations

import pytest
import torch

from mhla.registry import build_attention
from mhla.rope import ROPE_PLACEMENTS, RotaryTables, apply_rope, rope_and_feature_map, rope_placement
from models.lm import ROPE_PLACEMENTS as LM_ROPE_PLACEMENTS
from models.lm import MHLALMConfig
from models.lm.modeling_mhla_lm import build_lm_attention, rope_cos_sin


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
    layer = build_attention({"name": "linear", "rope": "after"}, 16, 2, projections=False)
    assert layer.rope == "after_feature_map"  # the old adapter spelling
    assert MHLALMConfig(attn={"name": "mhla", "rope": "before"}).attn["rope"] == "before_feature_map"
    with pytest.raises(ValueError, match="rope"):
        build_attention({"name": "linear", "rope": "middle"}, 16, 2)


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


# ------------------------------------------------- one layer: causal (LM) vs bidirectional (diffusers host)
T, C, H, D = 12, 3, 2, 8  # 4 chunks of 3 tokens, 2 heads of 8


def causal_and_bidirectional(kind: str, placement: str, normalize: bool):
    """The same q, k, v through the LM's causal layer (half-split tables) and the bidirectional layer a diffusers
    host runs through :meth:`attend` (interleaved tables, as Wan's), on the first L tokens for every prefix L of
    whole chunks. The last token of a prefix sees the same keys either way, so there the two must agree.

    Returns the causal ``o [B, T, H, Dv]``, ``{L: bidirectional o [B, L, H, Dv]}``, the raw projections and
    tables, the mixing matrix and eps."""
    torch.manual_seed(0)
    cfg = MHLALMConfig(attn={"name": kind, "rope": placement, "normalize": normalize, "gate": False,
                             **({"block_size": C} if kind == "mhla" else {})},
                       vocab_size=11, hidden_size=16, num_hidden_layers=1, num_heads=H, key_dim_ratio=1.0,
                       value_dim_ratio=1.0, max_position_embeddings=T, rope_theta=30.0)
    layer = build_lm_attention(cfg).double()
    mc = None
    if kind == "mhla":
        with torch.no_grad():  # generic nonnegative mixing: every past chunk matters
            layer.mixing.raw.uniform_(0.05, 1.0, generator=torch.Generator().manual_seed(4))
        mc = layer.mixing(T // C).detach()
    x = torch.randn(2, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    rot = rope_cos_sin(torch.arange(T), D, cfg.rope_theta, torch.float64)  # half-split [T, 1, D]
    with torch.no_grad():
        q0, k0, v0 = layer._project(x)  # normed projections, no phi, no rotation
        o_causal = layer.attend(q0, k0, v0, grid=(T,), rope_tables=rot)
    # the host hands interleaved pairs (Wan's tables, [1, N, 1, D]): the same rotation on permuted channels
    perm = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=-1).flatten()
    qi, ki = q0[..., perm], k0[..., perm]
    ci, si = rot.cos[None, ..., perm], rot.sin[None, ..., perm]
    o_bi = {}
    for L in range(C, T + 1, C):
        n = L // C
        opts = {"name": kind, "rope": placement, "normalize": normalize, "eps": layer.eps}
        if kind == "mhla":
            opts["blocks"] = (n,)
        bi = build_attention(opts, 16, H, projections=False, grid=(L,)).double()
        if kind == "mhla":
            with torch.no_grad():
                bi.mixing.raw.copy_(mc[:n, :n])
        with torch.no_grad():
            o_bi[L] = bi.attend(qi[:, :L], ki[:, :L], v0[:, :L], grid=(L,),
                                rope_tables=RotaryTables(ci[:, :L], si[:, :L], interleaved=True, upcast=True))
    return o_causal, o_bi, (q0, k0, v0, rot.cos, rot.sin), mc, layer.eps


AGREE = [(p, False) for p in ROPE_PLACEMENTS] + [("before_feature_map", True), ("none", True)]


@pytest.mark.parametrize("kind", ["linear", "mhla"])
@pytest.mark.parametrize("placement,normalize", AGREE)
def test_causal_and_bidirectional_placements_agree(kind, placement, normalize):
    """Same placement name, same numbers, whichever table layout the model hands in."""
    o_causal, o_bi, *_ = causal_and_bidirectional(kind, placement, normalize)
    for L, o in o_bi.items():
        torch.testing.assert_close(o[:, -1], o_causal[:, L - 1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["linear", "mhla"])
def test_after_feature_map_normalizer_uses_the_unrotated_features(kind):
    """normalize=True with rope after the feature map: the numerator uses rope(phi(q)) . rope(phi(k)), the
    normaliser the un-rotated phi(q) . phi(k) (positive), checked against that definition; a causal layer refuses
    the combination (it would need a second decode state)."""
    _, o_bi, (q0, k0, v0, cos, sin), mc, eps = causal_and_bidirectional(kind, "none", False)
    phi = lambda t: torch.relu(t) + 1e-6  # noqa: E731  (feature_map="relu")
    qp, kp = phi(q0), phi(k0)
    qr, kr = apply_rope(qp, cos, sin), apply_rope(kp, cos, sin)
    for L in range(C, T + 1, C):
        n = L // C
        opts = {"name": kind, "rope": "after_feature_map", "normalize": True}
        if kind == "mhla":
            opts["blocks"] = (n,)
        layer = build_attention(opts, 16, H, projections=False, grid=(L,)).double()
        if kind == "mhla":
            with torch.no_grad():
                layer.mixing.raw.copy_(mc[:n, :n])
        with torch.no_grad():
            o = layer.attend(q0[:, :L], k0[:, :L], v0[:, :L], grid=(L,),
                             rope_tables=RotaryTables(cos[:L], sin[:L]))
        w = torch.ones(L, L, dtype=torch.float64) if mc is None else mc[torch.arange(L)[:, None] // C,
                                                                        torch.arange(L)[None] // C]  # [L, L]
        num = torch.einsum("bthd,bshd,ts,bshe->bthe", qr[:, :L], kr[:, :L], w, v0[:, :L])
        den = torch.einsum("bthd,bshd,ts->bth", qp[:, :L], kp[:, :L], w)
        torch.testing.assert_close(o, num / (den + layer.eps)[..., None], rtol=1e-9, atol=1e-12)
        assert (den > 0).all()
    with pytest.raises(ValueError, match="no normaliser"):
        MHLALMConfig(attn={"name": kind, "rope": "after_feature_map", "normalize": True}, hidden_size=16,
                     num_hidden_layers=1, num_heads=H, vocab_size=11) and build_attention(
            {"name": kind, "rope": "after_feature_map", "normalize": True}, 16, H, causal=True)
