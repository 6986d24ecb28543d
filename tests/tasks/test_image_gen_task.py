"""Image generation task end to end on tiny configs: train two steps (pixel and latent space), sample grid,
deterministic sampling, checkpoint reload gives the same images, npz sharding over ranks, VAE errors."""

import os

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

TINY = ["logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "trainer.device=cpu",
        "model.depth=1", "model.hidden_size=32", "model.num_heads=2", "trainer.max_steps=2",
        "data.batch_size=8", "task.sample.steps=3", "task.sample.per_class=1", "task.sample.classes=3",
        "trainer.accumulate=1"]  # task=imagenet_gen's recipe batch (256) would be 32 accumulation steps


def make_cfg(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def fit(overrides, run_dir):
    from tasks.common.config import validate_config
    from tasks.common.trainer import Trainer
    from tasks.image_gen.task import ImageGenTask

    cfg = make_cfg(overrides)
    validate_config(cfg)
    trainer = Trainer(cfg, ImageGenTask(cfg), run_dir)
    return trainer, trainer.fit()


@pytest.fixture(scope="module")
def mnist_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mnist_gen")
    trainer, metrics = fit(["task=mnist_gen", *TINY, "data.limit=64", "data.eval_limit=16"], run_dir)
    return trainer, metrics, run_dir


def test_mnist_gen_trains_two_steps_and_saves_a_grid(mnist_run):
    trainer, metrics, run_dir = mnist_run
    assert trainer.step == 2 and np.isfinite(metrics["loss"]) and metrics["loss"] > 0
    assert os.path.isfile(run_dir / "samples.png") and os.path.isfile(run_dir / "checkpoints" / "last.pt")
    from PIL import Image

    w, h = Image.open(run_dir / "samples.png").size
    assert h > w  # 3 rows (classes) x 1 column


def test_checkpoint_reload_samples_the_same_images(mnist_run):
    from tasks.image_gen.sample import load_model
    from tasks.image_gen.sampling import generate

    trainer, _, run_dir = mnist_run
    labels = torch.tensor([0, 3, 7, 9])
    a = generate(trainer.ema.module, labels, steps=4, cfg_scale=2.0, generator=torch.Generator().manual_seed(1),
                 prediction="v")
    model, cfg, step = load_model(str(run_dir / "checkpoints" / "last.pt"))
    assert cfg.task.prediction == "v"  # the MNIST default; the sampler must read it back from the run
    b = generate(model, labels, steps=4, cfg_scale=2.0, generator=torch.Generator().manual_seed(1), prediction="v")
    c = generate(model, labels, steps=4, cfg_scale=2.0, generator=torch.Generator().manual_seed(2), prediction="v")
    e = generate(model, labels, steps=4, cfg_scale=2.0, generator=torch.Generator().manual_seed(1), prediction="eps")
    assert a.dtype == torch.uint8 and a.shape == (4, 16, 16, 1)
    assert step == 2 and torch.equal(a, b) and not torch.equal(b, c) and not torch.equal(b, e)
    d = generate(model, labels, steps=4, method="ddim", generator=torch.Generator().manual_seed(1))
    assert d.shape == a.shape


def test_npz_is_the_same_for_one_or_two_ranks(mnist_run, tmp_path):
    from tasks.image_gen.sample import load_model, sample_to_npz

    _, _, run_dir = mnist_run
    model, cfg, _ = load_model(str(run_dir / "checkpoints" / "last.pt"))
    kw = dict(num_samples=5, batch_size=2, steps=2, method="ddpm", cfg_scale=1.0, seed=3, progress=False)
    one = sample_to_npz(model, cfg, str(tmp_path / "one"), **kw)
    assert sample_to_npz(model, cfg, str(tmp_path / "two"), rank=1, world=2, **kw) is None
    two = sample_to_npz(model, cfg, str(tmp_path / "two"), rank=0, world=2, **kw)
    a, b = np.load(one)["arr_0"], np.load(two)["arr_0"]
    assert a.shape == (5, 16, 16, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    from tasks.image_gen.sample import batch_labels_and_generator
    from tasks.image_gen.sampling import generate

    labels, g = batch_labels_and_generator(3, 0, 2, 10, "cpu")  # global batch 0 of the npz
    ref = generate(model, labels, steps=2, generator=g, prediction=cfg.task.prediction)
    assert np.array_equal(a[:2], ref.repeat(1, 1, 1, 3).numpy())  # sampled with the run's prediction type
    assert not [f for f in os.listdir(tmp_path / "two") if f.startswith(".part")]


def test_non_tiling_block_count_fails_at_start():
    from tasks.common.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match="cannot tile"):
        validate_config(make_cfg(["task=mnist_gen", "attn.num_blocks=9"]))


@pytest.fixture(scope="module")
def tiny_vae_and_folder(tmp_path_factory):
    from diffusers import AutoencoderKL
    from PIL import Image

    root = tmp_path_factory.mktemp("gen_data")
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=16)
    vae.save_pretrained(root / "vae")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(3):
            os.makedirs(root / "imgs" / split / f"class{c}")
            for i in range(4):
                arr = rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(arr).save(root / "imgs" / split / f"class{c}" / f"{i}.png")
    return root


def test_missing_vae_says_what_to_download(tmp_path):
    from tasks.image_gen.vae import load_vae

    with pytest.raises(FileNotFoundError, match="stabilityai/sd-vae-ft-ema"):
        load_vae(str(tmp_path / "nothing"))


@pytest.mark.parametrize("latents", ["online", "precompute"])
def test_latent_training_with_a_tiny_vae(tiny_vae_and_folder, latents, tmp_path):
    root = tiny_vae_and_folder
    cache = tmp_path / "cache"
    over = ["task=imagenet_gen", *TINY, f"data.root={root / 'imgs'}", f"data.vae_path={root / 'vae'}",
            "data.image_size=16", "model.input_size=8", "model.num_classes=3", "data.batch_size=4",
            "trainer.num_workers=0", f"data.latents={latents}",
            f"data.latent_cache={cache}", "attn=mhla", "attn.num_blocks=4", "attn.cpe=true", "attn.gate=true"]
    trainer, metrics = fit(over, tmp_path / "run")
    assert trainer.step == 2 and os.path.isfile(tmp_path / "run" / "samples.png")
    if latents == "precompute":
        from tasks.image_gen.data import LatentDataset

        ds = LatentDataset(str(cache))
        z, y = ds[0]
        assert len(ds) == 12 and z.shape == (4, 8, 8) and 0 <= y < 3
        shard = np.load(cache / "shard_000-of-001.npy")
        assert shard.shape == (12, 2, 4, 8, 8) and not np.array_equal(shard[:, 0], shard[:, 1])


def test_latent_size_mismatch_is_explained(tiny_vae_and_folder, tmp_path):
    root = tiny_vae_and_folder
    over = ["task=imagenet_gen", *TINY, f"data.root={root / 'imgs'}", f"data.vae_path={root / 'vae'}",
            "data.image_size=16", "model.input_size=16", "model.num_classes=3", "trainer.num_workers=0"]
    with pytest.raises(ValueError, match="model.input_size=8"):
        fit(over, tmp_path / "run")
