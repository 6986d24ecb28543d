"""Mixing-matrix initialisations and the learnable MixingMatrix."""

import math

import pytest
import torch

from mhla.layouts import layout_2d
from mhla.mixing import INIT_KINDS, MixingMatrix, distances_1d, mixing_init

D16 = layout_2d(16, 16, 4).block_distances()  # the paper's DeiT case: 4 x 4 blocks, M = 16


# --------------------------------------------------------------------------------------- inits
def test_locality_init_defining_properties():
    w = mixing_init("locality", D16)
    assert w.shape == (16, 16) and w.dtype == torch.float32 and (w >= 0).all()
    torch.testing.assert_close(w.sum(1), torch.ones(16))
    assert torch.equal(w.argmax(1), torch.arange(16))
    far = D16.argmax(1)
    assert torch.all(w[torch.arange(16), far] == 0)
    assert not torch.allclose(w, w.T)  # each row uses its own max distance and its own sum


def test_locality_paper_case_by_hand():
    """4 x 4 block grid. Rows 0 (corner block (0, 0)) and 5 (interior block (1, 1)), by hand:
    raw[a, b] = 1 - dist / max_dist, max_dist = sqrt(18) (row 0) and sqrt(8) (row 5), then / row sum."""
    w = mixing_init("locality", D16)
    row0 = [0.144361, 0.110335, 0.076308, 0.042282, 0.110335, 0.096240, 0.068276, 0.036761,
            0.076308, 0.068276, 0.048120, 0.021678, 0.042282, 0.036761, 0.021678, 0.0]
    row5 = [0.071334, 0.092227, 0.071334, 0.029879, 0.092227, 0.142668, 0.092227, 0.041786,
            0.071334, 0.092227, 0.071334, 0.029879, 0.029879, 0.041786, 0.029879, 0.0]
    torch.testing.assert_close(w[0], torch.tensor(row0), atol=1e-6, rtol=0)
    torch.testing.assert_close(w[5], torch.tensor(row5), atol=1e-6, rtol=0)
    # the same from the formula written out with explicit block coordinates
    raw = torch.tensor([1 - math.hypot(a, b) / math.sqrt(18) for a in range(4) for b in range(4)])
    torch.testing.assert_close(w[0], raw / raw.sum())


def test_official_init_is_column_normalised_with_global_max():
    w = mixing_init("locality_official", D16)
    torch.testing.assert_close(w.sum(0), torch.ones(16))
    raw = 1 - D16 / D16.max()
    torch.testing.assert_close(w, (raw / raw.sum(0, keepdim=True)).float())
    assert not torch.allclose(w, mixing_init("locality", D16))
    # normalize is ignored for the official init
    assert torch.equal(mixing_init("locality_official", D16, normalize="none"), w)


