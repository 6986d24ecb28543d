"""MHLALM with padding masks and packed documents: padded tokens change nothing (the logits of the real tokens
equal those of each sequence alone, fp64), batched greedy / beam generate() over left-padded prompts gives the
tokens of one prompt at a time, and with ``cu_seqlens`` (``data.reset_at_doc_boundary``) a packed document's
outputs equal those of the document alone. For MHLA, linear and softmax attention."""

from __future__ import annotations

import pytest
import torch

from models.lm import MHLALMCache, MHLALMForCausalLM
from helpers.lm_configs import lm_config
from tasks.language.data import doc_cu_seqlens, packed_forward_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")

ATTNS = ["mhla", "linear", "softmax"]
VOCAB, EOS, PAD = 61, 2, 0


def tiny(attn_type="mhla", **kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2,
               block_size=4, max_position_embeddings=16, eos_token_id=None, pad_token_id=PAD)
    cfg.update(kw)
    torch.manual_seed(0)
    model = MHLALMForCausalLM(lm_config(attn_type, **cfg)).eval()
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:  # random nonnegative mixing: every past chunk matters
        if hasattr(layer.attn, "mixing"):
            layer.attn.mixing.raw.data = torch.rand(layer.attn.mixing.raw.shape, generator=g)
    return model


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]  # no PAD / EOS inside


def pad(seqs, side):
    """``[B, T]`` ids and mask, padded with PAD on ``side``."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


LENGTHS = [7, 1, 10, 4]  # 10 > 2 chunks of 4; 1 token; a chunk multiple


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("attn_type,extra", [("mhla", {"cpe": True}), ("mhla", {"normalize": True, "rope": "none"}),
                                             ("linear", {}), ("softmax", {})])
def test_padded_logits_equal_each_sequence_alone(attn_type, extra, side):
    model = tiny(attn_type, **extra).double()
    seqs = prompts(LENGTHS)
    ids, mask = pad(seqs, side)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False).logits
        for i, s in enumerate(seqs):
            alone = model(s[None], use_cache=False).logits[0]
            torch.testing.assert_close(out[i][mask[i].bool()], alone, rtol=1e-10, atol=1e-10)
            assert torch.all(out[i][~mask[i].bool()] == 0)  # pad positions: zeros


@pytest.mark.parametrize("attn_type", ATTNS)
def test_padded_prefill_then_decode_equals_alone(attn_type):
    """Prefill left-padded prompts into a cache, then feed tokens one at a time with the growing mask (as
    generate() does): every step's logits equal a full forward over each sequence alone."""
    model = tiny(attn_type, cpe=attn_type == "mhla").double()
    seqs = prompts(LENGTHS, seed=1)
    ids, mask = pad(seqs, "left")
    more = torch.randint(3, VOCAB, (len(seqs), 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = MHLALMCache(model.config)
        steps = [model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1:]]
        for t in range(more.shape[1]):
            mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=torch.long)], dim=1)
            steps.append(model(more[:, t:t + 1], attention_mask=mask, past_key_values=cache, use_cache=True).logits)
        steps = torch.cat(steps, dim=1)
        assert cache.get_seq_length() == ids.shape[1] + more.shape[1]
        for i, s in enumerate(seqs):
            alone = model(torch.cat([s, more[i]])[None], use_cache=False).logits[0, len(s) - 1:]
            torch.testing.assert_close(steps[i], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attn_type", ATTNS)
@pytest.mark.parametrize("num_beams", [1, 2])
def test_batched_generate_left_padding_equals_one_prompt_at_a_time(attn_type, num_beams):
    """generate() over left-padded prompts of different lengths gives exactly the tokens of one prompt at a
    time (greedy; and beam search, which reorders and repeats the per-sequence cache)."""
    model = tiny(attn_type, initializer_range=0.2, cpe=attn_type == "mhla")
    seqs = prompts([6, 2, 9], seed=3)
    ids, mask = pad(seqs, "left")
    kw = dict(max_new_tokens=10, do_sample=False, num_beams=num_beams, pad_token_id=PAD)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1]:]
        if num_beams == 1:  # without the cache: every step a padded forward over the whole sequences
            assert torch.equal(model.generate(ids, attention_mask=mask, use_cache=False, **kw)[:, ids.shape[1]:],
                               batched)
        for i, s in enumerate(seqs):
            alone = model.generate(s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long), **kw)
            assert torch.equal(batched[i], alone[0, len(s):]), (i, batched[i].tolist(), alone[0, len(s):].tolist())
    assert len(set(batched.flatten().tolist())) > 5, "degenerate test: near-constant continuations"


