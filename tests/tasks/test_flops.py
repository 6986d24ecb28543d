"""FLOP counting (:func:`tasks.common.utils.count_flops`) and the trainer's model line (repo issue 16).

``torch.utils.flop_counter`` has no formula for the CPU SDPA kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) and counted softmax attention on CPU as 0; count_flops adds
one, equal to the explicit ``softmax(q k^T) v``. The trainer's model line also gives DeiT's count at the paper's
unpadded 224 px beside the padded 256 px one.
"""

import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import models  # noqa: F401  (registers the DeiT models)
from mhla.registry import accepted_options, build_attention, get_attention_class, list_attentions
from models.deit import deit
from tasks.common.utils import count_flops, sdpa_flop_formulas

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_SDPA_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.packets = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.packets.add(func._overloadpacket)
        return func(*args, **(kwargs or {}))


def plain_count(model, *inputs) -> int:
    """What count_flops counted before: FlopCounterMode without the SDPA formulas."""
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter.get_total_flops()


def explicit_attention(q, k, v, mask=None):
    if k.shape[-3] != q.shape[-3]:  # GQA: broadcast the key / value heads
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


# ------------------------------------------------------------------------------ SDPA on CPU

def test_cpu_sdpa_op_and_mapping():
    """F.scaled_dot_product_attention on CPU runs the CPU flash kernel; the mapping covers it (and its backward)
    with OpOverloadPacket keys, the counter's own, unless this torch has a formula for it already."""
    q = torch.randn(1, 2, 8, 16)
    with OpLog() as log:
        F.scaled_dot_product_attention(q, q, q)
    assert CPU_SDPA in log.packets
    mapping = sdpa_flop_formulas()
    assert all(isinstance(op, torch._ops.OpOverloadPacket) for op in mapping)
    for op in (CPU_SDPA, CPU_SDPA_BACKWARD):
        assert (op in mapping) == (op not in flop_registry)
    if CPU_SDPA not in flop_registry:  # the bug: the plain counter sees nothing
        assert plain_count(Fn(F.scaled_dot_product_attention), q, q, q) == 0


SHAPES = {  # q, k, v shapes, SDPA kwargs
    "self": ((2, 3, 16, 32), (2, 3, 16, 32), (2, 3, 16, 32), {}),
    "cross": ((2, 3, 10, 32), (2, 3, 24, 32), (2, 3, 24, 32), {}),
    "gqa": ((2, 4, 12, 16), (2, 2, 20, 16), (2, 2, 20, 16), {"enable_gqa": True}),
    "causal": ((1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8), {"is_causal": True}),
    "mask": ((1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8), {"attn_mask": torch.ones(16, 16, dtype=torch.bool).tril()}),
    "3d": ((3, 16, 8), (3, 16, 8), (3, 16, 8), {}),
}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_cpu_sdpa_counts_as_explicit_math(case):
    sq, sk, sv, kw = SHAPES[case]
    q, k, v = torch.randn(sq), torch.randn(sk), torch.randn(sv)
    sdpa = count_flops(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)), q, k, v)
    mask = kw.get("attn_mask")
    if kw.get("is_causal"):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    math_ = count_flops(Fn(lambda q, k, v: explicit_attention(q, k, v, mask)), q, k, v)
    bh, lq, d = q.shape[:-2].numel(), q.shape[-2], q.shape[-1]
    assert sdpa == math_ == 2 * bh * lq * k.shape[-2] * (d + v.shape[-1]) > 0


def test_cpu_sdpa_backward_is_math_plus_the_recomputed_scores():
    """Forward + backward under the counter with the formulas: the fused kernel's backward is torch's CUDA
    convention (the explicit math's four gradient matmuls plus the recomputed Q K^T)."""
    B, H, Lq, Lk, D = 2, 3, 10, 14, 16

    def run(fn):
        q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for n in (Lq, Lk, Lk))
        with OpLog() as log, FlopCounterMode(display=False, custom_mapping=sdpa_flop_formulas()) as counter:
            fn(q, k, v).sum().backward()
        return counter.get_total_flops(), log.packets

    fused, ops = run(F.scaled_dot_product_attention)
    math_, _ = run(explicit_attention)
    assert CPU_SDPA_BACKWARD in ops
    assert fused == math_ + 2 * B * H * Lq * Lk * D


# ------------------------------------------------------------------------------ models

def test_deit_t_softmax_count_adds_exactly_the_attention():
    model, x = deit("tiny", "softmax"), torch.zeros(1, 3, 224, 224)
    before = plain_count(model, x)
    depth, heads, tokens, head_dim = 12, 3, 256, 64  # padded to 256 px: 16 x 16 tokens
    attention = depth * 2 * heads * tokens * tokens * (head_dim + head_dim)
    after = count_flops(model, x)
    assert after == before + attention
    assert after / 2e9 == pytest.approx(1.699, abs=1e-3)


@pytest.mark.parametrize("attn", ["linear", "mhla"])
def test_deit_t_linear_and_mhla_counts_unchanged(attn):
    """Their attention is plain matmuls / einsums, already counted: the SDPA formulas change nothing."""
    model, x = deit("tiny", attn), torch.zeros(1, 3, 224, 224)
    assert count_flops(model, x) == plain_count(model, x) > 0


CROSS_OPTIONS = {"mhla": {"num_blocks": 16}, "mhla_cross": {"num_blocks": 4, "key_blocks": 2}}


