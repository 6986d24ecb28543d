"""Perplexity of a causal LM on local text: WikiText (lm-eval's ``wikitext``) and LAMBADA (``lambada_openai``).

Works with any Hugging Face-style causal LM (``model(input_ids).logits`` of shape ``[B, T, V]``) and any
tokenizer with ``encode(text, add_special_tokens=False)``; our ``MHLALMForCausalLM`` is one of them.

Scoring follows lm-evaluation-harness exactly, so the numbers are comparable with the paper's table:

* **Rolling log-likelihood** (:func:`rolling_windows`, lm-eval's ``get_rolling_token_windows``): a document
  of ``n`` tokens is scored in windows of the model's context ``max_len``. The first window predicts tokens
  ``0 .. max_len-1`` from ``[prefix] + tokens[:max_len-1]`` (``prefix`` = the tokenizer's BOS token, else its
  EOS token: lm-eval's ``prefix_token_id``; so the first token is predicted too); each later window predicts
  the next ``max_len - context_len + 1`` tokens, conditioned on
  the ``max_len`` tokens before them. ``context_len=1`` (lm-eval's default) gives **non-overlapping chunks**:
  every token is predicted exactly once and sees only the tokens of its own chunk. ``context_len > 1`` gives a
  sliding window (every predicted token sees at least ``context_len - 1`` earlier tokens).
* **Metrics** (:func:`perplexity_metrics`), over a corpus of documents with total log-likelihood ``LL``:
  token perplexity ``exp(-LL / tokens)``; ``word_perplexity = exp(-LL / words)`` with words counted as
  ``len(re.split(r"\\s+", doc))`` on the original document; ``byte_perplexity = exp(-LL / bytes)`` (UTF-8
  bytes of the original document); ``bits_per_byte = -LL / bytes / ln 2``. The paper's "Wiki ppl" is
  lm-eval's ``wikitext`` ``word_perplexity`` (WikiText-2 raw test pages, detokenized before scoring; the
  WikiText-103 test split is the same text).
* **LAMBADA** (:func:`evaluate_lambada`): each ``text`` splits at its last space into context and target
  word; ``acc`` = fraction of documents whose target is the greedy continuation (every target token is the
  argmax), ``ppl = exp(-mean_doc log p(target | context))`` (lm-eval's ``perplexity`` aggregation).

Command line: ``python -m tasks.language.evaluate ppl --ckpt ... --wikitext PATH --lambada PATH``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------- scoring core


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_len: int,
                    context_len: int = 1) -> list[tuple[list[int], list[int]]]:
    """Split ``tokens`` into ``(context, continuation)`` windows that predict every token exactly once.

    Each window's ``context + continuation`` has at most ``max_len + 1`` tokens, so the model sees at most
    ``max_len`` inputs. Concatenating the continuations gives ``tokens`` back.
    """
    if not 1 <= context_len <= max_len:
        raise ValueError(f"context_len must be in [1, max_len={max_len}], got {context_len}")
    tokens = list(tokens)
    if not tokens:
        return []
    pred_len = max_len - context_len + 1
    first = min(max_len, len(tokens))
    out = [([int(prefix_token)], tokens[:first])]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, pred_len)
        end = done + n
        start = max(0, end - max_len - 1)
        out.append((tokens[start:done], tokens[done:end]))
        done = end
    return out


def model_max_length(model, default: int = 2048) -> int:
    """The context a model was trained for (``max_position_embeddings`` / ``block_size`` / ``n_positions``)."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_len"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return default


def _logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = model(input_ids, **kwargs)
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out