def test_causal_inits():
    d = distances_1d(6)
    # paper (section 4.2 + Appendix C): max distance over the WHOLE row, then mask the upper triangle, then
    # normalise. Row 1: max(1, 4) = 4 -> raw [3/4, 1]; row 2: max 3 -> [1/3, 2/3, 1]; row 5: max 5.
    p = mixing_init("locality", d, causal=True)
    assert torch.equal(p, p.tril())
    assert p[0].tolist() == [1, 0, 0, 0, 0, 0]
    torch.testing.assert_close(p.sum(1), torch.ones(6))
    torch.testing.assert_close(p[1], torch.tensor([3 / 7, 4 / 7, 0, 0, 0, 0]))
    torch.testing.assert_close(p[2], torch.tensor([1 / 6, 1 / 3, 1 / 2, 0, 0, 0]))
    torch.testing.assert_close(p[5], torch.tensor([0, 0.2, 0.4, 0.6, 0.8, 1.0]) / 3)
    assert (p[1:3, 0] > 0).all() and (p[3:, 0] == 0).all()  # block 0 is seen while i < (M - 1) / 2
    # not causal, both forms are the same
    torch.testing.assert_close(mixing_init("locality", d), mixing_init("locality_visible", d))

    w = mixing_init("locality_visible", d, causal=True)
    assert torch.equal(w, w.tril())
    assert w[0].tolist() == [1, 0, 0, 0, 0, 0]
    torch.testing.assert_close(w.sum(1), torch.ones(6))
    # the max distance is over the VISIBLE blocks: row 1 sees blocks 0, 1 (max 1), row 2 blocks 0..2 (max 2)
    assert w[1].tolist() == [0, 1, 0, 0, 0, 0]
    torch.testing.assert_close(w[2], torch.tensor([0, 1 / 3, 2 / 3, 0, 0, 0]))
    # row 3 sees blocks 0..3 with max distance 3: raw = [0, 1/3, 2/3, 1] / 2
    torch.testing.assert_close(w[3], torch.tensor([0, 1 / 6, 1 / 3, 1 / 2, 0, 0]))
    u = mixing_init("uniform", d, causal=True)
    assert torch.equal(u, u.tril())
    for i in range(6):
        torch.testing.assert_close(u[i, : i + 1], torch.full((i + 1,), 1 / (i + 1)))
    # the causal uniform is the formula itself, not only after normalising
    torch.testing.assert_close(mixing_init("uniform", d, causal=True, normalize="none"), u)
    # ones: the causal mask itself (plain linear attention without a normaliser)
    assert torch.equal(mixing_init("ones", d, causal=True), torch.ones(6, 6).tril())
    for kind in INIT_KINDS:
        wk = mixing_init(kind, d, causal=True)
        assert torch.equal(wk, wk.tril()), kind


@pytest.mark.parametrize("kind", INIT_KINDS)
def test_every_kind_is_nonnegative_and_normalised(kind):
    w = mixing_init(kind, layout_2d(8, 8, 2).block_distances())
    assert w.shape == (16, 16) and (w >= 0).all()
    if kind == "ones":  # not normalised: every entry 1, whatever normalize says
        assert torch.equal(w, torch.ones(16, 16))
        assert torch.equal(mixing_init(kind, layout_2d(8, 8, 2).block_distances(), normalize="col"), w)
        return
    sums = w.sum(0) if kind == "locality_official" else w.sum(1)
    torch.testing.assert_close(sums, torch.ones(16))
    wc = mixing_init(kind, layout_2d(8, 8, 2).block_distances(), normalize="col")
    torch.testing.assert_close(wc.sum(0), torch.ones(16))


def test_kind_formulas_unnormalised():
    d = distances_1d(5)  # max distance 4
    i, j = 1, 4  # distance 3
    assert mixing_init("uniform", d, normalize="none")[i, j].item() == pytest.approx(1 / 5)
    assert mixing_init("identity", d, normalize="none").tolist() == torch.eye(5).tolist()
    cos = mixing_init("cos", d, normalize="none")
    assert cos[i, j].item() == pytest.approx(math.cos(3 / 4 * math.pi / 4))
    assert mixing_init("exp", d, normalize="none")[i, j].item() == pytest.approx(math.exp(-1))
    assert mixing_init("exp", d, normalize="none", sigma=1.5)[i, j].item() == pytest.approx(math.exp(-2))
    sig = 4 / 3
    gauss = mixing_init("gaussian", d, normalize="none")
    assert gauss[i, j].item() == pytest.approx(math.exp(-9 / (2 * sig**2)))
    assert mixing_init("local", d, normalize="none")[2].tolist() == [0, 1, 1, 1, 0]
    assert mixing_init("local", d, normalize="none", local_threshold=2)[2].tolist() == [1, 1, 1, 1, 1]
    assert mixing_init("locality", d, normalize="none")[0].tolist() == [1, 0.75, 0.5, 0.25, 0]


def test_zero_rows_keep_diagonal_and_single_block():
    w = mixing_init("local", distances_1d(4) * 10)  # nothing but the block itself is "local"
    assert torch.equal(w, torch.eye(4))
    w = mixing_init("exp", distances_1d(3) * 1e4)  # off-diagonal underflows to 0
    assert torch.equal(w, torch.eye(3))
    for kind in INIT_KINDS:
        assert mixing_init(kind, distances_1d(1)).tolist() == [[1.0]], kind
        assert mixing_init(kind, distances_1d(1), causal=True).tolist() == [[1.0]], kind


