"""Gated linear attention in chunks (torch): pairwise gate ratios inside a chunk, a state between chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gla_chunked(q, k, v, log_a, chunk: int = 16, scale: float | None = None):
    """GLA in chunks of ``chunk`` tokens (same inputs / output as :func:`~.naive.gla_reference`).

    Inside a chunk, with ``b_t = sum_{s <= t} log_a_s`` (cumulative within the chunk):
    ``o_t = (q_t * e^{b_t}) S_prev + sum_{s <= t} (sum_d q_td k_sd e^{b_td - b_sd}) v_s``, where the pairwise
    exponent is ``<= 0`` (no overflow); the state after the chunk is
    ``S = diag(e^{b_L}) S_prev + sum_s (k_s * e^{b_L - b_s})^T v_s``. Cost ``O(T L Dk + T Dk Dv)`` per head.
    Accumulates in fp32 for half-precision inputs.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    scale = Dk ** -0.5 if scale is None else scale
    dtype = q.dtype
    f = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    pad = (-T) % chunk
    if pad:  # zero keys/values and zero log-gates (a = 1) in the padding: the causal outputs are unchanged
        q, k, v, log_a = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, log_a))
    n = (T + pad) // chunk
    # [B, H, n, L, d]
    q, k, v, log_a = (x.to(f).reshape(B, n, chunk, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, log_a))
    q = q * scale
    b = log_a.cumsum(dim=3)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # intra-chunk scores A[t, s] = sum_d q_td k_sd exp(b_td - b_sd), s <= t
    diff = (b[..., :, None, :] - b[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
    scores = torch.einsum("bhntd,bhnsd,bhntsd->bhnts", q, k, diff.exp())
    intra = scores @ v                                             # [B, H, n, L, Dv]
    # chunk-major copies so the per-chunk matmuls below read contiguous memory: [n, B, H, L, d]
    q_in = (q * b.exp()).permute(2, 0, 1, 3, 4).contiguous()                      # weights on the carried state
    k_out = (k * (b[..., -1:, :] - b).exp()).permute(2, 0, 1, 4, 3).contiguous()  # into the next state (T)
    v_c = v.permute(2, 0, 1, 3, 4).contiguous()
    decay = b[..., -1, :].exp().permute(2, 0, 1, 3)[..., None]                    # [n, B, H, Dk, 1]
    S = q.new_zeros(B, H, Dk, Dv)
    inter = []
    for i in range(n):
        inter.append(q_in[i] @ S)
        S = torch.baddbmm(S.mul(decay[i]).view(-1, Dk, Dv), k_out[i].view(-1, Dk, chunk),
                          v_c[i].view(-1, chunk, Dv)).view(B, H, Dk, Dv)
    o = intra + torch.stack(inter, dim=2)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, Dv)[:, :T]
    return o.to(dtype)
