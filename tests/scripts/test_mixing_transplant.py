"""scripts/mixing_transplant.py: the swap moves every mixing parameter and nothing else, refuses models whose mixing
differs, and the table reads the record it is given."""

from __future__ import annotations

import pytest
import torch

from helpers.lm_configs import lm_config
from mhla.mixing import MixingMatrix, mixing_matrices
from models.lm import MHLALMForCausalLM
from scripts import mixing_transplant as T


def tiny(attn: str = "mhla", seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    return MHLALMForCausalLM(lm_config(attn, block_size=4, vocab_size=32, hidden_size=32, num_hidden_layers=layers,
                                       num_heads=2, max_position_embeddings=16)).eval()


def test_swap_moves_the_mixing_and_nothing_else():
    a, b = tiny(seed=0), tiny(seed=1)
    with torch.no_grad():  # the inits' mixing matrices are equal: make b's differ
        for m in mixing_matrices(b).values():
            for p in m.parameters():
                p.add_(torch.rand_like(p))
    mixed = T.with_mixing_of(a, b)
    mix_names = {f"{mod}.{n}" for mod, m in mixed.named_modules() if isinstance(m, MixingMatrix)
                 for n, _ in m.named_parameters()}
    assert mix_names
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name, p in mixed.named_parameters():
        expected = pb[name] if name in mix_names else pa[name]
        assert torch.equal(p, expected), name
        if name in mix_names:
            assert not torch.equal(p, pa[name]), name   # it did change
    assert all(not torch.equal(p, pb[n]) for n, p in a.named_parameters() if n in mix_names)  # a is untouched
    x = torch.randint(0, 32, (1, 12))
    assert not torch.allclose(mixed(input_ids=x).logits, a(input_ids=x).logits)


@pytest.mark.parametrize("other", [lambda: tiny("linear"), lambda: tiny(layers=3)])
def test_swap_refuses_models_whose_mixing_differs(other):
    with pytest.raises(ValueError):
        T.with_mixing_of(tiny(), other())


def test_markdown_averages_the_seeds():
    rec = lambda acc: {"acc": acc, "depths": [{"acc": acc}]}  # noqa: E731
    record = {"command": "python scripts/mixing_transplant.py ...", "lengths": ["256", "1024"], "seeds": ["0", "1"],
              "runs": {"0": {"base": "B0", "trained": "S0"}, "1": {"base": "B1", "trained": "S1"}},
              "settings": {"examples": 8, "rule": "uniform_far", "depths": [1.0]}, "notes": "",
              "pairs": {s: {v: {"256": rec(1.0), "1024": rec(a)} for v in T.VARIANTS}
                        for s, a in (("0", 0.5), ("1", 0.25))}}
    md = T.markdown(record)
    assert "| trained + base mixing | 2 | 100.0 ± 0.0 | 37.5 ± 17.7 |" in md
    assert "| 1.00 | 100 | 38 |" in md and "seed 1: base `B1`, trained `S1`" in md


def tied(seed: int = 0):
    model = tiny(seed=seed)
    for m in mixing_matrices(model).values():
        m.tie_by_distance_()
    with torch.no_grad():  # distinct coefficients per distance
        for m in mixing_matrices(model).values():
            m.raw.copy_(torch.rand_like(m.raw))
    return model


@pytest.mark.parametrize("keep_near", [0, 2])
def test_equal_weights_flatten_the_far_coefficients_and_nothing_else(keep_near):
    model = tied()
    flat = T.with_equal_weights(model, keep_near)
    mix = {f"{mod}.{n}" for mod, m in flat.named_modules() if isinstance(m, MixingMatrix)
           for n, _ in m.named_parameters()}
    before = dict(model.named_parameters())
    for name, p in flat.named_parameters():
        if name not in mix:
            assert torch.equal(p, before[name]), name
            continue
        c = before[name].clamp(0, 1)
        assert torch.equal(p[..., :keep_near], c[..., :keep_near])
        far = c[..., keep_near:]
        assert torch.allclose(p[..., keep_near:], far.mean(-1, keepdim=True).expand_as(far))
        assert not torch.equal(p, before[name])
    x = torch.randint(0, 32, (1, 12))
    assert not torch.allclose(flat(input_ids=x).logits, model(input_ids=x).logits)


def test_equal_weights_take_untied_rows_and_leave_the_rest():
    model = tiny()
    flat = T.with_equal_weights(model)
    for name, m in mixing_matrices(flat).items():
        w = m.learned()
        assert torch.allclose(w[..., w.new_ones(w.shape[-2:]).tril().bool()], w[..., -1, :1].mean()), name
    mix = {n for n, _ in flat.named_parameters() if n.endswith(".raw")}
    assert mix and all(torch.equal(p, dict(model.named_parameters())[n])
                       for n, p in flat.named_parameters() if n not in mix)


def test_markdown_of_the_equal_weights_record():
    rec = lambda acc: {"acc": acc, "depths": [{"acc": acc}]}  # noqa: E731
    names = ["trained", "equal weights", "nearest 8 kept, the rest equal"]
    record = {"command": "python scripts/mixing_transplant.py --equal-weights ...", "lengths": ["4096"], "seeds": ["0"],
              "runs": {"0": {"trained": "S0"}}, "notes": "",
              "settings": {"examples": 8, "rule": "uniform_far", "depths": [1.0], "equal_weights": True},
              "pairs": {"0": {v: {"4096": rec(a)} for v, a in zip(names, (0.5, 0.75, 1.0))}}}
    md = T.markdown(record)
    assert "| equal weights | 1 | 75.0 ± 0.0 |" in md and "| nearest 8 kept, the rest equal | 1 | 100.0 ± 0.0 |" in md
    assert "seed 0: trained `S0`" in md and "made equal" in md and "base + trained mixing" not in md