def test_dtype_argument():
    assert mixing_init("locality", D16, dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("call,match", [
    (lambda: mixing_init("bogus", distances_1d(3)), "unknown mixing init 'bogus'; choose one of locality"),
    (lambda: mixing_init("locality", distances_1d(3), normalize="rows"), "normalize must be one of"),
    (lambda: mixing_init("exp", distances_1d(3), sigma=0.0), "sigma must be > 0"),
    (lambda: mixing_init("locality", torch.zeros(3, 4)), r"square \[M, M\]"),
    (lambda: mixing_init("locality", torch.zeros(3)), r"square \[M, M\]"),
    (lambda: mixing_init("locality", -distances_1d(3)), "nonnegative"),
])
def test_init_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -------------------------------------------------------------------------------------- module
def test_module_shapes_per_head_and_frozen():
    m = MixingMatrix(16, distances=D16, num_heads=3)
    assert m().shape == (3, 16, 16) and len(list(m.parameters())) == 1
    for h in range(3):
        torch.testing.assert_close(m()[h], mixing_init("locality", D16))
    shared = MixingMatrix(4)
    assert shared().shape == (4, 4)
    torch.testing.assert_close(shared(), mixing_init("locality", distances_1d(4)))
    frozen = MixingMatrix(4, learnable=False)
    assert len(list(frozen.parameters())) == 0 and frozen().shape == (4, 4)
    assert "raw" in frozen.state_dict()
    torch.testing.assert_close(frozen(), shared())
    assert m(2).shape == (3, 2, 2)


def test_extra_repr():
    r = repr(MixingMatrix(4, num_heads=2, causal=True, learnable=False, init="uniform"))
    for part in ("M=4", "init=uniform", "causal=True", "learnable=False", "per_head=2"):
        assert part in r


def test_softplus_reproduces_init():
    sp = MixingMatrix(16, distances=D16, parameterization="softplus")
    torch.testing.assert_close(sp(), mixing_init("locality", D16), atol=1e-3, rtol=0)
    assert (sp() > 0).all()
    sp_c = MixingMatrix(6, init="locality", causal=True, parameterization="softplus")
    want = mixing_init("locality", distances_1d(6), causal=True)
    torch.testing.assert_close(sp_c(), want, atol=1e-3, rtol=0)
    assert torch.equal(sp_c(), sp_c().tril())


def test_log_parameterization_reproduces_init_and_moves_relatively():
    lg = MixingMatrix(6, init="uniform", causal=True, parameterization="log")
    torch.testing.assert_close(lg(), mixing_init("uniform", distances_1d(6), causal=True))
    assert torch.equal(lg(), lg().tril())
    loc = MixingMatrix(16, distances=D16, parameterization="log")  # zeros of the init start at 1e-4
    torch.testing.assert_close(loc(), mixing_init("locality", D16), atol=1e-4, rtol=0)
    assert (loc() > 0).all()
    # one Adam step of lr changes every entry by the same RELATIVE amount, small entries too (with clamp: the
    # same ABSOLUTE amount, which sends an entry of 1/(i+1) to the 0 bound in about 1 / ((i+1) lr) steps)
    before = lg().detach().clone()
    opt = torch.optim.Adam(lg.parameters(), lr=1e-2)
    lg().sum().backward()
    opt.step()
    ratio = lg().detach().tril() / before.tril().where(before > 0, torch.ones(()))
    torch.testing.assert_close(ratio[before > 0], torch.full_like(ratio[before > 0], math.exp(-1e-2)))  # loss = sum: every entry shrinks
    # the LM re-initialises the stored values of every parameterization through initial_raw()
    torch.testing.assert_close(lg.initial_raw(), torch.log(mixing_init("uniform", distances_1d(6), causal=True)
                                                           .clamp_min(1e-4)).float())


def test_clamp_stays_nonnegative_and_project_recovers():
    m = MixingMatrix(4)  # locality init has zeros at the farthest blocks
    assert m()[0, 3] == 0
    opt = torch.optim.SGD(m.parameters(), lr=10.0)
    (m() * torch.tensor([[1.0, 1, 1, -1]] * 4)).sum().backward()  # pushes columns 0-2 down, column 3 up
    assert m.raw.grad[0, 3] != 0  # gradient reaches an entry sitting at the clip bound 0
    opt.step()
    assert (m.raw < 0).any() and (m.raw > 1).any()  # the step left the feasible set ...
    assert (m() >= 0).all() and (m() <= 1).all()  # ... the forward does not
    m.project_()
    assert (m.raw >= 0).all() and (m.raw <= 1).all()
    assert torch.equal(m(), m.raw.detach())
    assert m()[0, 3] > 0  # the zero entry grew
    # an entry that was pushed negative and projected to 0 can grow again
    neg = m.raw.detach() == 0
    assert neg.any()
    opt.zero_grad()
    (-m()).sum().backward()
    opt.step()
    m.project_()
    assert (m.raw.detach()[neg] > 0).all()


def test_max_value_and_project_noop_for_softplus():
    m = MixingMatrix(3, init="identity", max_value=0.5, init_kwargs={"normalize": "none"})
    assert m().max().item() == 0.5
    sp = MixingMatrix(3, parameterization="softplus")
    with torch.no_grad():
        sp.raw.fill_(-5.0)
    sp.project_()
    assert torch.all(sp.raw == -5.0)


def test_the_layers_mixing_max_lets_a_coefficient_started_at_1_rise():
    """``mixing_max`` (``attn.mixing_max``) is the clamp's upper bound: started at 1 (``mixing_init=ones``) a
    coefficient pushed up stays at 1 under the paper's bound and rises to the bound given; refused without clamp."""
    from mhla.layers import MultiHeadLinearAttention  # noqa: PLC0415

    risen = {}
    for bound in (1.0, 4.0):
        layer = MultiHeadLinearAttention(16, 2, causal=True, block_size=4, max_learned_blocks=3, mixing_init="ones",
                                         mixing_max=bound)
        assert layer.settings()["mixing_max"] == bound
        opt = torch.optim.SGD(layer.mixing.parameters(), lr=10.0)
        (-layer.mixing.learned()).sum().backward()  # every visible coefficient pushed up
        opt.step()
        layer.mixing.project_()
        risen[bound] = layer.mixing.learned().detach()
    visible = torch.ones(3, 3).tril().bool()
    assert torch.equal(risen[1.0][visible], torch.ones(6))
    assert torch.equal(risen[4.0][visible], torch.full((6,), 4.0))
    with pytest.raises(ValueError, match="mixing_max bounds the clamp"):
        MultiHeadLinearAttention(16, 2, causal=True, block_size=4, mixing_param="log", mixing_max=4.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"parameterization": "exp"}, "parameterization must be one of clamp, softplus"),
    ({"num_heads": 0}, "num_heads"),
    ({"max_value": 0.0}, "max_value"),
    ({"distances": distances_1d(5)}, r"distances have shape \(5, 5\) but num_blocks=4"),
    ({"init_kwargs": {"causal": True}}, "init_kwargs"),
    ({"init": "bogus"}, "unknown mixing init"),
])
def test_module_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MixingMatrix(4, **kwargs)
    with pytest.raises(ValueError, match="num_blocks"):
        MixingMatrix(0)


