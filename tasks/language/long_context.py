"""Recall at any length (issue 50): passkey retrieval in filler text and multi-query recall spread over the whole
context, generated; their evaluation by chunked prefill with the time and peak memory of every evaluation; and
two training tasks for the shared trainer (:class:`PasskeyLMTask`, :class:`SpreadMQARTask`).

**Passkey** (one document per example; the model's state starts empty, so nothing but the filler and the fact
is in the context). Filler: the language-model corpus's own tokens (the gensim prose of ``data=text_gensim``,
:func:`tasks.language.data.build_lm_datasets`) with the EOS separators removed, read from a seeded offset and
cycled when the length asks for more text than the split holds. The fact (the *needle*) is
``" The pass key is:" d1 .. dP ". Remember it."`` placed so that it starts at ``depth x (L - needle - tail)``
tokens; the last ``tail`` tokens are the question ``" What is the pass key? The pass key is:" d1 .. dP``. The
digits are the tokenizer's single-character tokens ``"0" .. "9"`` (byte-level BPE has them all), written as
tokens so that no merge hides them. An example is *recalled* when the model's argmax predicts all ``P`` answer
digits (teacher-forced, which is what greedy decoding gives whenever the digits before are right); the digit
accuracy is reported beside it (chance: 10%).

**Spread MQAR** (the MQAR model's vocabulary: keys in ``[1, V/2)``, values in ``[V/2, V)``,
:mod:`tasks.language.mqar`): the K key-value pairs sit at K distinct even positions drawn uniformly over the
whole context before the query region (so their depths cover ``[0, 1)``), the K queries are the last ``2K``
tokens (key ``k_j`` at ``L - 2K + 2 j``, label ``v_j`` there, as MQAR labels the query position), every other
token is random filler. ``filler="values"`` (the default) draws it from the value half ``[V/2, V)``, so the K keys
are the only key tokens in the context and a model can store just their pairs; ``filler="any"`` draws it from
``[0, V)`` with the example's own keys replaced by 0 (a stray copy of a key would be a second, wrong pair), so
about half the context is key tokens, each followed by a random token: about L/2 associations that no token marks
apart from the K real ones before a query arrives, far more than a fixed state of a few dozen dimensions holds
(docs/long_context.md). Depth = the pair's position / L; distance = query position - pair position.

**Evaluation** (:func:`evaluate_passkey`, :func:`evaluate_spread_mqar`): ``B`` examples at a time; the context
before the question runs through the model in chunks of ``prefill_chunk`` tokens into one
:class:`models.lm.MHLALMCache` (MHLA and linear attention: a state of constant size; softmax: the KV cache, which
grows), then the question (or the query region) in one call whose logits are read. :class:`PeakRSS` records the
process's resident memory before and its peak during each evaluation (Linux: the peak is reset through
``/proc/self/clear_refs`` so that it is this evaluation's own; elsewhere the process's peak so far), and the wall
time. Accuracy by depth and by distance: :func:`accuracy_table`.
"""

from __future__ import annotations

import math
import os
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

from .mqar import MQARTask
from .task import LanguageModelingTask

PASSKEY_DIGITS = 5
NEEDLE_PREFIX = " The pass key is:"
NEEDLE_SUFFIX = ". Remember it."
QUESTION = " What is the pass key? The pass key is:"


# ------------------------------------------------------------------------------------------ memory
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakRSS:
    """Resident memory of this process around a block: ``rss_mib`` (before), ``peak_mib`` (the peak during it)
    and ``seconds`` (wall). On Linux the kernel's high-water mark is reset at the start (``echo 5 >
    /proc/self/clear_refs``), so the peak is this block's own (``peak_scope = "block"``); where that fails, the
    process's peak so far (``peak_scope = "process"``, an upper bound)."""

    def __enter__(self) -> "PeakRSS":
        self.scope = "process"
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.scope = "block"
        except OSError:
            pass
        rss = _status_kib("VmRSS")
        self.rss_mib = rss / 1024 if rss is not None else None
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        self.seconds = time.perf_counter() - self._t0
        hwm = _status_kib("VmHWM") if self.scope == "block" else None
        if hwm is None:  # ru_maxrss: KiB on Linux, bytes on macOS
            ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            hwm = ru // 1024 if os.uname().sysname == "Darwin" else ru
            self.scope = "process"
        self.peak_mib = hwm / 1024
        return False

    @property
    def record(self) -> dict:
        rss = None if self.rss_mib is None else round(self.rss_mib, 1)
        return {"seconds": round(self.seconds, 3), "rss_mib": rss, "peak_rss_mib": round(self.peak_mib, 1),
                "peak_scope": self.scope}


# ------------------------------------------------------------------------------------------ passkey data
def filler_tokens(tokens, eos_id: int | None) -> np.ndarray:
    """The corpus tokens with the document separators (EOS) removed: one long stretch of prose (int64)."""
    arr = np.asarray(tokens).astype(np.int64)
    return arr[arr != eos_id] if eos_id is not None else arr


