"""Traffic and launch model of the Triton path of :func:`mhla.ops.mhla_attention`: every launch, its bytes.

For one call (forward, and the backward of ``torch.autograd.grad(o, (q, k, v, mixing), do)``) this lists
every kernel launch in the order the code issues it: the Triton kernels of :mod:`.chunk` and :mod:`.mix` and
the torch ops between them (casts, the causal mixing diagonal and its autograd backward, small
reductions). It is derived by reading the code, and
``tests/ops/test_kernel_traffic.py`` ties it to the code: it runs the real op under the CPU interpreter,
counts every launch and its bytes, and compares with this model, so a change of the kernels that is not
carried here fails the test.

What "bytes" means:

* Triton kernels: the bytes the kernel's loads and stores address (unmasked elements of every ``tl.load`` /
  ``tl.store`` of every program), so a tile that several programs load is counted once per program. This is
  what the code asks of memory; L2 can serve some re-reads (e.g. the mixed summaries ``P`` read by every chunk
  of a block), so it is an upper bound of DRAM traffic, and the re-reads are the thing to remove.
* torch ops: every tensor operand read once (its addressed elements: a broadcast ``expand`` counts once) and
  the output written once. A reduction or a GEMM may read an operand more than once from L2; not counted.

Launches: a Triton kernel launch or a torch op that runs a kernel (views, ``empty`` and ops on empty tensors
launch nothing). Host-device synchronisations are not launches; the Triton path has none (see the test).

Scope: inputs contiguous in ``[B, T, H, D]``, no ``initial_state`` (causal), a dense mixing matrix (``[M, M]``
shared or ``[H, M, M]`` per head) of exactly ``M = ceil(T / block_size)`` blocks that requires a gradient (the
backward computes it), or (causal) compact :class:`~mhla.ops.mhla.state.MixingRows` of ``M`` rows, shared or
per head, whose tensors all require a gradient (``window``: the LM's bounded rows, mixed by
:class:`~.mix.BandedMix`: its fused kernels, :func:`banded_kernel_traffic`, for the windows they take, else its
torch reference, whose ops :func:`banded_mix_ops` counts by running it on meta tensors), the normalizer on or off, the final state returned or not (``output_final_state``: its torch ops,
forward; a loss that does not use it). Not modelled: ``initial_state`` (a continued state), a state in the
loss, ``normalize="official"`` (torch path), the CPU interpreter's own fp32 casts of bf16 inputs.

The floors (the bytes no implementation can avoid, in the input dtype):

* forward: 4 tensors, q, k, v read once and o written once;
* forward + backward: 11 tensors, the forward's 4 and the backward's 7: q, k, v and do read, dq, dk, dv
  written (o is not counted: the normalizer's ``do_t . o_t = do_t . (q_t^T P_i) / d_t`` can be formed from
  what the backward reads anyway; FlashAttention-2's backward reads o, a 12-tensor floor).

Design targets (issue 46): at most 1.5x the forward floor and 2x the forward + backward floor at ``T >= 4k``,
at most 4 launches per forward call. ``python -m mhla.ops.mhla.triton.traffic --markdown`` prints the table of
docs/kernels.md ("Traffic and launch model").

Nothing here imports triton at import time (the tile sizes are read from :mod:`.utils` when a model is built).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

F32 = 4  # fp32 summaries, running sums, denominators

DESIGN_FORWARD_RATIO = 1.5  # x the 4-tensor floor, T >= 4k
DESIGN_TOTAL_RATIO = 2.0  # x the 11-tensor floor, T >= 4k
DESIGN_FORWARD_LAUNCHES = 4


@dataclass(frozen=True)
class KernelTraffic:
    """One launch site. ``name``: the Triton kernel (``_fwd_output_kernel``) or the aten op (``aten.bmm``);
    ``step``: what the code does there; ``phase``: ``"forward"`` or ``"backward"``; ``group``: the row of the
    docs table it is summed into."""

    name: str
    launches: int
    bytes_read: int
    bytes_written: int
    phase: str
    step: str
    group: str

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def is_triton(self) -> bool:
        return not self.name.startswith("aten.")


@dataclass
class Traffic:
    """The launches of one call and the floors. Sizes as :func:`mhla_traffic`'s arguments."""

    B: int
    T: int
    H: int
    D: int
    Dv: int
    block_size: int
    dtype_bytes: int
    causal: bool
    mixing: str
    kernels: list[KernelTraffic] = field(default_factory=list)

    def phase(self, phase: str) -> list[KernelTraffic]:
        return [k for k in self.kernels if k.phase == phase]

    def launches(self, phase: str | None = None) -> int:
        return sum(k.launches for k in (self.kernels if phase is None else self.phase(phase)))

    def bytes(self, phase: str | None = None) -> int:
        return sum(k.bytes for k in (self.kernels if phase is None else self.phase(phase)))

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one ``[B, T, H, D]`` tensor in the input dtype (the floors are counted in these, with
        ``Dv`` for v, o, do, dv)."""
        return self.B * self.T * self.H * self.D * self.dtype_bytes

    @property
    def floor_forward(self) -> int:
        """q, k read, v read, o written."""
        qk, vo = self.B * self.T * self.H * self.D, self.B * self.T * self.H * self.Dv
        return (2 * qk + 2 * vo) * self.dtype_bytes

    @property
    def floor_total(self) -> int:
        """Forward (q, k, v, o) + backward (q, k, v, do read; dq, dk, dv written): 11 tensors."""
        qk, vo = self.B * self.T * self.H * self.D, self.B * self.T * self.H * self.Dv
        return (2 * qk + 2 * vo + 4 * qk + 3 * vo) * self.dtype_bytes

    @property
    def ratio_forward(self) -> float:
        return self.bytes("forward") / self.floor_forward

    @property
    def ratio_total(self) -> float:
        return self.bytes() / self.floor_total

    def targets_met(self) -> dict[str, bool]:
        """Issue 46's design targets (meant for ``T >= 4k``): forward bytes, forward + backward bytes, forward
        launches."""
        return {"forward bytes": self.ratio_forward <= DESIGN_FORWARD_RATIO,
                "forward+backward bytes": self.ratio_total <= DESIGN_TOTAL_RATIO,
                "forward launches": self.launches("forward") <= DESIGN_FORWARD_LAUNCHES}

    def groups(self, phase: str) -> list[tuple[str, int, int]]:
        """``(group, launches, bytes)`` of a phase, in order of first launch."""
        out: dict[str, list[int]] = {}
        for k in self.phase(phase):
            acc = out.setdefault(k.group, [0, 0])
            acc[0] += k.launches
            acc[1] += k.bytes
        return [(g, n, b) for g, (n, b) in out.items()]


def mix_tiles(NB: int, N: int, F: int, kind: str) -> tuple[int, int, int]:
    """The tiles of :mod:`.mix`'s GEMM kernel ``kind`` (``"fwd"``, ``"dx"``, ``"dw"``; imported when called:
    :mod:`.mix` imports triton)."""
    from .mix import _tiles  # noqa: PLC0415

    return _tiles(NB, N, F, kind)


def mix_w_once(NB: int, N: int) -> tuple[bool, int]:
    """Whether :mod:`.mix`'s kernels hold the coefficient tile, and their feature tiles per program."""
    from .mix import feature_tiles_per_program, w_once  # noqa: PLC0415

    return w_once(NB, N), feature_tiles_per_program(NB, N)