def brute_force_extension(L, n, rule="uniform_far"):
    """The ``relative`` and ``uniform_far`` (default) extension rules, written out with loops."""
    M = L.shape[-1]
    W = torch.zeros(n, n)
    for i in range(n):
        far = i - M + 1  # blocks farther back than the learned window, for a row i >= M
        for b in range(i + 1):
            if i < M:
                W[i, b] = L[i, b]
            elif i - b <= M - 1:
                W[i, b] = L[M - 1, M - 1 - (i - b)]
            else:
                W[i, b] = L[M - 1, 0] / (far if rule == "uniform_far" else 1)
    return W


@pytest.mark.parametrize("rule", ["uniform_far", "relative"])
@pytest.mark.parametrize("num_heads", [None, 2])
def test_causal_extension_rule_and_gradients(num_heads, rule):
    M = 5
    kw = {} if rule == "uniform_far" else {"extension": rule}  # uniform_far: the default
    m = MixingMatrix(M, init="uniform", causal=True, num_heads=num_heads, **kw)
    with torch.no_grad():
        m.raw.copy_(torch.rand(m.raw.shape))  # the upper triangle must be masked out
    L = m.learned().detach()
    assert torch.equal(L, L.tril())
    W = m(3 * M)
    lead = () if num_heads is None else (num_heads,)
    assert W.shape == (*lead, 3 * M, 3 * M)
    assert torch.equal(W, W.tril())
    Ls, Ws = (L, W) if num_heads else (L[None], W[None])
    for h in range(Ls.shape[0]):
        torch.testing.assert_close(Ws[h].detach(), brute_force_extension(Ls[h], 3 * M, rule), rtol=1e-6, atol=0)
    torch.testing.assert_close(m(3), L[..., :3, :3])
    torch.testing.assert_close(m(M), L)
    # gradients: each learned lower-triangular entry gets the weight of the places it is used
    W.sum().backward()
    grad = m.raw.grad if num_heads is None else m.raw.grad[0]
    uses = torch.zeros(M, M)
    for i in range(3 * M):
        for b in range(i + 1):
            if i < M:
                uses[i, b] += 1
            elif i - b <= M - 1:
                uses[M - 1, M - 1 - (i - b)] += 1
            else:
                uses[M - 1, 0] += 1 / (i - M + 1) if rule == "uniform_far" else 1
    torch.testing.assert_close(grad, uses)


