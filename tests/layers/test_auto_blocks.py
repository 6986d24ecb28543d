"""``attn.num_blocks=auto``: M chosen from the model's token grid by the paper's ``M^2 <= N`` rule
(:func:`mhla.layouts.auto_blocks`), resolved when the layer is built with its grid, printed at start, refused
where the grid is unknown or the rule has no solution; the language model's ``block_size=auto`` (the same
bound on a causal sequence)."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from mhla.layers import MultiHeadLinearAttention
from mhla.layouts import auto_block_size, auto_blocks, auto_num_blocks
from mhla.registry import build_attention
from tasks.common.config import ConfigError, attention_line, model_attention, register_resolvers, resolve_run_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
register_resolvers()

# grid -> (blocks per axis, tokens per block); M = prod(blocks)
TABLE = [
    ((16, 16), (4, 4), (4, 4)),  # DeiT at 256 px: the paper's M = 16
    ((32, 32), (4, 4), (8, 8)),  # DiT-S/2 at 512 px: the paper's M = 16 (32 blocks would be 4 x 8 tiles)
    ((24, 24), (4, 4), (6, 6)),  # DeiT-T at 384 px (Table 13): M = 16 blocks of 6 x 6
    ((64, 64), (8, 8), (8, 8)),  # Table 14's 1024 px grid
    ((56, 56), (7, 7), (8, 8)),  # VLT's first stage: the paper's M = 49
    ((14, 14), (2, 2), (7, 7)),  # 224 px without padding: only 7 x 7 squares tile it
    ((8, 8), (2, 2), (4, 4)),  # vit_mini
    ((16, 32), (2, 4), (8, 8)),  # non-square grid, square blocks
    ((7, 7), (7, 1), (1, 7)),  # no square tile but the whole grid: rows of 7
    ((21, 30, 50), (7, 3, 5), (3, 10, 10)),  # Wan2.1's latent grid: the paper's M = 105
    ((8, 8, 8), (4, 2, 2), (2, 4, 4)),
    ((4, 8, 8), (1, 4, 4), (4, 2, 2)),
    ((64,), (8,), (8,)),
    ((100,), (10,), (10,)),
    ((14,), (2,), (7,)),
    ((2, 2), (2, 1), (1, 2)),
]


@pytest.mark.parametrize("grid,blocks,block", TABLE)
def test_rule_on_a_table_of_grids(grid, blocks, block):
    assert auto_blocks(grid) == blocks
    assert tuple(g // b for g, b in zip(grid, blocks)) == block
    assert auto_num_blocks(grid) == math.prod(blocks)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize(
    "grid",
    [(g,) for g in range(4, 80)]
    + list(itertools.product(range(2, 19), repeat=2))
    + [(f, h, w) for f in (1, 3, 4, 7) for h in (4, 6, 8, 10) for w in (8, 10, 12)],
)
def test_rule_properties(grid):
    """The choice tiles the grid, keeps M^2 <= N, has square spatial blocks whenever any tiling with M >= 2
    does, and no tiling of the same kind has more blocks."""
    n = math.prod(grid)
    tilings = [
        c
        for c in itertools.product(*(_divisors(g) for g in grid))
        if 2 <= math.prod(c) and math.prod(c) ** 2 <= n
    ]
    if not tilings:
        with pytest.raises(ValueError, match="no solution"):
            auto_blocks(grid)
        return
    blocks = auto_blocks(grid)
    shape = [g // b for g, b in zip(grid, blocks)]
    assert all(g % b == 0 for g, b in zip(grid, blocks)) and math.prod(blocks) ** 2 <= n

    def square(c):
        return len(grid) == 1 or grid[-1] // c[-1] == grid[-2] // c[-2]

    kind = [c for c in tilings if square(c)] or tilings
    assert (len(grid) == 1 or shape[-1] == shape[-2]) == square(kind[0])
    assert math.prod(blocks) == max(math.prod(c) for c in kind)


@pytest.mark.parametrize("grid", [(7,), (3,), (1,), (1, 1), (1, 3), (2,), (1, 1, 1)])
def test_rule_refuses_grids_without_a_solution(grid):
    with pytest.raises(ValueError, match=r"no solution .*M\^2 <= N"):
        auto_blocks(grid)


def test_layer_resolves_auto_from_its_grid_and_refuses_without_one():
    layer = build_attention({"name": "mhla", "num_blocks": "auto"}, 32, 2, grid=(32, 32))
    s = layer.settings()
    assert (s["num_blocks"], s["blocks"], tuple(s["block"]), s["auto_blocks"]) == (16, (4, 4), (8, 8), True)
    assert layer.mixing.num_blocks == 16 and layer(torch.randn(1, 1024, 32)).shape == (1, 1024, 32)
    one_d = build_attention({"name": "mhla", "block_size": "auto"}, 32, 2, grid=(64,))
    assert one_d.settings()["num_blocks"] == 8
    with pytest.raises(ValueError, match="without one"):
        MultiHeadLinearAttention(32, 2, num_blocks="auto")
    with pytest.raises(ValueError, match="no solution"):
        MultiHeadLinearAttention(32, 2, num_blocks="auto", grid=(7,))
    with pytest.raises(ValueError, match="block_size=auto"):
        MultiHeadLinearAttention(32, 2, num_blocks="auto", causal=True)
    with pytest.raises(ValueError, match="resolved by the model"):
        MultiHeadLinearAttention(32, 2, block_size="auto", causal=True)
    with pytest.raises(ValueError, match="drop blocks"):
        MultiHeadLinearAttention(32, 2, num_blocks="auto", blocks=(2, 2), grid=(8, 8))


def test_causal_block_size_auto_keeps_m_squared_within_n():
    assert [auto_block_size(n) for n in (1, 64, 65, 128, 256, 2048, 4096)] == [1, 8, 16, 16, 16, 64, 64]
    for n in range(1, 5000):
        c = auto_block_size(n)
        assert c & (c - 1) == 0 and c * c >= n and (c == 1 or (c // 2) ** 2 < n)
        assert (n / c) ** 2 <= n and (n % c or (n // c) ** 2 <= n)


def _compose(overrides):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        return compose("train", overrides=overrides)


def _mhla_layers(model):
    return [m for m in model.modules() if isinstance(m, MultiHeadLinearAttention)]


@pytest.mark.parametrize(
    "overrides,grid,blocks,block",
    [
        (["task=mnist", "model=vit_mini"], (8, 8), (2, 2), (4, 4)),
        (["task=mnist", "model=vit_mini", "model.patch_size=2"], (16, 16), (4, 4), (4, 4)),
        (["task=mnist_gen", "model.depth=1", "model.hidden_size=16", "model.num_heads=2"], None, None, None),
    ],
)
def test_composed_config_builds_the_chosen_m_and_prints_it(overrides, grid, blocks, block):
    from tasks.common.task import task_class

    cfg = _compose([*overrides, "attn=mhla", "attn.num_blocks=auto"])
    options = model_attention(cfg)
    assert options["num_blocks"] == "auto"
    layers = _mhla_layers(task_class(cfg)(cfg).build_model())
    assert layers
    for layer in layers:
        s = layer.settings()
        assert s["auto_blocks"] and s["blocks"] == auto_blocks(s["grid"])
        assert s["num_blocks"] == layer.mixing.num_blocks == auto_num_blocks(s["grid"])
    line = attention_line(resolve_run_attention(cfg))
    s = layers[0].settings()
    want = (
        f"num_blocks=auto(M={s['num_blocks']}: {'x'.join(map(str, s['blocks']))} blocks of "
        f"{'x'.join(map(str, s['block']))} tokens on the {'x'.join(map(str, s['grid']))} grid)"
    )
    assert want in line, line
    if grid is not None:
        assert (s["grid"], s["blocks"], tuple(s["block"])) == (grid, blocks, block)


def test_model_default_token_blocks_auto():
    from tasks.common.task import task_class

    cfg = _compose(["task=mnist", "model=vit_mini", "attn=mhla", "model.token_blocks=auto"])
    assert model_attention(cfg)["num_blocks"] == "auto"
    layers = _mhla_layers(task_class(cfg)(cfg).build_model())
    assert layers and all(layer.settings()["num_blocks"] == 4 for layer in layers)


def test_video_model_resolves_auto_on_its_3d_grid():
    from tasks.common.task import task_class

    cfg = _compose(["task=video_mini", "model.num_layers=3", "data.num_frames=4", "data.height=8",
                    "data.width=8", "attn=mhla", "attn.num_blocks=auto"])
    assert "num_blocks=auto(per layer at build, from its token grid)" in attention_line(resolve_run_attention(cfg))
    layers = _mhla_layers(task_class(cfg)(cfg).build_model())
    assert layers and {(layer.settings()["grid"], layer.settings()["blocks"]) for layer in layers} == {
        ((4, 4, 4), (2, 2, 2))}


def test_vlt_resolves_auto_per_stage():
    cfg = _compose(["task=mnist", "model=vlt_t", "scale=mini/vlt_t", "attn=mhla", "attn.num_blocks=auto"])
    line = attention_line(resolve_run_attention(cfg))
    assert line.count("M=") >= 1 and "num_blocks=auto(" in line, line


def test_language_model_block_size_auto_is_printed_and_num_blocks_auto_refused():
    cfg = _compose(
        [
            "task=lm_mini",
            "model.num_hidden_layers=1",
            "model.hidden_size=32",
            "model.num_heads=2",
            "attn=mhla",
            "attn.block_size=auto",
        ]
    )
    c = auto_block_size(int(cfg.model.max_position_embeddings))
    assert f"block_size=auto(block_size={c}, " in attention_line(resolve_run_attention(cfg))
    cfg = _compose(["task=lm_mini", "model.num_hidden_layers=1", "attn=mhla", "attn.num_blocks=auto"])
    with pytest.raises(ConfigError, match="block_size=auto"):
        model_attention(cfg)


def test_start_refuses_a_grid_without_a_solution():
    cfg = _compose(
        ["task=mnist", "model=vit_mini", "model.patch_size=32", "attn=mhla", "attn.num_blocks=auto"]
    )
    with pytest.raises(ConfigError, match=r"1x1 token grid.*num_blocks=auto has no solution"):
        model_attention(cfg)


def test_train_py_prints_the_chosen_m(tmp_path):
    overrides = ["task=mnist", "model=vit_mini", "attn=mhla", "attn.num_blocks=auto", "trainer.max_steps=1",
                 "data.limit=64", "data.batch_size=32", "data.eval_limit=64", "trainer.device=cpu",
                 "logger=none", "trainer.progress_bar=false", "trainer.count_flops=false",
                 f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = "attention: name=mhla num_blocks=auto(M=4: 2x2 blocks of 4x4 tokens on the 8x8 grid)"
    assert want in proc.stdout
