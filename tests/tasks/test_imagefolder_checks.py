"""ImageFolder reliability: start-of-run layout / class checks (before the model is built) and unreadable images
(named in the error, or skipped with ``data.skip_bad_images=true``), for classification and image generation."""

import os
import warnings

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from tasks.common.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")


# ------------------------------------------------------------------------------------ helpers
def make_cfg(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def imagenet_cfg(root, num_classes, *extra):
    """The ImageNet task on ``root`` with a tiny input size (the model itself is never built here)."""
    return make_cfg(["task=imagenet", "model=deit_t", "logger=none", f"data.root={root}",
                     f"model.num_classes={num_classes}", "model.img_size=32", "model.input_size=32", *extra])


def write_png(path, seed=0):
    from PIL import Image  # noqa: PLC0415

    arr = (np.random.default_rng(seed).random((8, 8, 3)) * 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def make_tree(root, train_classes, val_classes=None, n=2):
    """``root/train/<class>/<i>.png`` (and ``root/val/...`` unless ``val_classes`` is None): n 8x8 PNGs each."""
    for split, classes in (("train", train_classes), ("val", val_classes)):
        for c in classes or ():
            for i in range(n):
                write_png(root / split / c / f"{i}.png", seed=100 * classes.index(c) + i)
    return root


def truncate(path):
    """Cut an image file in half (a download interrupted mid-file)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


class ModelBuilt(Exception):
    """Raised instead of building the model: the data checks, if any, have run by then."""


@pytest.fixture
def no_model(monkeypatch):
    """Replace the ViT builder (the name the task calls) so that reaching it raises :class:`ModelBuilt`."""
    import tasks.classification.task as classification_task  # noqa: PLC0415

    def refuse(*args, **kwargs):
        raise ModelBuilt

    monkeypatch.setattr(classification_task, "build_vit", refuse)


def build_model(cfg):
    from tasks.classification.task import ClassificationTask  # noqa: PLC0415

    return ClassificationTask(cfg).build_model()


# ------------------------------------------------------------------------------------ classification: start checks
def test_valid_tree_passes_the_checks(tmp_path, no_model):
    root = make_tree(tmp_path, ["cat", "dog", "fox"], ["cat", "dog", "fox"])
    with pytest.raises(ModelBuilt):
        build_model(imagenet_cfg(root, 3))


def test_train_and_val_with_different_classes_refused_before_the_model(tmp_path, no_model):
    root = make_tree(tmp_path, ["cat", "dog"], ["cat", "fox"])
    with pytest.raises(ConfigError, match="different class") as e:
        build_model(imagenet_cfg(root, 2))
    assert "only in train/: [dog]" in str(e.value) and "only in val/: [fox]" in str(e.value)


def test_build_imagenet_refuses_different_classes(tmp_path):
    from tasks.classification.imagenet_data import build_imagenet  # noqa: PLC0415

    root = make_tree(tmp_path, ["cat", "dog"], ["cat", "fox"])
    with pytest.raises(ConfigError, match="fox"):
        build_imagenet(imagenet_cfg(root, 2).data, 8)


def test_one_class_root_refused_before_the_model(tmp_path, no_model):
    root = make_tree(tmp_path, ["cat"], ["cat"])
    with pytest.raises(ConfigError, match="at least 2"):
        build_model(imagenet_cfg(root, 1))


def test_num_classes_not_matching_the_folder_refused_before_the_model(tmp_path, no_model):
    root = make_tree(tmp_path, ["cat", "dog", "fox"], ["cat", "dog", "fox"])
    for n in (1, 5):
        with pytest.raises(ConfigError, match="set model.num_classes=3"):
            build_model(imagenet_cfg(root, n))


def test_num_classes_one_refused_on_mnist(no_model):
    with pytest.raises(ConfigError, match="model.num_classes=1"):
        build_model(make_cfg(["model.num_classes=1"]))


@pytest.mark.parametrize("missing", ["train", "val"])
def test_missing_split_refused_before_the_model_with_the_layout(tmp_path, no_model, missing):
    present = {"train": "val", "val": "train"}[missing]
    make_tree(tmp_path, ["cat", "dog"], None)
    if present == "val":
        (tmp_path / "train").rename(tmp_path / "val")
    with pytest.raises(ConfigError) as e:
        build_model(imagenet_cfg(tmp_path, 2))
    msg = str(e.value)
    assert os.path.join(str(tmp_path), missing) in msg
    assert "root/train/n01440764/*.JPEG" in msg and "root/val/n01440764/*.JPEG" in msg


def test_split_without_class_folders_refused(tmp_path, no_model):
    make_tree(tmp_path, ["cat", "dog"], ["cat", "dog"])
    for f in (tmp_path / "val").glob("*/*.png"):
        f.rename(tmp_path / "val" / f"{f.parent.name}_{f.name}")
    for d in (tmp_path / "val").iterdir():
        if d.is_dir():
            d.rmdir()
    with pytest.raises(ConfigError, match="no class subfolders"):
        build_model(imagenet_cfg(tmp_path, 2))


def test_skip_bad_images_is_a_config_key_off_by_default():
    assert make_cfg(["task=imagenet"]).data.skip_bad_images is False


# ------------------------------------------------------------------------------------ classification: bad images
def bad_tree(tmp_path, how):
    """A 2-class tree whose train/dog/1.png is truncated or not an image; returns (root, bad path)."""
    root = make_tree(tmp_path, ["cat", "dog"], ["cat", "dog"])
    bad = root / "train" / "dog" / "1.png"
    if how == "truncated":
        truncate(bad)
    else:
        bad.write_bytes(b"this is not a PNG")
    return root, bad


def read_all(ds):
    return [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("how", ["truncated", "garbage"])
@pytest.mark.parametrize("fmt", ["folder", "hf"])
def test_unreadable_image_error_names_the_file(tmp_path, monkeypatch, how, fmt):
    from tasks.classification.imagenet_data import BadImageError, build_imagenet  # noqa: PLC0415

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    root, bad = bad_tree(tmp_path / "data", how)
    train, _ = build_imagenet(imagenet_cfg(root, 2, f"data.format={fmt}").data, 8)
    with pytest.raises(BadImageError, match="skip_bad_images") as e:
        read_all(train)
    assert str(bad) in str(e.value)


def test_unreadable_image_named_through_a_dataloader_worker(tmp_path):
    import torch  # noqa: PLC0415

    from tasks.classification.imagenet_data import build_imagenet  # noqa: PLC0415

    root, bad = bad_tree(tmp_path, "truncated")
    train, _ = build_imagenet(imagenet_cfg(root, 2).data, 8)
    loader = torch.utils.data.DataLoader(train, batch_size=2, num_workers=1)
    with pytest.raises(Exception) as e:
        list(loader)
    assert str(bad) in str(e.value)


def test_skip_bad_images_replaces_logs_and_counts(tmp_path):
    from tasks.classification.imagenet_data import build_imagenet  # noqa: PLC0415

    root, bad = bad_tree(tmp_path, "truncated")
    train, val = build_imagenet(imagenet_cfg(root, 2, "data.skip_bad_images=true").data, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = read_all(train) + read_all(train)  # two epochs: counted twice, warned once
    assert len(samples) == 2 * len(train) == 8 and all(x.shape == (3, 8, 8) for x, _ in samples)
    assert train.dataset.bad_files == [str(bad)] and train.dataset.skips == 2
    assert [str(bad) in str(w.message) and "1 bad file(s)" in str(w.message) for w in caught] == [True]
    assert len(read_all(val)) == 4 and val.dataset.bad_files == []


# ------------------------------------------------------------------------------------ image generation
def test_image_gen_needs_only_train(tmp_path):
    from tasks.image_gen.data import build_image_folder  # noqa: PLC0415

    root = make_tree(tmp_path, ["all"], None)
    ds = build_image_folder(str(root), 8)
    assert len(ds) == 2 and ds.num_classes == 1 and ds[0][0].shape == (3, 8, 8)


def test_image_gen_missing_train_shows_the_layout(tmp_path):
    from tasks.image_gen.data import build_image_folder, check_image_folder_split  # noqa: PLC0415

    make_tree(tmp_path, [], ["cat"])
    for check in (lambda: check_image_folder_split(str(tmp_path)), lambda: build_image_folder(str(tmp_path), 8)):
        with pytest.raises(ConfigError, match=r"root/train/n01440764/\*\.JPEG") as e:
            check()
        assert os.path.join(str(tmp_path), "train") in str(e.value)


def test_image_gen_unreadable_image_named_or_skipped(tmp_path):
    from tasks.classification.imagenet_data import BadImageError  # noqa: PLC0415
    from tasks.image_gen.data import build_image_folder  # noqa: PLC0415

    root = make_tree(tmp_path, ["all"], None, n=3)
    bad = root / "train" / "all" / "1.png"
    truncate(bad)
    ds = build_image_folder(str(root), 8)
    with pytest.raises(BadImageError) as e:
        read_all(ds)
    assert str(bad) in str(e.value) and "data.skip_bad_images=true" in str(e.value)
    skipping = build_image_folder(str(root), 8, skip_bad_images=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert len(read_all(skipping)) == 3
    assert skipping.dataset.bad_files == [str(bad)]


@pytest.mark.parametrize("latents", ["none", "online"])
def test_image_gen_task_checks_the_root_before_the_model(tmp_path, monkeypatch, latents):
    import tasks.image_gen.task as image_gen_task  # noqa: PLC0415
    from tasks.image_gen.task import ImageGenTask  # noqa: PLC0415

    def refuse(*args, **kwargs):
        raise ModelBuilt

    monkeypatch.setattr(image_gen_task, "build_dit", refuse)
    make_tree(tmp_path, [], ["cat"])  # val/ only
    cfg = make_cfg(["task=imagenet_gen", "model=dit_s", "logger=none", f"data.root={tmp_path}",
                    f"data.latents={latents}", "data.skip_bad_images=true"])
    with pytest.raises(ConfigError, match="train"):
        ImageGenTask(cfg).build_model()
    make_tree(tmp_path, ["cat"], None)
    with pytest.raises(ModelBuilt):
        ImageGenTask(cfg).build_model()


def test_table3b_finetune_refuses_to_start_without_the_released_checkpoint(tmp_path):
    """The cell declares the released weights as an input (``inputs.dit_xl2_weights``): train.py's config check
    refuses without them (the run would otherwise train DiT-XL/2 from scratch) and names the file and its URL."""
    from tasks.common.config import validate_config  # noqa: PLC0415

    make_tree(tmp_path / "imagenet", ["cat"], None)
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text("{}")
    base = ["experiment=table3b/dit_xl2_256_mhla_finetune", "logger=none", f"data.root={tmp_path / 'imagenet'}",
            f"data.vae_path={tmp_path / 'vae'}"]
    with pytest.raises(ConfigError, match="DiT-XL-2-256x256.pt") as e:
        validate_config(make_cfg(base))
    assert "https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-256x256.pt" in str(e.value)
    assert "model.pretrained=/models/DiT-XL-2-256x256.pt" in str(e.value) and "data.root" not in str(e.value)
    weights = tmp_path / "DiT-XL-2-256x256.pt"
    with pytest.raises(ConfigError, match="does not exist"):
        validate_config(make_cfg([*base, f"model.pretrained={weights}"]))
    weights.write_bytes(b"")
    validate_config(make_cfg([*base, f"model.pretrained={weights}"]))
