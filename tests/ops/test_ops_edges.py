"""The operator's edges: the decode step's input checks, non-finite values against causality, the option
checks (mixing values, state, eps), and a causal block far longer than the sequence."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mhla.ops import MHLAState, init_state, mhla_attention, mhla_decode_step

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


def rand_qkv(B, T, H, D, Dv=None, *, dtype=F64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, T, H, D, generator=g, dtype=F64)
    k = torch.rand(B, T, H, D, generator=g, dtype=F64)
    v = torch.randn(B, T, H, Dv or D, generator=g, dtype=F64)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def rand_mixing(M, *, seed=1, dtype=F64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(M, M, generator=g, dtype=F64).to(device=device, dtype=dtype)


def triton_ready() -> bool:
    try:
        from mhla.ops.mhla.triton import backend as triton_backend  # noqa: PLC0415
    except Exception:
        return False
    return triton_backend.available()


needs_triton = pytest.mark.skipif(not triton_ready(), reason="Triton kernels cannot run here")


class TensorSizeLimit(TorchDispatchMode):
    """Fails as soon as an op returns a tensor of more than ``limit`` bytes (a memory check that stops
    before anything large is allocated)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.limit:
                raise AssertionError(f"{func} made a {tuple(t.shape)} tensor, over {self.limit} bytes")
        return out


# ------------------------------------------------------------------------------- decode-step checks


def decode_inputs():
    q, k, v = rand_qkv(2, 1, 3, 4)
    return q, k, v, rand_mixing(4), init_state(2, 3, 4, 4, 8, dtype=F64)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, v: (q, k[:1], v[:1]), "batch sizes differ"),
        (lambda q, k, v: (q, k, v[:1]), "batch sizes differ"),
        (lambda q, k, v: (q, k[:, :, :1], v[:, :, :1]), "head counts differ"),
        (lambda q, k, v: (q, k, v[:, :, :1]), "head counts differ"),
        (lambda q, k, v: (q, k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1)), "same length"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), "floating point"),
        (lambda q, k, v: (q[:, 0, 0], k, v), "4 dims"),
    ],
    ids=["k-batch", "v-batch", "kv-heads", "v-heads", "k-two-tokens", "int64", "q-2d"],
)
def test_decode_step_checks_its_inputs_like_mhla_attention(change, match):
    q, k, v, mix, st = decode_inputs()
    with pytest.raises(ValueError, match=match):
        mhla_decode_step(*change(q, k, v), mix, st)


def test_decode_step_without_a_state_is_a_value_error():
    q, k, v, mix, _ = decode_inputs()
    with pytest.raises(ValueError, match="MHLAState"):
        mhla_decode_step(q, k, v, mix, None)


# ------------------------------------------------------------------------- non-finite vs causality


def poisoned(q, k, v, name, pos, value):
    x = {"q": q, "k": k.clone(), "v": v.clone()}
    x[name][:, pos] = value
    return x["q"], x["k"], x["v"]


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("C", [4, 5, 8, 13, 32, 50])
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("normalize", [True, False])
def test_nonfinite_token_reaches_no_earlier_output(backend, C, name, value, normalize):
    T, pos = 32, 20
    q, k, v = rand_qkv(2, T, 2, 4, 3)
    mix = rand_mixing(math.ceil(T / C))
    kw = dict(causal=True, normalize=normalize, backend=backend)
    clean = mhla_attention(q, k, v, mix, C, **kw)
    got = mhla_attention(*poisoned(q, k, v, name, pos, value), mix, C, **kw)
    assert torch.isfinite(got[:, :pos]).all()
    torch.testing.assert_close(got[:, :pos], clean[:, :pos], rtol=0, atol=1e-12)
    assert not torch.isfinite(got[:, pos]).all()  # the value is not dropped either


@pytest.mark.parametrize("impl", ["chunked", "reference"])
@pytest.mark.parametrize("C", [4, 5, 13, 64])
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("normalize", [True, False])
def test_linear_attention_nonfinite_token_reaches_no_earlier_output(impl, C, name, value, normalize):
    from mhla.ops.linear import linear_attention, linear_reference  # noqa: PLC0415

    T, pos = 32, 20
    q, k, v = rand_qkv(2, T, 2, 4, 3)
    if impl == "chunked":
        def run(q, k, v):
            return linear_attention(q, k, v, causal=True, normalize=normalize, chunk_size=C)
    else:
        def run(q, k, v):
            return linear_reference(q, k, v, causal=True, normalize=normalize)
    clean = run(q, k, v)
    got = run(*poisoned(q, k, v, name, pos, value))
    assert torch.isfinite(got[:, :pos]).all()
    torch.testing.assert_close(got[:, :pos], clean[:, :pos], rtol=0, atol=1e-12)
    assert not torch.isfinite(got[:, pos]).all()


