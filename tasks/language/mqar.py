"""MQAR: multi-query associative recall (Zoology; Arora, Eyuboglu et al. 2023), data and a Task for the Trainer.

Definition (the one of ``multiquery_ar`` in HazyResearch/zoology, re-implemented here). Vocabulary ``V``; keys
are drawn from ``[1, V/2)``, values from ``[V/2, V)``; each example has ``K`` distinct keys and ``K`` distinct
values. A sequence of length ``N``:

* positions ``0 .. 2K-1``: the key-value pairs ``k_1 v_1 k_2 v_2 ... k_K v_K`` (after ``pairs_offset`` filler
  tokens when that option is set; everything below then moves right by the offset);
* the query region, positions ``2K .. N-1``: query ``j`` (the key ``k_j`` again) is placed at
  ``2K + 2 * g_j``, with distinct gaps ``g_j`` drawn without replacement from ``{0, .., (N - 2K)/2 - 1}`` with
  probability ``p(g) ∝ a (g + 1)^(a - 1)`` (power law, ``a = power_a``; small gaps are likely, ``a = 1`` is
  uniform); every other query-region position is ``0``, replaced by a uniform random token from ``[0, V)``
  when ``random_non_queries`` (the default);
* labels are ``-100`` everywhere except at each query position ``2K + 2 g_j``, whose label is ``v_j``: the model
  must output the value of the key it just read. Accuracy = fraction of these positions predicted exactly.

Labels are aligned with the inputs (``labels[t]`` is the target of the logits at ``t``), not shifted.

Gaps are sampled with the Gumbel-top-k trick, which draws ``K`` items without replacement with the same law as
successive weighted draws (``numpy.random.choice(replace=False, p=p)``, Zoology's sampler).

``python train.py task=mqar attn=mhla|linear|softmax data.seq_len=128 data.num_kv_pairs=8`` trains one cell;
``scripts/run_mqar.py`` runs the grid and writes ``results/mqar.md``.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from mhla.mixing import mixing_matrices, normalized_rows
from models.lm import MHLALMConfig, MHLALMForCausalLM
from tasks.common.config import model_attention
from tasks.common.task import Task


def power_law_probs(space: int, power_a: float) -> np.ndarray:
    """``p(g) ∝ a (g + 1)^(a - 1)`` for ``g = 0 .. space-1`` (normalised)."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def multiquery_ar(num_examples: int, input_seq_len: int, vocab_size: int, num_kv_pairs: int,
                  power_a: float = 0.01, random_non_queries: bool = True,
                  seed: int = 0, long_context: bool = False,
                  pairs_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate MQAR sequences. Returns ``inputs [n, N]`` (int64) and ``labels [n, N]`` (``-100`` or a value).

    ``pairs_offset``: filler tokens before the key-value pairs (0, Zoology's layout: the pairs open the sequence).
    The pairs then sit at ``offset .. offset + 2K - 1`` and the queries after them; with ``offset = 0`` the
    examples are the same as without the option (the same random draws).
    """
    n, N, V, K, offset = num_examples, input_seq_len, vocab_size, num_kv_pairs, pairs_offset
    if N % 2:
        raise ValueError(f"input_seq_len must be even, got {N}")
    if V <= N and not long_context:
        raise ValueError(f"vocab_size ({V}) must exceed input_seq_len ({N}), as in Zoology; long_context=True "
                         "(the task's data.long_context=true) lifts the rule: keys, values and fillers keep their "
                         "ranges, so a longer sequence is the same task with more filler")
    if offset < 0 or 4 * K + offset > N:
        raise ValueError(f"{K} key-value pairs after {offset} filler tokens need input_seq_len >= 4 * K + offset = "
                         f"{4 * K + offset} (pairs + queries), got {N}")
    half = V // 2
    if K > half - 1:
        raise ValueError(f"{K} distinct keys do not fit in the key vocabulary [1, {half})")
    rng = np.random.default_rng(seed)
    # K distinct keys in [1, V/2) and K distinct values in [V/2, V) per example: first K of a random permutation
    keys = rng.random((n, half - 1)).argsort(axis=1)[:, :K] + 1
    values = rng.random((n, V - half)).argsort(axis=1)[:, :K] + half
    context = 2 * K
    space = (N - offset - context) // 2
    # K distinct gaps per example, weighted by the power law, without replacement (Gumbel-top-k)
    scores = np.log(power_law_probs(space, power_a))[None, :] + rng.gumbel(size=(n, space))
    gaps = np.argsort(-scores, axis=1)[:, :K]

    inputs = np.zeros((n, N), dtype=np.int64)
    inputs[:, offset:offset + context:2] = keys
    inputs[:, offset + 1:offset + context:2] = values
    qpos = offset + context + 2 * gaps                              # [n, K] query positions
    np.put_along_axis(inputs, qpos, keys, axis=1)
    labels = np.full((n, N), -100, dtype=np.int64)
    np.put_along_axis(labels, qpos, values, axis=1)
    if random_non_queries:
        filler = rng.integers(0, V, size=(n, N))
        empty = np.zeros((n, N), dtype=bool)
        empty[:, :offset] = True
        empty[:, offset + context:] = True
        np.put_along_axis(empty, qpos, False, axis=1)
        inputs = np.where(empty, filler, inputs)
    return torch.from_numpy(inputs), torch.from_numpy(labels)


class MQARDataset(Dataset):
    """A fixed set of MQAR examples; items are ``(inputs [N], labels [N])``."""

    def __init__(self, num_examples: int, seq_len: int, vocab_size: int, num_kv_pairs: int, power_a: float = 0.01,
                 random_non_queries: bool = True, seed: int = 0, long_context: bool = False, pairs_offset: int = 0):
        self.inputs, self.labels = multiquery_ar(num_examples, seq_len, vocab_size, num_kv_pairs, power_a,
                                                 random_non_queries, seed, long_context=long_context,
                                                 pairs_offset=pairs_offset)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, i: int):
        return self.inputs[i], self.labels[i]


def build_mqar_model(cfg, attn: dict | None = None, trained_context: int | None = None) -> nn.Module:
    """Our causal LM (``models.lm.MHLALMForCausalLM``) with the run's resolved attention ``attn`` (resolved from
    ``cfg`` when None) and ``cfg.model``'s sizes (context = ``data.seq_len``; ``trained_context``: the longest
    context a training row reads, :class:`models.lm.MHLALMConfig`)."""
    m = OmegaConf.to_container(cfg.model, resolve=True) if OmegaConf.is_config(cfg.model) else dict(cfg.model)
    sizes = {k: m[k] for k in ("hidden_size", "num_hidden_layers", "num_heads", "key_dim_ratio", "value_dim_ratio",
                               "intermediate_size", "rope_theta", "tie_word_embeddings") if m.get(k) is not None}
    attn = attn if attn is not None else model_attention(cfg)
    config = MHLALMConfig(attn=attn, vocab_size=int(cfg.data.vocab_size), bos_token_id=None,
                          eos_token_id=None, pad_token_id=None,
                          max_position_embeddings=int(m.get("max_position_embeddings") or cfg.data.seq_len),
                          trained_context=trained_context, **sizes)
    return MHLALMForCausalLM(config)


def mqar_loss_and_correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean cross-entropy and number of exactly predicted values over the positions with a label.

    logits ``[..., V]``, labels ``[...]`` (``-100`` = no target). Returns ``(loss, correct, count)``.
    """
    mask = labels != -100
    sel = logits[mask].float()                                       # [P, V]
    target = labels[mask]
    loss = F.cross_entropy(sel, target)
    correct = (sel.argmax(-1) == target).sum()
    return loss, correct, int(mask.sum())