def pad_batch(rows: Sequence[Sequence[int]], pad_id: int = 0, side: str = "right"
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(input_ids [B, W], attention_mask, position_ids)`` of token rows padded to the longest one.

    ``attention_mask`` (1 = token, 0 = padding) is ``None`` when no row is padded. ``position_ids`` (the count of
    earlier real tokens; 0 on padding) is given for left padding only, where it differs from ``arange``; our LM
    computes the same positions from the mask itself, Hugging Face models with absolute or rotary positions
    need them.
    """
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(list(r), dtype=torch.long)
        mask[i, sl] = 1
    if bool(mask.all()):
        return ids, None, None
    pos = (mask.cumsum(-1) - 1).clamp(min=0) if side == "left" else None
    return ids, mask, pos


@torch.no_grad()
def score_continuations(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, max_len: int,
                        batch_size: int = 8, device=None, padding_side: str = "right",
                        pad_id: int = 0) -> list[tuple[float, bool, int]]:
    """Log-likelihood of each ``continuation`` given its ``context`` (lm-eval's ``loglikelihood``).

    ``context + continuation`` is cut from the left to ``max_len + 1`` tokens; the model reads all but the last
    token. Returns ``(sum of log p(continuation tokens), is_greedy, n_tokens)`` per pair, where ``is_greedy``
    says every continuation token is the argmax of its position. The continuation must be non-empty and at
    most ``max_len`` tokens.

    Batches (longest first, as lm-eval orders them) are padded with ``pad_id`` and the model gets the 2-D
    ``attention_mask`` of the padding. ``padding_side="right"`` (default, what lm-eval's HF model does): the
    padding comes after every scored position, so in a causal model it cannot change a score even if the model
    ignored the mask. ``"left"``: rows end together; the scores then rely on the model's mask (and
    ``position_ids``) handling, which ours implements exactly (each row is run alone); the tests check both
    sides against one sequence at a time.
    """
    if device is None:
        device = next(model.parameters()).device
    results: list = [None] * len(pairs)
    prepared = []
    for i, (ctx, cont) in enumerate(pairs):
        ctx, cont = list(ctx), list(cont)
        if not cont:
            raise ValueError("an empty continuation has no log-likelihood")
        if len(cont) > max_len:
            raise ValueError(f"continuation of {len(cont)} tokens exceeds the model context {max_len}")
        if not ctx:
            raise ValueError("the context must hold at least one token (e.g. the EOS/BOS token)")
        full = (ctx + cont)[-(max_len + 1):]
        prepared.append((i, full[:-1], cont))
    # longest first: fewer padded positions per batch
    prepared.sort(key=lambda p: -len(p[1]))
    was_training = model.training
    model.eval()
    for b in range(0, len(prepared), batch_size):
        chunk = prepared[b:b + batch_size]
        ids, mask, pos = pad_batch([inp for _, inp, _ in chunk], pad_id, padding_side)
        width = ids.shape[1]
        logits = _logits(model, ids.to(device), None if mask is None else mask.to(device),
                         None if pos is None else pos.to(device))
        logp = F.log_softmax(logits.float(), dim=-1)
        for r, (i, inp, cont) in enumerate(chunk):
            n = len(cont)
            end = width if padding_side == "left" else len(inp)   # one past the last real input
            pos_r = logp[r, end - n:end]                           # [n, V] predicts cont
            target = torch.tensor(cont, device=pos_r.device)
            ll = pos_r.gather(-1, target[:, None]).squeeze(-1).sum().item()
            greedy = bool((pos_r.argmax(-1) == target).all().item())
            results[i] = (ll, greedy, n)
    model.train(was_training)
    return results


def rolling_loglikelihood(model, docs_tokens: Sequence[Sequence[int]], *, prefix_token: int, max_len: int,
                          context_len: int = 1, batch_size: int = 8, device=None,
                          padding_side: str = "right") -> list[tuple[float, int]]:
    """Total log-likelihood and token count of each document (lm-eval's ``loglikelihood_rolling``): the windows
    of every document are scored together, in batches of ``batch_size``."""
    pairs, owner = [], []
    for d, toks in enumerate(docs_tokens):
        for ctx, cont in rolling_windows(toks, prefix_token, max_len, context_len):
            pairs.append((ctx, cont))
            owner.append(d)
    scores = score_continuations(model, pairs, max_len=max_len, batch_size=batch_size, device=device,
                                 padding_side=padding_side)
    out = [[0.0, 0] for _ in docs_tokens]
    for d, (ll, _, n) in zip(owner, scores):
        out[d][0] += ll
        out[d][1] += n
    return [(ll, n) for ll, n in out]


# --------------------------------------------------------------------------------------------- metrics


def count_words(text: str) -> int:
    """lm-eval's word count for ``word_perplexity``: pieces of ``re.split(r"\\s+", text)`` (empty ends count)."""
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def perplexity_metrics(loglikelihoods: Sequence[float], tokens: Sequence[int], words: Sequence[int],
                       nbytes: Sequence[int]) -> dict:
    """Corpus-level metrics from per-document log-likelihoods (natural log) and unit counts."""
    ll = float(sum(loglikelihoods))
    n_tok, n_words, n_bytes = int(sum(tokens)), int(sum(words)), int(sum(nbytes))
    return {
        "token_perplexity": math.exp(-ll / n_tok) if n_tok else float("nan"),
        "word_perplexity": math.exp(-ll / n_words) if n_words else float("nan"),
        "byte_perplexity": math.exp(-ll / n_bytes) if n_bytes else float("nan"),
        "bits_per_byte": -ll / n_bytes / math.log(2) if n_bytes else float("nan"),
        "loglikelihood": ll, "tokens": n_tok, "words": n_words, "bytes": n_bytes, "docs": len(loglikelihoods),
    }


# ---------------------------------------------------------------------------------------------- WikiText


def wikitext_detokenize(page: str) -> str:
    """lm-eval's ``wikitext_detokenizer``: undo WikiText's tokenization (`` @-@ `` -> ``-``, spaced punctuation,
    spaced brackets and quotes, heading markers) before the model reads the page."""
    s = page.replace("s '", "s'")
    s = re.sub(r"/' [0-9]/", r"/'[0-9]/", s)
    for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "), (" . ", ". "),
                 (" ! ", "! "), (" ? ", "? "), (" , ", ", ")):
        s = s.replace(a, b)
    s = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", s)
    s = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", s)
    s = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", s)
    s = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', s)
    s = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", s)
    for a, b in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"), (" \n", "\n"),
                 ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        s = s.replace(a, b)
    return s


def split_wikitext_pages(raw: str) -> list[str]:
    """Split a raw WikiText file (``wiki.test.raw``) into article pages, as ``wikitext_document_level`` does:
    a new page starts at every top-level heading line `` = Title = ``."""
    pages, current = [], []
    for line in raw.split("\n"):
        r = line.replace("= = =", "===").replace("= =", "==").strip()
        if r.startswith("= ") and r.endswith(" ="):
            page = "\n".join(current)
            if page.strip():
                pages.append(page)
            current = []
        current.append(line)
    page = "\n".join(current)
    if page.strip():
        pages.append(page)
    return pages


def _read_records(path: str) -> list[dict]:
    """Rows of a jsonl / json / parquet file, or of a ``datasets`` folder (``save_to_disk`` or parquet files)."""
    if os.path.isdir(path):
        import datasets  # noqa: PLC0415

        if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(
                os.path.join(path, "dataset_dict.json")):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["test"] if "test" in ds else ds[next(iter(ds))]
            return list(ds)
        files = sorted(f for f in os.listdir(path) if f.endswith((".parquet", ".jsonl", ".json")))
        test = [f for f in files if "test" in f] or files
        return [r for f in test for r in _read_records(os.path.join(path, f))]
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # noqa: PLC0415  (pyarrow, from datasets: .parquet files only)

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            return data if isinstance(data, list) else data.get("data", [])
        return [json.loads(line) for line in f if line.strip()]


def _missing(path: str, what: str) -> FileNotFoundError:
    return FileNotFoundError(f"{what} not found at {path!r}. {DATA_HELP}")


DATA_HELP = (
    "Nothing is downloaded at run time. WikiText: download wikitext-103-raw-v1.zip (or wikitext-2-raw-v1.zip) "
    "from https://wikitext.smerity.com and pass the extracted wiki.test.raw, or save the HF dataset "
    "'EleutherAI/wikitext_document_level' (wikitext-2-raw-v1, test) with save_to_disk and pass that folder. "
    "LAMBADA: download lambada_test.jsonl (lm-eval's lambada_openai: one {\"text\": ...} per line, HF dataset "
    "'EleutherAI/lambada_openai', config 'default', test split) and pass its path.")


def load_wikitext_pages(path: str) -> list[str]:
    """Pages of the WikiText test split from ``wiki.test.raw`` / a text file, a jsonl / parquet with a ``page``
    (or ``text``) field, or a saved HF dataset folder."""
    if not os.path.exists(path):
        raise _missing(path, "WikiText")
    if os.path.isfile(path) and path.endswith((".raw", ".txt", ".tokens")):
        with open(path, encoding="utf-8") as f:
            return split_wikitext_pages(f.read())
    rows = _read_records(path)
    key = "page" if rows and "page" in rows[0] else "text"
    return [r[key] for r in rows if r[key].strip()]


def load_lambada(path: str) -> list[str]:
    if not os.path.exists(path):
        raise _missing(path, "LAMBADA")
    return [r["text"] for r in _read_records(path)]


# ------------------------------------------------------------------------------------------- evaluators


@dataclass
class EvalSettings:
    """``max_len``: model context (``None``: from the model config). ``context_len``: 1 = lm-eval's
    non-overlapping chunks, > 1 = sliding window. ``prefix_token``: token that precedes each document
    (``None``: :func:`prefix_token_id`, the tokenizer's BOS, else EOS, as lm-eval)."""

    max_len: int | None = None
    context_len: int = 1
    batch_size: int = 8
    prefix_token: int | None = None
    limit: int | None = None


def prefix_token_id(tokenizer) -> int:
    """lm-eval's ``prefix_token_id`` (every 0.4.x version of its HF model): the token that conditions the first
    window of a rolling document and an empty context: the tokenizer's BOS token, else its EOS token."""
    for name in ("bos_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            return v
    raise ValueError("the tokenizer has neither a BOS nor an EOS token; pass EvalSettings(prefix_token=...)")


def _prefix(tokenizer, settings: EvalSettings) -> int:
    return int(settings.prefix_token) if settings.prefix_token is not None else prefix_token_id(tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair``: trailing spaces of the context move to the continuation, the pair is encoded
    jointly and split at the length of the encoded context (so merges across the boundary match the joint
    encoding)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    ctx = encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def request_tokens(tokenizer, context: str, continuation: str, prefix: int) -> tuple[list[int], list[int]]:
    """Token ids of one ``loglikelihood`` request as lm-eval 0.4 makes them: :func:`encode_pair`; an empty
    context becomes ``[prefix]``, or the continuation's first token when that token is the prefix itself
    (then the rest of the continuation is scored)."""
    if context == "":
        cont = encode(tokenizer, continuation)
        if len(cont) > 1 and cont[0] == prefix:
            return cont[:1], cont[1:]
        return [prefix], cont
    ctx, cont = encode_pair(tokenizer, context, continuation)
    return ctx or [prefix], cont   # a whitespace-only context: the prefix conditions the continuation


def evaluate_documents(model, tokenizer, docs: Iterable[str], settings: EvalSettings | None = None,
                       model_inputs: Iterable[str] | None = None) -> dict:
    """Rolling log-likelihood of each document and the corpus metrics of :func:`perplexity_metrics`.

    ``model_inputs`` (default ``docs``) is what the model reads; words and bytes are counted on ``docs``
    (lm-eval's ``wikitext`` scores the detokenized page but counts units on the original one).
    """
    settings = settings or EvalSettings()
    docs = list(docs)[: settings.limit] if settings.limit else list(docs)
    inputs = list(model_inputs)[: len(docs)] if model_inputs is not None else docs
    max_len = settings.max_len or model_max_length(model)
    toks = [encode(tokenizer, t) for t in inputs]
    res = rolling_loglikelihood(model, toks, prefix_token=_prefix(tokenizer, settings), max_len=max_len,
                                context_len=settings.context_len, batch_size=settings.batch_size)
    out = perplexity_metrics([r[0] for r in res], [r[1] for r in res], [count_words(d) for d in docs],
                             [count_bytes(d) for d in docs])
    out.update(max_len=max_len, context_len=settings.context_len)
    return out


def evaluate_wikitext(model, tokenizer, path: str, settings: EvalSettings | None = None) -> dict:
    """lm-eval's ``wikitext`` on local data: detokenized pages scored, words/bytes of the original pages."""
    pages = load_wikitext_pages(path)
    return evaluate_documents(model, tokenizer, pages, settings, model_inputs=[wikitext_detokenize(p) for p in pages])


def lambada_split(text: str) -> tuple[str, str]:
    """lm-eval's ``lambada_openai``: context = everything before the last space, target = `` `` + last word."""
    ctx, _, last = text.rpartition(" ")   # one word: empty context (lm-eval's template gives "" too)
    return ctx, " " + last


def evaluate_lambada(model, tokenizer, path_or_texts, settings: EvalSettings | None = None) -> dict:
    """Last-word accuracy (greedy) and perplexity of the last word on LAMBADA-style texts."""
    settings = settings or EvalSettings()
    texts = load_lambada(path_or_texts) if isinstance(path_or_texts, str) else list(path_or_texts)
    if settings.limit:
        texts = texts[: settings.limit]
    max_len = settings.max_len or model_max_length(model)
    prefix = _prefix(tokenizer, settings)
    pairs = [request_tokens(tokenizer, *lambada_split(t), prefix) for t in texts]
    res = score_continuations(model, pairs, max_len=max_len, batch_size=settings.batch_size)
    lls = [r[0] for r in res]
    return {"acc": sum(r[1] for r in res) / len(res), "ppl": math.exp(-sum(lls) / len(lls)), "docs": len(res),
            "max_len": max_len}