#: :mod:`.mix`'s target number of programs of the coefficient-gradient kernel (``_TARGET_PROGRAMS``)
MIX_TARGET_PROGRAMS = 256


def _geometry(T: int, D: int, Dv: int, block_size: int, causal: bool, wide: bool = False) -> dict:
    """The kernels' sizes, as :class:`mhla.ops.mhla.triton.chunk.Geometry` (a causal call inside one block
    tiles only its ``T`` tokens, as :func:`mhla.ops.mhla.triton.causal.mhla_causal_triton` does); ``wide``:
    :meth:`~mhla.ops.mhla.triton.chunk.Geometry.wide`'s feature tiles."""
    from .chunk import WIDE_TILE  # noqa: PLC0415  (imports triton; kept out of module import)
    from .utils import chunk_tile, feature_tile  # noqa: PLC0415

    C = T if causal and T <= block_size else block_size
    cap = {"max_tile": WIDE_TILE} if wide and max(D, Dv) <= WIDE_TILE else {}  # as Geometry.wide
    BT, BK, BV = chunk_tile(C), feature_tile(D, **cap), feature_tile(Dv, **cap)
    NB, NC = math.ceil(T / C), math.ceil(C / BT)
    return dict(C=C, NB=NB, NC=NC, NT=NB * NC, BT=BT, BV=BV, NK=math.ceil(D / BK), NV=math.ceil(Dv / BV))


#: ops that allocate or re-describe memory without running a kernel (as the test's recorder)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
              "alias", "lift_fresh", "detach", "set_"}
#: factory ops whose tensor argument only gives the dtype and device
_NO_READ = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}


