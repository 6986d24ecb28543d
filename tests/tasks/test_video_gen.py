"""Video generation: 3-D layout round trip, Wan variants build and train, data, config composition, loading errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("diffusers")

from mhla.adapters.diffusers import AttentionProcessor  # noqa: E402
from mhla.layouts import BlockLayout  # noqa: E402
from models.wan import MissingWeightsError, apply_attention, build_transformer, check_weights_dir, token_grid  # noqa: E402
from tasks.video_gen.data import MovingShapes, VideoFolder, caption_ids  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(patch_size=[1, 4, 4], num_attention_heads=2, attention_head_dim=12, in_channels=3, out_channels=3,
            text_dim=8, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)


def test_3d_layout_round_trip_paper_grid():
    lay = BlockLayout((21, 30, 50), (3, 10, 10))
    assert lay.num_blocks == 105 and lay.num_tokens == 31_500 == 21 * 30 * 50
    x = torch.arange(2 * 31_500, dtype=torch.float32).view(2, 31_500, 1)
    xb = lay.raster_to_block_major(x)
    torch.testing.assert_close(lay.block_major_to_raster(xb), x)
    # block 0 holds frames 0-2, rows 0-9, cols 0-9 of the raster grid
    first = xb[0, :300, 0].long()
    f, rem = first // 1500, first % 1500
    assert f.max() == 2 and (rem // 50).max() == 9 and (rem % 50).max() == 9
    assert token_grid(81, 480, 800) == (21, 30, 50)
    with pytest.raises(ValueError, match="frames"):
        token_grid(80, 480, 800)


@pytest.mark.parametrize("variant", ["mhla", "hybrid", "linear", "softmax"])
def test_variants_build_and_train_two_steps(variant):
    torch.manual_seed(0)
    model = build_transformer(TINY)
    attn = {"name": "mhla" if variant == "hybrid" else variant, "normalize": False, "out_norm": True,
            "rope": "after", "layers": "hybrid" if variant == "hybrid" else "all"}
    if variant in ("mhla", "hybrid"):
        attn["blocks"] = [2, 2, 2]
    if variant == "softmax":  # Wan's own processor: no options
        attn = {"name": "softmax"}
    names = apply_attention(model, attn)
    expected = {"mhla": 3, "hybrid": 2, "linear": 3, "softmax": 0}[variant]
    assert len(names) == expected
    swapped = [isinstance(b.attn1.processor, AttentionProcessor) for b in model.blocks]
    assert sum(swapped) == expected
    if variant == "hybrid":
        assert swapped == [True, True, False]
    model.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 3, 4, 16, 16)
    text = torch.randn(2, 3, 8)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".attention." in n}
    losses = []
    for _ in range(2):
        loss = (model(x, torch.tensor([200.0, 800.0]), text).sample - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    for n, p in model.named_parameters():
        if n in before:
            assert not torch.equal(p, before[n]), f"{n} did not train"


def test_moving_shapes_data():
    ds = MovingShapes(8, num_frames=8, size=32, seed=0)
    video, ids = ds[3]
    assert video.shape == (3, 8, 32, 32) and video.min() >= -1 and video.max() <= 1
    assert torch.equal(ids, caption_ids(ds.caption(3)))
    torch.testing.assert_close(ds[3][0], video)  # deterministic
    # the shape is visible in every frame and its centre moves in the captioned direction
    fg = (video - video[:, :1, :1, :1]).abs().sum(0) > 0.1  # [F, H, W]
    assert fg.flatten(1).any(1).all()
    ys, xs = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    cy = (fg * ys).flatten(1).sum(1) / fg.flatten(1).sum(1)
    cx = (fg * xs).flatten(1).sum(1) / fg.flatten(1).sum(1)
    d = ds.spec(3)["direction"]
    moved = {"right": cx[-1] - cx[0], "left": cx[0] - cx[-1], "down": cy[-1] - cy[0], "up": cy[0] - cy[-1]}[d]
    assert moved > 5


def test_video_folder_reads_clips(tmp_path):
    from tasks.video_gen.media import save_mp4

    clip = torch.linspace(-1, 1, 10).view(1, 10, 1, 1).expand(3, 10, 24, 40).contiguous()
    assert save_mp4(clip, tmp_path / "clips" / "a.mp4", fps=8) is not None
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"video": "clips/a.mp4", "caption": "a ramp"}) + "\n")
    ds = VideoFolder(str(tmp_path), num_frames=5, height=16, width=16, frame_stride=2)
    video, caption = ds[0]
    assert video.shape == (3, 5, 16, 16) and caption == "a ramp"
    assert video[:, -1].mean() > video[:, 0].mean() + 0.5  # frames in order
    with pytest.raises(FileNotFoundError, match="metadata.jsonl"):
        VideoFolder(str(tmp_path / "nothing"), num_frames=5, height=16, width=16)


def test_missing_weights_message(tmp_path):
    with pytest.raises(MissingWeightsError, match="Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        check_weights_dir(str(tmp_path / "absent"), "transformer")
    with pytest.raises(MissingWeightsError, match="transformer/"):
        build_transformer({**TINY, "pretrained": str(tmp_path)})


def test_video_mini_config_composes_and_task_runs(tmp_path):
    from hydra import compose, initialize_config_dir

    from tasks.common.trainer import Trainer
    from tasks.video_gen.task import VideoGenTask

    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[
            "task=video_mini", "logger=none", "trainer.max_steps=2", "data.train_size=8", "data.eval_size=4",
            "data.batch_size=4", "data.num_frames=4", "data.height=8", "data.width=8", "model.num_layers=2",
            "attn.layers=hybrid", "sample.num_steps=2", "sample.prompts=[a red square moving right]",
            "trainer.progress_bar=false"])
        fin = compose("train", overrides=["task=wan_finetune", "attn=mhla"])
    from tasks.common.config import model_attention

    assert model_attention(fin)["blocks"] == [7, 3, 5] and fin.optim.lr == 2e-5 and fin.task.shift == 3.0
    assert fin.sample.num_steps == 50 and fin.sample.guidance_scale == 3.0  # the authors' release (cfg_scale 3.0)
    task = VideoGenTask(cfg)
    assert task.grid == (4, 4, 4)
    metrics = Trainer(cfg, task, tmp_path).fit()
    assert metrics["loss"] > 0
    assert (tmp_path / "samples.gif").stat().st_size > 0
    assert (tmp_path / "checkpoints" / "last.pt").exists()
    follow = json.loads((tmp_path / "samples_follow.json").read_text())  # the prompt check of the samples
    assert 0 <= metrics["follow"] <= 1 and follow["per_prompt"][0]["prompt"] == "a red square moving right"
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert any("attention.mixing" in k for k in state["model"])


def test_wan_token_order_is_the_grid_mhla_assumes():
    """The attention sees patch (f, h, w) at raster index (f * H + h) * W + w of the grid the adapter tracks:
    perturb one input patch and find the one token (and only that one) whose patch embedding changes."""
    model = build_transformer(TINY)  # patch (1, 4, 4)
    apply_attention(model, {"name": "mhla", "blocks": [2, 2, 2]})
    x = torch.zeros(1, 3, 4, 16, 24)
    seen = {}
    model.blocks[0].attn1.register_forward_hook(lambda m, a, k, o: seen.update(x=a[0]), with_kwargs=True)
    with torch.no_grad():
        model.patch_embedding.bias.zero_()
        for f, h, w in [(0, 0, 1), (1, 2, 3), (3, 3, 5)]:
            xp = x.clone()
            xp[:, :, f, 4 * h:4 * h + 4, 4 * w:4 * w + 4] = 1.0
            model(xp, torch.tensor([500.0]), torch.randn(1, 3, 8))
            grid = model._mhla_grid_context.grid
            assert grid == (4, 4, 6)
            # the self-attention input of layer 0 is per-token (norm + modulation) of the patch embedding:
            # every empty patch gives the same row, the lit patch a different one
            rows = seen["x"][0]
            assert rows.shape[0] == 4 * 4 * 6
            hot = (rows - rows[(f * grid[1] + h) * grid[2] + w - 1]).abs().sum(-1).nonzero().flatten().tolist()
            assert hot == [(f * grid[1] + h) * grid[2] + w], (f, h, w, hot)


def test_euler_sampler_recovers_a_clip_with_the_oracle_velocity():
    """Time convention of the sampler vs the loss: x_t = (1 - t) x0 + t eps, v = eps - x0, sampling from t = 1
    (noise) to 0 with the training shift. With the exact velocity of a one-clip data set,
    v(x, t) = (x - x0) / t, Euler lands on the clip (any shift, any step count); a sign or direction
    error in either convention lands elsewhere."""
    from tasks.common import flow_matching as fm

    x0 = MovingShapes(2, num_frames=4, size=16)[1][0][None]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.4])
    xt = fm.interpolate(x0, noise, t)
    torch.testing.assert_close((xt - x0) / t, fm.velocity_target(x0, noise))  # the oracle is the loss target
    for shift in (1.0, 3.0):
        out = fm.euler_sample(lambda x, tt, c: (x - x0) / tt.view(-1, 1, 1, 1, 1), noise, num_steps=7, shift=shift)
        torch.testing.assert_close(out, x0, atol=1e-5, rtol=0)


def test_moving_shapes_scale_with_canvas():
    """At 16 px the shapes are half the 32 px size and (at most) speed, and stay inside the canvas."""
    a, b = MovingShapes(16, size=32), MovingShapes(16, size=16)
    for i in range(16):
        sa, sb = a.spec(i), b.spec(i)
        assert sb["radius"] == pytest.approx(sa["radius"] / 2)
        assert 0.5 < sb["speed"] <= sa["speed"] / 2 + 1e-9  # half, or slower where the clip would leave the canvas
        video = b[i][0]
        fg = (video - video[:, :1, :1, :1]).abs().sum(0) > 0.1
        assert fg.flatten(1).any(1).all()  # visible in every frame
        edge = fg[:, 0].any() or fg[:, -1].any() or fg[:, :, 0].any() or fg[:, :, -1].any()
        assert not edge  # never touches the border


def test_text_pool_starts_as_wan_and_conditions_every_block():
    """model.text_pool: the mean text embedding is added to Wan's time embedding through a zero-initialised map,
    so at init the model equals the one without it; once the map is nonzero the prompt changes the output."""
    from tasks.video_gen.model import VideoDenoiser

    torch.manual_seed(0)
    pooled = VideoDenoiser(build_transformer(TINY), 10, TINY["text_dim"], text_pool=True).eval()
    plain = VideoDenoiser(build_transformer(TINY), 10, TINY["text_dim"]).eval()
    plain.load_state_dict({k: v for k, v in pooled.state_dict().items() if "text_to_time" not in k})
    x, t = torch.randn(2, TINY["in_channels"], 2, 8, 8), torch.tensor([0.3, 0.7])
    text = torch.tensor([[1, 5, 7], [2, 6, 8]])
    with torch.no_grad():
        torch.testing.assert_close(pooled(x, t, text), plain(x, t, text))
        torch.nn.init.normal_(pooled.text_to_time.weight)
        assert (pooled(x, t, text) - plain(x, t, text)).abs().max() > 1e-3


def test_coord_channels_give_absolute_positions():
    """model.coord_channels: (frame, row, column) in [-1, 1] are appended to x_t, so the transformer is built with
    3 more input channels and its output keeps the data's channels; a pretrained Wan cannot take them."""
    from omegaconf import OmegaConf

    from tasks.common.config import ConfigError
    from tasks.video_gen.model import VideoDenoiser
    from tasks.video_gen.task import VideoGenTask

    coords = VideoDenoiser.coordinates(torch.zeros(2, 3, 4, 8, 8))
    assert coords.shape == (2, 3, 4, 8, 8)
    assert coords[0, 0, 0].eq(-1).all() and coords[0, 0, -1].eq(1).all()  # frame axis
    assert coords[0, 2, :, :, 0].eq(-1).all() and coords[0, 2, :, :, -1].eq(1).all()  # column axis
    model_cfg = {**TINY, "name": "wan_mini", "kind": "wan", "pretrained": None, "vae": None, "text": "table",
                 "coord_channels": True}
    cfg = OmegaConf.create({"model": model_cfg, "attn": {"name": "softmax"}, "task": {"name": "video_mini"},
                            "data": {"name": "moving_shapes", "num_frames": 2, "height": 8, "width": 8}})
    task = VideoGenTask(cfg)
    model = task.build_model()
    assert model.transformer.config.in_channels == TINY["in_channels"] + 3
    x = torch.randn(task.latent_shape(2))
    assert model(x, torch.tensor([0.2, 0.9]), torch.tensor([[1, 5, 7], [2, 6, 8]])).shape == x.shape
    cfg.model.pretrained = "/somewhere"
    with pytest.raises(ConfigError, match="coord_channels"):
        VideoGenTask(cfg).build_model()