def test_default_extension_bounds_the_row_mass():
    """uniform_far: an extended row carries the last learned row's mass plus its farthest coefficient, at any
    length (relative: the far blocks add that coefficient once per block, so the mass grows with the row)."""
    m = MixingMatrix(4, init="uniform", causal=True)
    assert m.extension == "uniform_far"
    L = m.learned().detach()
    for n in (5, 9, 40):
        torch.testing.assert_close(m(n)[-1].sum(), L[-1].sum() + L[-1, 0])
    relative = MixingMatrix(4, init="uniform", causal=True, extension="relative")(40)[-1].sum()
    assert relative > 5 * (L[-1].sum() + L[-1, 0])


def test_noncausal_cannot_extend():
    with pytest.raises(ValueError, match="built for M = 4 blocks"):
        MixingMatrix(4)(6)
    with pytest.raises(ValueError, match=">= 1"):
        MixingMatrix(4, causal=True)(0)


def test_optimizer_gives_the_mixing_matrix_its_own_lr_and_decay():
    from omegaconf import OmegaConf

    from mhla.layers import MultiHeadLinearAttention
    from tasks.common.optim import build_optimizer, build_scheduler

    layer = MultiHeadLinearAttention(16, 2, causal=True, block_size=4, mixing_init="uniform")
    cfg = OmegaConf.create({"lr": 1e-3, "weight_decay": 0.05, "mixing_lr_scale": 0.01, "mixing_weight_decay": 0.1})
    opt = build_optimizer(layer, cfg)
    mix = [g for g in opt.param_groups if any(p is layer.mixing.raw for p in g["params"])]
    assert len(mix) == 1 and len(mix[0]["params"]) == 1
    assert mix[0]["lr"] == pytest.approx(1e-5) and mix[0]["weight_decay"] == 0.1
    others = [g for g in opt.param_groups if g is not mix[0]]
    assert all(g["lr"] == pytest.approx(1e-3) for g in others)
    # the schedule scales every group alike: the ratio survives warmup and decay
    sched = build_scheduler(opt, OmegaConf.create({"name": "cosine", "warmup_steps": 2}), 10, 10)
    for _ in range(5):
        opt.step()
        sched.step()
        assert mix[0]["lr"] == pytest.approx(0.01 * others[0]["lr"])
    # default: same lr, no decay (as before the option existed)
    opt = build_optimizer(layer, OmegaConf.create({"lr": 1e-3, "weight_decay": 0.05}))
    assert {g["lr"] for g in opt.param_groups} == {1e-3}
    with pytest.raises(ValueError, match="mixing_lr_scale"):
        build_optimizer(layer, OmegaConf.create({"lr": 1e-3, "weight_decay": 0.05, "mixing_lr_scale": -1}))