def _addressed_bytes(t) -> int:
    """Bytes of the elements a tensor view addresses (a broadcast dim, stride 0, counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _torch_ops(fn) -> list[tuple[str, int, int]]:
    """``(aten name, bytes read, bytes written)`` of every torch op that runs a kernel while ``fn()`` runs
    (the module docstring's convention: each distinct tensor operand read once over its addressed elements,
    the output written once; views, allocations and ops with empty outputs launch nothing)."""
    import torch  # noqa: PLC0415
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415
    from torch.utils._pytree import tree_flatten  # noqa: PLC0415

    ops = []

    class _Rec(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if func.is_view or name in _NO_KERNEL:
                return out
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if not any(t.numel() for t in outs):
                return out
            ins = {id(t): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            read = 0 if name in _NO_READ else sum(_addressed_bytes(t) for t in ins.values())
            if func._schema.is_mutable:
                raise AssertionError(f"in-place op {func} in the banded mix: extend the byte convention")
            ops.append((f"aten.{name}", read, sum(t.numel() * t.element_size() for t in outs)))
            return out

    with _Rec():
        fn()
    return ops


def banded_mix_ops(B: int, H: int, G: int, NB: int, D: int, Dv: int, window: tuple[int, int],
                   normalize: bool) -> tuple[list, list]:
    """The torch ops of :class:`~.mix.BandedMix`'s reference (compact :class:`~mhla.ops.mhla.state.MixingRows`, no
    state; what runs for a window its kernels do not take, :func:`banded_fused`): ``(forward, backward)`` lists of
    ``(aten name, bytes read, bytes written)``, forward ``mix_reference`` of the summaries ``S [B, H, NB, D, Dv]``
    (and the key sums ``Z [B, H, NB, D]`` with the normalizer) and its ``backward_reference`` (the banded mix
    again under autograd, then its gradients).

    The reference is some 50 torch ops per part whose shapes follow from ``NB``, ``window`` and its band tile;
    rather than a second copy of them here, its own code runs on ``meta`` tensors (shapes only, no data, no
    time) under the byte convention of the module docstring."""
    import torch  # noqa: PLC0415

    from .mix import BandedMix  # noqa: PLC0415

    mixer = BandedMix(window, 0, 0, False, 0, NB)
    m = dict(device="meta", dtype=torch.float32)
    coeffs = (torch.empty(G, NB, window[0], **m), torch.empty(G, NB, window[1], **m), torch.empty(G, NB, **m))
    xs = [torch.empty(B, H, NB, D, Dv, **m), torch.empty(B, H, NB, D, **m) if normalize else None]
    dps = [torch.empty(B, H, NB, D, Dv, **m), torch.empty(B, H, NB, D, **m) if normalize else None]
    with torch.no_grad():
        fwd = _torch_ops(lambda: mixer.mix_reference(coeffs, xs))
    bwd = _torch_ops(lambda: mixer.backward_reference(coeffs, xs, dps, True))
    return fwd, bwd


def banded_kernel_traffic(B: int, H: int, G: int, NB: int, F1: int, F2: int, window: tuple[int, int], *,
                          first: int = 0, kept_head: int = 0, folded: bool = False, kept_recent: int = 0,
                          x_bytes: int = F32, coeff_bytes: int = F32, need_dcoeff: bool = True) -> tuple[list, list]:
    """The launches of :mod:`.banded`'s kernels (the fused :class:`~.mix.BandedMix`): ``(forward, backward)`` lists
    of ``(name, bytes read, bytes written)`` for summaries ``x [B, H, SC + NB, F1]`` (and ``[.., F2]``, 0 for none;
    ``SC`` the state's columns) in ``x_bytes`` (``P`` alike; ``dP`` and ``dx`` fp32, as the gradients are),
    coefficients ``[G, NB, ..]`` in ``coeff_bytes``.

    Per program (one feature tile of one batch x head; ``nf`` features, both parts' tiles end to end), as the
    kernels' loads and stores address them. Forward: the state's columns once (first non-finite column, folded
    sum), the head blocks (``X_head``) and the kept recent ones (Z tile 0), every call block once, ``P`` once; per
    row its ``far``, ``n_recent`` recent and ``min(n_head, first + r)`` head coefficients. Backward, the scan
    kernel: the state's columns and every call block (non-finite columns; ``FB`` written, ``nf`` int32), and with
    ``need_dcoeff`` ``dP``, every Z tile again as the previous tile of the next row tile (the Gram matrices reduce
    over chunks of features loaded from memory), the head blocks once per row tile, and the partial gradients
    (``NB * (n_head + n_recent + 1)`` fp32); the dx kernel: ``FB``, ``dP``, the coefficients as the forward,
    ``dx`` of every column once. Then (``need_dcoeff``) one ``aten.sum`` of the partials over the programs of each
    coefficient group."""
    from .banded import banded_tiles  # noqa: PLC0415  (imports triton)

    n_head, n_recent = window
    sc = kept_head + int(folded) + kept_recent
    TR, NHP, BN = banded_tiles(window, max(F1, F2))
    NT = math.ceil(NB / TR)
    tiles = [min(BN, F - f0) for F in (F1, F2) for f0 in range(0, F, BN)]  # features of each feature tile
    progs = B * H * len(tiles)
    feats = B * H * sum(tiles)  # features summed over the programs
    head_blocks = min(n_head, first + NB) if n_head else 0  # X_head: the head blocks that exist
    coeff = (NB + NB * n_recent + sum(min(n_head, first + r) for r in range(NB))) * coeff_bytes  # one walk
    K = n_head + n_recent + 1
    fwd_read = feats * (sc + head_blocks + kept_recent + NB) * x_bytes + progs * coeff
    fwd = [("_banded_fwd_kernel", fwd_read, feats * NB * x_bytes)]
    read = feats * (sc + NB) * x_bytes  # the state's columns, the call's blocks
    written = feats * 4  # FB
    if need_dcoeff:
        prev = min(NT * TR, TR + NB) - (TR - kept_recent)  # Z positions read as a previous tile
        read += feats * (prev + NT * head_blocks) * x_bytes + feats * NB * F32  # previous tiles, X_head, dP
        written += progs * NB * K * F32
    bwd = [("_banded_bwd_scan_kernel", read, written)]
    read = feats * 4 + feats * NB * F32 + progs * coeff  # FB, dP, the coefficients
    written = feats * (NB + kept_recent + int(folded) + (kept_head if n_head else 0)) * F32  # dx
    bwd.append(("_banded_bwd_dx_kernel", read, written))
    if need_dcoeff:
        bwd.append(("aten.sum", progs * NB * K * F32, G * NB * K * F32))
    return fwd, bwd


def banded_fused(window: tuple[int, int]) -> bool:
    """Whether :class:`~.mix.BandedMix` runs the kernels of :mod:`.banded` for compact rows of ``window``, or its
    torch reference (the kernels take every dtype the causal path stores summaries in: fp32, and fp16 / bf16)."""
    from .banded import fused_supported  # noqa: PLC0415

    import torch  # noqa: PLC0415

    return fused_supported(window, torch.float32)


def mhla_traffic(B: int, T: int, H: int, D: int, Dv: int | None = None, *, block_size: int,
                 dtype_bytes: int = 2, causal: bool = False, mixing: str = "shared", mixing_bytes: int = 4,
                 normalize: bool = True, window: tuple[int, int] | None = None,
                 output_final_state: bool = False, summary_bytes: int = F32) -> Traffic:
    """Model of one ``mhla_attention(q, k, v, mixing, block_size, causal=causal, backend="triton")`` call.

    Args:
        B, T, H, D, Dv: ``q, k [B, T, H, D]``, ``v [B, T, H, Dv]`` (``Dv`` defaults to ``D``).
        block_size: ``C`` (non-causal: ``T % C == 0``, ``M = T / C``; causal: ``M = ceil(T / C)``).
        dtype_bytes: bytes per element of q, k, v (2 for fp16 / bf16, 4 for fp32).
        mixing: ``"shared"`` (``[M, M]``) or ``"per_head"`` (``[H, M, M]``).
        mixing_bytes: bytes per element of the mixing matrix or rows (4: fp32; 2: bf16, read in place, their
            gradients cast back).
        normalize: the paper's normalizer (True) or none.
        window: None (a dense mixing matrix), or ``(head, recent)``: compact causal
            :class:`~mhla.ops.mhla.state.MixingRows` of ``M`` rows with that window (``mixing`` then says whether
            they are shared or per head, ``mixing_bytes`` their dtype), mixed by :class:`~.mix.BandedMix`.
        output_final_state: causal: the call also returns its final :class:`~mhla.ops.MHLAState`.
        summary_bytes: bytes per element of the block summaries ``S``, ``z`` and their mix ``P``, ``p``: 4
            (fp32, the default), or the input's with ``MHLA_SUMMARY_DTYPE=input`` (:func:`.utils.summary_dtype`;
            without a state only: a returned state, and compact rows outside the banded kernels' windows, keep
            fp32). Running sums and gradients stay fp32.
    Returns:
        :class:`Traffic`, its ``kernels`` in launch order (forward, then backward).
    """
    if mixing not in ("shared", "per_head"):
        raise ValueError(f"mixing must be 'shared' or 'per_head', got {mixing!r}")
    Dv = D if Dv is None else Dv
    if not causal and (window is not None or output_final_state):
        raise ValueError("window (MixingRows) and output_final_state are for causal=True only")
    if not causal and T % block_size:
        raise ValueError(f"non-causal MHLA needs T ({T}) to be a multiple of block_size ({block_size})")
    g = _geometry(T, D, Dv, block_size, causal)
    NB, NT, NK, NV, BV = g["NB"], g["NT"], g["NK"], g["NV"], g["BV"]
    gw = _geometry(T, D, Dv, block_size, causal, wide=True)  # the wide kernels' tiles (chunk.WIDE_TILE)
    e, mb = dtype_bytes, mixing_bytes
    BH = B * H
    Hm = H if mixing == "per_head" else 1
    M = NB
    n_qk, n_v, n_tok = B * T * H * D, B * T * H * Dv, B * T * H  # elements
    summ = BH * NB * D * Dv * F32  # dP, dS (and S, P in fp32): [B*H, NB, D, Dv]
    zsum = BH * NB * D * F32  # Z, Pz, dPz, dZ: [B*H, NB, D]
    per_chunk = BH * NT * D * Dv * F32  # R (and one read of a block summary per chunk)
    compact = window is not None
    # S, P: fp32, or (opt-in) the input dtype without a state, with dense rows or the banded kernels' compact ones
    sb = F32 if output_final_state or (compact and not banded_fused(window)) else summary_bytes
    summ_s = BH * NB * D * Dv * sb  # S, P
    per_chunk_s = BH * NT * D * Dv * sb  # P read once per chunk
    zsum_s, per_chunk_z_s = BH * NB * D * sb, BH * NT * D * sb  # Z, Pz (and Pz per chunk)
    per_chunk_z = BH * NT * D * F32
    den = BH * T * F32  # d, delta: [B*H, T]
    has_r = causal and g["NC"] > 1  # running in-block sums (causal, several chunks per block)
    mix3 = Hm * M * M * F32  # the fp32 mixing, [1 or H, M, M]
    md = mb  # the kernels read the mixing's diagonal (and compact rows) in its dtype, in place
    # compact rows [1 or H, M, k]: diag, head, recent, far (k = 1, h, r, 1); their gradients are cast back
    row_sizes = [Hm * M * w for w in ((1, window[0], window[1], 1) if compact else ())]
    coeff = Hm * NB * NB * F32  # coefficients of this call's blocks, [1 or H, NB, NB]
    out = Traffic(B, T, H, D, Dv, g["C"], e, causal, mixing)
    phase = "forward"

    def add(name, read, written, step, group, launches=1):
        out.kernels.append(KernelTraffic(name, launches, int(read), int(written), phase, step, group))

    def mix_fwd(F1: int, F2: int, step: str):
        """``mix.mix_gemm_parts``: one ``_mix_fwd_kernel`` over the summaries (``F1`` features) and the key sums
        (``F2``, 0 without) (``N = NB`` columns); causal: a row tile reads the columns before its last row only.
        The coefficients are read in the mixing's dtype: once per program when they fit one tile (``W_ONCE``,
        ``FT`` feature tiles per program), else once per feature tile and column step."""
        BM, BK, BN = mix_tiles(NB, M, max(F1, F2), "fwd")
        once, FT = mix_w_once(NB, M)
        NF = math.ceil(F1 / BN) + math.ceil(F2 / BN)
        w_pairs = x_cols = 0
        for i_m in range(math.ceil(NB / BM)):
            k_end = min(M, i_m * BM + BM - 1) if causal else M
            loaded = min(M, math.ceil(k_end / BK) * BK) if k_end > 0 else 0
            x_cols += loaded
            for r in range(i_m * BM, min(NB, i_m * BM + BM)):
                w_pairs += min(M, r) if causal else loaded
        w_loads = math.ceil(NF / FT) if once else NF
        add("_mix_fwd_kernel", BH * (w_loads * w_pairs * mb + x_cols * (F1 + F2) * sb), BH * NB * (F1 + F2) * sb,
            step, "mix GEMMs")

    def mix_bwd(F1: int, F2: int, step: str):
        """``mix.mix_gemm_parts_backward``: ``dx = coeff^T dP`` and the partial ``dcoeff = dP x^T`` (summed over
        the batch, and the heads when shared, in ``split`` partial sums that torch adds), both parts in one
        launch each."""
        BM, BK, BN = mix_tiles(NB, M, max(F1, F2), "dx")
        once, FT = mix_w_once(NB, M)
        NF = math.ceil(F1 / BN) + math.ceil(F2 / BN)
        w_pairs = dp_rows = 0
        for i_k in range(math.ceil(M / BK)):
            cols = range(i_k * BK, min(M, i_k * BK + BK))
            start = max(0, i_k * BK + 1) if causal and not once else 0
            dp_rows += max(0, NB - start)
            for r in range(start, NB):
                w_pairs += sum(1 for c in cols if c < r) if causal else len(cols)
        w_loads = math.ceil(NF / FT) if once else NF
        add("_mix_bwd_dx_kernel", BH * (w_loads * w_pairs * mb + dp_rows * (F1 + F2) * F32),
            BH * M * (F1 + F2) * F32, step + ": d summaries", "mix GEMMs")
        BM, BK, BN = mix_tiles(NB, M, max(F1, F2), "dw")
        n_m, n_k = math.ceil(NB / BM), math.ceil(M / BK)
        members = B if Hm > 1 else BH
        split = max(1, min(members, MIX_TARGET_PROGRAMS // (n_m * n_k * Hm)))
        read = 0
        for i_m in range(n_m):
            for i_k in range(n_k):
                if causal and i_k * BK >= i_m * BM + BM - 1:  # a tile above the diagonal reads nothing
                    continue
                rows, cols = min(NB, i_m * BM + BM) - i_m * BM, min(M, i_k * BK + BK) - i_k * BK
                read += Hm * members * (rows * F32 + cols * sb) * (F1 + F2)  # dP; S (and Z)
        add("_mix_bwd_dw_kernel", read, split * Hm * NB * M * F32, step + ": d coefficients (partial sums)",
            "mix GEMMs")
        add("aten.sum", split * Hm * NB * M * F32, Hm * NB * M * F32, step + ": d coefficients, partial sums",
            "mix GEMMs")

    # ------------------------------------------------------------------------------------------- forward
    # No torch op: the kernels read the mixing (the coefficients and, causal, its diagonal) in its own dtype
    # through its strides (no fp32 cast, no copy of the diagonal).
    store_z = normalize or output_final_state  # a returned state keeps the key sums
    NK, NV = (g["NK"], g["NV"]) if has_r else (gw["NK"], gw["NV"])  # wide tiles without running sums
    add("_fwd_block_summaries_kernel",
        NV * n_qk * e + NK * n_v * e,  # k once per V tile, v once per K tile
        summ_s + (zsum_s if store_z else 0) + (per_chunk if has_r else 0)
        + (per_chunk_z if has_r and store_z else 0),
        "S_b, z_b per block (fp32)" + ("; running sums R_j, r_j per chunk" if has_r else ""),
        "fwd_block_summaries")
    if compact and banded_fused(window):
        banded_fwd, banded_bwd = banded_kernel_traffic(B, H, Hm, NB, D * Dv, D if normalize else 0, window,
                                                       x_bytes=sb, coeff_bytes=mb)
        for name, r, w in banded_fwd:
            add(name, r, w, "BandedMix: P (and Pz) from the compact rows, one walk over the blocks", "banded mix")
    elif compact:
        banded_fwd, banded_bwd = banded_mix_ops(B, H, Hm, NB, D, Dv, window, normalize)
        for name, r, w in banded_fwd:
            add(name, r, w, "BandedMix: P (and Pz) from the compact rows", "banded mix (torch)")
    else:
        mix_fwd(D * Dv, D if normalize else 0, "P = coeff @ S" + (", Pz = coeff @ Z" if normalize else ""))
    # Causal, half inputs, one wide K tile and several V tiles (chunk.all_v_tiles): a program per chunk walks the
    # V tiles, q, k once, P (Pz) and R (Rz) once per chunk.
    all_v = causal and e == 2 and g["NV"] > 1 and gw["NK"] == 1
    if all_v:
        read = 2 * n_qk * e + n_v * e + per_chunk_s + (per_chunk_z_s if normalize else 0) + BH * NT * md
        if has_r:
            read += per_chunk + (per_chunk_z if normalize else 0)  # R, Rz
        add("_fwd_output_all_v_kernel", read, n_v * e + (den if normalize else 0), "o (and d), every V tile",
            "fwd_output")
    else:
        # q once per V tile. A program walks the chunks of one block: with one K tile and no running sums it
        # reads the block's P (and Pz, per V tile) once, otherwise once per chunk. Non-causal: the wide tiles.
        NK, NV = (g["NK"], g["NV"]) if causal else (gw["NK"], gw["NV"])
        one_k = NK == 1 and not has_r
        read = NV * n_qk * e + (summ_s if one_k else per_chunk_s)
        read += (NV * (zsum_s if one_k else per_chunk_z_s) if normalize else 0)
        if has_r:
            read += per_chunk + (NV * per_chunk_z if normalize else 0)  # R, Rz
        if causal:  # k per V tile, v, m_i per program
            read += NV * n_qk * e + n_v * e + NV * BH * (NB if one_k else NT) * md
        add("_fwd_output_kernel", read, n_v * e + (den if normalize else 0), "o (and d)", "fwd_output")

    if output_final_state:  # backend.mhla_triton: init_state, then state_after_chunk (fold_blocks)
        grp = "final state (torch)"
        s1, z1 = B * H * D * Dv * F32, B * H * D * F32  # one block's summary, key sum
        for _ in range(2 if compact else 1):  # current (and, compact, far) summary and key sum
            add("aten.zeros", 0, s1, "init_state", grp)
            add("aten.zeros", 0, z1, "init_state", grp)
        finished = T // block_size  # the call's finished blocks (it starts at token 0)
        if finished == NB:  # the call ends on a block boundary: the running sums restart at zero
            add("aten.zeros_like", 0, s1, "state: running summary", grp)
            add("aten.zeros_like", 0, z1, "state: running key sum", grp)
        if finished:
            add("aten.cat", finished * s1, finished * s1, "state: the finished blocks", grp)
            add("aten.cat", finished * z1, finished * z1, "state: their key sums", grp)
        if compact:
            kh = min(finished, window[0])
            kr = min(finished - kh, window[1])
            nf = finished - kh - kr
            if nf > 0:  # the folded blocks: summed into the far sums, the kept ones gathered
                add("aten.sum", nf * s1, s1, "state: far summary", grp)
                add("aten.add", 2 * s1, s1, "state: far summary", grp)
                add("aten.sum", nf * z1, z1, "state: far key sum", grp)
                add("aten.add", 2 * z1, z1, "state: far key sum", grp)
                add("aten.cat", (kh + kr) * s1, (kh + kr) * s1, "state: kept blocks", grp)
                add("aten.cat", (kh + kr) * z1, (kh + kr) * z1, "state: kept key sums", grp)

    # ------------------------------------------------------------------------------------------ backward
    phase = "backward"
    NK, NV, BV = (g["NK"], g["NV"], g["BV"]) if has_r else (gw["NK"], gw["NV"], gw["BV"])  # wide without R
    read = NV * n_qk * e + NK * n_v * e  # q once per V tile, do once per K tile
    written = summ + (zsum if normalize else 0)
    if normalize:
        read += NK * NV * den  # d, per program and chunk
        # delta = do . o: the V-tile-0 programs read o and the other V tiles of do; K tile 0 stores delta
        read += NK * n_v * e + NK * (n_v - n_tok * min(BV, Dv)) * e
        written += den
    if has_r:
        read += per_chunk + (per_chunk_z if normalize else 0)
        written += per_chunk + (per_chunk_z if normalize else 0) + NK * NV * BH * NB * F32
    add("_bwd_block_grads_kernel", read, written,
        "dP_i, dp_i" + (", delta = do . o" if normalize else "") + (", dR_j, the R part of dm_i" if has_r else ""),
        "bwd_block_grads")
    if has_r:
        add("aten.sum", NK * NV * BH * NB * F32, BH * NB * F32, "dm_r: sum over tiles",
            "small reductions (torch)")

    if compact and banded_fused(window):
        for name, r, w in banded_bwd:
            add(name, r, w, "BandedMix backward: dS (dZ), d rows" + (" (partial sums)" if name.startswith("_")
                                                                      else ": sum of the partial sums"),
                "banded mix")
    elif compact:
        for name, r, w in banded_bwd:
            add(name, r, w, "BandedMix backward: dS (dZ), d rows (recomputed under autograd)",
                "banded mix (torch)")
    else:
        mix_bwd(D * Dv, D if normalize else 0, "dS = coeff^T @ dP" + (", dZ = coeff^T @ dPz" if normalize else ""))

    if all_v:  # as the forward: a program per chunk, k and q once, dS (dR) once per chunk
        read = 2 * n_qk * e + n_v * e + per_chunk + (per_chunk if has_r else 0) + (den if normalize else 0)
        add("_bwd_dv_all_v_kernel", read + BH * NT * md, n_v * e, "dv, every V tile", "bwd_dv")
    else:
        NK, NV = (g["NK"], g["NV"]) if causal else (gw["NK"], gw["NV"])  # non-causal: the wide tiles
        read = NV * n_qk * e + per_chunk  # k per V tile; every chunk reads its block's dS
        if has_r:
            read += per_chunk
        if causal:
            read += NV * n_qk * e + n_v * e + (NV * den if normalize else 0) + NV * BH * NT * md
        add("_bwd_dv_kernel", read, n_v * e, "dv", "bwd_dv")

    NK, NV = g["NK"], g["NV"]  # tiles of at most 64
    read = 2 * NK * n_v * e + per_chunk_s + per_chunk  # do, v per K tile; P, dS per chunk
    read += (2 * NK * den + per_chunk_z_s + per_chunk_z if normalize else 0)  # d, delta once per program; Pz, dSz
    if has_r:
        read += 2 * per_chunk + (2 * per_chunk_z if normalize else 0)  # R, dR (Rz, dRz)
    written = 2 * n_qk * e
    if causal:
        read += 2 * n_qk * e + NK * BH * NT * md  # q, k (the intra-chunk part); m_i
        written += NK * BH * NT * F32
    add("_bwd_dqk_kernel", read, written, "dq, dk" + (", the intra-chunk part of dm_i" if causal else ""),
        "bwd_dqk")

    if causal:
        grp = "small reductions (torch)"
        add("aten.sum", NK * BH * NT * F32, BH * NT * F32, "dm_i: sum over K tiles", grp)
        add("aten.sum", BH * NT * F32, BH * NB * F32, "dm_i: sum over the chunks of a block", grp)
        if has_r:
            add("aten.add", 2 * BH * NB * F32, BH * NB * F32, "dm = dm_i + dm_r", grp)
        add("aten.sum", BH * NB * F32, H * NB * F32, "dmdiag: sum over the batch", grp)
        if mixing == "shared":
            add("aten.sum", H * NB * F32, NB * F32, "dmdiag: sum over the heads", grp)
    if causal and compact:  # the rows' gradients back to their dtype
        if mb != F32:
            for n in row_sizes:
                if n:
                    add("aten._to_copy", n * F32, n * mb, "d rows in their dtype", "mixing casts (torch)")
    elif causal:
        grp = "causal coefficients (torch)"  # autograd of _causal_coefficients' views, in the mixing's dtype
        if mb != F32:
            add("aten._to_copy", Hm * NB * F32, Hm * NB * mb, "d diagonal in the mixing's dtype",
                "mixing casts (torch)")
        add("aten.diagonal_backward", Hm * NB * mb, Hm * M * M * mb, "backward of diagonal(mix)", grp)
        add("aten.add", 2 * Hm * M * M * mb, Hm * M * M * mb, "d mixing: the rows and the diagonal", grp)
    if mb != F32 and not compact:
        add("aten._to_copy", mix3, Hm * M * M * mb, "d mixing in the mixing's dtype", "mixing casts (torch)")
    return out


# ------------------------------------------------------------------------------------------- the docs table


def bench_num_blocks(T: int) -> int:
    """``M`` of the non-causal benchmark, as ``scripts/bench_ops.py``'s ``choose_num_blocks`` (imported from
    there when the scripts package is importable)."""
    try:
        from scripts.bench_ops import choose_num_blocks  # noqa: PLC0415
    except ImportError:  # an installed mhla without the repository's scripts
        m = 1
        while (m * 4) ** 2 <= T and T % (m * 4) == 0:
            m *= 4
        return m
    return choose_num_blocks(T)


#: The issue's benchmark shape: bf16 (inputs and mixing), B 8, H 16; causal blocks of 64 tokens
#: (``scripts/bench_ops.py --block``), non-causal M from ``choose_num_blocks``.
BENCH = dict(B=8, H=16, dtype_bytes=2, mixing_bytes=2, causal_block=64)
BENCH_DIMS = (64, 128)
BENCH_LENGTHS = (1024, 4096, 16384, 65536)


def bench_traffic(T: int, D: int, causal: bool) -> Traffic:
    C = BENCH["causal_block"] if causal else T // bench_num_blocks(T)
    return mhla_traffic(BENCH["B"], T, BENCH["H"], D, block_size=C, dtype_bytes=BENCH["dtype_bytes"],
                        causal=causal, mixing="shared", mixing_bytes=BENCH["mixing_bytes"])


#: The LM setting (``scripts/bench_ops.py``'s op ``mhla_window``): 32 learned causal rows extended by
#: ``uniform_far`` (:meth:`mhla.mixing.MixingMatrix.causal_rows`): compact rows with window (0, 31), shared,
#: bf16, blocks of 64 tokens; the benchmark's B 8, H 16.
LM_WINDOW = (0, 31)


def lm_traffic(T: int, D: int, summary_bytes: int = F32) -> Traffic:
    return mhla_traffic(BENCH["B"], T, BENCH["H"], D, block_size=BENCH["causal_block"],
                        dtype_bytes=BENCH["dtype_bytes"], causal=True, mixing="shared",
                        mixing_bytes=BENCH["mixing_bytes"], window=LM_WINDOW, summary_bytes=summary_bytes)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def markdown() -> str:
    """The tables of docs/kernels.md's "Traffic and launch model" (regenerate with ``--markdown``)."""
    lines = ["Totals: GB per call, x floor (forward: 4 tensors; forward + backward: 11), launches per call.",
             "",
             "| form | D | T | M | fwd GB | fwd x floor | fwd launches | fwd+bwd GB | fwd+bwd x floor "
             "| bwd launches | targets met (fwd bytes, fwd+bwd bytes, fwd launches) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for causal in (False, True):
        for D in BENCH_DIMS:
            for T in BENCH_LENGTHS:
                t = bench_traffic(T, D, causal)
                lines.append(
                    f"| {'causal' if causal else 'non-causal'} | {D} | {T} | {math.ceil(T / t.block_size)} "
                    f"| {_gb(t.bytes('forward'))} | {t.ratio_forward:.2f} | {t.launches('forward')} "
                    f"| {_gb(t.bytes())} | {t.ratio_total:.2f} | {t.launches('backward')} "
                    f"| {', '.join('yes' if ok else 'no' for ok in t.targets_met().values())} |")
    lines += ["", "The LM setting: causal, compact `MixingRows` with window (0, 31) (32 learned rows, `uniform_far`; "
              "`BandedMix`), shared, bf16, B 8, H 16, blocks of 64; growth: bytes against T 4096 (linear: T / 4096).",
              "",
              "| D | T | M | fwd GB | fwd x floor | fwd launches | fwd+bwd GB | fwd+bwd x floor | bwd launches "
              "| fwd growth | fwd+bwd growth |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for D in BENCH_DIMS:
        base = lm_traffic(4096, D)
        for T in BENCH_LENGTHS:
            t = lm_traffic(T, D)
            lines.append(
                f"| {D} | {T} | {math.ceil(T / t.block_size)} | {_gb(t.bytes('forward'))} | {t.ratio_forward:.2f} "
                f"| {t.launches('forward')} | {_gb(t.bytes())} | {t.ratio_total:.2f} | {t.launches('backward')} "
                f"| {t.bytes('forward') / base.bytes('forward'):.2f} | {t.bytes() / base.bytes():.2f} |")
    head = " | ".join(f"T {T}" for T in BENCH_LENGTHS)
    tables = [(f"{'Causal' if causal else 'Non-causal'}, D {D}", [bench_traffic(T, D, causal) for T in BENCH_LENGTHS])
              for causal in (False, True) for D in BENCH_DIMS]
    tables += [(f"The LM setting (compact rows), D {D}", [lm_traffic(T, D) for T in BENCH_LENGTHS])
               for D in BENCH_DIMS]
    for title, ts in tables:
        lines += ["", f"{title}: bytes per kernel in tensors (one tensor: B T H D in bf16; the floors are 4 and "
                  "11), launches per call:", "",
                  f"| phase | kernel or torch ops | launches | {head} |",
                  "|---|---|---|" + "---|" * len(ts)]
        for phase in ("forward", "backward"):
            rows = {}
            for t in ts:
                for group, n, b in t.groups(phase):
                    ns, vals = rows.setdefault(group, ([], []))
                    ns.append(n)
                    vals.append(f"{b / t.tensor_bytes:.2f}")
            for group, (ns, vals) in rows.items():
                n = str(ns[0]) if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"
                lines.append(f"| {phase} | {group} | {n} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--markdown", action="store_true", help="the docs/kernels.md tables (issue 46's shapes)")
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--per-head", action="store_true")
    p.add_argument("--summary-bytes", type=int, default=F32, help="bytes of S and P (2: MHLA_SUMMARY_DTYPE=input)")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(), end="")
        return
    t = mhla_traffic(args.B, args.T, args.H, args.D, block_size=args.block_size, dtype_bytes=args.dtype_bytes,
                     causal=args.causal, mixing="per_head" if args.per_head else "shared",
                     summary_bytes=args.summary_bytes)
    for k in t.kernels:
        print(f"{k.phase:8s} {k.name:30s} x{k.launches} read {k.bytes_read:>14,d} "
              f"written {k.bytes_written:>14,d}  {k.step}")
    print("targets met:", t.targets_met())
    print(f"forward: {t.launches('forward')} launches, {t.ratio_forward:.2f}x the 4-tensor floor; "
          f"forward+backward: {t.launches()} launches, {t.ratio_total:.2f}x the 11-tensor floor")


if __name__ == "__main__":
    main()