def number_ids(filler: np.ndarray, tokenizer) -> np.ndarray:
    """The distinct token ids of ``filler`` whose text holds a digit (``"8"``, ``",744"``): the filler's numbers."""
    ids = np.unique(filler)
    has_digit = np.array([any(c.isdigit() for c in tokenizer.decode([int(i)])) for i in ids], dtype=bool)
    return ids[has_digit]


def without_numbers(filler: np.ndarray, tokenizer) -> np.ndarray:
    """``filler`` without the tokens whose text holds a digit (:func:`number_ids`): prose in which no number can be
    taken for the passkey's digits (the control for a write gate that writes numbers of the filler as it writes the
    passkey)."""
    return filler[~np.isin(filler, number_ids(filler, tokenizer))]


class PasskeyFormat:
    """The token pieces of a passkey example for ``tokenizer`` (a ``PreTrainedTokenizerFast`` with the single
    characters ``"0" .. "9"`` in its vocabulary)."""

    def __init__(self, tokenizer, digits: int = PASSKEY_DIGITS):
        def enc(text):
            return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        self.prefix, self.suffix, self.question = enc(NEEDLE_PREFIX), enc(NEEDLE_SUFFIX), enc(QUESTION)
        vocab = tokenizer.get_vocab()
        missing = [d for d in "0123456789" if d not in vocab]
        if missing:
            raise ValueError(f"the tokenizer has no single-character token for the digits {missing}")
        self.digit_ids = np.asarray([vocab[d] for d in "0123456789"], dtype=np.int64)
        self.digits = int(digits)

    @property
    def needle_len(self) -> int:
        return len(self.prefix) + self.digits + len(self.suffix)

    @property
    def tail_len(self) -> int:
        """The question and its answer: the last tokens of an example."""
        return len(self.question) + self.digits

    def min_length(self) -> int:
        return self.needle_len + self.tail_len + 1


def passkey_batch(filler: np.ndarray, fmt: PasskeyFormat, length: int, depths,
                  rng: np.random.Generator, decoys: float = 0.0) -> dict:
    """``len(depths)`` passkey examples of ``length`` tokens (module docstring): ``input_ids [B, L]``,
    ``answer [B, P]`` (the digit tokens), ``needle_pos [B]`` (the needle's first token) and ``targets_at [P]``
    (the positions whose logits predict the answer digits: the same in every row). ``depths`` in ``[0, 1]``.

    ``decoys``: decoy numbers per 1,000 filler tokens (a Poisson count per row): runs of ``P`` random digit tokens,
    the passkey's own kind, written over the filler at uniform random places without the needle's words, so that
    only the words before them tell the passkey from a number of the text. 0 (the default) draws nothing more from
    ``rng``: the examples are those of a run without the option."""
    L, P = int(length), fmt.digits
    if L < fmt.min_length():
        raise ValueError(f"a passkey example needs at least {fmt.min_length()} tokens, got {L}")
    room = L - fmt.needle_len - fmt.tail_len  # filler tokens
    B = len(depths)
    x = np.empty((B, L), dtype=np.int64)
    answers = rng.integers(0, 10, size=(B, P))
    needle_pos = np.empty(B, dtype=np.int64)
    for b, depth in enumerate(depths):
        start = int(rng.integers(0, len(filler)))
        idx = (start + np.arange(room)) % len(filler)
        fill = filler[idx]
        if decoys > 0:
            fill = with_decoys(fill, fmt, decoys, rng)
        pos = int(round(float(depth) * room))
        digits = fmt.digit_ids[answers[b]]
        needle = np.concatenate([fmt.prefix, digits, fmt.suffix])
        x[b] = np.concatenate([fill[:pos], needle, fill[pos:], fmt.question, digits])
        needle_pos[b] = pos
    targets_at = np.arange(L - P - 1, L - 1)
    return {"input_ids": torch.from_numpy(x), "answer": torch.from_numpy(fmt.digit_ids[answers]),
            "needle_pos": torch.from_numpy(needle_pos), "targets_at": torch.from_numpy(targets_at)}


def with_decoys(fill: np.ndarray, fmt: PasskeyFormat, per_1k: float, rng: np.random.Generator) -> np.ndarray:
    """A copy of ``fill`` (one row's filler tokens) with a Poisson(``per_1k`` x len / 1000) number of decoys: runs
    of ``fmt.digits`` random digit tokens written over it at uniform random starts (:func:`passkey_batch`)."""
    P, fill = fmt.digits, fill.copy()
    if len(fill) < P:
        return fill
    for start in rng.integers(0, len(fill) - P + 1, size=rng.poisson(per_1k * len(fill) / 1000)):
        fill[start:start + P] = fmt.digit_ids[rng.integers(0, 10, size=P)]
    return fill


