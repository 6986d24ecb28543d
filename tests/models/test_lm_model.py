"""MHLALM: build, loss, cache parity (logits and greedy tokens) across chunk boundaries and beyond the
training context, save/load through the Auto classes, the release's options, baselines."""

from __future__ import annotations

import pytest
import torch

from models.lm import MHLALMCache, MHLALMConfig, MHLALMForCausalLM
from helpers.lm_configs import lm_config

ATTNS = ["mhla", "linear", "softmax"]


def tiny(attn_type="mhla", **kw):
    cfg = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_heads=2,
               block_size=4, max_position_embeddings=16)
    cfg.update(kw)
    torch.manual_seed(0)
    return MHLALMForCausalLM(lm_config(attn_type, **cfg)).eval()


def _randomize_mixing(model):
    """Random (nonnegative) mixing so that every past chunk matters (the init zeroes some entries)."""
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        if hasattr(layer.attn, "mixing"):
            raw = layer.attn.mixing.raw
            raw.data = torch.rand(raw.shape, generator=g, dtype=raw.dtype)


@pytest.mark.parametrize("attn_type", ATTNS)
def test_forward_loss_and_backward(attn_type):
    model = tiny(attn_type).train()
    x = torch.randint(0, 61, (2, 13))
    out = model(x, labels=x)
    assert out.logits.shape == (2, 13, 61)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 61), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad), "unused parameters"


@pytest.mark.parametrize("attn_type", ATTNS)
def test_bf16_autocast_with_rope_trains(attn_type):
    """Under bf16 autocast (a GPU run's precision=auto) q and k leave the projections in bf16 beside a bf16 v;
    RoPE's fp32 tables must not promote them alone (the op needs one dtype). Close to the fp32 loss."""
    model = tiny(attn_type).train()
    x = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(0))
    ref = model(x, labels=x).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss) and abs(out.loss.item() - ref.item()) < 0.05 * ref.item()


def test_paper_340m_size():
    cfg = MHLALMConfig()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_heads, cfg.vocab_size) == (1024, 24, 4, 32000)
    assert (cfg.head_dim, cfg.head_value_dim, cfg.intermediate_size, cfg.attn["block_size"]) == (128, 256, 2816, 64)
    assert cfg.attn["max_learned_blocks"] == 32 and cfg.tie_word_embeddings
    assert cfg.attn["name"] == "mhla" and cfg.attn["normalize"] is False and cfg.attn["gate"] is True  # its RMSNorm
    def count(layers):  # tied: the embedding is counted once
        cfg.num_hidden_layers = layers
        return sum(p.numel() for p in MHLALMForCausalLM(cfg).parameters())

    one, two = count(1), count(2)
    n = one + 23 * (two - one)
    assert 330e6 < n < 350e6, n  # GLA 340M tied: 341.7M (docs/baselines.md#lm-baselines); the output gate is needed for 340M