def test_mixing_freeze_steps_holds_the_matrix_then_releases_it():
    from omegaconf import OmegaConf

    from mhla.layers import MultiHeadLinearAttention
    from tasks.common.optim import build_optimizer, build_scheduler

    torch.manual_seed(0)
    layer = MultiHeadLinearAttention(16, 2, causal=True, block_size=4, mixing_init="uniform")
    cfg = OmegaConf.create({"lr": 1e-2, "weight_decay": 0.05, "mixing_freeze_steps": 3})
    opt = build_optimizer(layer, cfg)
    sched = build_scheduler(opt, OmegaConf.create({"name": "constant"}), 10, 10)
    x = torch.randn(2, 12, 16)
    mix0, qkv0 = layer.mixing.raw.detach().clone(), layer.qkv.weight.detach().clone()
    history = []
    for _ in range(5):
        opt.zero_grad()
        layer(x).pow(2).mean().backward()
        opt.step()
        sched.step()
        history.append(layer.mixing.raw.detach().clone())
    assert not torch.equal(layer.qkv.weight, qkv0)  # the rest trains from step 0
    assert all(torch.equal(h, mix0) for h in history[:3])  # the matrix waits 3 steps
    assert not torch.equal(history[3], mix0)  # then moves
    with pytest.raises(ValueError, match="mixing_freeze_steps"):
        build_optimizer(layer, OmegaConf.create({"lr": 1e-3, "weight_decay": 0.0, "mixing_freeze_steps": -2}))


def test_extension_rule_is_an_option():
    from mhla.mixing import EXTENSION_RULES, extend_causal_mixing  # noqa: PLC0415

    torch.manual_seed(0)
    mix = MixingMatrix(4, init="uniform", causal=True, extension="relative")
    with torch.no_grad():
        mix.raw.uniform_(0.1, 0.9)
    L = mix.learned().detach()
    relative = mix(10).detach()
    assert torch.equal(relative[9, :6], L[3, 0].expand(6))  # far blocks: the farthest learned coefficient
    for rule in EXTENSION_RULES:
        windowed = MixingMatrix(4, init="uniform", causal=True, extension=rule)
        windowed.load_state_dict(mix.state_dict())
        W = windowed(10).detach()
        assert torch.equal(W, extend_causal_mixing(L, 10, rule)) and torch.equal(W.triu(1), torch.zeros(10, 10))
        assert torch.equal(W[:4, :4], L)
        if rule in ("relative", "window", "uniform_far", "sqrt_far"):
            assert torch.equal(W[9, 6:], relative[9, 6:])  # they differ only beyond the learned window
    # the far blocks of row 9 (6 of them, d >= M = 4): relative 1 each, uniform_far 1/6, sqrt_far 1/sqrt(6)
    for rule, share in (("uniform_far", 1 / 6), ("sqrt_far", 6 ** -0.5)):
        far = extend_causal_mixing(L, 10, rule)[9, :6]
        torch.testing.assert_close(far, L[3, 0] * share * torch.ones(6))
    assert torch.equal(MixingMatrix(4, init="uniform", causal=True, extension="window").__call__(10)[9, :6],
                       torch.zeros(6))
    with pytest.raises(ValueError, match="extension"):
        MixingMatrix(4, causal=True, extension="nope")


