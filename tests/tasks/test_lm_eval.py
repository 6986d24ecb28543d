"""Perplexity metrics, rolling windows and the lm-evaluation-harness adapter on hand-made examples.

A tiny randomly initialised causal LM (``transformers.LlamaForCausalLM``, no download, and our
``MHLALMForCausalLM`` when it is importable) with a byte-level tokenizer; every log-likelihood the code returns
is compared with one computed directly from a single forward pass.
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

import torch.nn.functional as F
from helpers.lm_configs import lm_config

from tasks.language import eval_ppl
from tasks.language.eval_ppl import (
    EvalSettings,
    count_words,
    encode_pair,
    evaluate_documents,
    evaluate_lambada,
    evaluate_wikitext,
    lambada_split,
    perplexity_metrics,
    rolling_windows,
    split_wikitext_pages,
    wikitext_detokenize,
)
from tasks.language.lm_eval_adapter import MHLAEvalLM, cut_at_stop


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258; 0 = pad, 1 = BOS, 2 = EOS (a stand-in with the HF tokenizer methods used)."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259
    name_or_path = "byte"

    def encode(self, text, add_special_tokens=False):
        return ([self.bos_token_id] if add_special_tokens else []) + [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) - 3 for i in ids if int(i) >= 3).decode("utf-8", errors="replace")

    def __call__(self, text, **kw):
        return SimpleNamespace(input_ids=self.encode(text))


def tiny_llama(max_pos: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_pos,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def tiny_models():
    models = [("llama", tiny_llama())]
    try:
        from models.lm import MHLALMForCausalLM
    except ImportError:
        return models
    for attn in ("mhla", "linear"):
        torch.manual_seed(0)
        cfg = lm_config(attn, vocab_size=259, hidden_size=32, num_hidden_layers=2, num_heads=2,
                           block_size=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
        models.append((attn, MHLALMForCausalLM(cfg).eval()))
    return models


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from one forward pass: [len(ids) - 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = F.log_softmax(logits[:-1], dim=-1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


# ------------------------------------------------------------------------------------------ metrics


def test_perplexity_definitions_on_hand_numbers():
    # two documents, total log-likelihood -6 nats; 3 tokens, 2 words, 4 bytes in all
    m = perplexity_metrics([-2.0, -4.0], [1, 2], [1, 1], [1, 3])
    assert m["token_perplexity"] == pytest.approx(math.exp(6 / 3))
    assert m["word_perplexity"] == pytest.approx(math.exp(6 / 2))
    assert m["byte_perplexity"] == pytest.approx(math.exp(6 / 4))
    assert m["bits_per_byte"] == pytest.approx(6 / 4 / math.log(2))
    assert m["bits_per_byte"] == pytest.approx(math.log2(m["byte_perplexity"]))


def test_word_and_byte_counts_follow_lm_eval():
    assert count_words("a b  c") == 3
    assert count_words(" a b\n") == 4            # re.split keeps empty ends, as lm-eval counts them
    assert eval_ppl.count_bytes("h\u00e9") == 3    # UTF-8 bytes, not characters


def test_wikitext_detokenizer_and_pages():
    assert wikitext_detokenize("1 @,@ 000 km , the ( big ) dog 's toy @-@ box .") == "1,000 km, the (big) dog's toy-box ."
    assert wikitext_detokenize(" = = Section = = \n") == " == Section ==\n"
    raw = " = A = \n\n text one \n = = Sub = = \n more \n = B = \n\n text two \n"
    pages = split_wikitext_pages(raw)
    assert len(pages) == 2 and pages[0].startswith(" = A = ") and "Sub" in pages[0]
    assert pages[1].startswith(" = B = ") and "text two" in pages[1]


def test_lambada_split_and_pair_encoding():
    assert lambada_split("the cat sat on the mat") == ("the cat sat on the", " mat")
    tok = ByteTokenizer()
    ctx, cont = encode_pair(tok, "hello ", "world")    # trailing space moves to the continuation
    assert tok.decode(ctx) == "hello" and tok.decode(cont) == " world"


@pytest.mark.parametrize("n,max_len,context_len", [(1, 4, 1), (10, 4, 1), (10, 4, 3), (9, 3, 3), (4, 4, 1)])
def test_rolling_windows_cover_every_token_once(n, max_len, context_len):
    toks = list(range(10, 10 + n))
    wins = rolling_windows(toks, 1, max_len, context_len)
    assert [t for _, cont in wins for t in cont] == toks
    assert wins[0][0] == [1]
    for ctx, cont in wins:
        assert len(ctx) + len(cont) <= max_len + 1 and cont
        full = ctx + cont
        if ctx != [1]:  # later windows: context is exactly the tokens right before the continuation
            i = toks.index(cont[0])
            assert ctx == toks[i - len(ctx):i]
            assert len(full) == max_len + 1 or i - len(ctx) == 0
    if context_len == 1 and n > max_len:  # disjoint chunks: window k predicts tokens [k*L, (k+1)*L)
        assert [len(c) for _, c in wins[:-1]] == [max_len] * (len(wins) - 1)


# -------------------------------------------------------------------------- scores vs direct log-probs


@pytest.mark.parametrize("name,model", tiny_models())
def test_loglikelihood_equals_sum_of_token_logprobs(name, model):
    tok = ByteTokenizer()
    lm = MHLAEvalLM(model=model, tokenizer=tok, batch_size=3, device="cpu")
    reqs = [SimpleNamespace(args=("The quick brown", " fox")), SimpleNamespace(args=("ab", "c")),
            SimpleNamespace(args=("", "xyz")), SimpleNamespace(args=("Longer context here.", " And more"))]
    out = lm.loglikelihood(reqs)
    for req, (ll, greedy) in zip(reqs, out):
        ctx, cont = req.args
        ctx_ids = tok.encode(ctx) if ctx else [tok.bos_token_id]   # empty context: the prefix token (BOS)
        ids = ctx_ids + tok.encode(cont)
        lp = direct_logprobs(model, ids)[-len(tok.encode(cont)):]
        assert ll == pytest.approx(lp.sum().item(), abs=1e-4), name
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1][-len(tok.encode(cont)):]
        assert greedy == bool((logits.argmax(-1) == torch.tensor(tok.encode(cont))).all())


def test_is_greedy_true_for_the_models_own_argmax():
    model, tok = tiny_llama(), ByteTokenizer()
    lm = MHLAEvalLM(model=model, tokenizer=tok, device="cpu")
    ids = tok.encode("Hi")
    for _ in range(3):   # build the argmax continuation token by token
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    ctx, cont = ids[:2], ids[2:]
    pairs = eval_ppl.score_continuations(model, [(ctx, cont), (ctx, cont[:-1] + [(cont[-1] + 1) % 259])],
                                         max_len=64)
    assert pairs[0][1] is True and pairs[1][1] is False
    assert pairs[0][2] == 3


@pytest.mark.parametrize("name,model", tiny_models())
def test_rolling_loglikelihood_matches_direct_chunks(name, model):
    tok = ByteTokenizer()
    text = "A sentence that is longer than the tiny context of sixteen tokens."
    lm = MHLAEvalLM(model=model, tokenizer=tok, max_length=16, device="cpu")
    (ll,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    ids = tok.encode(text)
    expected = direct_logprobs(model, [tok.bos_token_id] + ids[:16]).sum().item()   # first chunk: BOS prefix
    for start in range(16, len(ids), 16):                                          # disjoint later chunks
        window = ids[max(0, min(start + 16, len(ids)) - 17):min(start + 16, len(ids))]
        n = min(start + 16, len(ids)) - start
        expected += direct_logprobs(model, window)[-n:].sum().item()
    assert ll == pytest.approx(expected, abs=1e-3), name
    # a sliding window scores the same tokens with more context: a different (finite) number
    res = eval_ppl.rolling_loglikelihood(model, [ids], prefix_token=2, max_len=16, context_len=8)
    assert res[0][1] == len(ids) and math.isfinite(res[0][0])


def test_generate_until_is_greedy_and_stops():
    model, tok = tiny_llama(), ByteTokenizer()
    lm = MHLAEvalLM(model=model, tokenizer=tok, device="cpu")
    ids = tok.encode("Q: ")
    expected = []
    for _ in range(6):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids + expected])).logits[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        expected.append(nxt)
    full = tok.decode(expected)
    (out,) = lm.generate_until([SimpleNamespace(args=("Q: ", {"until": [], "max_gen_toks": 6}))])
    assert out == full
    if len(full) > 2:
        (cut,) = lm.generate_until([SimpleNamespace(args=("Q: ", {"until": [full[2]], "max_gen_toks": 6}))])
        assert cut == full[:full.index(full[2])]
    assert cut_at_stop("abc\n\nQ:", ["\n\n", "Q:"]) == "abc"


def test_create_from_arg_string(tmp_path, monkeypatch):
    import transformers

    model = tiny_llama()
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(lambda cls, p: ByteTokenizer()))
    lm = MHLAEvalLM.create_from_arg_string(f"pretrained={tmp_path / 'm'},batch_size=2,max_length=32",
                                           {"device": "cpu", "batch_size": None})
    assert lm.batch_size == 2 and lm.max_length == 32 and lm.device.type == "cpu"
    req = [SimpleNamespace(args=("ab", "cd"))]
    direct = MHLAEvalLM(model=model, tokenizer=ByteTokenizer(), device="cpu").loglikelihood(req)[0][0]
    assert lm.loglikelihood(req)[0][0] == pytest.approx(direct, abs=1e-5)
    with pytest.raises(ValueError, match="pretrained"):
        MHLAEvalLM.create_from_arg_string("")


# --------------------------------------------------------------------------- local-file evaluators


def test_wikitext_and_lambada_files_end_to_end(tmp_path):
    model, tok = tiny_llama(), ByteTokenizer()
    raw = " = Alpha = \n\n The cat sat on the mat . \n = Beta = \n\n Dogs bark @-@ loudly , often . \n"
    (tmp_path / "wiki.test.raw").write_text(raw)
    w = evaluate_wikitext(model, tok, str(tmp_path / "wiki.test.raw"), EvalSettings(max_len=16))
    pages = split_wikitext_pages(raw)
    lls = [eval_ppl.rolling_loglikelihood(model, [tok.encode(wikitext_detokenize(p))], prefix_token=1,
                                          max_len=16)[0][0] for p in pages]
    n_words = sum(len(re.split(r"\s+", p)) for p in pages)
    assert w["docs"] == 2 and w["words"] == n_words
    assert w["word_perplexity"] == pytest.approx(math.exp(-sum(lls) / n_words), rel=1e-5)
    with open(tmp_path / "lambada.jsonl", "w") as f:
        for t in ("one two three", "the end of the story"):
            f.write(json.dumps({"text": t}) + "\n")
    lam = evaluate_lambada(model, tok, str(tmp_path / "lambada.jsonl"), EvalSettings(max_len=64))
    direct = [direct_logprobs(model, tok.encode(c) + tok.encode(t))[-len(tok.encode(t)):].sum().item()
              for c, t in (("one two", " three"), ("the end of the", " story"))]
    assert lam["ppl"] == pytest.approx(math.exp(-sum(direct) / 2), rel=1e-5)
    assert 0.0 <= lam["acc"] <= 1.0 and lam["docs"] == 2
    d = evaluate_documents(model, tok, ["abc def"], EvalSettings(max_len=8))
    assert d["tokens"] == 7 and d["words"] == 2
    with pytest.raises(FileNotFoundError, match="wikitext.smerity.com"):
        evaluate_wikitext(model, tok, str(tmp_path / "missing.raw"))


# ------------------------------------------------------------------------------ evaluate.py loading


def _word_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<unk>", "the", "cat", "sat", "on", "mat", "dogs", "bark", "."]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(path)
    return tok


def test_evaluate_loads_hf_folders_and_trainer_checkpoints(tmp_path):
    pytest.importorskip("models.lm")
    from omegaconf import OmegaConf

    from tasks.language import evaluate
    from tasks.language.task import build_lm

    tok = _word_tokenizer(tmp_path / "tok")
    model_cfg = {"kind": "lm", "arch": "mhla_lm", "hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2,
                 "max_position_embeddings": 16}
    attn = {"name": "mhla", "block_size": 4}
    torch.manual_seed(0)
    model = build_lm(OmegaConf.create(model_cfg), attn, 10).eval()
    # a Trainer checkpoint (weights + the run's config) and an EMA variant
    ckpt = {"model": model.state_dict(), "ema": None,
            "config": {"model": model_cfg, "attn": attn, "data": {"tokenizer": str(tmp_path / "tok")}}}
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save(ckpt, tmp_path / "run" / "checkpoints" / "best.pt")
    ids = torch.tensor([[2, 3, 4, 5, 2, 6, 9]])
    ref = model(ids).logits
    m1, t1 = evaluate.load_model(str(tmp_path / "run"))
    torch.testing.assert_close(m1(ids).logits, ref)
    assert t1.encode("the cat", add_special_tokens=False) == [2, 3]
    ema = {f"module.{k}": v * 0 for k, v in model.state_dict().items()} | {"num_updates": torch.tensor(3)}
    torch.save(ckpt | {"ema": ema}, tmp_path / "ema.pt")
    m2, _ = evaluate.load_model(str(tmp_path / "ema.pt"))
    assert all((p == 0).all() for p in m2.parameters())                # the EMA weights are the ones loaded
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    m3, _ = evaluate.load_model(str(tmp_path / "hf"))
    torch.testing.assert_close(m3(ids).logits, ref)
    (tmp_path / "wiki.test.raw").write_text(" = the cat = \n\n the cat sat on the mat . \n")
    assert evaluate.main(["ppl", "--model", str(tmp_path / "hf"), "--wikitext", str(tmp_path / "wiki.test.raw"),
                          "--device", "cpu"]) == 0
