"""Variable-length (packed) batches in flash-linear-attention's ``cu_seqlens`` convention.

``N`` sequences are concatenated along the token axis of a batch of one: ``x: [1, total_T, ...]``, and
``cu_seqlens: [N + 1]`` (int32 or int64; 0 first, ``total_T`` last, non-decreasing) says that sequence ``n``
is tokens ``cu_seqlens[n] : cu_seqlens[n + 1]`` (it may be empty). A causal op runs on every sequence as if
it were alone: its blocks (chunks) start at the sequence's own first token and nothing crosses a boundary.

:func:`run_varlen` runs any causal op with the signature of the library's ops,
``op(q, k, v, initial_state, output_final_state) -> o`` or ``(o, state)`` on a dense ``[B, T, ...]`` batch,
on such a packed batch, in one of two ways:

* stateless calls (no initial states, no final states): length buckets. The non-empty sequences are sorted
  by length and cut into contiguous groups (:func:`bucket_sequences`); each group runs as one right-padded
  batch ``[group_size, group_max_len, ...]`` (zeros behind each sequence; a group of one is the sequence's
  own slice, unpadded), and the outputs are put back in the packed order. Zeros *behind* a causal sequence
  change none of its outputs, so this equals separate calls. The cut minimises
  ``sum(group_size * group_max_len) + call_cost_tokens * number_of_groups``: the work is that of the padded
  tokens of the groups (about ``total_T`` for any mix of lengths, not ``N * max_len``) plus a fixed cost per
  op call.
* calls with states: one op call per sequence (a Python loop), the states a list of ``N`` per-sequence
  states (each of batch 1). Sequences may have consumed different numbers of tokens before, which a single
  batched state (one ``num_tokens``) cannot express.

Per-sequence states: a list of ``N`` entries, one per sequence, each the op's own state with batch 1
(:class:`mhla.ops.MHLAState`, ``(S, z)`` for linear attention, ...), or None (that sequence starts empty).
"""

from __future__ import annotations

import dataclasses

import torch

# The fixed cost of one op call, in tokens (of work of the op on one token), that bucket_sequences weighs
# against padding. CPU: one causal MHLA call (torch path, H=8, D=64, fp32, one thread) costs about 1 ms
# (forward) / 2 ms (fwd+bwd) on top of its tokens, which cost about 18 / 35 us each (measured on a loaded
# 2-core EPYC, T = 1 ... 2048): about 55 tokens. The fixed cost grows with the mixing matrix (its values are
# checked on every call: ~5 ms for [8, 256, 256]), so 128. Padding costs at least its tokens (on the torch
# path more: the per-token cost grows with the padded length), which keeps the default modest.
# CUDA (not measured here): a call is ~50-100 kernel launches (~0.3 ms of host time) while a token costs
# ~10-50 ns on the fused kernels, and a small batch leaves the GPU idle: batching short sequences pays, so
# padding is cheaper than a call until thousands of tokens; 4096.
CALL_COST_TOKENS = {"cpu": 128, "cuda": 4096}


def default_call_cost_tokens(device: torch.device | str) -> int:
    """:data:`CALL_COST_TOKENS` for ``device`` (CPU; any other device counts as CUDA)."""
    return CALL_COST_TOKENS["cpu" if torch.device(device).type == "cpu" else "cuda"]