@pytest.mark.parametrize("C", [5, 8, 32])
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("entry", [(), (0, 1)], ids=["token", "one-entry"])
def test_nonfinite_outputs_are_those_of_token_by_token_decoding(C, name, entry):
    """Same finite / non-finite pattern as decoding, also when one entry (head 0, feature 1) is NaN."""
    T, pos = 32, 20
    q, k, v = rand_qkv(1, T, 2, 4, 3)
    {"k": k, "v": v}[name][(slice(None), pos, *entry)] = NAN
    mix = rand_mixing(math.ceil(T / C))
    st = init_state(1, 2, 4, 3, C, dtype=F64)
    steps = []
    for t in range(T):
        o, st = mhla_decode_step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], mix, st)
        steps.append(o)
    decoded = torch.cat(steps, dim=1)
    full = mhla_attention(q, k, v, mix, C, causal=True, backend="torch")
    assert torch.equal(torch.isfinite(full), torch.isfinite(decoded))
    assert torch.isfinite(full[:, :pos]).all()
    assert not torch.isfinite(full[:, pos:]).flatten(2).all(-1).any()  # every later output reads it
    finite = torch.isfinite(full)
    torch.testing.assert_close(full[finite], decoded[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("split", [3, 13, 21])
def test_nonfinite_token_after_a_state_reaches_no_earlier_output(split):
    T, C, pos = 32, 8, 22
    q, k, v = rand_qkv(1, T, 2, 4)
    mix = rand_mixing(4)
    clean = mhla_attention(q, k, v, mix, C, causal=True, backend="torch")
    qq, kk, vv = poisoned(q, k, v, "v", pos, NAN)
    o1, st = mhla_attention(qq[:, :split], kk[:, :split], vv[:, :split], mix, C, causal=True,
                            backend="torch", output_final_state=True)
    o2 = mhla_attention(qq[:, split:], kk[:, split:], vv[:, split:], mix, C, causal=True, backend="torch",
                        initial_state=st)
    got = torch.cat([o1, o2], dim=1)
    torch.testing.assert_close(got[:, :pos], clean[:, :pos], rtol=0, atol=1e-12)
    assert not torch.isfinite(got[:, pos:]).all(-1).any()


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's "invalid value" under the interpreter
@pytest.mark.parametrize("C", [5, 8, 20, 32])
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_triton_nonfinite_token_reaches_no_earlier_output(C, name, value):
    T, pos = 32, 20
    q, k, v = rand_qkv(1, T, 2, 16, dtype=torch.float32, device=DEVICE)
    mix = rand_mixing(math.ceil(T / C), dtype=torch.float32, device=DEVICE)
    clean = mhla_attention(q, k, v, mix, C, causal=True, backend="triton")
    got = mhla_attention(*poisoned(q, k, v, name, pos, value), mix, C, causal=True, backend="triton")
    assert torch.isfinite(got[:, :pos]).all()
    torch.testing.assert_close(got[:, :pos], clean[:, :pos], rtol=1e-6, atol=1e-6)
    assert not torch.isfinite(got[:, pos]).all()


# -------------------------------------------------------------------------------------- option checks


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("value", [INF, -INF], ids=["inf", "-inf"])
def test_infinite_mixing_is_rejected(causal, value):
    q, k, v = rand_qkv(1, 32, 2, 4)
    mix = rand_mixing(4)
    mix[2, 1] = value
    with pytest.raises(ValueError, match="inf"):
        mhla_attention(q, k, v, mix, 8, causal=causal, backend="torch")
    if causal:
        st = init_state(1, 2, 4, 4, 8, dtype=F64)
        st.num_tokens = 16
        st.block_summaries = torch.zeros(1, 2, 2, 4, 4, dtype=F64)
        st.block_key_sums = torch.zeros(1, 2, 2, 4, dtype=F64)
        with pytest.raises(ValueError, match="inf"):
            mhla_decode_step(q[:, :1], k[:, :1], v[:, :1], mix, st)


@pytest.mark.parametrize(
    "state",
    [
        lambda: (torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4)),
        lambda: torch.zeros(1, 2, 4, 4, dtype=F64),
        lambda: {"num_tokens": 0},
    ],
    ids=["tuple", "tensor", "dict"],
)
def test_initial_state_of_the_wrong_type_is_rejected(state):
    q, k, v = rand_qkv(1, 16, 2, 4)
    with pytest.raises(ValueError, match="MHLAState"):
        mhla_attention(q, k, v, rand_mixing(4), 8, causal=True, backend="torch", initial_state=state())


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("inputs,summaries", [(F64, torch.float32), (torch.float32, F64)])
def test_initial_state_of_the_wrong_dtype_is_rejected(backend, inputs, summaries):
    q, k, v = rand_qkv(1, 16, 2, 4, dtype=inputs)
    st = init_state(1, 2, 4, 4, 8, dtype=summaries)
    with pytest.raises(ValueError, match="dtype"):
        mhla_attention(q, k, v, rand_mixing(4, dtype=inputs), 8, causal=True, backend=backend,
                       initial_state=st)
    with pytest.raises(ValueError, match="dtype"):
        mhla_decode_step(q[:, :1], k[:, :1], v[:, :1], rand_mixing(4, dtype=inputs), st)


def test_initial_state_with_a_wrong_block_count_is_rejected():
    q, k, v = rand_qkv(1, 16, 2, 4)
    st = init_state(1, 2, 4, 4, 8, dtype=F64)
    st.num_tokens = 8  # claims a finished block it does not hold
    with pytest.raises(ValueError, match="finished blocks"):
        mhla_attention(q, k, v, rand_mixing(4), 8, causal=True, backend="torch", initial_state=st)


BAD_EPS = [0.0, -1e-6, NAN, INF, None, "1e-6", True, torch.tensor(1e-6)]
BAD_EPS_IDS = ["zero", "negative", "nan", "inf", "none", "str", "bool", "tensor"]


@pytest.mark.parametrize("eps", BAD_EPS, ids=BAD_EPS_IDS)
def test_eps_must_be_a_positive_float(eps):
    q, k, v = rand_qkv(1, 16, 2, 4)
    mix = rand_mixing(2)
    for kw in (dict(causal=False), dict(causal=True), dict(causal=True, backend="reference")):
        with pytest.raises(ValueError, match="eps"):
            mhla_attention(q, k, v, mix, 8, eps=eps, **kw)
    with pytest.raises(ValueError, match="eps"):
        mhla_decode_step(q[:, :1], k[:, :1], v[:, :1], mix, init_state(1, 2, 4, 4, 8, dtype=F64), eps=eps)


def test_good_eps_values_are_accepted():
    q, k, v = rand_qkv(1, 16, 2, 4)
    mix = rand_mixing(2)
    a = mhla_attention(q, k, v, mix, 8, causal=True, eps=1)
    b = mhla_attention(q, k, v, mix, 8, causal=True, eps=1.0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------- a block longer than the call


@pytest.mark.parametrize("normalize", [True, False])
def test_block_far_longer_than_the_sequence_costs_only_its_tokens(normalize):
    T, C = 5, 2**15
    q, k, v = rand_qkv(1, T, 1, 4)
    mix = rand_mixing(1)
    kw = dict(causal=True, normalize=normalize, backend="torch")
    with TensorSizeLimit(16 * 1024):
        got = mhla_attention(q, k, v, mix, C, **kw)
        o1, st = mhla_attention(q[:, :3], k[:, :3], v[:, :3], mix, C, output_final_state=True, **kw)
        o2, st = mhla_attention(q[:, 3:4], k[:, 3:4], v[:, 3:4], mix, C, initial_state=st,
                                output_final_state=True, **kw)
        o3, st = mhla_decode_step(q[:, 4:], k[:, 4:], v[:, 4:], mix, st, normalize=normalize)
    want = mhla_attention(q, k, v, mix, T, **kw)  # with T <= C there is one block of T tokens
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([o1, o2, o3], dim=1), want, rtol=1e-12, atol=1e-12)
    assert st.num_tokens == T and st.block_summaries.shape[2] == 0
    torch.testing.assert_close(mhla_attention(q, k, v, mix, C, causal=True, normalize=normalize,
                                              backend="reference"), want, rtol=1e-12, atol=1e-12)


def test_call_that_finishes_a_huge_block_costs_only_its_tokens():
    """A state in the middle of a 2^15-token block, then a chunk that runs into the next block."""
    C, seen, T = 2**15, 2**15 - 3, 5
    q, k, v = rand_qkv(1, T, 1, 4)
    mix = rand_mixing(2)
    _, k0, v0 = rand_qkv(1, 3, 1, 4, seed=5)  # the 3 tokens of block 0 the state summarises

    def state(num_tokens, block_size):
        return MHLAState(
            block_summaries=torch.zeros(1, 1, 0, 4, 4, dtype=F64),
            block_key_sums=torch.zeros(1, 1, 0, 4, dtype=F64),
            current_summary=torch.einsum("bthd,bthe->bhde", k0, v0),
            current_key_sum=k0.sum(1),
            num_tokens=num_tokens,
            block_size=block_size,
        )

    with TensorSizeLimit(16 * 1024):
        got, st = mhla_attention(q, k, v, mix, C, causal=True, backend="torch", initial_state=state(seen, C),
                                 output_final_state=True)
    # The same geometry with a block of 8: 5 tokens seen, 3 left in block 0, then 2 in block 1.
    want, st8 = mhla_attention(q, k, v, mix, 8, causal=True, backend="torch", initial_state=state(5, 8),
                               output_final_state=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.block_summaries, st8.block_summaries, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.current_summary, st8.current_summary, rtol=1e-12, atol=1e-12)
    assert st.num_tokens == seen + T


@needs_triton
def test_triton_block_far_longer_than_the_sequence_costs_only_its_tokens():
    T, C = 5, 2**15
    q, k, v = rand_qkv(1, T, 1, 16, dtype=torch.float32, device=DEVICE)
    mix = rand_mixing(1, dtype=torch.float32, device=DEVICE)
    kw = dict(causal=True, backend="triton", output_final_state=True)
    mhla_attention(q, k, v, mix, C, **kw)  # on a GPU the autotuner's first run allocates its own buffers
    with TensorSizeLimit(64 * 1024):
        got, st = mhla_attention(q, k, v, mix, C, **kw)
    want = mhla_attention(q, k, v, mix, T, causal=True, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert st.num_tokens == T and st.block_summaries.shape[2] == 0