@pytest.mark.parametrize("attn_type", ATTNS)
def test_short_conv_padded_and_packed_calls_equal_each_sequence_alone(attn_type):
    """attn.short_conv (the conv keeps its last K-1 inputs per sequence): a padded batch (prefill, then
    decoding with the growing mask) and packed documents give the logits of each sequence alone, and batched
    generate() over left-padded prompts the tokens of one prompt at a time."""
    model = tiny(attn_type, short_conv=4).double()
    seqs = prompts(LENGTHS, seed=7)
    ids, mask = pad(seqs, "left")
    more = torch.randint(3, VOCAB, (len(seqs), 5), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False).logits
        cache = MHLALMCache(model.config)
        steps = [model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1:]]
        for t in range(more.shape[1]):
            mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=torch.long)], dim=1)
            out_t = model(more[:, t:t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            steps.append(out_t.logits)
        steps = torch.cat(steps, dim=1)
        for i, s in enumerate(seqs):
            alone = model(torch.cat([s, more[i]])[None], use_cache=False).logits[0]
            torch.testing.assert_close(out[i, ids.shape[1] - len(s):], alone[:len(s)], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(steps[i], alone[len(s) - 1:], rtol=1e-10, atol=1e-10)
        d1, d2, d3 = prompts([6, 9, 11], seed=9)
        rows = packed_rows([d1, d2, d3], 18)
        reset = model(rows, cu_seqlens=doc_cu_seqlens(rows, EOS), use_cache=False).logits
        doc2 = torch.cat([d2, torch.tensor([EOS])])
        start = len(d1) + 1
        alone = model(doc2[None], use_cache=False).logits[0]
        torch.testing.assert_close(reset[0, start:start + len(doc2)], alone, rtol=1e-10, atol=1e-10)
    gen = tiny(attn_type, short_conv=4, initializer_range=0.2)
    seqs = prompts([6, 2, 9], seed=3)
    ids, mask = pad(seqs, "left")
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        batched = gen.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1]:]
        for i, s in enumerate(seqs):
            alone = gen.generate(s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long), **kw)
            assert torch.equal(batched[i], alone[0, len(s):])


def packed_rows(docs, T):
    """Documents joined by EOS, cut into rows of ``T`` tokens: ``[B, T]``."""
    flat = torch.cat([torch.cat([d, torch.tensor([EOS])]) for d in docs])
    B = len(flat) // T
    return flat[:B * T].view(B, T)


def test_doc_cu_seqlens():
    ids = torch.tensor([[5, EOS, 6, 7, EOS], [8, 9, EOS, 3, 4]])
    assert doc_cu_seqlens(ids, EOS).tolist() == [0, 2, 5, 8, 10]  # row 0 ends with EOS: next doc = row 1
    assert doc_cu_seqlens(ids, EOS).dtype == torch.int32
    assert packed_forward_kwargs({"reset_at_doc_boundary": False}, ids, EOS) == {}
    assert packed_forward_kwargs({}, ids, EOS) == {}  # default: the paper's recipe, no reset
    assert torch.equal(packed_forward_kwargs({"reset_at_doc_boundary": True}, ids, EOS)["cu_seqlens"],
                       doc_cu_seqlens(ids, EOS))


@pytest.mark.parametrize("attn_type", ATTNS)
def test_packed_document_equals_document_alone(attn_type):
    """With cu_seqlens from the EOS separators, the second document of a packed row has the logits of the
    document alone (states reset, chunks and RoPE positions restart); without them it reads the first."""
    model = tiny(attn_type, cpe=attn_type == "mhla").double()
    d1, d2, d3, d4 = prompts([6, 9, 11, 8], seed=4)
    ids = packed_rows([d1, d2, d3, d4], 18)  # row 0: d1 EOS d2 EOS d3[:1]; row 1: d3[1:] EOS d4[:7]
    start = len(d1) + 1
    doc2 = torch.cat([d2, torch.tensor([EOS])])
    with torch.no_grad():
        alone = model(doc2[None], use_cache=False).logits[0]
        reset = model(ids, cu_seqlens=doc_cu_seqlens(ids, EOS), use_cache=False).logits
        carried = model(ids, use_cache=False).logits
    torch.testing.assert_close(reset[0, start:start + len(doc2)], alone, rtol=1e-10, atol=1e-10)
    assert (carried[0, start:start + len(doc2)] - alone).abs().max() > 1e-3
    with torch.no_grad():  # a row start is a boundary too: row 1 opens with the rest of d3 and its EOS
        torch.testing.assert_close(reset[1, :11], model(ids[1:, :11], use_cache=False).logits[0],
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attn_type", ATTNS)
def test_packed_training_step(attn_type):
    """A training step on a packed batch with cu_seqlens: a finite loss, a finite gradient for every parameter."""
    model = tiny(attn_type).train()
    ids = packed_rows(prompts([5, 12, 3, 9, 7], seed=5), 12)
    out = model(ids, labels=ids, cu_seqlens=doc_cu_seqlens(ids, EOS), use_cache=False)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_bad_padding_and_packing_inputs():
    model = tiny("mhla")
    ids, mask = pad(prompts([3, 5]), "left")
    with pytest.raises(ValueError, match="either a padding attention_mask or cu_seqlens"):
        model(ids, attention_mask=mask, cu_seqlens=torch.tensor([0, 5, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="row start"):
        model(ids, cu_seqlens=torch.tensor([0, 7, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"attention_mask .* must be"):
        model(ids, attention_mask=mask[:, :3])
    cache = MHLALMCache(model.config)
    full = torch.ones_like(mask)
    model(ids, attention_mask=full, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="padding in the past tokens"):
        model(ids[:, :1], attention_mask=torch.cat([mask, full[:, :1]], 1), past_key_values=cache, use_cache=True)


def test_padded_call_continues_a_cache_filled_without_padding():
    """A padded chunk after an unpadded prefill (the batched cache is split into per-sequence states)."""
    model = tiny("mhla", cpe=True).double()
    x = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = MHLALMCache(model.config)
        model(x[:, :5], past_key_values=cache, use_cache=True)
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 7:] = 0  # row 1: right padding in the new chunk
        out = model(x[:, 5:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
        full0 = model(x[:1], use_cache=False).logits[0, 5:]
        full1 = model(x[1:, :7], use_cache=False).logits[0, 5:]
    torch.testing.assert_close(out[0], full0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1, :2], full1, rtol=1e-10, atol=1e-10)