def query_logits(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                 cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[P, V]`` and targets ``[P]`` at the ``P`` labelled (query) positions of ``inputs, labels [B, N]``
    (``cache``: the state of the text before ``inputs``, e.g. from a state-passed document's earlier windows).

    Only ``K`` of the ``N`` positions of a sequence have a target, so the LM head runs on those hidden states
    alone: the same loss as slicing the full ``[B, N, V]`` logits, at about ``K / N`` of the head's cost.
    """
    mask = labels != -100
    return model(inputs, past_key_values=cache, use_cache=cache is not None, logits_to_keep=mask).logits, labels[mask]


def mixing_shares(model: nn.Module) -> dict:
    """Where the learned causal mixing rows put their weight, per MHLA layer (for the logs; empty without MHLA).

    ``mix<l>_first``: mean over rows ``i >= 1`` of ``M[i, 0] / sum_b M[i, b]``, the share of the first chunk
    (where MQAR's key-value pairs are, with ``pairs_offset = 0``; a shifted layout puts only part of them
    there); ``mix<l>_diag``: the same for the diagonal (the query's own chunk).
    Uniform rows give ``mean 1/(i+1)`` for both.
    """
    out = {}
    for layer, m in enumerate(mixing_matrices(model).values()):
        w = m().detach().double()
        w = w.mean(0) if w.dim() == 3 else w                          # per-head matrices: their mean
        rows = normalized_rows(w[1:])                                 # [M-1, M]
        if rows.numel():
            out[f"mix{layer}_first"] = rows[:, 0].mean().item()
            out[f"mix{layer}_diag"] = rows.diagonal(offset=1).mean().item()
    return out


@torch.no_grad()
def recall_by_distance(model: nn.Module, seq_len: int, *, vocab_size: int, num_kv_pairs: int, num_examples: int = 256,
                       power_a: float = 1.0, edges: tuple[int, ...] = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
                       seed: int = 12345, batch_size: int = 16) -> dict:
    """Recall past the training length: MQAR examples of ``seq_len`` tokens (pairs first, the K queries at gaps
    drawn with ``power_a``: 1 = uniform over the whole sequence), accuracy overall and by the query's distance
    from the pair it recalls (``edges``: bucket bounds in tokens).

    Returns ``{"acc", "n", "buckets": [{"lo", "hi", "acc", "n"}, ...]}`` (empty buckets left out).
    """
    inputs, labels = multiquery_ar(num_examples, seq_len, vocab_size, num_kv_pairs, power_a, True, seed,
                                   long_context=True)
    K = num_kv_pairs
    device = next(model.parameters()).device
    correct, distance = [], []
    for i in range(0, num_examples, batch_size):
        x, y = inputs[i:i + batch_size].to(device), labels[i:i + batch_size].to(device)
        logits, target = query_logits(model, x, y)
        correct.append((logits.argmax(-1) == target).cpu())
        mask = (y != -100).cpu()
        pos = mask.nonzero()  # [P, 2] (row, position), in the order of logits[mask]
        keys = x.cpu()[pos[:, 0], pos[:, 1]]
        pair_pos = (x.cpu()[pos[:, 0], :2 * K:2] == keys[:, None]).float().argmax(-1) * 2  # where its key was
        distance.append(pos[:, 1] - pair_pos)
    correct, distance = torch.cat(correct), torch.cat(distance)
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (distance >= lo) & (distance < hi)
        if sel.any():
            buckets.append({"lo": lo, "hi": hi, "acc": correct[sel].float().mean().item(), "n": int(sel.sum())})
    return {"acc": correct.float().mean().item(), "n": int(correct.numel()), "buckets": buckets}


class MQARTask(Task):
    """MQAR for the shared Trainer: ``monitor = acc`` (accuracy on the value positions of the test set)."""

    monitor = "acc"
    monitor_mode = "max"

    def build_model(self) -> nn.Module:
        return build_mqar_model(self.cfg, self.attention.options, self.trained_context())

    def trained_context(self) -> int | None:
        """The longest context a training row reads, when longer than ``data.seq_len`` (None here)."""
        return None

    def describe_model(self, model: nn.Module) -> str:
        c = model.config
        chunk = f", MHLA chunk {c.attn['block_size']}" if "block_size" in c.attn else ""
        return (f"{self.cfg.model.name} ({c.num_hidden_layers} layers, width {c.hidden_size}, {c.num_heads} heads"
                f"{chunk}) with {c.attn_name} attention")

    def build_datasets(self):
        d = self.cfg.data
        common = dict(seq_len=int(d.seq_len), vocab_size=int(d.vocab_size), num_kv_pairs=int(d.num_kv_pairs),
                      power_a=float(d.power_a), random_non_queries=bool(d.random_non_queries),
                      long_context=bool(d.get("long_context", False)),
                      pairs_offset=int(d.get("pairs_offset", 0)))
        seed = int(self.cfg.get("seed", 0))
        # distinct generator seeds for train and test (Zoology builds its splits from different seeds)
        return (MQARDataset(int(d.num_train), seed=2 * seed + 1, **common),
                MQARDataset(int(d.num_test), seed=2 * seed + 2, **common))

    def example_input(self, device):
        return torch.zeros(1, int(self.cfg.data.seq_len), dtype=torch.long, device=device)

    def training_loss(self, model, batch, cache=None):
        """Query loss and accuracy of ``batch`` (``cache``: the state of the text before it, a state-passed
        document's earlier windows)."""
        x, y = batch
        loss, correct, count = mqar_loss_and_correct(*query_logits(model, x, y, cache))
        return loss, {"acc": correct.item() / max(count, 1)}

    @torch.no_grad()
    def evaluate(self, model, loader, device, dist_info) -> dict:
        tot = torch.zeros(3, device=device, dtype=torch.float64)     # loss sum, correct, count
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss, correct, count = mqar_loss_and_correct(*query_logits(model, x, y))
            tot += torch.tensor([loss.item() * count, correct.item(), count], device=device, dtype=torch.float64)
        if dist_info.enabled:
            dist.all_reduce(tot)
        return {"acc": (tot[1] / tot[2]).item(), "loss": (tot[0] / tot[2]).item(), **mixing_shares(model)}

