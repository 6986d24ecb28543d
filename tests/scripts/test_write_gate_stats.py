"""scripts/write_gate_stats.py: the parts of a passkey example it reads the gates of, and its statistics on a
model whose gates are known (closed on every token but the needle's digits, or open everywhere)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.lm_configs import lm_config
from mhla.layers import WriteGate
from models.lm import MHLALMForCausalLM
from scripts.write_gate_stats import MILLION, gate_stats, part_masks
from tasks.language.long_context import passkey_batch


class Fmt:
    """A passkey format without a tokenizer: ids 0-9 are the digits, the filler uses 20-59."""
    prefix, suffix, question = np.array([10, 11]), np.array([12]), np.array([13, 14, 15])
    digit_ids, digits = np.arange(10), 5
    needle_len = 2 + 5 + 1
    tail_len = 3 + 5

    def min_length(self):
        return self.needle_len + self.tail_len + 1


def _model(seed=0):
    torch.manual_seed(seed)
    return MHLALMForCausalLM(lm_config("mhla", vocab_size=61, hidden_size=32, num_hidden_layers=2, num_heads=2,
                                       block_size=4, max_position_embeddings=64, write_gate="relu")).eval()


def test_the_parts_of_an_example_cover_it_once():
    fmt, L = Fmt(), 48
    batch = passkey_batch(np.arange(20, 60), fmt, L, [0.0, 0.5, 1.0], np.random.default_rng(0))
    m = part_masks(batch, fmt, L)
    x = batch["input_ids"]
    assert torch.all(x[m["digits"]] < 10) and torch.all(x[m["filler"]] >= 20)
    assert torch.all(m["digits"] <= m["needle"])
    answer = torch.zeros_like(m["filler"])
    answer[:, L - fmt.digits:] = True
    cover = m["filler"].int() + m["needle"].int() + m["question"].int() + answer.int()
    assert torch.all(cover == 1)
    assert m["needle"].sum(1).tolist() == [fmt.needle_len] * 3 and m["question"].sum(1).tolist() == [3] * 3


@pytest.mark.parametrize("selective", [True, False])
def test_gate_stats_reads_the_gates_the_model_writes_with(selective):
    """A gate open on the digit tokens alone (through their embedding's first channel) reads 100% closed filler and
    no filler mass; the start (g = 1 everywhere) reads none closed and a mass of a million over the needle's size."""
    fmt, model = Fmt(), _model()
    if selective:
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb[:, 0] = -1.0
            emb[:10, 0] = 1.0
            for layer in model.model.layers:  # the gate reads the normed input: make channel 0 decide
                layer.attn.write_gate.weight.zero_()
                layer.attn.write_gate.weight[:, 0] = 50.0
                layer.attn.write_gate.bias.zero_()
    rows = gate_stats(model, np.arange(20, 60), fmt, 48, [0.0, 1.0], examples=2)
    assert [r["layer"] for r in rows] == [n for n, m in model.named_modules() if isinstance(m, WriteGate)]
    first = rows[0]
    if selective:
        assert first["filler_zero"] == 1.0 and first["filler"] == 0.0 and first["filler_mass_1m"] == 0.0
        assert first["digits"] > 1.0 and first["needle"] < first["digits"]
    else:
        assert first["filler_zero"] == 0.0
        for part in ("filler", "needle", "digits", "question"):
            assert first[part] == pytest.approx(1.0)
        assert first["filler_mass_1m"] == pytest.approx(MILLION / fmt.needle_len)


def test_a_layer_that_writes_nothing_has_no_mass_ratio():
    fmt, model = Fmt(), _model()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.write_gate.bias.fill_(-1.0)  # W = 0: every gate relu(-1) = 0
    rows = gate_stats(model, np.arange(20, 60), fmt, 48, [0.5], examples=2)
    assert all(r["filler_zero"] == 1.0 and r["filler_mass_1m"] is None for r in rows)


def test_digit_gates_follow_the_needles_digits():
    """A first-layer gate open on the token "7" alone (as above, through channel 0 of the embedding): the gate on
    the needle's i-th digit is that token's gate times the share of examples whose i-th digit is 7, so the per-digit
    gates read the digits at their positions, not their neighbours."""
    fmt, model = Fmt(), _model()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = -1.0
        emb[7, 0] = 1.0
        gate = model.model.layers[0].attn.write_gate
        gate.weight.zero_()
        gate.weight[:, 0] = 50.0
        gate.bias.zero_()
    filler, depths, examples = np.arange(20, 60), [0.0, 1.0], 20
    rows = gate_stats(model, filler, fmt, 48, depths, examples=examples)
    rng = np.random.default_rng([0, 48])  # the examples gate_stats drew
    answers = torch.cat([passkey_batch(filler, fmt, 48, [d] * examples, rng)["answer"] for d in depths])
    share = (answers == 7).float().mean(0)  # [P]
    first = rows[0]
    gates = torch.tensor(first["digit_gates"])
    assert len(gates) == fmt.digits == len(first["digit_gates_min_head"])
    assert 0 < share.min() < share.max()  # the examples tell the positions apart
    assert gates.tolist() == pytest.approx((gates.max() / share.max() * share).tolist(), rel=1e-5)
    assert first["digit_gates_min_head"] == pytest.approx(first["digit_gates"])  # both heads share the weights


class _Oracle(torch.nn.Module):
    """A 'model' with a write gate whose logits at position t name the token at t + 1 (it sees the future), except
    where they predict the ``wrong`` positions (counted from the end, 1 = the last token): there they name the next
    digit instead."""

    def __init__(self, vocab: int, wrong=()):
        super().__init__()
        self.gate, self.vocab, self.wrong = WriteGate(4, 1, "relu"), vocab, tuple(wrong)

    def forward(self, input_ids):
        self.gate(torch.zeros(*input_ids.shape, 4))
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], 1)
        for w in self.wrong:
            nxt[:, -w - 1] = (nxt[:, -w - 1] + 1) % 10
        return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, self.vocab).float()})()


