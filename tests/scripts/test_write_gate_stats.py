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