def _lengths(length) -> tuple[int, ...]:
    """A curriculum stage's lengths: one (an int), or a list taken in turn."""
    lengths = tuple(int(n) for n in length) if hasattr(length, "__iter__") else (int(length),)
    if not lengths:
        raise ValueError("a curriculum stage needs at least one length")
    return lengths


class CurriculumBatches(Dataset):
    """Training items of ``seq_len`` tokens whose first batches are other lengths: the machinery that
    :class:`PasskeyDataset` and :class:`SpreadMQARDataset` share.

    ``curriculum``: ``[(length, batches), ...]``: the first ``batches`` batches are made of ``length``-token
    examples, then the next stage's, then ``seq_len``'s. A stage's length may be a list, whose lengths take the
    stage's batches in turn (``[[1024, 256], 300]``: 150 batches of 1,024 tokens interleaved with 150 of 256).
    With a curriculum the items are indices and :meth:`collate` builds the batch: its number is the place of its
    first item in the epoch's order of the trainer's sampler (:class:`tasks.common.data.ResumableSampler` with
    ``batch_size`` and ``sampler_seed``, one process; the trainer tells the epoch through :meth:`set_epoch`), so a
    resumed run (``trainer.resume``) and data-loader workers see the same stages. A short batch (``length <
    seq_len``) holds ``seq_len // length`` examples per item (``[B * seq_len // length, length]``: about the same
    tokens per step). Subclasses give :meth:`item` and :meth:`batch_at`."""

    def __init__(self, seq_len: int, num_examples: int, curriculum=None, batch_size: int = 1,
                 sampler_seed: int = 0):
        self.seq_len, self.n = int(seq_len), int(num_examples)
        self.curriculum = [(_lengths(length), int(batches)) for length, batches in (curriculum or [])]
        self.batch_size, self.sampler_seed, self.epoch, self._place = int(batch_size), int(sampler_seed), 0, {}

    def stage_lengths(self) -> list[int]:
        """Every length the curriculum names."""
        return [n for lengths, _ in self.curriculum for n in lengths]

    def __len__(self) -> int:
        return self.n

    def item(self, i: int):
        """Item ``i`` at ``seq_len`` (no curriculum)."""
        raise NotImplementedError

    def batch_at(self, indices, length: int):
        """The training batch of these item indices at ``length`` tokens."""
        raise NotImplementedError

    def __getitem__(self, i: int):
        return int(i) if self.curriculum else self.item(i)

    def length_at(self, batch: int) -> int:
        """The example length of training batch ``batch`` (0-based) under the curriculum."""
        end = 0
        for lengths, batches in self.curriculum:
            if batch < end + batches:
                return lengths[(batch - end) % len(lengths)]
            end += batches
        return self.seq_len

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def batch_number(self, indices) -> int:
        """The training batch (from the run's start) that holds these item indices."""
        from tasks.common.data import ResumableSampler  # noqa: PLC0415

        if self.epoch not in self._place:
            sampler = ResumableSampler(self.n, self.batch_size, shuffle=True, seed=self.sampler_seed)
            sampler.set_epoch(self.epoch)
            order = np.asarray(sampler.order())
            place = np.empty(self.n, dtype=np.int64)
            place[order] = np.arange(len(order))
            self._place = {self.epoch: (place, sampler.steps_per_epoch)}
        place, per_epoch = self._place[self.epoch]
        return self.epoch * per_epoch + int(place[int(indices[0])]) // self.batch_size

    def collate(self, indices):
        """The training batch of these indices at ``length_at(batch_number(indices))`` tokens."""
        return self.batch_at(indices, self.length_at(self.batch_number(indices)))