@pytest.mark.parametrize("wrong, expect", [((), [1.0] * 5), ((3,), [1.0, 1.0, 0.0, 1.0, 1.0])])
def test_answer_accuracy_is_read_per_digit(wrong, expect):
    """The accuracy of answer digit i is read at the position that predicts it: an oracle off on the answer's third
    digit alone (position L - 3, predicted at L - 4) scores 0 there and 1 on the others."""
    acc: list = []
    gate_stats(_Oracle(61, wrong), np.arange(20, 60), Fmt(), 48, [0.0, 0.5], examples=2, answer_acc=acc)
    assert acc == expect


@pytest.mark.parametrize("selective", [True, False])
def test_the_filler_splits_into_its_numbers_and_its_words(selective):
    """Ids 20-29 play the filler's numbers. A gate open on them alone puts every write of the filler on the numbers
    (share 100%, the words' gate 0); the start (g = 1 everywhere) writes both alike, so the numbers' share of the
    writes is their share of the tokens."""
    fmt, model = Fmt(), _model()
    if selective:
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb[:, 0] = -1.0
            emb[20:30, 0] = 1.0
            gate = model.model.layers[0].attn.write_gate
            gate.weight.zero_()
            gate.weight[:, 0] = 50.0
            gate.bias.zero_()
    rows = gate_stats(model, np.arange(20, 60), fmt, 48, [0.0, 1.0], examples=2, numbers=np.arange(20, 30))
    first = rows[0]
    assert 0 < first["numbers_in_filler"] < 1
    if selective:
        assert first["filler_numbers"] > 1.0 and first["filler_words"] == 0.0 and first["numbers_share"] == 1.0
    else:
        assert first["filler_numbers"] == pytest.approx(1.0) and first["filler_words"] == pytest.approx(1.0)
        assert first["numbers_share"] == pytest.approx(first["numbers_in_filler"])
    plain = gate_stats(model, np.arange(20, 60), fmt, 48, [0.0, 1.0], examples=2)[0]
    assert "filler_numbers" not in plain and plain["filler"] == first["filler"]  # the split leaves the rest as it was
