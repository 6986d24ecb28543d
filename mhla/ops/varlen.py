"""Variable-length (packed) batches in flash-linear-attention's ``cu_seqlens`` convention.

``N`` sequences are concatenated along the token axis of a batch of one: ``x: [1, total_T, ...]``, and
``cu_seqlens: [N + 1]`` (int32 or int64; 0 first, ``total_T`` last, non-decreasing) says that sequence ``n``
is tokens ``cu_seqlens[n] : cu_seqlens[n + 1]`` (it may be empty). A causal op runs on every sequence as if
it were alone: its blocks (chunks) start at the sequence's own first token and nothing crosses a boundary.

:func:`run_varlen` runs any causal op with the signature of the library's ops,
``op(q, k, v, initial_state, output_final_state) -> o`` or ``(o, state)`` on a dense ``[B, T, ...]`` batch,
on such a packed batch, in one of two ways:

* stateless calls (no initial states, no final states): the sequences are laid out as a right-padded batch
  ``[N, max_len, ...]`` (zeros behind each sequence) and the op runs once. Zeros *behind* a causal sequence
  change none of its outputs, so this equals separate calls; the work is ``N * max_len`` tokens.
* calls with states: one op call per sequence (a Python loop), the states a list of ``N`` per-sequence
  states (each of batch 1). Sequences may have consumed different numbers of tokens before, which a single
  batched state (one ``num_tokens``) cannot express.

Per-sequence states: a list of ``N`` entries, one per sequence, each the op's own state with batch 1
(:class:`mhla.ops.MHLAState`, ``(S, z)`` for linear attention, ...), or None (that sequence starts empty).
"""

from __future__ import annotations

import dataclasses

import torch


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
               empty_state=None):
    """Run the causal ``op`` on every sequence of a packed batch (module docstring).

    Args:
        op: ``op(*xs, initial_state, output_final_state)`` on dense tensors ``[B, T, ...]``; returns ``o``
            ``[B, T, ...]``, or ``(o, state)`` when ``output_final_state``.
        xs: the op's token-aligned inputs, each ``[1, total_T, ...]`` (e.g. ``(q, k, v)``).
        cu_seqlens: ``[N + 1]``, already validated (:func:`mhla.ops.validation.check_cu_seqlens`).
        initial_state: None, or a list of ``N`` per-sequence states (batch 1; None entries start empty).
        output_final_state: also return the list of the ``N`` final states.
        empty_state: ``empty_state()`` is the state of an empty sequence that had no initial state (needed
            only with ``output_final_state``).
    Returns:
        ``o: [1, total_T, ...]``, or ``(o, states)`` with ``states`` a list of ``N``.
    """
    if initial_state is None and not output_final_state:
        seq, pos = token_index(cu_seqlens.to(xs[0].device))
        num_seqs = cu_seqlens.numel() - 1
        out = op(*(pad_sequences(x, seq, pos, num_seqs) for x in xs), None, False)
        return out[seq, pos].unsqueeze(0)
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
