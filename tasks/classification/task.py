"""The classification task for the shared trainer: data, model, loss and top-1 / top-5 evaluation."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from omegaconf import OmegaConf
from timm.data import Mixup

from models.vit import build_vit
from models.vlt import build_vlt
from tasks.common.config import ConfigError
from tasks.common.task import Task
from tasks.common.utils import count_flops_split

from .imagenet_data import build_imagenet, check_class_count, check_image_folder
from .mnist_data import MNIST


class ClassificationTask(Task):
    monitor = "top1"
    monitor_mode = "max"

    def check_data(self) -> None:
        """Start-of-run data checks, cheap (folder names only) and run before the model is built, so a bad data
        root or class count fails in a second instead of after model building or at the first evaluation:
        ImageNet-style folders (:func:`~tasks.classification.imagenet_data.check_image_folder`: train/ and val/
        exist, same classes, >= 2 of them, ``model.num_classes`` of them); MNIST has 10 classes."""
        data, n_cls = self.cfg.data, int(self.cfg.model.num_classes)
        if data.name in ("imagenet", "imagefolder"):
            check_image_folder(data, n_cls)
        elif data.name == "mnist" and n_cls != 10:
            raise ConfigError(f"data=mnist has 10 classes but model.num_classes={n_cls}; set model.num_classes=10")
        if n_cls < 2:
            raise ConfigError(f"model.num_classes={n_cls}: classification needs at least 2 classes")

    def build_model(self) -> nn.Module:
        self.check_data()
        kind = self.cfg.model.get("kind", "vit")
        attn = self.attention.options
        if kind == "vit":
            return build_vit(self.cfg.model, attn)
        if kind == "vlt":
            m = self.cfg.model
            return build_vlt(m.variant, linear_attn=attn, img_size=int(m.img_size), num_classes=int(m.num_classes),
                             in_chans=int(m.get("in_chans", 3)), head_dim=int(m.get("head_dim", 2048)),
                             stage_num_blocks=tuple(m.stage_num_blocks), drop_path_rate=m.get("drop_path_rate"))
        raise ValueError(f"model.kind={kind!r} is not a classification model (vit | vlt)")

    def describe_model(self, model: nn.Module) -> str:
        return f"{self.cfg.model.name} with {self.cfg.attn.name} attention"

    def build_datasets(self):
        self.check_data()
        data = self.cfg.data
        if data.name == "mnist":
            return (MNIST("train", pad_to=data.get("pad_to", 32), limit=data.get("limit")),
                    MNIST("test", pad_to=data.get("pad_to", 32), limit=data.get("eval_limit")))
        if data.name in ("imagenet", "imagefolder"):
            size = int(self.cfg.model.get("input_size") or self.cfg.model.img_size)
            train, val = build_imagenet(data, size, seed=int(self.cfg.get("seed", 0)))
            # again on what was loaded (format=hf labels only the class folders that hold images)
            check_class_count(train.num_classes, int(self.cfg.model.num_classes), f"data.root={data.root}")
            return train, val
        raise ValueError(f"data.name={data.name!r} is not supported by the classification task")

    def _mixup(self):
        if not hasattr(self, "_mixup_fn"):
            mix = self.cfg.task.get("mixup")
            self._mixup_fn = None
            if mix and (mix.get("mixup_alpha", 0) > 0 or mix.get("cutmix_alpha", 0) > 0):
                self._mixup_fn = Mixup(
                    mixup_alpha=mix.mixup_alpha, cutmix_alpha=mix.cutmix_alpha, prob=mix.get("prob", 1.0),
                    switch_prob=mix.get("switch_prob", 0.5), mode=mix.get("mode", "batch"),
                    label_smoothing=float(self.cfg.task.get("label_smoothing", 0.0)),
                    num_classes=int(self.cfg.model.num_classes))
        return self._mixup_fn

    def on_batch(self, batch, device):
        x, y = (b.to(device, non_blocking=True) for b in batch)
        mixup = self._mixup()
        if mixup is not None and x.shape[0] % 2 == 0:
            x, y = mixup(x, y)  # soft targets, label smoothing included
        return x, y

    def example_input(self, device):
        m = self.cfg.model
        size = int(m.get("input_size") or m.img_size)
        return torch.zeros(1, int(m.get("in_chans", 3)), size, size, device=device)

    def paper_flops(self, model, device) -> tuple[int, str, str] | None:
        """The trainer's optional FLOP hook: when the model zero-pads its input internally (DeiT:
        ``model.pad_to=256`` for 224 px inputs, so :meth:`example_input` is counted at 256 tokens, while the papers
        quote 224 px, 196 tokens), ``(FLOPs at the input size unpadded, words for that count, words for the
        padded count)``; else None. :meth:`paper_flop_counts` with only its total."""
        out = self.paper_flop_counts(model, device)
        return None if out is None else (out[0]["total"], out[1], out[2])

    def paper_flop_counts(self, model, device) -> tuple[dict, str, str] | None:
        """:meth:`paper_flops` with the count split (:func:`~tasks.common.utils.count_flops_split`: ``{"total",
        "attention"}``, the second being the attention matmuls): ``(counts, words, words for the padded count)``.

        Counted on the same model built without the padding. When that model cannot be built (MHLA: M = 16
        blocks do not tile a 14 x 14 grid), the counts are scaled instead, and the words say so: at a fixed block
        count every FLOP of these ViTs is affine in the token count ``N`` (per-token projections, MLPs, convs and
        block summaries, plus the N-free head and M x M mixing), so the counts of the unpadded model at half (else
        twice) the padded size and of ``model`` at the padded size give the one at ``N`` exactly (each part
        separately). The extra models are built with the global RNG state restored after."""
        m = self.cfg.model
        if m.get("kind", "vit") != "vit" or not m.get("pad_to"):
            return None
        size, padded, patch = int(m.get("input_size") or m.img_size), int(m.pad_to), int(m.patch_size)
        if size == padded or size % patch:
            return None

        in_chans = int(m.get("in_chans", 3))

        def tokens(px: int) -> int:
            return (px // patch) ** 2

        def unpadded_flops(px: int) -> dict:
            cfg = OmegaConf.merge(m, {"img_size": px, "input_size": px, "pad_to": None})
            with torch.random.fork_rng(devices=[]):  # the run's RNG stream stays as without this count
                net = build_vit(cfg, self.attention.options).to(device)
            return count_flops_split(net, torch.zeros(1, in_chans, px, px, device=device))

        n = tokens(size)
        run_words = f"at {size} px zero-padded to {padded} px ({tokens(padded)} tokens)"
        try:
            return unpadded_flops(size), f"at {size} px unpadded as in the paper ({n} tokens)", run_words
        except ValueError as err:  # the attention cannot run the unpadded grid (MHLA's blocks)
            reason = str(err).split(";")[0]
        full = count_flops_split(model, torch.zeros(1, in_chans, padded, padded, device=device))
        for other in (padded // 2, 2 * padded):
            try:
                f_other = unpadded_flops(other)
            except ValueError:
                continue
            n_other, n_full = tokens(other), tokens(padded)
            flops = {k: round(f_other[k] + (full[k] - f_other[k]) * (n - n_other) / (n_full - n_other))
                     for k in full}
            return flops, (f"at {size} px unpadded as in the paper ({n} tokens; scaled affinely in the token "
                           f"count from {other} and {padded} px, as this model cannot run unpadded: {reason})"), \
                run_words
        raise ValueError(f"cannot count FLOPs at the paper's {size} px ({reason}); set trainer.count_flops=false")

    def training_loss(self, model, batch):
        x, y = batch
        logits = model(x)
        if y.dim() == 2:  # soft targets (mixup / cutmix)
            loss = torch.sum(-y * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        else:
            loss = F.cross_entropy(logits.float(), y, label_smoothing=float(self.cfg.task.get("label_smoothing", 0.0)))
        return loss, {}

    @torch.no_grad()
    def evaluate(self, model, loader, device, dist_info) -> dict:
        n_cls = int(self.cfg.model.num_classes)
        top1 = torchmetrics.classification.MulticlassAccuracy(num_classes=n_cls, top_k=1, average="micro").to(device)
        top5 = torchmetrics.classification.MulticlassAccuracy(
            num_classes=n_cls, top_k=min(5, n_cls), average="micro").to(device)
        loss_sum = torch.zeros((), device=device)
        count = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x).float()
            loss_sum += F.cross_entropy(logits, y, reduction="sum")
            count += y.numel()
            top1.update(logits, y)
            top5.update(logits, y)
        if dist_info.enabled:
            dist.all_reduce(loss_sum)
            dist.all_reduce(count)
        return {"top1": top1.compute().item(), "top5": top5.compute().item(), "loss": (loss_sum / count).item()}