@pytest.mark.parametrize("attn", list_attentions())
def test_every_registered_attention_core_is_counted(attn):
    """The FLOPs a layer does outside its child modules (the attention itself, not qkv / proj / convs) are at
    least linear attention's two D x Dv products per token and head, whatever the attention (a cross-attention
    reads a condition of N tokens)."""
    N, C, H = 64, 32, 2
    takes_grid = "grid" in (accepted_options(get_attention_class(attn)) or {"grid"})
    layer = build_attention({"name": attn, **CROSS_OPTIONS.get(attn, {})}, C, H,
                            **({"grid": [8, 8]} if takes_grid else {}))
    inputs = (torch.randn(1, N, C),) * (2 if get_attention_class(attn).supports.cross else 1)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=sdpa_flop_formulas()) as counter:
        layer(*inputs)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(layer).__name__
    core = counts[root] - sum(v for name, v in counts.items() if name.startswith(root + ".") and name.count(".") == 1)
    assert core >= 2 * 2 * N * H * (C // H) * (C // H)
    if not attn.startswith("softmax"):
        assert count_flops(layer, *inputs) == plain_count(layer, *inputs)


@pytest.mark.slow
def test_triton_backend_counted_as_torch_backend():
    """Triton kernels run outside the dispatcher (the CPU interpreter here, CUDA in training): count_flops runs
    MHLA on the torch backend, so both backends count the same, and the layer keeps its backend."""
    pytest.importorskip("triton")
    code = (
        "import os; os.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch\n"
        "from mhla.registry import build_attention\n"
        "from tasks.common.utils import count_flops\n"
        "from tests.tasks.test_flops import plain_count\n"
        "x = torch.randn(1, 16, 32)\n"
        "tri = build_attention({'name': 'mhla', 'grid': [4, 4], 'num_blocks': 4, 'backend': 'triton'}, 32, 2)\n"
        "ref = build_attention({'name': 'mhla', 'grid': [4, 4], 'num_blocks': 4, 'backend': 'torch'}, 32, 2)\n"
        "assert plain_count(tri, x) < plain_count(ref, x), 'the interpreter should hide the kernels'\n"
        "assert count_flops(tri, x) == count_flops(ref, x) == plain_count(ref, x)\n"
        "assert tri.backend == 'triton'\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# ------------------------------------------------------------------------------ the trainer's model line

def model_line(capsys, overrides):
    from tasks.classification.task import ClassificationTask  # noqa: PLC0415
    from tasks.common.trainer import Trainer  # noqa: PLC0415

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["task=imagenet", "logger=none", "trainer.device=cpu",
                                                       "trainer.progress_bar=false", *overrides])
    task = ClassificationTask(cfg)
    task.check_data = lambda: None  # no ImageNet folder: only the model is built
    trainer = Trainer(cfg, task, tempfile.mkdtemp())
    model = task.build_model()
    capsys.readouterr()
    rng = torch.get_rng_state()
    trainer._describe_model(model)
    assert torch.equal(rng, torch.get_rng_state()), "counting must not move the run's RNG stream"
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("model: ")][-1]


# model=deit_t builds every attention with the paper's kernel-3 CPE (configs/model/deit_t.yaml attn_defaults)
@pytest.mark.parametrize("attn,padded,paper", [("softmax", 1.704, 1.251), ("linear", 1.478, 1.132),
                                               ("mhla", 1.517, 1.171)])
def test_model_line_gives_padded_and_paper_resolution(capsys, attn, padded, paper):
    line = model_line(capsys, ["model=deit_t", f"attn={attn}"])
    assert "matmul/conv only" not in line and "matmuls, convs and attention" in line
    assert f"{padded:.3f} at 224 px zero-padded to 256 px (256 tokens)" in line, line
    assert f"{paper:.3f} at 224 px unpadded as in the paper (196 tokens" in line, line
    assert ("scaled affinely" in line) == (attn == "mhla"), line


def test_model_line_without_padding_has_one_count(capsys):
    line = model_line(capsys, ["model=deit_t", "attn=softmax", "model.pad_to=null"])
    assert "GMACs per sample (torch.utils.flop_counter: matmuls, convs and attention" in line
    assert "unpadded" not in line
    assert "GMACs" not in model_line(capsys, ["model=deit_t", "attn=softmax", "trainer.count_flops=false"])


def test_affine_scaling_is_exact(monkeypatch):
    """The fallback (MHLA's blocks do not tile 14 x 14) equals the direct count where both exist: linear
    attention, with the unpadded 224 px build made to fail."""
    import tasks.classification.task as classification_task  # noqa: PLC0415
    from tasks.classification.task import ClassificationTask  # noqa: PLC0415

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["task=imagenet", "model=deit_t", "attn=linear"])
    task = ClassificationTask(cfg)
    task.check_data = lambda: None
    model = task.build_model()
    direct, words, _ = task.paper_flops(model, torch.device("cpu"))
    assert "scaled" not in words
    build = classification_task.build_vit

    def no_unpadded_224(model_cfg, attn_cfg):
        if int(model_cfg.img_size) == 224 and not model_cfg.get("pad_to"):
            raise ValueError("cannot run 14 x 14 (pretend)")
        return build(model_cfg, attn_cfg)

    monkeypatch.setattr(classification_task, "build_vit", no_unpadded_224)
    scaled, words, _ = task.paper_flops(model, torch.device("cpu"))
    assert "scaled affinely in the token count from 128 and 256 px" in words and "pretend" in words
    assert scaled == direct
