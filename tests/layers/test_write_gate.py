"""``write_gate`` (:class:`mhla.layers.WriteGate`): a learned per-head gate on each token's write into the state. It
starts as the ungated layer, every path (one pass, chunked prefill and decoding, packed sequences) applies it
alike, a token the relu gate closes leaves the state as if it were not there (``relu_leaky_grad`` and, at evaluation,
``hard_concrete`` too, whose closed gates still get a gradient), and the settings it cannot honour are refused."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.lm_configs import lm_config
from mhla.layers import (HARD_CONCRETE_BETA, HARD_CONCRETE_GAMMA, HARD_CONCRETE_ZETA, LEAKY_GRAD_SLOPE,
                         AttentionCache, LinearAttention, MultiHeadLinearAttention, WriteGate, relu_leaky_grad)
from mhla.registry import attention_tag
from models.lm import MHLALMForCausalLM

LAYERS = {"mhla": (MultiHeadLinearAttention, {"block_size": 4, "mixing_init": "ones"}),
          "linear": (LinearAttention, {})}


KINDS = ["relu", "relu_leaky_grad", "sigmoid", "hard_concrete"]


def _layer(name, write_gate=None, seed=0, **kw):
    """A layer in eval mode (hard_concrete draws its gates in training)."""
    cls, own = LAYERS[name]
    torch.manual_seed(seed)
    return cls(16, 2, causal=True, normalize=False, out_norm=True, write_gate=write_gate, **own, **kw).eval()


def _random_gate(layer, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.write_gate.weight.copy_(torch.randn(layer.write_gate.weight.shape, generator=g))
    return layer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_gated_layer_starts_as_the_ungated_one(name, kind):
    """W = 0 gives g = 1 for every token: the same weights give the same output, and building the gate draws no
    random number (the other weights of a seed are those of the ungated layer)."""
    plain, gated = _layer(name), _layer(name, kind)
    assert set(gated.state_dict()) - set(plain.state_dict()) == {"write_gate.weight", "write_gate.bias"}
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(gated.state_dict()[key], value)
    x = torch.randn(2, 11, 16)
    torch.testing.assert_close(gated.write_gate(x), torch.ones(2, 11, 2))
    torch.testing.assert_close(gated(x), plain(x))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_chunked_prefill_decoding_and_packed_sequences_apply_the_gate_alike(name, kind):
    layer = _random_gate(_layer(name, kind))
    x = torch.randn(2, 13, 16)
    full = layer(x)
    cache = AttentionCache()
    parts = [layer(x[:, :5], cache=cache), layer(x[:, 5:6], cache=cache), layer(x[:, 6:], cache=cache)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    packed = layer(torch.cat([x[:1], x[1:, :7]], dim=1), cu_seqlens=torch.tensor([0, 13, 20]))
    torch.testing.assert_close(packed[:, :13], full[:1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, 13:], layer(x[1:, :7]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_token_the_relu_gate_closes_is_not_in_the_state(name):
    """With the gate at 0 for token 3 (its bias pushed below zero on that token alone), later outputs do not depend
    on that token's value; with the sigmoid gate, which never reaches 0, they do."""
    for kind, closed in (("relu", True), ("relu_leaky_grad", True), ("sigmoid", False), ("hard_concrete", True)):
        layer = _layer(name, kind)
        x = torch.randn(1, 12, 16)
        x[0, 3] = 0.0
        x[0, 3, 0] = 1.0  # token 3 alone reads channel 0
        with torch.no_grad():
            layer.write_gate.weight[:, 0] = -10.0
            x[0, :3, 0] = x[0, 4:, 0] = 0.0
        v_only = torch.zeros(1, 12, 16)
        v_only[0, 3, 1:] = torch.randn(15)  # moves token 3's value (and its key and query)
        a, b = layer(x), layer(x + v_only)
        after = slice(8, 12)  # past the short window of a short convolution, if any
        same = torch.allclose(a[:, after], b[:, after], atol=1e-6)
        assert same is closed, (name, kind)


