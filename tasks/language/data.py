"""Text sources, tokenizers and packed token streams for language modelling.

Sources (``data.source``), all local (nothing is downloaded at run time):

* ``gensim``: every English prose file that ships in the ``gensim`` wheel's ``test/test_data`` (the Lee
  news corpus, movie-review snippets, IMDB reviews, Wikipedia paragraphs, a shortened English Wikipedia
  dump cleaned of markup, ...): about 3.5 MB of text, the embedded default (``task=lm_mini``).
* ``text``: local text files (``data.path``: a file, a folder or a glob); one document per file, or per
  line with ``data.doc_per_line=true``.
* ``hf_disk``: a ``datasets`` dataset saved with ``save_to_disk`` (``data.path``; column ``data.text_field``).
* ``parquet`` / ``jsonl``: local files of a dataset such as FineWeb-Edu ``sample/10BT`` (``data.path``: a
  file, folder or glob; column ``data.text_field``).

Documents are split into train / validation by a seeded hash of their index (deterministic, independent of
the order in which files are listed), tokenized once with a progress bar into a flat ``uint16`` /
``uint32`` token file (EOS between documents) cached under ``data.cache_dir``, and read back as a memory map:
:class:`PackedTokens` serves consecutive non-overlapping windows of ``seq_len`` tokens.

Packing and document boundaries (``data.reset_at_doc_boundary``, default ``false``): a window holds the end of
one document, EOS, and the start of the next. By default the model reads it as one sequence, so the recurrent
state (and softmax attention) runs across the EOS into the next document. That is the paper's recipe: it trains
with flame / flash-linear-attention, which packs documents into fixed windows and passes no ``cu_seqlens``
unless its ``varlen`` mode is asked for (off by default), so its linear-attention states are not reset between
documents. With ``true``, :func:`packed_forward_kwargs` gives the model ``cu_seqlens`` (:func:`doc_cu_seqlens`):
every document in a window starts from an empty state (MHLA chunks start at its first token, RoPE at
position 0), as if it were alone; the token after an EOS still predicts the next document's first token.

Tokenizers: ``data.tokenizer=bpe`` trains a byte-level BPE (``tokenizers``) on the training documents and
caches it (lm_mini); any other value is a local path for ``AutoTokenizer.from_pretrained`` (the paper's
recipe: the Llama 32k tokenizer).
"""

from __future__ import annotations

import bz2
import glob
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tokenizer_models
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from tasks.common.fileio import atomic_write

GENSIM_PROSE = (
    "lee_background.cor", "lee.cor", "pang_lee_polarity.cor", "alldata-id-10.txt", "para2para_text1.txt",
    "para2para_text2.txt", "crime-and-punishment.txt",
)
GENSIM_WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
EOS = "<|endoftext|>"
UNIGRAM_COUNT_TOKENS = 200_000_000  # the unigram baseline counts at most this many training tokens


# ------------------------------------------------------------------------------------------ sources
def gensim_test_data_dir() -> Path:
    import gensim  # noqa: PLC0415

    return Path(gensim.__file__).parent / "test" / "test_data"


def _clean_wiki(text: str) -> str:
    """Wikipedia text after gensim's ``filter_wiki``: drop bold/italic quotes, headings and list stubs."""
    text = re.sub(r"'{2,}", "", text)
    keep = []
    for line in text.split("\n"):
        line = line.strip()
        if line.startswith("=") or len(line.split()) < 6:
            continue
        keep.append(re.sub(r"\s+", " ", line))
    return "\n".join(keep)


def gensim_documents() -> list[str]:
    """All English prose in the gensim wheel, one string per document (fixed order)."""
    root = gensim_test_data_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"gensim test data not found at {root}; reinstall gensim (make install)")
    docs: list[str] = []
    for name in GENSIM_PROSE:
        lines = (root / name).read_text(encoding="utf-8", errors="replace").splitlines()
        if name == "pang_lee_polarity.cor":  # one-sentence reviews: strip labels, group 10 per document
            lines = [re.sub(r"^__label__\w+\s*", "", ln) for ln in lines]
            lines = [" ".join(lines[i:i + 10]) for i in range(0, len(lines), 10)]
        elif name == "alldata-id-10.txt":  # IMDB reviews prefixed by "_*<id> "
            lines = [re.sub(r"^_\*\d+\s*", "", ln) for ln in lines]
        elif name == "crime-and-punishment.txt":
            lines = [" ".join(lines)]
        docs += [re.sub(r"\s+", " ", ln).strip() for ln in lines if len(ln.split()) >= 5]
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki  # noqa: PLC0415

    with bz2.open(root / GENSIM_WIKI) as f:
        for _title, text, _pid in extract_pages(f):
            if text.lstrip().upper().startswith("#REDIRECT"):
                continue
            clean = _clean_wiki(filter_wiki(text))
            # long articles become several documents (paragraph groups of ~4k characters)
            chunk: list[str] = []
            for para in clean.split("\n"):
                chunk.append(para)
                if sum(len(p) for p in chunk) > 4000:
                    docs.append("\n".join(chunk))
                    chunk = []
            if chunk:
                docs.append("\n".join(chunk))
    return docs