def check_curriculum_runs(cfg) -> list:
    """``task.curriculum`` of a run's config (``[]`` when unset), after checking that the run can follow it: a
    batch's number comes from one process's sampler order, so it needs one process and ``trainer.accumulate=1``."""
    curriculum = list(cfg.task.get("curriculum") or [])
    if curriculum and (str(cfg.trainer.get("accumulate", 1)) not in ("1", "auto", "None")
                       or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ValueError("task.curriculum finds a batch's number from one process's sampler order: it needs "
                         "one process and trainer.accumulate=1")
    return curriculum


class PasskeyDataset(CurriculumBatches):
    """Training / validation passkey sequences of ``seq_len`` tokens at uniform random depths: item ``i`` is
    ``(input_ids [L], answer_mask [L])`` (``answer_mask[t]``: token ``t`` is an answer digit), the same for a
    given ``(seed, i)``.

    ``curriculum`` (training; :class:`CurriculumBatches`): a short stage's needle is never farther than its
    ``length`` tokens from the question. A long stage (``length`` a multiple of ``seq_len`` above it) holds one
    ``length``-token document per item (``[B, length]``), which :class:`PasskeyLMTask` trains as windows of
    ``seq_len`` with the state passed: the earlier windows fill the model's cache without gradient, the last one
    (the question, and the needle when it falls there) trains."""

    def __init__(self, filler: np.ndarray, fmt: PasskeyFormat, seq_len: int, num_examples: int, seed: int = 0,
                 curriculum=None, batch_size: int = 1, sampler_seed: int = 0, decoys: float = 0.0):
        super().__init__(seq_len, num_examples, curriculum, batch_size, sampler_seed)
        self.filler, self.fmt, self.seed, self.decoys = filler, fmt, seed, float(decoys)
        for length in self.stage_lengths():
            if not (fmt.min_length() <= length <= self.seq_len or length % self.seq_len == 0):
                raise ValueError(f"curriculum lengths must be in [{fmt.min_length()}, {self.seq_len}] or multiples "
                                 f"of seq_len {self.seq_len} (documents passed on in windows), got {length}")

    def example(self, i: int, length: int, sub: int | None = None):
        """Example ``i`` at ``length`` tokens (``sub``: the ``sub``-th short example of item ``i``)."""
        rng = np.random.default_rng([self.seed, i] if sub is None else [self.seed, i, length, sub])
        batch = passkey_batch(self.filler, self.fmt, length, [rng.random()], rng, decoys=self.decoys)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[batch["targets_at"] + 1] = True
        return batch["input_ids"][0], mask

    def item(self, i: int):
        return self.example(i, self.seq_len)

    def batch_at(self, indices, length: int):
        """``(input_ids [b, l], answer_mask [b, l])`` of the items ``indices`` at ``length`` tokens."""
        if length == self.seq_len:
            pairs = [self.example(i, length) for i in indices]
        elif length > self.seq_len:  # one long document per item (its windows: PasskeyLMTask)
            pairs = [self.example(i, length, 0) for i in indices]
        else:
            pairs = [self.example(i, length, j) for i in indices for j in range(self.seq_len // length)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


class TextDocuments(CurriculumBatches):
    """Training windows of the LM corpus (``train``: :class:`tasks.language.data.PackedTokens`, the documents joined
    by EOS) for :class:`StatePassedLMTask`: item ``i`` is the packed window ``i`` (``[seq_len]``, as ``task=lm_mini``
    trains). A long stage (``length`` a multiple of ``seq_len`` above it, :class:`CurriculumBatches`) gives item
    ``i`` the ``length`` tokens that end with that window (``[B, length]``; from the corpus's start for the first
    windows): the same window trained, read after the text before it, which the task passes on as state."""

    def __init__(self, train, curriculum=None, batch_size: int = 1, sampler_seed: int = 0):
        super().__init__(train.seq_len, len(train), curriculum, batch_size, sampler_seed)
        self.train = train
        for length in self.stage_lengths():
            if length % self.seq_len or length > len(train.tokens):
                raise ValueError(f"state-passed text lengths must be multiples of seq_len {self.seq_len} within the "
                                 f"{len(train.tokens):,} training tokens, got {length}")

    def item(self, i: int):
        return self.train[i]

    def batch_at(self, indices, length: int):
        """``input_ids [b, length]``: for each item, the ``length`` tokens that end with its window."""
        tokens = self.train.tokens
        ends = [min(max((int(i) + 1) * self.seq_len, length), len(tokens)) for i in indices]
        return torch.stack([torch.from_numpy(np.asarray(tokens[e - length:e]).astype(np.int64)) for e in ends])


# ------------------------------------------------------------------------------------------ spread MQAR
SPREAD_MQAR_FILLERS = ("values", "any")


def check_spread_mqar_length(length: int, num_kv_pairs: int) -> None:
    """Refuse a spread-MQAR length that cannot hold its K pairs and K queries: it must be even and >= 4 K."""
    if length % 2 or length < 4 * num_kv_pairs:
        raise ValueError(f"spread MQAR needs an even length >= 4 K = {4 * num_kv_pairs}, got {length}")


def spread_mqar(num_examples: int, length: int, vocab_size: int, num_kv_pairs: int, seed: int = 0,
                filler: str = "values") -> dict:
    """Spread-MQAR examples (module docstring; ``filler``: ``"values"`` or ``"any"``): ``input_ids [n, L]``,
    ``labels [n, L]`` (-100 except the K query positions), ``pair_pos [n, K]`` (position of pair ``j``'s key) and
    ``query_pos [K]`` (query ``j``'s position, the same in every row)."""
    n, L, V, K = int(num_examples), int(length), int(vocab_size), int(num_kv_pairs)
    half = V // 2
    if filler not in SPREAD_MQAR_FILLERS:
        raise ValueError(f"spread MQAR filler must be one of {SPREAD_MQAR_FILLERS}, got {filler!r}")
    check_spread_mqar_length(L, K)
    if K > half - 1:
        raise ValueError(f"{K} distinct keys do not fit in the key vocabulary [1, {half})")
    rng = np.random.default_rng(seed)
    keys = rng.random((n, half - 1)).argsort(axis=1)[:, :K] + 1
    values = rng.random((n, V - half)).argsort(axis=1)[:, :K] + half
    slots = (L - 2 * K) // 2
    pair_pos = 2 * np.sort(rng.random((n, slots)).argsort(axis=1)[:, :K], axis=1)  # K distinct even positions
    order = rng.random((n, K)).argsort(axis=1)  # which pair sits at which slot
    x = rng.integers(0 if filler == "any" else half, V, size=(n, L))
    for j in range(K):  # stray copies of the example's keys -> 0 (filler="any" only: values are never keys)
        x[x == keys[:, j:j + 1]] = 0
    rows = np.arange(n)[:, None]
    x[rows, pair_pos] = np.take_along_axis(keys, order, 1)
    x[rows, pair_pos + 1] = np.take_along_axis(values, order, 1)
    query_pos = L - 2 * K + 2 * np.arange(K)
    x[:, query_pos] = keys
    labels = np.full((n, L), -100, dtype=np.int64)
    labels[:, query_pos] = values
    # pair_pos in query order: where key j sits
    where = np.empty((n, K), dtype=np.int64)
    np.put_along_axis(where, order, pair_pos, axis=1)
    return {"input_ids": torch.from_numpy(x), "labels": torch.from_numpy(labels),
            "pair_pos": torch.from_numpy(where), "query_pos": torch.from_numpy(query_pos)}


class SpreadMQARDataset(CurriculumBatches):
    """A fixed set of spread-MQAR examples; items are ``(inputs [L], labels [L])`` as MQAR's. Under a
    ``curriculum`` (training; :class:`CurriculumBatches`) a short stage's batch is generated afresh: item ``i`` at
    ``length`` tokens holds ``seq_len // length`` examples drawn from the seed ``(seed, i, length)``, the same K
    pairs spread over the shorter context. A long stage (a multiple of ``seq_len``) holds one ``length``-token
    document per item, its pairs spread over all of it and its queries at the end, which
    :class:`SpreadMQARTask` trains as the last window read after the state of the others (:func:`pass_state`)."""

    def __init__(self, num_examples: int, seq_len: int, vocab_size: int, num_kv_pairs: int, seed: int = 0,
                 filler: str = "values", curriculum=None, batch_size: int = 1, sampler_seed: int = 0):
        super().__init__(seq_len, num_examples, curriculum, batch_size, sampler_seed)
        self.vocab_size, self.num_kv_pairs, self.seed, self.filler = int(vocab_size), int(num_kv_pairs), seed, filler
        for length in self.stage_lengths():
            check_spread_mqar_length(length, self.num_kv_pairs)
            if length > self.seq_len and length % self.seq_len:
                raise ValueError(f"spread-MQAR curriculum lengths must be at most seq_len {self.seq_len} or multiples "
                                 f"of it (documents passed on in windows), got {length}")
        d = spread_mqar(num_examples, seq_len, vocab_size, num_kv_pairs, seed, filler)
        self.inputs, self.labels = d["input_ids"], d["labels"]

    def item(self, i: int):
        return self.inputs[i], self.labels[i]

    def batch_at(self, indices, length: int):
        """``(inputs [b, l], labels [b, l])`` of the items ``indices`` at ``length`` tokens."""
        if length == self.seq_len:
            return self.inputs[list(indices)], self.labels[list(indices)]
        parts = [spread_mqar(max(1, self.seq_len // length), length, self.vocab_size, self.num_kv_pairs,
                             [self.seed, int(i), length], self.filler) for i in indices]
        return torch.cat([p["input_ids"] for p in parts]), torch.cat([p["labels"] for p in parts])


# ------------------------------------------------------------------------------------------ evaluation
def _cache(model):
    from models.lm import MHLALMCache  # noqa: PLC0415

    return MHLALMCache(model.config)


@torch.no_grad()
def prefill(model, x: torch.Tensor, chunk: int):
    """Run ``x [B, T]`` through ``model`` in chunks of ``chunk`` tokens into a fresh cache; returns the cache."""
    cache = _cache(model)
    for a in range(0, x.shape[1], chunk):
        model(x[:, a:a + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def pass_state(model, seq_len: int, x: torch.Tensor, *aligned: torch.Tensor):
    """Truncated backpropagation through a long document: ``x [B, T]`` with ``T > seq_len`` runs its first
    ``T - seq_len`` tokens into a cache without gradient (:func:`prefill`, in windows of ``seq_len``) and keeps the
    last window to train, read from that cache (state-passing training, Buitrago Ruiz and Gu 2025). Returns
    ``(cache or None, x [B, seq_len], *aligned cut the same way)``; a batch of ``seq_len`` or fewer tokens passes
    through with no cache."""
    if x.shape[1] <= seq_len:
        return (None, x, *aligned)
    cache = prefill(model, x[:, :-seq_len], seq_len)
    return (cache, x[:, -seq_len:], *(t[:, -seq_len:] for t in aligned))


def depth_at_distance(fmt: PasskeyFormat, length: int, distance: int) -> float | None:
    """The depth that starts the needle ``distance`` tokens before the end of a ``length``-token example (the
    record's ``distance``: from the needle's first token to the question's end), or None where no depth does
    (``distance`` outside ``[needle + tail, length]``)."""
    room = int(length) - fmt.needle_len - fmt.tail_len
    pos = int(length) - int(distance)
    return pos / room if 0 <= pos <= room else None


@torch.no_grad()
def evaluate_passkey(model, filler: np.ndarray, fmt: PasskeyFormat, length: int, depths, *,
                     examples_per_depth: int = 4, batch_size: int = 4, prefill_chunk: int = 2048,
                     seed: int = 0, distances=None) -> dict:
    """Passkey recall of ``model`` at ``length`` tokens for every depth of ``depths``: ``{"length", "depths": [
    {"depth", "acc", "digit_acc", "n", "distance"}], "acc", "digit_acc", "n", "cache_bytes", **PeakRSS.record}``
    (``distance``: mean tokens from the needle's first token to the question's end).

    ``distances`` (instead of ``depths``): the needle at these distances from the end, the same at every length
    (:func:`depth_at_distance`), so that lengths differ only in the filler before the needle; each row also
    has ``target_distance``; a distance that does not fit ``length`` is a row with ``n`` 0 and ``acc`` None (and
    the record's ``acc`` is None when none fits)."""
    device = next(model.parameters()).device
    rows, cache_bytes = [], 0
    placements = ([(d, None) for d in depths] if distances is None else
                  [(depth_at_distance(fmt, length, D), int(D)) for D in distances])
    with PeakRSS() as mem:
        for di, (depth, target) in enumerate(placements):
            if depth is None:
                rows.append({"target_distance": target, "depth": None, "acc": None, "digit_acc": None, "n": 0,
                             "distance": None})
                continue
            rng = np.random.default_rng([seed, int(length), di])
            ok, digit_ok, dist_sum = 0, 0, 0.0
            for s in range(0, examples_per_depth, batch_size):
                b = min(batch_size, examples_per_depth - s)
                batch = passkey_batch(filler, fmt, length, [depth] * b, rng)
                x = batch["input_ids"].to(device)
                cut = length - fmt.tail_len  # the question and the answer run in one last call
                cache = prefill(model, x[:, :cut], prefill_chunk)
                logits = model(x[:, cut:], past_key_values=cache, use_cache=True).logits
                cache_bytes = max(cache_bytes, cache.nbytes())
                pred = logits[:, batch["targets_at"] - cut].argmax(-1).cpu()
                hit = pred == batch["answer"]
                ok += int(hit.all(1).sum())
                digit_ok += int(hit.sum())
                dist_sum += float((length - batch["needle_pos"]).double().sum())
                del cache, logits
            rows.append({**({} if target is None else {"target_distance": target}), "depth": float(depth),
                         "acc": ok / examples_per_depth, "digit_acc": digit_ok / (examples_per_depth * fmt.digits),
                         "n": examples_per_depth, "distance": dist_sum / examples_per_depth})
    n = sum(r["n"] for r in rows)

    def mean(key):  # over the rows that ran (None when no distance fits the length)
        return sum(r[key] * r["n"] for r in rows if r["n"]) / n if n else None

    return {"length": int(length), "depths": rows, "n": n, "acc": mean("acc"), "digit_acc": mean("digit_acc"),
            "cache_bytes": cache_bytes, **mem.record}


@torch.no_grad()
def evaluate_spread_mqar(model, length: int, *, vocab_size: int, num_kv_pairs: int, num_examples: int = 16,
                         batch_size: int = 4, prefill_chunk: int = 2048, seed: int = 0,
                         depth_bins: int = 5, filler: str = "values") -> dict:
    """Spread-MQAR recall at ``length`` (``filler``: the one the model trained on): ``{"length", "acc", "n",
    "by_depth": [{"lo", "hi", "acc", "n"}], "by_distance": [{"lo", "hi", "acc", "n"}] (powers of two),
    "cache_bytes", **PeakRSS.record}``."""
    device = next(model.parameters()).device
    K = int(num_kv_pairs)
    d = spread_mqar(num_examples, length, vocab_size, K, seed, filler)
    correct, depth, distance, cache_bytes = [], [], [], 0
    with PeakRSS() as mem:
        for s in range(0, num_examples, batch_size):
            x = d["input_ids"][s:s + batch_size].to(device)
            cut = length - 2 * K
            cache = prefill(model, x[:, :cut], prefill_chunk)
            logits = model(x[:, cut:], past_key_values=cache, use_cache=True).logits
            cache_bytes = max(cache_bytes, cache.nbytes())
            pred = logits[:, d["query_pos"] - cut].argmax(-1).cpu()                # [b, K]
            target = d["labels"][s:s + batch_size][:, d["query_pos"]]
            correct.append((pred == target).flatten())
            pp = d["pair_pos"][s:s + batch_size]
            depth.append((pp.double() / length).flatten())
            distance.append((d["query_pos"][None] - pp).flatten())
            del cache, logits
    correct, depth, distance = torch.cat(correct), torch.cat(depth), torch.cat(distance)
    by_depth = [_bucket(correct, (depth >= i / depth_bins) & (depth < (i + 1) / depth_bins),
                        i / depth_bins, (i + 1) / depth_bins) for i in range(depth_bins)]
    edges = [0] + [2 ** k for k in range(4, int(math.log2(max(length, 16))) + 1)]
    by_distance = [_bucket(correct, (distance >= lo) & (distance < hi), lo, hi)
                   for lo, hi in zip(edges[:-1], edges[1:])]
    return {"length": int(length), "acc": correct.float().mean().item(), "n": int(correct.numel()),
            "by_depth": [b for b in by_depth if b["n"]], "by_distance": [b for b in by_distance if b["n"]],
            "cache_bytes": cache_bytes, **mem.record}


def _bucket(correct: torch.Tensor, sel: torch.Tensor, lo, hi) -> dict:
    n = int(sel.sum())
    return {"lo": lo, "hi": hi, "acc": correct[sel].float().mean().item() if n else None, "n": n}


# ------------------------------------------------------------------------------------------ training tasks
class CurriculumCollate:
    """A task whose training dataset (``self._train``, a :class:`CurriculumBatches`) may hand out indices: under a
    curriculum the dataset builds their batch; other samples go to the task's own ``collate``."""

    def trained_context(self) -> int:
        """The longest context a training row reads: ``data.seq_len``, or the longest document of
        ``task.curriculum`` (passed on in windows); it resolves ``attn.mixing_extension=uniform_far:auto``."""
        curriculum = self.cfg.task.get("curriculum") or []
        return max([int(self.cfg.data.seq_len), *(n for length, _ in curriculum for n in _lengths(length))])

    def collate(self, samples):
        if samples and isinstance(samples[0], int):
            return self._train.collate(samples)
        return super().collate(samples)


class PasskeyLMTask(CurriculumCollate, LanguageModelingTask):
    """The LM task on passkey sequences (``task=lm_mini`` data, model and recipe; every training window is one
    passkey example of ``data.seq_len`` tokens in the corpus's filler, ``data.num_train`` of them drawn afresh
    per index, under ``task.curriculum``'s lengths first: :class:`PasskeyDataset`): loss = ``task.lm_weight`` x
    the next-token loss on every token + ``task.answer_weight`` x the loss on the answer digits. A curriculum
    stage longer than ``data.seq_len`` passes the state: a document's windows before its last run through the
    model into a cache without gradient (:func:`prefill`, as the evaluation reads long contexts), and the loss is
    the last window's, read from that cache (truncated backpropagation through the context, as state-passing
    training of recurrent models, Buitrago Ruiz and Gu 2025). Evaluation at
    the training length: the answer loss (the monitor), passkey and digit accuracy, and the validation
    perplexity (on the same sequences)."""

    monitor = "answer_loss"  # the validation loss on the answer digits (best.pt): the recipe trains on them only
    monitor_mode = "min"

    def build_model(self):
        """The LM of ``task=lm_mini`` (:meth:`LanguageModelingTask.build_model`); ``task.mixing_tie=distance``
        makes every MHLA mixing matrix a learned function of the block distance, ``log_distance`` a smooth one
        (knots in log distance) (:meth:`mhla.mixing.MixingMatrix.tie_by_distance_`), so its rows mean the same at
        any length."""
        model = super().build_model()
        tie = self.cfg.task.get("mixing_tie")
        if tie:
            from mhla.mixing import TIE_MODES, mixing_matrices  # noqa: PLC0415

            if tie not in TIE_MODES:
                raise ValueError(f"task.mixing_tie must be null or one of {TIE_MODES[1:]}, got {tie!r}")
            for m in mixing_matrices(model).values():
                m.tie_by_distance_(tie)
        return model

    def fmt(self) -> PasskeyFormat:
        return PasskeyFormat(self.data()[2], int(self.cfg.task.get("digits", PASSKEY_DIGITS)))

    def build_datasets(self):
        train, val, tok, _ = self.data()
        d, fmt, seed = self.cfg.data, self.fmt(), int(self.cfg.get("seed", 0))
        curriculum = check_curriculum_runs(self.cfg)
        self._train = PasskeyDataset(filler_tokens(train.tokens, tok.eos_token_id), fmt, self.seq_len,
                                     int(d.get("num_train", 100_000)), seed=2 * seed + 1, curriculum=curriculum,
                                     batch_size=int(d.batch_size), sampler_seed=seed,
                                     decoys=float(self.cfg.task.get("filler_decoys") or 0.0))
        return (self._train, PasskeyDataset(filler_tokens(val.tokens, tok.eos_token_id), fmt, self.seq_len,
                                            int(d.get("num_val", 128)), seed=10_000))

    def on_batch(self, batch, device):
        return tuple(t.to(device, non_blocking=True) for t in batch)

    def _losses(self, model, batch):
        cache, x, mask = pass_state(model, self.seq_len, *batch)  # a long document: its earlier windows' state
        logits = model(input_ids=x, past_key_values=cache, use_cache=cache is not None).logits[:, :-1].float()
        target, m = x[:, 1:], mask[:, 1:]
        lm = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        ans_logits = logits[m]
        ans = F.cross_entropy(ans_logits, target[m])
        hit = (ans_logits.argmax(-1) == target[m]).view(x.shape[0], -1)
        return lm, ans, hit

    def training_loss(self, model, batch):
        lm, ans, hit = self._losses(model, batch)
        w = float(self.cfg.task.get("answer_weight", 1.0))
        lm_w = float(self.cfg.task.get("lm_weight", 1.0))
        return lm_w * lm + w * ans, {"lm_loss": lm.item(), "answer_loss": ans.item(),
                              "passkey_acc": hit.all(1).float().mean().item()}

    @torch.no_grad()
    def evaluate(self, model, loader, device, dist_info) -> dict:
        tot = torch.zeros(5, device=device, dtype=torch.float64)  # lm / answer loss sums, windows, recalled, digits
        for batch in loader:
            batch = self.on_batch(batch, device)
            lm, ans, hit = self._losses(model, batch)
            tot += torch.tensor([lm.item() * len(hit), ans.item() * len(hit), len(hit), hit.all(1).sum().item(),
                                 hit.float().mean(1).sum().item()], device=device, dtype=torch.float64)
        if dist_info.enabled:
            dist.all_reduce(tot)
        loss = (tot[0] / tot[2]).item()
        return {"val_loss": loss, "val_ppl": math.exp(loss), "answer_loss": (tot[1] / tot[2]).item(),
                "passkey_acc": (tot[3] / tot[2]).item(), "digit_acc": (tot[4] / tot[2]).item()}

    def after_fit(self, trainer, metrics: dict) -> dict:
        return {}


class StatePassedLMTask(CurriculumCollate, LanguageModelingTask):
    """The LM task (``task=lm_mini``'s data, model, loss and validation) trained with the state passed under
    ``task.curriculum`` (:class:`TextDocuments`): a long stage's batch is each window read after the text before it
    (``[[1024, 256], 600]``: 300 batches of 256-token windows read after 768 tokens of context, interleaved with
    300 plain ones), the earlier tokens run into the model's cache without gradient (:func:`pass_state`), so the
    mixing rows past the learned ones, and the far coefficient the extension rule spreads, are trained on the
    states a long context reaches. Validation is the plain LM's (windows of ``data.seq_len``)."""

    def build_datasets(self):
        train, val, _, _ = self.data()
        seed, curriculum = int(self.cfg.get("seed", 0)), check_curriculum_runs(self.cfg)
        if curriculum and self.cfg.data.get("reset_at_doc_boundary", False):
            raise ValueError("task.curriculum passes the state across the text before a window, documents "
                             "included: set data.reset_at_doc_boundary=false")
        self._train = TextDocuments(train, curriculum=curriculum,
                                    batch_size=int(self.cfg.data.batch_size), sampler_seed=seed)
        return self._train, val

    def training_loss(self, model, batch):
        cache, x = pass_state(model, self.seq_len, batch)
        return super().training_loss(model, x, cache)


def spread_mqar_filler(cfg) -> str:
    """The spread-MQAR filler a run's config trained on: ``data.filler``, or ``"any"`` when the key is absent
    (runs made before it)."""
    return str(cfg.data.get("filler", None) or "any")


class SpreadMQARTask(CurriculumCollate, MQARTask):
    """MQAR (``task=mqar``'s model and recipe) on spread-MQAR examples (:func:`spread_mqar`) of ``data.seq_len``
    with ``data.filler`` (absent: ``"any"``, what runs made before the key trained on), under ``task.curriculum``'s
    shorter lengths first (:class:`SpreadMQARDataset`; the test set is at ``data.seq_len``)."""

    def build_datasets(self):
        d, seed = self.cfg.data, int(self.cfg.get("seed", 0))
        common = dict(seq_len=int(d.seq_len), vocab_size=int(d.vocab_size), num_kv_pairs=int(d.num_kv_pairs),
                      filler=spread_mqar_filler(self.cfg))
        self._train = SpreadMQARDataset(int(d.num_train), seed=2 * seed + 1, curriculum=check_curriculum_runs(self.cfg),
                                        batch_size=int(d.batch_size), sampler_seed=seed, **common)
        return self._train, SpreadMQARDataset(int(d.num_test), seed=2 * seed + 2, **common)

    def training_loss(self, model, batch):
        cache, x, y = pass_state(model, int(self.cfg.data.seq_len), *batch)  # a long document: its earlier windows
        return super().training_loss(model, (x, y), cache)