def test_a_closed_leaky_grad_gate_writes_0_and_still_hears_the_loss():
    """``relu_leaky_grad`` writes relu's gates exactly; on a token whose gate is closed (z < 0) relu passes no
    gradient to W, so the budget's closing is final, while relu_leaky_grad passes the loss's gradient times the
    slope, in the direction that opens the gate when the loss wants the token written."""
    x = torch.randn(6, 16)
    grads = {}
    for kind in ("relu", "relu_leaky_grad"):
        gate = WriteGate(16, 2, kind)
        with torch.no_grad():
            gate.bias.fill_(-1.0)  # every token closed: z = -1 with W = 0
        g = gate(x)
        assert torch.equal(g, torch.zeros(6, 2))  # exactly 0: the token is not in the state
        (-g.sum()).backward()  # a loss that wants every token written
        grads[kind] = (gate.weight.grad.clone(), gate.bias.grad.clone())
    assert torch.count_nonzero(grads["relu"][0]) == 0 and torch.count_nonzero(grads["relu"][1]) == 0
    torch.testing.assert_close(grads["relu_leaky_grad"][1], torch.full((2,), -6 * LEAKY_GRAD_SLOPE))  # opens
    torch.testing.assert_close(grads["relu_leaky_grad"][0], -LEAKY_GRAD_SLOPE * x.sum(0).expand(2, 16))
    z = torch.linspace(-2, 2, 8, requires_grad=True)  # not 0 itself
    out = relu_leaky_grad(z)
    assert torch.equal(out, torch.relu(z))
    out.sum().backward()
    torch.testing.assert_close(z.grad, torch.where(z > 0, 1.0, LEAKY_GRAD_SLOPE))


def test_a_closed_hard_concrete_gate_writes_0_at_evaluation_and_opens_on_some_training_draws():
    """At evaluation the hard concrete gate is exactly 0 below z = -log(11) and exactly 1 above log(11). In training
    it is drawn: at z = -3 most draws are exactly 0, some open, and through those the loss reaches the gate and
    opens it (relu's closed gate hears nothing); the budget is the chance that a gate is open, smooth in z. The draws
    follow torch's seed."""
    gate = WriteGate(16, 2, "hard_concrete", penalty=1.0)
    assert gate.initial_bias() == 3.0
    x = torch.zeros(4000, 16)  # z = bias on every token
    with torch.no_grad():
        gate.bias.fill_(-3.0)
    gate.eval()
    assert torch.equal(gate(x), torch.zeros(4000, 2))
    with torch.no_grad():
        gate.bias.copy_(torch.tensor([-2.3, 2.5]))
    g = gate(x)
    assert torch.all(g[:, 0] > 0) and torch.all(g[:, 0] < 0.01) and torch.equal(g[:, 1], torch.ones(4000))
    with torch.no_grad():
        gate.bias.fill_(-3.0)
    gate.train()
    torch.manual_seed(0)
    g = gate(x)
    open_frac = (g > 0).float().mean().item()
    expected = torch.sigmoid(torch.tensor(-3.0 - HARD_CONCRETE_BETA * math.log(-HARD_CONCRETE_GAMMA / HARD_CONCRETE_ZETA)))
    assert 0.02 < open_frac < 0.2 and abs(open_frac - expected.item()) < 0.02
    torch.testing.assert_close(gate.regularization_loss(), expected)  # the budget: P(open), not the draws' mean
    (-g.sum()).backward()  # a loss that wants every token written
    assert torch.all(gate.bias.grad < 0)  # opens: a gradient step raises the bias
    torch.manual_seed(0)
    assert torch.equal(gate(x), g.detach())  # the same seed, the same draws
    assert abs(gate(x).mean().item() - g.mean().item()) > 0  # another draw


def test_the_settings_it_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="write_gate='relu' scales the values.*normalize=false"):
        MultiHeadLinearAttention(16, 2, causal=True, block_size=4, normalize=True, write_gate="relu")
    with pytest.raises(ValueError, match="projections=False"):
        LinearAttention(16, 2, causal=True, normalize=False, projections=False, write_gate="relu")
    with pytest.raises(ValueError, match="write_gate must be one of relu, relu_leaky_grad, sigmoid"):
        LinearAttention(16, 2, causal=True, normalize=False, write_gate="tanh")


def test_the_layer_reports_the_gate_and_the_tag_names_it():
    layer = _layer("mhla", "relu")
    assert layer.settings()["write_gate"] == "relu"
    assert "write_gate" not in _layer("mhla").settings()
    assert attention_tag({"name": "mhla", "mixing_init": "ones", "write_gate": "relu"}) == "mhla-ones-wg_relu"
    assert attention_tag({"name": "linear", "write_gate": "sigmoid"}) == "linear-wg_sigmoid"
    assert attention_tag({"name": "linear", "write_gate": None}) == "linear"