def bucket_sequences(lengths: list[int], call_cost_tokens: int) -> list[list[int]]:
    """Group the non-empty sequences into length buckets, each to run as one right-padded batch.

    Sorted by length (ties by index), the sequences are cut into contiguous groups that minimise
    ``sum(len(group) * max length in group) + call_cost_tokens * number_of_groups``; an exchange argument
    shows that some optimal grouping is contiguous in the sorted order, so this is the optimum over all
    groupings. Exact dynamic program ``f[j] = min_i f[i] + (j - i) * L[j-1] + c`` over the sorted lengths
    ``L``, evaluated with the monotone convex-hull trick (lines ``-i * x + f[i]`` of decreasing slope, queried
    at non-decreasing ``x = L[j-1]``), in O(N) after the sort: no fallback rule is needed for large ``N``.
    Integer arithmetic throughout (exact).

    Args:
        lengths: the ``N`` sequence lengths (>= 0); empty sequences belong to no group.
        call_cost_tokens: the fixed cost of one op call, in tokens (>= 0).
    Returns:
        The groups, each a list of sequence indices, ascending in length; groups in ascending length.
    """
    if call_cost_tokens < 0:
        raise ValueError(f"call_cost_tokens must be >= 0, got {call_cost_tokens}")
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (lengths[i], i))
    L = [lengths[i] for i in order]
    n = len(L)
    f = [0] * (n + 1)
    prev = [0] * (n + 1)
    hull: list[int] = [0]  # candidate cut points i (lines y = -i * x + f[i]), slopes decreasing
    head = 0  # queries x are non-decreasing: the best line only moves towards the back

    def useless(a: int, b: int, c: int) -> bool:
        """Line ``b`` (between ``a`` and ``c``, a < b < c) is nowhere strictly below both others."""
        # intersection(a, c) <= intersection(a, b): (f[c] - f[a]) / (c - a) <= (f[b] - f[a]) / (b - a)
        return (f[c] - f[a]) * (b - a) <= (f[b] - f[a]) * (c - a)

    def at(i: int, x: int) -> int:  # line i at x
        return f[i] - i * x

    for j in range(1, n + 1):
        x = L[j - 1]
        while head + 1 < len(hull) and at(hull[head + 1], x) <= at(hull[head], x):
            head += 1
        i = hull[head]
        f[j] = f[i] + (j - i) * x + call_cost_tokens
        prev[j] = i
        while len(hull) - head >= 2 and useless(hull[-2], hull[-1], j):
            hull.pop()
        hull.append(j)
    groups = []
    j = n
    while j > 0:
        groups.append(order[prev[j]:j])
        j = prev[j]
    return groups[::-1]


def sequence_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the ``N`` sequences (one host copy of ``cu_seqlens``)."""
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def token_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token of the packed batch: its sequence and its position in that sequence.

    Returns ``seq, pos: [total_T]`` (int64), ``seq[t] = n`` and ``pos[t] = t - cu_seqlens[n]``.
    """
    cu = cu_seqlens.long()
    n = cu.numel() - 1
    seq = torch.repeat_interleave(torch.arange(n, device=cu.device), cu.diff())
    pos = torch.arange(seq.numel(), device=cu.device) - cu[seq]
    return seq, pos


