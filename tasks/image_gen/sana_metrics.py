"""Metrics of a sampled SANA run folder: FID & co. against a reference (:mod:`tasks.image_gen.metrics`), the CLIP
score (torchmetrics ``CLIPScore`` on a LOCAL CLIP folder), and the command that runs GenEval on it.

    evaluate_run(run_dir, reference="/data/MJHQ-30K/images", clip_path="/models/clip-vit-large-patch14")
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from tqdm.auto import tqdm

from models.weights import require_local_weights
from tasks.image_gen.npz import build_reference_npz, load_npz

CLIP_REPO = "openai/clip-vit-large-patch14"


def load_clip_score(path: str | None, device="cpu"):
    """torchmetrics' ``CLIPScore`` (``max(100 * mean cos(image, text), 0)``) on a LOCAL CLIP folder; captions
    longer than CLIP's 77 tokens are truncated by the tokenizer (end-of-text token kept)."""
    require_local_weights(path, what=f"CLIP model (the CLIP score uses {CLIP_REPO})", repo=CLIP_REPO,
                          option="--clip {dir}", example_dir="/models/clip-vit-large-patch14",
                          contents="config.json, weights, tokenizer and preprocessor files")
    from torchmetrics.multimodal.clip_score import CLIPScore  # noqa: PLC0415
    from transformers import CLIPModel, CLIPProcessor  # noqa: PLC0415

    def loader():
        model = CLIPModel.from_pretrained(path, local_files_only=True).eval()
        return _FeatureCLIP(model), _TruncatingProcessor(CLIPProcessor.from_pretrained(path, local_files_only=True),
                                                         int(model.config.text_config.max_position_embeddings))

    return CLIPScore(model_name_or_path=loader).to(device)


class _TruncatingProcessor:
    """``CLIPProcessor`` that tokenizes captions with ``truncation=True, max_length=77``: long captions (MJHQ has
    many) keep their end-of-text token, which CLIP pools, instead of torchmetrics' plain cut of the ids."""

    def __init__(self, processor, max_length: int):
        self.processor, self.max_length = processor, max_length

    def __call__(self, *args, text=None, **kwargs):
        if text is not None:
            kwargs.setdefault("truncation", True)
            kwargs.setdefault("max_length", self.max_length)
        return self.processor(*args, text=text, **kwargs)


class _FeatureCLIP(torch.nn.Module):
    """``CLIPModel`` whose ``get_image_features`` / ``get_text_features`` return the projected embeddings
    ``[B, P]`` as tensors: transformers 5 returns output objects there, which torchmetrics 1.9 cannot divide."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip
        self.config = clip.config

    @staticmethod
    def _tensor(out):
        return out if torch.is_tensor(out) else out.pooler_output

    def get_image_features(self, pixel_values):
        return self._tensor(self.clip.get_image_features(pixel_values=pixel_values))

    def get_text_features(self, input_ids, attention_mask=None):
        return self._tensor(self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask))


@torch.no_grad()
def clip_score(images, prompts: list[str], clip_path: str | None, device="cpu", batch_size: int = 64,
               progress: bool = False) -> float:
    """CLIP score of uint8 ``images [N, H, W, 3]`` against ``prompts`` (``N`` strings); see :func:`load_clip_score`."""
    if len(prompts) != len(images):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    metric = load_clip_score(clip_path, device)
    starts = range(0, len(images), batch_size)
    if progress:
        starts = tqdm(starts, desc="CLIP score", unit="batch")
    for s in starts:
        batch = torch.from_numpy(np.ascontiguousarray(images[s:s + batch_size])).permute(0, 3, 1, 2).to(device)
        metric.update(batch, list(prompts[s:s + batch_size]))
    return float(metric.compute())


def reference_npz(reference: str, out_root: str, size: int) -> str:
    """``reference`` itself when it is a file (ADM batch or stats); a folder of images (MJHQ-30K) becomes
    ``<out_root>/reference-<name>-<size>.npz`` once (centre crop + resize, as the samples)."""
    if os.path.isfile(reference):
        return reference
    if not os.path.isdir(reference):
        raise FileNotFoundError(f"reference {reference} not found: pass an ADM-style .npz (images in arr_0, or "
                                f"stats) or a folder of reference images (e.g. MJHQ-30K's images)")

    path = os.path.join(out_root, f"reference-{os.path.basename(os.path.normpath(reference))}-{size}.npz")
    if not os.path.isfile(path):
        build_reference_npz(reference, path, size=size)
    return path


def evaluate_run(run_dir: str, *, reference: str | None = None, clip_path: str | None = None, device="cpu",
                 inception_path: str | None = None, progress: bool = True) -> dict:
    """FID & co. (:func:`tasks.image_gen.metrics.evaluate_samples`) and the CLIP score of a sampled run folder
    (``samples.npz`` + ``samples.jsonl``); writes and returns ``metrics.json``'s content."""
    from .metrics import evaluate_samples  # noqa: PLC0415  (scipy)

    npz = os.path.join(run_dir, "samples.npz")
    out = {}
    if reference:
        size = int(load_npz(npz).shape[1])
        ref = reference_npz(reference, os.path.dirname(os.path.normpath(run_dir)), size)
        out.update(evaluate_samples(npz, ref, device=str(device), inception_path=inception_path, progress=progress))
        out["reference"] = ref
    if clip_path:
        with open(os.path.join(run_dir, "samples.jsonl")) as f:
            texts = [json.loads(line)["prompt"] for line in f]
        if any(t is None for t in texts):
            out["clip_score"] = None
            out.setdefault("implementation", {})["clip_score"] = "not computed: the prompt files carry no text"
        else:
            out["clip_score"] = clip_score(load_npz(npz), texts, clip_path, device, progress=progress)
            out.setdefault("implementation", {})["clip_score"] = (
                f"torchmetrics CLIPScore with {clip_path}, images of samples.npz")
    with open(os.path.join(run_dir, "metrics.json"), "w") as f:
        json.dump(out, f, indent=2)
    return out


def geneval_command(run_dir: str) -> str:
    return (f"# in GenEval's environment (github.com/djghosh13/geneval, mmdet + Mask2Former):\n"
            f"python evaluation/evaluate_images.py {run_dir} --outfile {run_dir}/geneval_results.jsonl "
            f"--model-path <OBJECT_DETECTOR_FOLDER>\n"
            f"python evaluation/summary_scores.py {run_dir}/geneval_results.jsonl")