@pytest.mark.parametrize("name", list(LAYERS))
def test_the_language_model_starts_its_gates_at_1(name):
    """The LM's weight init (transformers' post_init) leaves the gate at its start: W = 0, g = 1."""
    torch.manual_seed(0)
    model = MHLALMForCausalLM(lm_config(name, vocab_size=61, hidden_size=32, num_hidden_layers=2, num_heads=2,
                                        block_size=4, max_position_embeddings=16, write_gate="relu"))
    gates = [m for m in model.modules() if isinstance(m, WriteGate)]
    assert len(gates) == 2
    for gate in gates:
        assert torch.count_nonzero(gate.weight) == 0 and torch.all(gate.bias == 1.0)


def test_the_penalty_is_the_mean_gate_of_the_forwards_with_gradients_read_once():
    from mhla.hooks import regularization_loss
    layer = _random_gate(_layer("mhla", "relu", write_gate_penalty=0.5)).train()
    assert layer.settings()["write_gate_penalty"] == 0.5
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        layer(x)  # a state passed without gradients, or an evaluation: not in the budget
    assert regularization_loss(layer) is None
    layer(x[:, :4])
    layer(x[:, 4:])
    expected = 0.5 * (layer.write_gate(x[:, :4]).mean() + layer.write_gate(x[:, 4:]).mean()) / 2
    layer.write_gate._written.pop()  # the two calls just made (for the expectation) are not the layer's
    layer.write_gate._written.pop()
    torch.testing.assert_close(regularization_loss(layer), expected)
    assert regularization_loss(layer) is None  # read once
    layer.eval()
    layer(x)
    assert regularization_loss(layer) is None
    with pytest.raises(ValueError, match="write_gate_penalty=0.1 is set but there is no write gate"):
        _layer("linear", write_gate_penalty=0.1)
    assert attention_tag({"name": "mhla", "write_gate": "relu", "write_gate_penalty": 0.01}) == "mhla-wg_relu0.01"


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_gate_on_the_short_conv_starts_as_the_ungated_layer_and_every_path_gates_alike(name):
    """``write_gate_input=short_conv``: the gate reads the short convolution's q | k | v (the token and the K - 1
    before it). At W = 0 it is the ungated layer; with random W, chunked prefill, decoding and packed sequences
    give the one-pass output (the gate's input continues through the convolution's cache)."""
    plain = _layer(name, short_conv=3)
    gated = _layer(name, "relu", short_conv=3, write_gate_input="short_conv")
    assert gated.write_gate.weight.shape == (2, 2 * (2 * 8 + 8))
    assert gated.settings()["write_gate_input"] == "short_conv"
    x = torch.randn(2, 13, 16)
    torch.testing.assert_close(gated(x), plain(x))
    layer = _random_gate(gated)
    full = layer(x)
    assert not torch.allclose(full, plain(x), atol=1e-3)
    cache = AttentionCache()
    parts = [layer(x[:, :5], cache=cache), layer(x[:, 5:6], cache=cache), layer(x[:, 6:], cache=cache)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    packed = layer(torch.cat([x[:1], x[1:, :7]], dim=1), cu_seqlens=torch.tensor([0, 13, 20]))
    torch.testing.assert_close(packed[:, :13], full[:1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, 13:], layer(x[1:, :7]), atol=1e-5, rtol=1e-5)


def test_the_gate_on_the_short_conv_sees_the_tokens_before():
    """The same token after different neighbours gets different gates on the short conv, the same on the input."""
    for reads, differ in (("input", False), ("short_conv", True)):
        layer = _random_gate(_layer("linear", "relu", short_conv=3, write_gate_input=reads))
        seen = {}
        layer.write_gate.register_forward_hook(lambda m, a, out: seen.__setitem__("g", out))
        x = torch.randn(1, 6, 16)
        y = x.clone()
        y[0, 3] = torch.randn(16)  # token 4 keeps its input, its neighbour changes
        layer(x)
        gx = seen["g"][0, 4]
        layer(y)
        assert (not torch.allclose(gx, seen["g"][0, 4])) is differ, reads


def test_the_gate_input_is_refused_where_it_cannot_read():
    with pytest.raises(ValueError, match="write_gate_input='short_conv' reads the short convolution"):
        _layer("mhla", "relu", write_gate_input="short_conv")
    with pytest.raises(ValueError, match="write_gate_input='short_conv' is set but there is no write gate"):
        _layer("linear", short_conv=3, write_gate_input="short_conv")
    with pytest.raises(ValueError, match="write_gate_input must be one of input, short_conv"):
        _layer("linear", "relu", write_gate_input="ids")
    assert "write_gate_input" not in _layer("linear", "relu").settings()
    assert attention_tag({"name": "mhla", "write_gate": "relu", "write_gate_penalty": 0.01,
                          "write_gate_input": "short_conv"}) == "mhla-wg_relu_sc0.01"