@pytest.mark.parametrize("attn_type", ATTNS)
@pytest.mark.parametrize("rope", ["after_feature_map", "before_feature_map", "none"])
def test_cached_logits_equal_full_forward(attn_type, rope):
    """Prefill 7 tokens, then decode one token at a time past max_position_embeddings (16): the logits of
    every step equal those of one full forward over the whole sequence (fp64)."""
    model = tiny(attn_type, rope=rope, cpe=attn_type == "mhla").double()
    _randomize_mixing(model)
    x = torch.randint(0, 61, (2, 29))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = MHLALMCache(model.config)
        steps = [model(x[:, :7], past_key_values=cache, use_cache=True).logits]
        for t in range(7, 29):
            out = model(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            steps.append(out.logits)
    assert cache.get_seq_length() == 29
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("attn_type", ATTNS)
def test_generate_greedy_parity(attn_type):
    """generate() with the cache = without it, over several chunk boundaries and past the context."""
    model = tiny(attn_type, initializer_range=0.2)  # larger weights: a varied continuation
    _randomize_mixing(model)
    x = torch.randint(1, 61, (1, 6))  # no pad id (0) in the prompt: generate() would mask it
    kw = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with_cache = model.generate(x, use_cache=True, **kw)
        without = model.generate(x, use_cache=False, **kw)
    assert with_cache.shape == (1, 36)
    assert torch.equal(with_cache, without)
    assert len(set(with_cache[0, 6:].tolist())) > 3, "degenerate test: a constant continuation"


def test_decoding_uses_earlier_context():
    """The release's cached path ignores earlier chunks (docs/method.md#release-differences); ours must not: changing the first
    token changes the logits of a token decoded 5 chunks later."""
    model = tiny("mhla").double()
    _randomize_mixing(model)
    x = torch.randint(1, 61, (1, 24))
    y = x.clone()
    y[0, 0] = 0
    outs = []
    with torch.no_grad():
        for seq in (x, y):
            cache = MHLALMCache(model.config)
            model(seq[:, :23], past_key_values=cache, use_cache=True)
            outs.append(model(seq[:, 23:], past_key_values=cache, use_cache=True).logits)
    assert (outs[0] - outs[1]).abs().max() > 1e-6


def test_save_load_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tiny("mhla", mixing_init="uniform", output_gate=True)
    _randomize_mixing(model)
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "mhla_lm"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MHLALMForCausalLM)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr(), "embeddings untied"
    x = torch.randint(0, 61, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_mixing_init_options():
    loc = tiny("mhla", mixing_init="locality", mixing_param="clamp").model.layers[0].attn.mixing(4)
    uni = tiny("mhla").model.layers[0].attn.mixing(4)  # the LM default (results/mqar/)
    torch.testing.assert_close(uni[3], torch.full((4,), 0.25))  # release: 1/(i+1) over past chunks
    assert loc[3, 0] == 0 and loc[3, 3] > loc[3, 2] > loc[3, 1]  # paper: locality, nearest chunks weigh most
    torch.testing.assert_close(loc.sum(-1), torch.ones(4, dtype=loc.dtype))


def test_no_length_cap():
    """A sequence 4x the training context runs without a cache too (mixing extends by distance)."""
    model = tiny("mhla", max_position_embeddings=8)
    with torch.no_grad():
        assert model(torch.randint(0, 61, (1, 64)), use_cache=False).logits.shape == (1, 64, 61)


def test_bad_config():
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        MHLALMConfig(attn="flash")
    with pytest.raises(ValueError, match="rope"):
        MHLALMConfig(attn={"name": "mhla", "rope": "sometimes"})
    with pytest.raises(ValueError, match="no causal form"):
        MHLALMConfig(attn="focused")
    with pytest.raises(ValueError, match="options of the attention"):
        MHLALMConfig(mixing_init="locality")  # the flat field of the old config: refused, not ignored
    with pytest.raises(ValueError, match="does not take"):
        MHLALMConfig(attn={"name": "softmax", "mixing_init": "locality"})


def test_config_saved_before_the_attention_dict_loads_as_it_was(tmp_path):
    """A checkpoint saved by the code before ``attn`` was one dict (``attn_type`` + flat fields; made with
    mixing_init=locality, cpe=true, 40 tokens past its 16-token context) loads through the one legacy mapping
    and gives the logits it gave then, to float32 rounding: the stored logits were computed on another CPU,
    whose matmul kernels round differently (measured: at most 3e-6 on logits up to 3.9), while a wrong mapping
    (no CPE, another rope or feature map) moves them by orders of magnitude more. Saved again in today's schema
    and reloaded on this machine, it gives bit-identical logits."""
    import os  # noqa: PLC0415

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "lm_mhla_legacy_config")
    model = MHLALMForCausalLM.from_pretrained(path).eval()
    assert model.config.attn["mixing_init"] == "locality" and model.config.attn["cpe"] is True
    expected = torch.load(os.path.join(path, "expected_logits.pt"))
    with torch.no_grad():
        logits = model(expected["input_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    again = MHLALMForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.attn == model.config.attn
    with torch.no_grad():
        assert torch.equal(again(expected["input_ids"], use_cache=False).logits, logits)


def test_padding_mask_leaves_the_real_tokens_unchanged():
    """A left-padded row gives the logits of its real tokens alone (tests/models/test_lm_padding.py covers the
    rest)."""
    model = tiny("mhla").double()
    x = torch.randint(0, 61, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 0] = 0
    padded = model(x, attention_mask=mask).logits
    alone = model(x[:1, 1:]).logits
    torch.testing.assert_close(padded[0, 1:], alone[0], rtol=1e-10, atol=1e-10)


def test_logits_to_keep_bool_mask_selects_positions():
    """A [B, T] bool mask gives the logits at its True positions (MQAR's query positions), through forward."""
    model = tiny("mhla")
    x = torch.randint(0, 61, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, [3, 7]] = True
    mask[1, 11] = True
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        kept = model(x, use_cache=False, logits_to_keep=mask).logits
    assert kept.shape == (3, 61)
    torch.testing.assert_close(kept, full[mask])


@pytest.mark.parametrize("attn_type", ATTNS)
def test_short_conv_is_causal_and_mixes_the_previous_tokens(attn_type):
    """attn.short_conv=K: token t's q, k, v see tokens t-K+1..t (a later token changes nothing before it; the
    token K positions back does not reach t through the conv, only through attention)."""
    model = tiny(attn_type, short_conv=4).train()
    conv = model.model.layers[0].attn.short_conv
    assert conv.kernel_size == (4,) and conv.groups == conv.in_channels == 2 * (8 + 8 + 16)  # q|k|v of 2 heads
    x = torch.randint(0, 61, (2, 13))
    x2 = x.clone()
    x2[:, 9] = (x2[:, 9] + 1) % 61
    with torch.no_grad():
        a, b = model(x, use_cache=False).logits, model(x2, use_cache=False).logits
    assert torch.equal(a[:, :9], b[:, :9]) and not torch.allclose(a[:, 9:], b[:, 9:])
    # the conv alone on q, k, v: an impulse at t reaches t..t+3 only
    layer = model.model.layers[0].attn
    q = torch.zeros(1, 8, 2, 8)  # [B, T, H, D]: key dim 0.5 x 32 over 2 heads
    q[0, 2] = 1.0
    qo, ko, vo = layer._apply_short_conv(q, q.clone(), torch.zeros(1, 8, 2, 16))
    reached = qo.abs().sum(dim=(0, 2, 3)) > 0
    assert reached.tolist() == [False, False, True, True, True, True, False, False]
    out = model(x, labels=x)
    out.loss.backward()
    assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("attn_type", ATTNS)
def test_short_conv_decodes(attn_type):
    """With attn.short_conv the cache keeps the conv's last K-1 inputs: model(x) with the default
    use_cache=True works, a prefill then one token at a time (and a chunked prefill) gives the logits of one
    full forward (fp64), and generate() with the cache gives the tokens of generate() without it."""
    model = tiny(attn_type, short_conv=4).double()
    _randomize_mixing(model)
    x = torch.randint(0, 61, (2, 29))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        torch.testing.assert_close(model(x).logits, full, rtol=1e-12, atol=1e-12)  # the LM's default: a cache
        cache = MHLALMCache(model.config)
        steps = [model(x[:, :7], past_key_values=cache, use_cache=True).logits]
        steps.append(model(x[:, 7:9], past_key_values=cache, use_cache=True).logits)  # a 2-token chunk
        for t in range(9, 29):
            steps.append(model(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)
    past = cache.layer_state(0).short_conv
    assert past.shape == (2, 3, 2 * (8 + 8 + 16)) and cache.nbytes() > past.numel() * 8
    gen = tiny(attn_type, short_conv=4, initializer_range=0.2)
    _randomize_mixing(gen)
    prompt = torch.randint(1, 61, (1, 6))
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with_cache = gen.generate(prompt, use_cache=True, **kw)
        assert torch.equal(with_cache, gen.generate(prompt, use_cache=False, **kw))


def test_short_conv_kernel_must_be_nonnegative():
    with pytest.raises(ValueError, match="short_conv"):
        MHLALMForCausalLM(MHLALMConfig(attn={"name": "mhla", "short_conv": -1}))