def test_a_capped_uniform_far_stops_falling_at_its_cap():
    """``uniform_far:C``: equal to ``uniform_far`` while a row has at most C far blocks; past that every far block
    keeps L[M-1, 0] / C (so the far part's mass grows with the count, as under ``relative``). Rows and decode
    state agree with the dense matrix (tests/ops/test_compact_state.py runs every rule with ``uniform_far:3``)."""
    from mhla.mixing import causal_mixing_rows, check_extension, extend_causal_mixing, parse_extension  # noqa: PLC0415

    torch.manual_seed(0)
    L = torch.rand(4, 4, dtype=torch.float64).tril() + 0.1
    n = 12  # row i >= 4 has i - 3 far blocks: 1 .. 8
    capped, uniform = extend_causal_mixing(L, n, "uniform_far:5"), extend_causal_mixing(L, n, "uniform_far")
    relative = extend_causal_mixing(L, n, "relative")
    assert torch.equal(capped[:8 + 1], uniform[:8 + 1])  # rows with at most 5 far blocks (i <= 8)
    for i in range(9, n):  # 6 .. 8 far blocks: each L[3, 0] / 5, not / count
        torch.testing.assert_close(capped[i, :i - 3], (L[3, 0] / 5).expand(i - 3))
        assert torch.equal(capped[i, i - 3:], relative[i, i - 3:])  # the window is untouched
    far_mass = capped[9:, :].sum(-1) - relative[9:, :].sum(-1) + relative[9:, 0] * torch.arange(6, 9)
    assert bool((far_mass.diff() > 0).all())  # the row's mass grows past the cap (uniform_far's does not)
    assert torch.equal(extend_causal_mixing(L, n, f"uniform_far:{n}"), uniform)  # a cap never reached: uniform_far
    assert torch.equal(extend_causal_mixing(L, n, "uniform_far:1"), relative)  # a model trained within its rows
    rows = causal_mixing_rows(L, 0, n, "uniform_far:5")
    torch.testing.assert_close(rows.far[9:], (L[3, 0] / 5).expand(3))
    assert parse_extension("uniform_far:5") == ("uniform_far", 5) and parse_extension("relative") == ("relative",
                                                                                                       None)
    mix = MixingMatrix(4, causal=True, extension="uniform_far:120")
    assert mix.extension == check_extension("uniform_far:120") == "uniform_far:120"
    for bad in ("uniform_far:0", "uniform_far:", "uniform_far:x", "relative:4", "sqrt_far:2", "uniform_far:-1"):
        with pytest.raises(ValueError, match="uniform_far:C"):
            MixingMatrix(4, causal=True, extension=bad)


def test_the_cap_read_from_training_resolves_once_in_the_language_models_attention():
    """``uniform_far:auto``: the LM's attention completion resolves it from the longest context a row trained on
    (blocks of that context less the learned rows): ``uniform_far:C``, or ``uniform_far`` for a model trained
    within its rows; a layer never takes it unresolved; the config stores the resolved rule and the context."""
    from mhla.lm_attention import complete_lm_attention  # noqa: PLC0415
    from mhla.mixing import AUTO_CAP, resolve_far_cap  # noqa: PLC0415
    from models.lm import MHLALMConfig  # noqa: PLC0415

    assert resolve_far_cap(AUTO_CAP, 120) == "uniform_far:120" and resolve_far_cap(AUTO_CAP, 0) == "uniform_far"
    assert resolve_far_cap("relative", 5) == "relative" and resolve_far_cap("uniform_far:7", 5) == "uniform_far:7"
    attn = {"name": "mhla", "block_size": 32, "mixing_extension": AUTO_CAP}
    assert complete_lm_attention(attn, 256, 4096)["mixing_extension"] == "uniform_far:120"  # 128 blocks - 8 rows
    assert complete_lm_attention(attn, 256, 1024)["mixing_extension"] == "uniform_far:24"
    assert complete_lm_attention(attn, 256)["mixing_extension"] == "uniform_far"  # trained within its 8 rows
    assert complete_lm_attention({**attn, "max_learned_blocks": 4}, 256)["mixing_extension"] == "uniform_far:4"
    config = MHLALMConfig(attn=attn, vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2,
                          max_position_embeddings=256, trained_context=1024)
    assert config.attn["mixing_extension"] == "uniform_far:24" and config.trained_context == 1024
    assert MHLALMConfig.from_dict(config.to_dict()).attn["mixing_extension"] == "uniform_far:24"
    with pytest.raises(ValueError, match="resolved when a language model is built"):
        MixingMatrix(4, causal=True, extension=AUTO_CAP)