def _expand(path: str, exts: tuple[str, ...]) -> list[str]:
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        files = sorted(f for ext in exts for f in glob.glob(os.path.join(p, "**", f"*{ext}"), recursive=True))
    else:
        files = sorted(glob.glob(p))
    if not files:
        raise FileNotFoundError(f"no {'/'.join(exts)} files at data.path={path}")
    return files


def require_path(data_cfg) -> None:
    """Sources other than ``gensim`` read a local copy: fail early with what to download and where."""
    if data_cfg.source != "gensim" and not data_cfg.get("path"):
        raise FileNotFoundError(
            f"data.source={data_cfg.source} needs data.path=... (a local copy; nothing is downloaded). For the "
            f"paper's recipe download FineWeb-Edu sample-10BT (huggingface.co/datasets/HuggingFaceFW/fineweb-edu, "
            f"sample/10BT/*.parquet) and pass data.path=/path/to/fineweb-edu/sample/10BT")


def iter_documents(data_cfg):
    """Yield the documents of ``data_cfg.source`` (see the module docstring)."""
    source = data_cfg.source
    path = data_cfg.get("path")
    field = data_cfg.get("text_field", "text")
    limit = data_cfg.get("max_documents")
    require_path(data_cfg)
    if source == "gensim":
        it = iter(gensim_documents())
    elif source == "text":
        files = _expand(path, (".txt", ".md", ".cor"))

        def _text():
            for f in files:
                text = Path(f).read_text(encoding="utf-8", errors="replace")
                if data_cfg.get("doc_per_line", False):
                    yield from (ln for ln in text.splitlines() if ln.strip())
                else:
                    yield text
        it = _text()
    elif source in ("hf_disk", "parquet", "jsonl"):
        import datasets  # noqa: PLC0415

        if source == "hf_disk":
            if not os.path.isdir(os.path.expanduser(path)):
                raise FileNotFoundError(f"data.path={path} is not a dataset saved with save_to_disk")
            ds = datasets.load_from_disk(os.path.expanduser(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[data_cfg.get("split", "train")]
        else:
            files = _expand(path, (".parquet",) if source == "parquet" else (".jsonl", ".json", ".jsonl.gz"))
            ds = datasets.load_dataset("parquet" if source == "parquet" else "json", data_files=files,
                                       split="train")
        if field not in ds.column_names:
            raise KeyError(f"data.text_field={field} is not a column of {path} (columns: {ds.column_names})")
        it = (row[field] for row in ds.select_columns([field]))
    else:
        raise ValueError(f"data.source must be gensim | text | hf_disk | parquet | jsonl, got {source!r}")
    for i, doc in enumerate(it):
        if limit is not None and i >= int(limit):
            return
        yield doc


def is_validation(index: int, val_fraction: float, seed: int) -> bool:
    """Deterministic document-level split: a seeded hash of the document index."""
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < val_fraction


# ---------------------------------------------------------------------------------------- tokenizer
def _cache_key(data_cfg, extra: str = "") -> str:
    keys = ("source", "path", "text_field", "doc_per_line", "max_documents", "val_fraction", "split_seed", "split")
    desc = json.dumps({k: str(data_cfg.get(k)) for k in keys}, sort_keys=True) + extra
    return hashlib.sha1(desc.encode()).hexdigest()[:12]


def train_bpe_tokenizer(docs, vocab_size: int, path: Path):
    """Byte-level BPE trained on ``docs`` (an iterable of str), saved to ``path`` (tokenizer.json)."""
    tok = Tokenizer(tokenizer_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    atomic_write(path, tok.save)


def load_tokenizer(data_cfg, cache_dir: Path, train_docs=None):
    """A ``PreTrainedTokenizerFast`` with an EOS token.

    ``data.tokenizer=bpe``: trained on ``train_docs`` (``data.vocab_size``) and cached; else a local path.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: PLC0415

    spec = str(data_cfg.get("tokenizer", "bpe"))
    if spec == "bpe":
        vocab = int(data_cfg.get("vocab_size", 4096))
        path = cache_dir / f"bpe{vocab}-{_cache_key(data_cfg)}" / "tokenizer.json"
        if not path.exists():
            if train_docs is None:
                raise RuntimeError("the BPE tokenizer is not cached yet; pass train_docs")
            train_bpe_tokenizer(train_docs, vocab, path)
        return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS, bos_token=EOS)
    local = os.path.expanduser(spec)
    if not os.path.isdir(local) and not os.path.isfile(local):
        raise FileNotFoundError(
            f"data.tokenizer={spec} does not exist. The paper's recipe uses the Llama 32k tokenizer (e.g. the one "
            f"of fla-hub/gla-1.3B-100B or hf-internal-testing/llama-tokenizer): download it once (tokenizer.json "
            f"+ tokenizer_config.json) and pass data.tokenizer=/path/to/that/folder; or data.tokenizer=bpe")
    tok = AutoTokenizer.from_pretrained(local)
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer at {spec} has no EOS token; documents are separated by EOS")
    return tok


# ------------------------------------------------------------------------------------- token files
def _token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65535 else np.uint32


def write_token_file(docs, tokenizer, path: Path, desc: str = "tokenize", batch: int = 256) -> int:
    """Tokenize ``docs`` (EOS after each) into a flat binary file; returns the token count (atomic write)."""
    dtype = _token_dtype(len(tokenizer))
    eos = tokenizer.eos_token_id
    n = 0
    buf: list[str] = []

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f, tqdm(desc=desc, unit="doc", leave=False) as bar:
            def flush():
                nonlocal n
                ids = tokenizer(buf, add_special_tokens=False)["input_ids"]
                arr = np.fromiter((t for seq in ids for t in (*seq, eos)), dtype=dtype)
                f.write(arr.tobytes())
                n += arr.size
                bar.update(len(buf))
                buf.clear()
            for doc in docs:
                buf.append(doc)
                if len(buf) == batch:
                    flush()
            if buf:
                flush()

    atomic_write(path, write)
    return n


class PackedTokens(Dataset):
    """Consecutive windows of ``seq_len`` tokens of a flat token file (documents joined by EOS).

    Item ``i`` is ``LongTensor [seq_len]`` = tokens ``[i * seq_len, (i + 1) * seq_len)``; the trailing
    remainder is dropped. The model shifts inputs against labels itself.
    """

    def __init__(self, path: Path, seq_len: int, dtype=np.uint16):
        self.path, self.seq_len = Path(path), int(seq_len)
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        self.n = len(self.tokens) // self.seq_len
        if self.n == 0:
            raise ValueError(f"{path} holds {len(self.tokens)} tokens, fewer than one window of {seq_len}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        s = i * self.seq_len
        return torch.from_numpy(self.tokens[s:s + self.seq_len].astype(np.int64))


def doc_cu_seqlens(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document offsets of a packed batch, for ``model(input_ids, cu_seqlens=...)``.

    ``input_ids [B, T]`` (windows of documents joined by EOS) -> ``cu_seqlens [N + 1]`` (int32) over the
    ``B * T`` flattened tokens: a document starts at every row start and after every EOS (the EOS ends its
    document), and no document crosses a row.
    """
    B, T = input_ids.shape
    starts = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    offsets = starts.flatten().nonzero().squeeze(1)
    return torch.cat([offsets, offsets.new_tensor([B * T])]).to(torch.int32)


def packed_forward_kwargs(data_cfg, input_ids: torch.Tensor, eos_id: int) -> dict:
    """Extra model inputs for a packed batch ``input_ids [B, T]``: ``{"cu_seqlens": ...}`` with
    ``data.reset_at_doc_boundary=true`` (documents attended alone), else ``{}`` (module docstring)."""
    if not data_cfg.get("reset_at_doc_boundary", False):
        return {}
    return {"cu_seqlens": doc_cu_seqlens(input_ids, eos_id)}


def unigram_perplexity(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Perplexity on ``val`` of the add-one smoothed unigram distribution of ``train`` tokens."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[val.astype(np.int64)].mean()))


def build_lm_datasets(data_cfg, seq_len: int, seed: int = 0):
    """``(train, val, tokenizer, info)``: packed token windows of the train / validation documents.

    ``info`` holds the token counts and the unigram-baseline perplexity of the validation tokens.
    """
    require_path(data_cfg)
    cache_dir = Path(os.path.expanduser(str(data_cfg.get("cache_dir", "outputs/cache/lm"))))
    val_fraction = float(data_cfg.get("val_fraction", 0.05))
    split_seed = int(data_cfg.get("split_seed", 0))

    def split(want_val: bool):
        for i, doc in enumerate(iter_documents(data_cfg)):
            if is_validation(i, val_fraction, split_seed) == want_val:
                yield doc

    tokenizer = load_tokenizer(data_cfg, cache_dir, train_docs=split(False))  # lazy: read only to train BPE
    tok_id = hashlib.sha1(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:10]
    base = cache_dir / f"tokens-{_cache_key(data_cfg, tok_id)}"
    files = {}
    for name, want_val in (("train", False), ("val", True)):
        path = base / f"{name}.bin"
        if not path.exists():
            write_token_file(split(want_val), tokenizer, path, desc=f"tokenize {name}")
        files[name] = path
    dtype = _token_dtype(len(tokenizer))
    train = PackedTokens(files["train"], seq_len, dtype)
    val = PackedTokens(files["val"], seq_len, dtype)
    # the baseline is scored on exactly the tokens the model predicts: every window's tokens after the first
    predicted = np.asarray(val.tokens[:len(val) * seq_len]).reshape(len(val), seq_len)[:, 1:].reshape(-1)
    info = {"train_tokens": len(train.tokens), "val_tokens": len(val.tokens),
            "unigram_ppl": unigram_perplexity(np.asarray(train.tokens[:UNIGRAM_COUNT_TOKENS]), predicted,
                                              len(tokenizer))}
    return train, val, tokenizer, info