def pad_sequences(x: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``x: [1, total_T, ...]`` -> ``[N, max_len, ...]``, each sequence left-aligned, zeros behind it
    (``seq``, ``pos`` from :func:`token_index`). Differentiable."""
    max_len = int(pos.max()) + 1
    out = x.new_zeros(num_seqs, max_len, *x.shape[2:])
    return out.index_put((seq, pos), x[0])


def run_varlen(op, xs, cu_seqlens: torch.Tensor, *, initial_state=None, output_final_state: bool = False,
               empty_state=None, call_cost_tokens: int | None = None):
    """Run the causal ``op`` on every sequence of a packed batch (module docstring).

    Args:
        op: ``op(*xs, initial_state, output_final_state)`` on dense tensors ``[B, T, ...]``; returns ``o``
            ``[B, T, ...]``, or ``(o, state)`` when ``output_final_state``.
        xs: the op's token-aligned inputs, each ``[1, total_T, ...]`` (e.g. ``(q, k, v)``).
        cu_seqlens: ``[N + 1]``, already validated (:func:`mhla.ops.utils.validation.check_cu_seqlens`).
        initial_state: None, or a list of ``N`` per-sequence states (batch 1; None entries start empty).
        output_final_state: also return the list of the ``N`` final states.
        empty_state: ``empty_state()`` is the state of an empty sequence that had no initial state (needed
            only with ``output_final_state``).
        call_cost_tokens: stateless calls only: the fixed cost of one op call in tokens, which the length
            buckets (:func:`bucket_sequences`) weigh against padding; 0 runs every sequence alone (no
            padding), a huge value runs all in one batch padded to the longest. Default
            :func:`default_call_cost_tokens` of the inputs' device (:data:`CALL_COST_TOKENS`).
    Returns:
        ``o: [1, total_T, ...]``, or ``(o, states)`` with ``states`` a list of ``N``.
    """
    if initial_state is None and not output_final_state:
        return _run_buckets(op, xs, cu_seqlens, call_cost_tokens)
    bounds = sequence_bounds(cu_seqlens)
    states = list(initial_state) if initial_state is not None else [None] * len(bounds)
    outs, finals = [], []
    for (start, end), state in zip(bounds, states):
        if start == end:  # an empty sequence: no output, its state unchanged
            finals.append(state if state is not None else (empty_state() if output_final_state else None))
            continue
        res = op(*(x[:, start:end] for x in xs), state, output_final_state)
        o, final = res if output_final_state else (res, None)
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=1)
    return (o, finals) if output_final_state else o


def _run_buckets(op, xs, cu_seqlens: torch.Tensor, call_cost_tokens: int | None) -> torch.Tensor:
    """The stateless path of :func:`run_varlen`: one op call per length bucket, outputs in packed order."""
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    device = xs[0].device
    if call_cost_tokens is None:
        call_cost_tokens = default_call_cost_tokens(device)
    groups = bucket_sequences(lengths, call_cost_tokens)
    if not groups:  # no tokens at all: the op on the (empty) packed batch, as a dense call would be
        return op(*xs, None, False)
    pieces = []  # per group: its outputs, flat [tokens of its sequences in group order, ...]
    for group in groups:
        if len(group) == 1:  # a sequence alone: its own slice, nothing padded
            a, b = cu[group[0]], cu[group[0] + 1]
            pieces.append(op(*(x[:, a:b] for x in xs), None, False)[0])
            continue
        seq, pos, src = _group_index([cu[n] for n in group], [lengths[n] for n in group], device)
        width = lengths[group[-1]]  # the group is ascending in length

        def pad(x, seq=seq, pos=pos, src=src, size=len(group), width=width):
            return x.new_zeros(size, width, *x.shape[2:]).index_put((seq, pos), x[0].index_select(0, src))

        pieces.append(op(*(pad(x) for x in xs), None, False)[seq, pos])
    order = [n for group in groups for n in group]
    if all(len(g) == 1 for g in groups):  # one call per sequence: put the outputs back in packed order
        by_seq = dict(zip(order, pieces))
        return torch.cat([by_seq[n] for n in sorted(by_seq)], dim=0).unsqueeze(0)
    flat = torch.cat(pieces, dim=0)
    if order == sorted(order):  # the groups already hold the sequences in packed order
        return flat.unsqueeze(0)
    _, _, src_all = _group_index([cu[n] for n in order], [lengths[n] for n in order], "cpu")  # packed rows
    inverse = torch.empty_like(src_all)
    inverse[src_all] = torch.arange(src_all.numel())
    return flat.index_select(0, inverse.to(device)).unsqueeze(0)


def _group_index(starts: list[int], lens: list[int], device) -> tuple[torch.Tensor, ...]:
    """For the tokens of a group of sequences (packed starts, lengths), in group order: their row in the
    padded batch, their position in their sequence, and their packed token index (int64, on ``device``)."""
    lens_t = torch.tensor(lens, device=device)
    total = sum(lens)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t, output_size=total)
    first = torch.tensor([0, *lens[:-1]], device=device).cumsum(0)  # flat offset of each sequence
    pos = torch.arange(total, device=device) - first[seq]
    src = torch.tensor(starts, device=device)[seq] + pos
    return seq, pos, src


def unbind_state(state, n: int) -> list:
    """Split a batched state (batch dim 0 of every tensor) into ``n`` per-sequence states of batch 1.

    ``state``: a tensor, a tuple of tensors, a dataclass such as :class:`mhla.ops.MHLAState` (its non-tensor
    fields are shared), or None (-> ``[None] * n``).
    """
    if state is None:
        return [None] * n
    if torch.is_tensor(state):
        if state.shape[0] != n:
            raise ValueError(f"a batched state of batch {state.shape[0]} cannot be split into {n} sequences")
        return list(state.split(1))
    if isinstance(state, tuple):
        parts = [unbind_state(s, n) for s in state]
        return [tuple(p[i] for p in parts) for i in range(n)]
    if dataclasses.is_dataclass(state):
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
        parts = {k: unbind_state(v, n) for k, v in fields.items() if torch.is_tensor(v)}
        return [dataclasses.replace(state, **{k: p[i] for k, p in parts.items()}) for i in range(n)]
    raise TypeError(f"cannot split a state of type {type(state).__name__}")