# ------------------------------------------------------------------------------------ mixing_profile
def test_mixing_profile_of_untrained_matrices():
    """At its init a matrix is 0 from its init; uniform mixing is 0 from uniform with entropy log M; identity
    keeps all its weight on its own block at distance 0."""
    from mhla.mixing import mixing_profile

    u = mixing_profile(MixingMatrix(16, distances=D16, init="uniform"))
    assert u["tv_from_init"] == pytest.approx(0, abs=1e-12) and u["tv_from_uniform"] == pytest.approx(0, abs=1e-12)
    assert u["entropy"] == pytest.approx(math.log(16)) and u["self_share"] == pytest.approx(1 / 16)
    assert u["mean_distance"] == pytest.approx(D16.mean().item()) == u["mean_distance_uniform"]
    eye = mixing_profile(MixingMatrix(16, distances=D16, init="identity", learnable=False))
    assert eye["self_share"] == pytest.approx(1) and eye["entropy"] == pytest.approx(0, abs=1e-9)
    assert eye["mean_distance"] == 0 and eye["zero_fraction"] == pytest.approx(15 / 16)
    assert eye["tv_from_uniform"] == pytest.approx(15 / 16) and not eye["learnable"]
    loc = mixing_profile(MixingMatrix(16, distances=D16, num_heads=2, parameterization="softplus"))
    assert loc["tv_from_init"] == pytest.approx(0, abs=1e-12) and loc["init"] == "locality"
    assert u["mean_distance"] > loc["mean_distance"] > 0 and loc["self_share"] > 1 / 16  # locality is local
    causal = mixing_profile(MixingMatrix(6, init="uniform", causal=True))
    assert causal["tv_from_uniform"] == pytest.approx(0, abs=1e-12) and causal["self_share"] == pytest.approx(
        sum(1 / (i + 1) for i in range(6)) / 6)


def test_mixing_profile_after_a_change_by_hand():
    """Moving every row of a uniform 4 x 4 matrix onto its own block: TV = 3/4 from the init, row scale ignored."""
    from mhla.mixing import mixing_profile

    m = MixingMatrix(4, init="uniform")
    with torch.no_grad():
        m.raw.copy_(torch.eye(4) * 0.5)  # rows sum to 0.5: normalised first
    p = mixing_profile(m)
    assert p["tv_from_init"] == pytest.approx(0.75) and p["self_share"] == pytest.approx(1)
    assert p["row_sum"] == pytest.approx(0.5) and p["self_share_init"] == pytest.approx(0.25)
    torch.testing.assert_close(m.initial(), torch.full((4, 4), 0.25))


@pytest.mark.parametrize("num_heads", [None, 2])
@pytest.mark.parametrize("keep_near", [0, 2])
def test_equal_weights_make_every_far_coefficient_the_last_rows_mean(num_heads, keep_near):
    """Untied causal rows: coefficients at distance >= keep_near take the mean of the last learned row's at those
    distances (per head), nearer ones stay; under `relative` the extended rows then read the same constant."""
    torch.manual_seed(0)
    m = MixingMatrix(6, causal=True, num_heads=num_heads, init="uniform", extension="relative")
    with torch.no_grad():
        m.raw.copy_(torch.rand_like(m.raw) * 1.4 - 0.2)  # some entries outside [0, 1]: clamped first
    before = m.learned().detach().clone()
    m.equalize_(keep_near)
    W = m(20).detach()  # past the learned rows, by the rule
    i = torch.arange(20)
    d = i[:, None] - i[None, :]
    mean = before[..., 5, : 6 - keep_near].mean(-1)
    far = W[..., d >= keep_near]
    assert torch.allclose(far, mean[..., None].expand_as(far))
    near = (d >= 0) & (d < keep_near) & (i[:, None] < 6)  # the learned rows' near entries: kept
    assert torch.equal(W[..., near], before[..., near[:6, :6]])
    assert torch.equal(W[..., d < 0], torch.zeros_like(W[..., d < 0]))


def test_equal_weights_refuse_what_has_no_coefficient_per_entry():
    with pytest.raises(ValueError, match="clamp"):
        MixingMatrix(4, causal=True, parameterization="log").equalize_()
    with pytest.raises(ValueError, match="causal"):
        MixingMatrix(4).equalize_()
    with pytest.raises(ValueError, match="log_distance"):
        MixingMatrix(8, causal=True, tie="log_distance").equalize_()
