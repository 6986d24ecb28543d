#!/usr/bin/env python
"""Sample a (fine-tuned, MHLA) SANA transformer and evaluate it: FID (MJHQ-30K), CLIP score, GenEval folder.

    # prompts pre-extracted to .pt files ({"text": [L, 2304], optional "mask" [L], "prompt", "id", "metadata"})
    python -m tasks.image_gen.sana_sample --ckpt outputs/sana_finetune/<run> --prompts /data/mjhq_embeds \\
        --out samples --vae /models/dc-ae-f32c32-sana-1.0-diffusers \\
        --clip /models/clip-vit-large-patch14 --reference /data/MJHQ-30K/images
    # prompts as text, encoded by a local diffusers SANA pipeline's Gemma-2 (and its DC-AE, unless --vae)
    torchrun --nproc_per_node=8 -m tasks.image_gen.sana_sample --ckpt <run> \\
        --pipeline /models/Sana_600M_1024px_diffusers --prompts geneval/prompts/evaluation_metadata.jsonl --out samples
    # encode prompts once (GPU with the pipeline), sample later from the .pt files
    python -m tasks.image_gen.sana_sample --pipeline /models/Sana_600M_1024px_diffusers \\
        --prompts /data/MJHQ-30K/meta_data.json --encode-to /data/mjhq_embeds
    # tiny CPU run on `python train.py task=sana_mini attn=mhla` (generated data, no text encoder, no VAE)
    python -m tasks.image_gen.sana_sample --ckpt outputs/sana_mini/<run> --random-prompts 8 --vae preview

Sampling: rectified flow from ``t = 1`` (noise) to ``t = 0`` with classifier-free guidance
``v_u + g (v_c - v_u)`` (``g = 4.5``, SANA's default; ``v_u`` from the negative / empty-prompt embedding) on
SANA's shifted time grid (``flow_shift`` 3.0 at 1024 px, as diffusers' SANA pipeline). ``--solver dpm``
(SANA's Flow-DPM-Solver: diffusers' ``DPMSolverMultistepScheduler`` with flow sigmas, what ``SanaPipeline`` runs;
the default for Table 4, 20 steps) or ``--solver euler`` (:func:`tasks.common.flow_matching.euler_sample`).
Defaults come from the ``task.sample`` block saved with the run (``configs/task/sana_finetune.yaml``), then
command-line flags. Latents are decoded by DC-AE f32c32 (``AutoencoderDC``, ``latents / scaling_factor``) from a
LOCAL folder; ``--vae preview`` is a stand-in that shows the first 3 latent channels (tiny / CPU runs).

Outputs ``<out>/<model>-<attn>-<step>-<solver><steps>-cfg<g>-shift<s>-seed<seed>/``:

* ``<index:05d>/metadata.jsonl`` + ``<index:05d>/samples/<k:04d>.png``: GenEval's layout (``metadata.jsonl``
  holds the prompt's line of ``evaluation_metadata.jsonl``); run GenEval's own detector environment on it (the
  command is printed).
* ``samples.npz``: ADM-style uint8 ``arr_0`` ``[N, S, S, 3]`` (centre crop + resize to ``--npz-size``, the same
  preprocessing :func:`tasks.image_gen.npz.build_reference_npz` applies to the reference) for
  :func:`tasks.image_gen.metrics.evaluate_samples`; ``samples.jsonl``: one line per row (prompt, ids, seed).
* ``metrics.json``: FID / sFID / precision / recall against ``--reference`` (an ADM ``.npz`` / stats file or a
  folder of images, e.g. MJHQ-30K, turned into ``<out>/reference-<name>-<size>.npz`` once) and the CLIP score
  (torchmetrics ``CLIPScore`` with a LOCAL ``openai/clip-vit-large-patch14`` folder).
* ``latents.npy`` (float32 ``[N, C, h, w]``) when nothing decodes (no ``--vae``).

Determinism: image ``k`` of prompt ``i`` starts from noise drawn by a CPU generator seeded with
``seed * 1_000_003 + i * 1_000 + k``, so the same seed gives the same latents whatever the batch size, device or
number of ranks. Under ``torchrun``, global batch ``j`` is sampled by rank ``j % world_size``; rank 0 assembles.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from mhla.layouts import ceil_div  # noqa: E402
from models.weights import require_local_weights  # noqa: E402

DC_AE_REPO = "mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers"
CLIP_REPO = "openai/clip-vit-large-patch14"
PIPELINE_REPO = "Efficient-Large-Model/Sana_600M_1024px_diffusers"
# Used when the run's config has no task.sample block (SanaPipeline's defaults at 1024 px).
DEFAULTS = dict(steps=20, cfg_scale=4.5, shift=3.0, seed=0, solver="dpm", images_per_prompt=1, batch_size=8,
                max_sequence_length=300, use_chi=True, npz_size=512, precision="auto")
SOLVERS = ("dpm", "euler")
NEGATIVE_FILE = "negative.pt"  # the unconditional caption embedding beside prompt / training .pt files


# ------------------------------------------------------------------------------------ the transformer
def resolve_checkpoint(path: str, which: str = "last") -> str:
    """A ``.pt`` file as is; a run directory -> ``<run>/checkpoints/<which>.pt`` (``which``: last / best)."""
    if os.path.isdir(path):
        cand = os.path.join(path, "checkpoints", f"{which}.pt")
        if not os.path.isfile(cand) and os.path.isfile(os.path.join(path, f"{which}.pt")):
            cand = os.path.join(path, f"{which}.pt")  # the checkpoints/ folder itself
        if not os.path.isfile(cand):
            raise FileNotFoundError(f"no {which}.pt under {path}: pass a train.py run directory (it holds "
                                    f"checkpoints/last.pt and best.pt) or the .pt file itself")
        return cand
    return path


def transformer_config(model_cfg) -> dict:
    """``SanaTransformer2DModel`` kwargs of a run: the config recorded at training time
    (``model.transformer_config``, written by :class:`tasks.image_gen.sana_task.SanaFinetuneTask`), else the
    ``config.json`` of ``model.pretrained`` when that folder exists here, else the named ``model.config``."""
    from models.sana import sana_config  # noqa: PLC0415

    mc = dict(model_cfg)
    if mc.get("transformer_config"):
        return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in dict(mc["transformer_config"]).items()
                if not str(k).startswith("_")}
    pre = mc.get("pretrained")
    if pre and os.path.isdir(pre):
        from diffusers import SanaTransformer2DModel  # noqa: PLC0415

        sub = os.path.join(pre, "transformer")
        folder = sub if not os.path.isfile(os.path.join(pre, "config.json")) and os.path.isdir(sub) else pre
        return {k: v for k, v in SanaTransformer2DModel.load_config(folder).items() if not k.startswith("_")}
    return sana_config(mc.get("config", "sana_tiny"))


def load_sana_checkpoint(ckpt: str, weights: str = "ema", device="cpu", which: str = "last"):
    """Rebuild the SANA transformer of a ``train.py`` run (its attention swapped as it was trained) and load
    the EMA weights when the checkpoint has them (``weights="model"``: the raw ones).

    Returns ``(model, cfg, step)`` with ``model`` in eval mode on ``device`` (fp32 weights).
    """
    from diffusers import SanaTransformer2DModel  # noqa: PLC0415
    from omegaconf import OmegaConf  # noqa: PLC0415

    from models.sana import swap_attention  # noqa: PLC0415
    from tasks.common.checkpoint import load_checkpoint, model_weights  # noqa: PLC0415

    state = load_checkpoint(resolve_checkpoint(ckpt, which), map_location="cpu")
    cfg = OmegaConf.create(state["config"])
    model = SanaTransformer2DModel(**transformer_config(OmegaConf.to_container(cfg.model, resolve=True)))
    swap_attention(model, OmegaConf.to_container(cfg.attn, resolve=True))
    model.load_state_dict(model_weights(state, weights))
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device).eval(), cfg, int(state.get("step", 0))


def sample_settings(cfg=None, **overrides) -> dict:
    """:data:`DEFAULTS` < the run's ``task.sample`` block < ``overrides`` that are not ``None``."""
    s = dict(DEFAULTS)
    block = None
    if cfg is not None:
        task = cfg.get("task") if hasattr(cfg, "get") else None
        block = task.get("sample") if task is not None else None
    if block:
        from omegaconf import OmegaConf  # noqa: PLC0415

        block = OmegaConf.to_container(block, resolve=True) if OmegaConf.is_config(block) else dict(block)
        s.update(block)  # an explicit null counts (npz_size: null keeps the decoded size)
    s.update({k: v for k, v in overrides.items() if v is not None})
    if s["solver"] not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {s['solver']!r}")
    return s


# --------------------------------------------------------------------------------------------- sampling
Cond = tuple  # (text [B, L, D], mask [B, L] or None)


def sample_seed(seed: int, prompt_index: int, k: int) -> int:
    """The noise seed of image ``k`` of prompt ``prompt_index``."""
    return int(seed) * 1_000_003 + int(prompt_index) * 1_000 + int(k)


def initial_noise(seeds, shape, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """``[len(seeds), *shape]`` standard normal noise, row ``b`` from a CPU generator seeded with ``seeds[b]``."""
    rows = [torch.randn(tuple(shape), generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    return torch.stack(rows).to(device=device, dtype=dtype)


def make_velocity(model, precision: str = "fp32") -> Callable:
    """``velocity(x [B, C, h, w], t [B] in [0, 1], cond=(text [B, L, D], mask [B, L] | None)) -> v`` (fp32).

    The transformer sees ``timestep = t * 1000`` (as in training and in ``SanaPipeline``); ``precision``
    ``bf16`` / ``fp16`` runs it under CUDA autocast.
    """
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}

    def velocity(x, t, cond):
        text, mask = cond
        ctx = (torch.autocast("cuda", dtype=dtypes[precision]) if precision in dtypes and x.is_cuda
               else torch.autocast("cpu", enabled=False))
        with ctx:
            out = model(x, encoder_hidden_states=text, timestep=t.float() * 1000.0, encoder_attention_mask=mask,
                        return_dict=False)[0]
        return out.float()

    return velocity


def dpm_scheduler(shift: float):
    """SANA's Flow-DPM-Solver: diffusers' ``DPMSolverMultistepScheduler`` on flow sigmas shifted by ``shift``
    (the scheduler a diffusers SANA pipeline folder ships, ``flow_shift`` 3.0 at 1024 px)."""
    from diffusers import DPMSolverMultistepScheduler  # noqa: PLC0415

    return DPMSolverMultistepScheduler(flow_shift=float(shift), use_flow_sigmas=True, prediction_type="flow_prediction")


@torch.no_grad()
def dpm_sample(velocity: Callable, noise: torch.Tensor, *, num_steps: int = 20, shift: float = 3.0, cond=None,
               uncond=None, guidance_scale: float = 1.0, progress: bool = False) -> torch.Tensor:
    """Flow-DPM-Solver (2nd-order multistep) from ``noise [B, ...]`` at ``t = 1`` to ``t = 0``.

    ``velocity(x, t [B] in [0, 1], cond)``; the model sees the scheduler's timesteps (``sigma * 1000``), with
    the guidance of :func:`tasks.common.flow_matching.guided_velocity`. Returns ``x_0`` (fp32).
    """
    from tasks.common.flow_matching import guided_velocity  # noqa: PLC0415

    sched = dpm_scheduler(shift)
    sched.set_timesteps(num_steps, device=noise.device)
    x = noise.float().clone()
    steps = sched.timesteps
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        steps = tqdm(steps, desc="sampling", leave=False)
    for ts in steps:
        t = (ts.float() / 1000.0).expand(x.shape[0])
        v = guided_velocity(velocity, x, t, cond, uncond, guidance_scale)
        x = sched.step(v.float(), ts, x, return_dict=False)[0]
    return x


@torch.no_grad()
def sample_latents(model, text: torch.Tensor, *, mask: torch.Tensor | None = None,
                   neg_text: torch.Tensor | None = None, neg_mask: torch.Tensor | None = None,
                   noise: torch.Tensor | None = None, seeds=None, steps: int = 20, shift: float = 3.0,
                   guidance_scale: float = 4.5, solver: str = "dpm", precision: str = "fp32",
                   progress: bool = False) -> torch.Tensor:
    """Sample SANA latents ``[B, C, h, w]`` (fp32; ``C, h = w`` from the transformer's config) for captions
    ``text [B, L, D]`` (``mask [B, L]``: 1 for tokens, 0 for padding, or ``None``).

    ``neg_text [B, L', D]`` (``neg_mask``) is the unconditional branch of classifier-free guidance (SANA: the
    Gemma embedding of ""); without it, or with ``guidance_scale == 1``, the conditional velocity alone is
    integrated. Noise: ``noise [B, C, h, w]``, or :func:`initial_noise` of ``seeds`` (one seed per row).
    """
    from tasks.common.flow_matching import euler_sample  # noqa: PLC0415

    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    device = next(model.parameters()).device
    c = model.config
    shape = (c.in_channels, c.sample_size, c.sample_size)
    if noise is None:
        if seeds is None:
            raise ValueError("pass noise [B, C, h, w] or one seed per caption")
        noise = initial_noise(seeds, shape, device)
    if noise.shape[0] != text.shape[0]:
        raise ValueError(f"noise batch {noise.shape[0]} != captions {text.shape[0]}")
    dev = lambda m: None if m is None else m.to(device)  # noqa: E731
    cond = (text.to(device=device, dtype=torch.float32), dev(mask))
    uncond = None if neg_text is None else (neg_text.to(device=device, dtype=torch.float32), dev(neg_mask))
    velocity = make_velocity(model, precision)
    kwargs = dict(num_steps=int(steps), shift=float(shift), cond=cond, uncond=uncond,
                  guidance_scale=float(guidance_scale), progress=progress)
    if solver == "euler":
        return euler_sample(velocity, noise.to(device).float(), **kwargs)
    return dpm_sample(velocity, noise.to(device), **kwargs)


# ------------------------------------------------------------------------------------------- decoders
def load_dcae(path: str | None, device="cpu", dtype=torch.float32):
    """diffusers' ``AutoencoderDC`` (DC-AE f32c32 for SANA-0.6B) from a LOCAL folder, frozen, in eval mode."""
    require_local_weights(path, what="DC-AE weights (SANA-0.6B decodes with DC-AE f32c32)", repo=DC_AE_REPO,
                          option="--vae {dir} (or --pipeline <Sana_600M_1024px_diffusers>, whose vae/ is used)",
                          example_dir="/models/dc-ae-f32c32-sana-1.0-diffusers",
                          contents="config.json + diffusion_pytorch_model.safetensors")
    from diffusers import AutoencoderDC  # noqa: PLC0415

    vae = AutoencoderDC.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()
    for p in vae.parameters():
        p.requires_grad_(False)
    return vae


def dcae_decoder(vae) -> Callable:
    """``decode(latents [B, C, h, w]) -> images [B, 3, h * f, w * f]`` in [-1, 1] (fp32, clamped), dividing by
    the VAE config's ``scaling_factor`` first (0.41407 for DC-AE f32c32 SANA)."""
    scale = float(vae.config.scaling_factor)
    dtype = next(vae.parameters()).dtype

    @torch.no_grad()
    def decode(z):
        return vae.decode((z / scale).to(dtype), return_dict=False)[0].float().clamp(-1, 1)

    return decode


@torch.no_grad()
def preview_decoder(z: torch.Tensor, factor: int = 4) -> torch.Tensor:
    """Stand-in decoder (no VAE): latent channels 0-2 squashed by ``tanh`` and upsampled ``factor`` x (nearest).

    ``z [B, C, h, w]`` -> ``[B, 3, h * factor, w * factor]`` in [-1, 1]; only for tiny runs and tests.
    """
    rgb = z[:, :3] if z.shape[1] >= 3 else z[:, :1].expand(-1, 3, -1, -1)
    return torch.nn.functional.interpolate(torch.tanh(rgb.float()), scale_factor=factor, mode="nearest")


# -------------------------------------------------------------------------------------------- prompts
def read_prompt_list(path: str, limit: int | None = None) -> list[dict]:
    """Prompts from a text file (one per line), GenEval's ``evaluation_metadata.jsonl`` or MJHQ-30K's
    ``meta_data.json`` (``{id: {"prompt", "category"}}``). Returns ``[{"prompt", "id", "metadata"}]``, where
    ``metadata`` is what GenEval's ``metadata.jsonl`` must hold (the jsonl line; ``{"prompt"}`` otherwise)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path} not found (a .txt with one prompt per line, GenEval's "
                                f"prompts/evaluation_metadata.jsonl or MJHQ-30K's meta_data.json)")
    records = []
    if path.endswith(".jsonl"):
        with open(path) as f:
            for i, line in enumerate(x for x in f if x.strip()):
                meta = json.loads(line)
                records.append({"prompt": meta["prompt"], "id": str(meta.get("id", f"{i:05d}")), "metadata": meta})
    elif path.endswith(".json"):
        with open(path) as f:
            data = json.load(f)
        items = data.items() if isinstance(data, dict) else ((str(i), d) for i, d in enumerate(data))
        for key, meta in items:
            meta = meta if isinstance(meta, dict) else {"prompt": str(meta)}
            records.append({"prompt": meta["prompt"], "id": str(key), "metadata": dict(meta, id=str(key))})
    else:
        with open(path) as f:
            for i, line in enumerate(x.rstrip("\n") for x in f if x.strip()):
                records.append({"prompt": line, "id": f"{i:05d}", "metadata": {"prompt": line}})
    return records[:limit] if limit is not None else records


def stack_captions(texts, masks) -> Cond:
    """Stack ``[L_b, D]`` embeddings (``masks``: ``[L_b]`` or ``None``) into ``[B, L, D]`` + mask ``[B, L]``.

    The mask is ``None`` when every row has the same length and none had a mask (files
    without masks); otherwise rows are zero-padded at the end and the padding is masked out.
    """
    lens = {t.shape[0] for t in texts}
    if len(lens) == 1 and all(m is None for m in masks):
        return torch.stack([t.float() for t in texts]), None
    L = max(lens)
    text = torch.zeros(len(texts), L, texts[0].shape[-1])
    mask = torch.zeros(len(texts), L, dtype=torch.long)
    for b, (t, m) in enumerate(zip(texts, masks)):
        text[b, :t.shape[0]] = t.float()
        mask[b, :t.shape[0]] = 1 if m is None else m.long()
    return text, mask


def load_negative(neg, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unconditional (empty-prompt) caption ``(text [L, D] fp32, mask [L] | None)`` of classifier-free guidance.

    ``neg``: a ``negative.pt`` path or its loaded dict ``{"text": [L, D], optional "mask": [L]}`` (what
    :func:`encode_to_files` writes), or ``"zeros"``: an all-zero ``[1, D]`` embedding with no mask (needs ``dim``;
    tiny / generated-data runs). Shared by :class:`FilePrompts` and the training task's caption dropout
    (:class:`tasks.image_gen.sana_task.SanaFinetuneTask`), so both use the same unconditional branch.
    """
    if isinstance(neg, str) and neg == "zeros":
        if dim is None:
            raise ValueError("a 'zeros' negative embedding needs the caption dimension")
        return torch.zeros(1, int(dim)), None
    if isinstance(neg, (str, os.PathLike)):
        if not os.path.isfile(neg):
            raise FileNotFoundError(f"negative embedding {neg} not found")
        neg = torch.load(neg, map_location="cpu")
    return neg["text"].float(), neg.get("mask")


class FilePrompts:
    """Pre-extracted caption embeddings (the training task's ``.pt`` format), the offline path.

    ``path``: a folder of ``.pt`` files ``{"text": [L, D], optional "mask": [L], "prompt": str, "id": str,
    "metadata": dict}`` (sorted by name; ``negative.pt`` there is the unconditional embedding), or one ``.pt``
    holding ``{"text": [N, L, D], optional "mask": [N, L], "prompt": [N], "id": [N], "negative": {...}}``.
    ``negative``: a ``.pt`` path, ``"zeros"`` (an all-zero ``[1, D]`` embedding: tiny / generated-data runs) or
    ``None`` (the one found with the prompts, if any).
    """

    def __init__(self, path: str, negative: str | None = None, limit: int | None = None):
        import glob  # noqa: PLC0415

        if not os.path.exists(path):
            raise FileNotFoundError(f"prompt embeddings {path} not found: a folder of .pt files "
                                    f"{{'text': [L, D], 'prompt', 'id'}} (see --encode-to) or one .pt file")
        self.texts, self.masks, self.records, neg = [], [], [], None
        if os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "**", "*.pt"), recursive=True))
            for f in files:
                if os.path.basename(f) == NEGATIVE_FILE:
                    neg = f
                    continue
                d = torch.load(f, map_location="cpu")
                self._add(d["text"], d.get("mask"), d, os.path.splitext(os.path.basename(f))[0])
        else:
            d = torch.load(path, map_location="cpu")
            t = d["text"]
            for i in range(t.shape[0] if t.dim() == 3 else 1):
                row = {k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in d.items()
                       if k in ("prompt", "id", "metadata")}
                self._add(t[i] if t.dim() == 3 else t, None if d.get("mask") is None else d["mask"][i], row,
                          f"{i:05d}")
            neg = d.get("negative")
        if not self.texts:
            raise FileNotFoundError(f"no prompt embeddings (.pt) under {path}")
        if limit is not None:
            self.texts, self.masks, self.records = self.texts[:limit], self.masks[:limit], self.records[:limit]
        neg = negative if negative is not None else neg
        self.negative = None if neg is None else load_negative(neg, self.texts[0].shape[-1])

    def _add(self, text, mask, d, default_id):
        self.texts.append(text.float())
        self.masks.append(mask)
        prompt = d.get("prompt")
        meta = d.get("metadata") or ({"prompt": prompt} if prompt is not None else {})
        self.records.append({"prompt": prompt, "id": str(d.get("id", default_id)), "metadata": dict(meta)})

    def __len__(self):
        return len(self.records)

    def encode(self, indices, device="cpu") -> tuple[Cond, Cond | None]:
        """Conditional and unconditional ``(text [B, L, D], mask [B, L] | None)`` for prompts ``indices``."""
        text, mask = stack_captions([self.texts[i] for i in indices], [self.masks[i] for i in indices])
        uncond = None
        if self.negative is not None:
            nt, nm = self.negative
            uncond = (nt[None].expand(len(indices), -1, -1).to(device),
                      None if nm is None else nm[None].expand(len(indices), -1).to(device))
        return (text.to(device), None if mask is None else mask.to(device)), uncond


class RandomPrompts(FilePrompts):
    """``n`` random caption embeddings ``N(0, 1) [L, D]`` (seeded), for runs on the generated-data task."""

    def __init__(self, n: int, text_len: int, dim: int, seed: int = 0):  # noqa: D107 (no super().__init__)
        g = torch.Generator().manual_seed(seed)
        self.texts = [torch.randn(text_len, dim, generator=g) for _ in range(n)]
        self.masks = [None] * n
        self.records = [{"prompt": None, "id": f"{i:05d}", "metadata": {"prompt": f"random caption {i}"}}
                        for i in range(n)]
        self.negative = (torch.zeros(1, dim), None)


def load_pipeline(path: str, transformer, device="cpu", text_dtype=None):
    """``SanaPipeline.from_pretrained(path, transformer=<our model>, local_files_only=True)``: the Gemma-2
    tokenizer / text encoder and DC-AE of a LOCAL diffusers SANA folder around our (MHLA) transformer."""
    require_local_weights(path, what="diffusers SANA pipeline folder", repo=PIPELINE_REPO, option="--pipeline {dir}",
                          example_dir="/models/Sana_600M_1024px_diffusers", marker="model_index.json",
                          contents="model_index.json, text_encoder/, tokenizer/, vae/")
    from diffusers import SanaPipeline  # noqa: PLC0415

    if text_dtype is None:
        text_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    pipe = SanaPipeline.from_pretrained(path, transformer=transformer, local_files_only=True, dtype=text_dtype)
    pipe.text_encoder.to(device)
    if getattr(pipe, "vae", None) is not None:  # DC-AE decodes in fp32
        pipe.vae.to(device=device, dtype=None if pipe.vae.dtype == torch.float32 else torch.float32)
    return pipe


def default_chi() -> list[str]:
    """The complex human instruction ``SanaPipeline.__call__`` prepends by default (read from its signature)."""
    from diffusers import SanaPipeline  # noqa: PLC0415

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


class PipelinePrompts:
    """Text prompts (:func:`read_prompt_list`) encoded on demand by a SANA pipeline's ``encode_prompt``
    (Gemma-2, ``max_sequence_length`` tokens, the complex human instruction when ``use_chi``; the negative
    prompt ``""`` without it, as ``SanaPipeline``)."""

    def __init__(self, pipe, records: list[dict], *, max_sequence_length: int = 300, use_chi: bool = True,
                 negative_prompt: str = ""):
        self.pipe, self.records = pipe, records
        self.max_sequence_length, self.negative_prompt = int(max_sequence_length), negative_prompt
        self.chi = default_chi() if use_chi else None

    def __len__(self):
        return len(self.records)

    @torch.no_grad()
    def encode(self, indices, device="cpu") -> tuple[Cond, Cond]:
        prompts = [self.records[i]["prompt"] for i in indices]
        pe, pm, ne, nm = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=True,
                                                 negative_prompt=self.negative_prompt, device=device,
                                                 max_sequence_length=self.max_sequence_length,
                                                 complex_human_instruction=self.chi)
        return (pe, pm), (ne, nm)  # the text encoder's dtype; sample_latents casts to fp32


def encode_to_files(prompts: PipelinePrompts, out_dir: str, batch_size: int = 16, device="cpu",
                    progress: bool = True) -> str:
    """Write ``<out_dir>/<index:05d>.pt`` and ``negative.pt``, the inputs of :class:`FilePrompts`: ``text [L, D]``
    in the encoder's dtype (bf16 on CUDA) cut after the last unmasked token, ``mask [L]``, ``prompt``, ``id``,
    ``metadata``. The cut padding is masked out of cross-attention either way, so sampling is unchanged."""
    os.makedirs(out_dir, exist_ok=True)
    starts = range(0, len(prompts), batch_size)
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        starts = tqdm(starts, desc="encoding prompts")

    def cut(text, mask):
        n = int(torch.nonzero(mask).max()) + 1 if mask.any() else 1
        return {"text": text[:n].cpu(), "mask": mask[:n].long().cpu()}

    neg = None
    for s in starts:
        idx = list(range(s, min(s + batch_size, len(prompts))))
        (pe, pm), (ne, nm) = prompts.encode(idx, device)
        for b, i in enumerate(idx):
            r = prompts.records[i]
            torch.save(dict(cut(pe[b], pm[b]), prompt=r["prompt"], id=r["id"], metadata=r["metadata"]),
                       os.path.join(out_dir, f"{i:05d}.pt"))
        neg = cut(ne[0], nm[0])
    torch.save(neg, os.path.join(out_dir, NEGATIVE_FILE))
    return out_dir


# ------------------------------------------------------------------------------------ generate, write
@dataclass
class Job:
    """Image ``k`` of prompt ``prompt`` (``index``: its row in ``samples.npz``)."""

    index: int
    prompt: int
    k: int
    seed: int = 0


@dataclass
class SampleRun:
    out_dir: str
    jobs: list = field(default_factory=list)
    batch_size: int = 8

    @property
    def num_batches(self) -> int:
        return ceil_div(len(self.jobs), self.batch_size)

    def batch(self, j: int) -> list:
        return self.jobs[j * self.batch_size:(j + 1) * self.batch_size]


def make_jobs(num_prompts: int, images_per_prompt: int, seed: int) -> list:
    """Jobs in (prompt, k) order: row ``i * images_per_prompt + k`` is image ``k`` of prompt ``i``."""
    return [Job(i * images_per_prompt + k, i, k, sample_seed(seed, i, k))
            for i in range(num_prompts) for k in range(images_per_prompt)]


def run_name(cfg, step: int, s: dict) -> str:
    return (f"{cfg.model.name}-{cfg.attn.name}-{step:07d}-{s['solver']}{s['steps']}-cfg{s['cfg_scale']:g}"
            f"-shift{s['shift']:g}-seed{s['seed']}")


def write_metadata(out_dir: str, prompts) -> None:
    """GenEval's per-prompt folders: ``<i:05d>/metadata.jsonl`` (one JSON object) and ``<i:05d>/samples/``."""
    for i, r in enumerate(prompts.records):
        folder = os.path.join(out_dir, f"{i:05d}")
        os.makedirs(os.path.join(folder, "samples"), exist_ok=True)
        with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
            f.write(json.dumps(r["metadata"]) + "\n")


def generate(model, prompts, run: SampleRun, s: dict, *, decode: Callable | None = None, rank: int = 0,
             world: int = 1, device="cpu", write_png: bool = True, npz_size: int | None = None,
             progress: bool = True) -> None:
    """Sample this rank's global batches (``j % world == rank``) of ``run.jobs``.

    Each batch writes its PNGs (``<prompt:05d>/samples/<k:04d>.png``) and a part file in ``run.out_dir``:
    uint8 images ``[b, S, S, 3]`` (centre crop + resize to ``npz_size`` when smaller than the decoded size) or,
    without ``decode``, the latents ``[b, C, h, w]``. :func:`finalize` (rank 0, after all ranks) joins the parts.
    """
    from PIL import Image  # noqa: PLC0415

    from .npz import center_crop_resize  # noqa: PLC0415
    from .sampling import to_uint8  # noqa: PLC0415

    mine = list(range(rank, run.num_batches, world))
    it = mine
    if progress and rank == 0:
        from tqdm.auto import tqdm  # noqa: PLC0415

        it = tqdm(mine, desc=f"sampling {len(run.jobs)} images", unit="batch")
    for j in it:
        jobs = run.batch(j)
        cond, uncond = prompts.encode([jb.prompt for jb in jobs], device)
        z = sample_latents(model, cond[0], mask=cond[1], neg_text=None if uncond is None else uncond[0],
                           neg_mask=None if uncond is None else uncond[1], seeds=[jb.seed for jb in jobs],
                           steps=s["steps"], shift=s["shift"], guidance_scale=s["cfg_scale"], solver=s["solver"],
                           precision=s["precision"])
        part = os.path.join(run.out_dir, f".part_{j:06d}.npy")
        if decode is None:
            np.save(part, z.cpu().numpy().astype(np.float32))
            continue
        imgs = to_uint8(decode(z)).cpu().numpy()  # [b, H, W, 3] uint8
        if write_png:
            for jb, im in zip(jobs, imgs):
                Image.fromarray(im).save(os.path.join(run.out_dir, f"{jb.prompt:05d}", "samples", f"{jb.k:04d}.png"))
        if npz_size and npz_size < imgs.shape[1]:  # downscale only
            imgs = np.stack([center_crop_resize(Image.fromarray(im), npz_size) for im in imgs])
        np.save(part, imgs)


def finalize(run: SampleRun, prompts, s: dict) -> dict:
    """Join the part files (rank 0): ``samples.npz`` (uint8 ``arr_0``) or ``latents.npy``, and ``samples.jsonl``
    (row ``n``: prompt index, image index, seed, prompt, id). Returns ``{"npz" or "latents": path, "rows": N}``."""
    from .npz import save_npz  # noqa: PLC0415

    arrays = []
    for j in range(run.num_batches):
        part = os.path.join(run.out_dir, f".part_{j:06d}.npy")
        arrays.append(np.load(part))
        os.unlink(part)
    arr = np.concatenate(arrays)
    with open(os.path.join(run.out_dir, "samples.jsonl"), "w") as f:
        for jb in run.jobs:
            r = prompts.records[jb.prompt]
            f.write(json.dumps({"index": jb.index, "prompt_index": jb.prompt, "k": jb.k, "seed": jb.seed,
                                "prompt": r["prompt"], "id": r["id"]}) + "\n")
    with open(os.path.join(run.out_dir, "settings.json"), "w") as f:
        json.dump(s, f, indent=2)
    if arr.dtype == np.uint8:
        return {"npz": save_npz(arr, os.path.join(run.out_dir, "samples.npz")), "rows": int(arr.shape[0])}
    path = os.path.join(run.out_dir, "latents.npy")
    np.save(path, arr)
    return {"latents": path, "rows": int(arr.shape[0])}


# ------------------------------------------------------------------------------------------- metrics
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
        from tqdm.auto import tqdm  # noqa: PLC0415

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
    from .npz import build_reference_npz  # noqa: PLC0415

    path = os.path.join(out_root, f"reference-{os.path.basename(os.path.normpath(reference))}-{size}.npz")
    if not os.path.isfile(path):
        build_reference_npz(reference, path, size=size)
    return path


def evaluate_run(run_dir: str, *, reference: str | None = None, clip_path: str | None = None, device="cpu",
                 inception_path: str | None = None, progress: bool = True) -> dict:
    """FID & co. (:func:`tasks.image_gen.metrics.evaluate_samples`) and the CLIP score of a sampled run folder
    (``samples.npz`` + ``samples.jsonl``); writes and returns ``metrics.json``'s content."""
    from .metrics import evaluate_samples  # noqa: PLC0415
    from .npz import load_npz  # noqa: PLC0415

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


# ----------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="a train.py run directory or its last.pt / best.pt")
    p.add_argument("--which", default="last", choices=["last", "best"], help="checkpoint of a run directory")
    p.add_argument("--weights", default="ema", choices=["ema", "model"])
    p.add_argument("--prompts", help="a .pt folder / file of caption embeddings, or (with --pipeline) a .txt, "
                                     "GenEval evaluation_metadata.jsonl or MJHQ meta_data.json")
    p.add_argument("--random-prompts", type=int, default=None, help="N random caption embeddings (tiny runs)")
    p.add_argument("--pipeline", default=None, help="a LOCAL diffusers SANA pipeline folder (Gemma-2 + DC-AE)")
    p.add_argument("--negative", default=None, help="unconditional embedding .pt, or 'zeros' (file prompts)")
    p.add_argument("--encode-to", default=None, help="with --pipeline: only write the prompts' .pt files here")
    p.add_argument("--out", default="samples")
    p.add_argument("--vae", default=None, help="DC-AE folder, or 'preview' (latent channels as RGB); none: latents")
    p.add_argument("--clip", default=None, help="LOCAL openai/clip-vit-large-patch14 folder -> CLIP score")
    p.add_argument("--reference", default=None, help="FID reference: ADM .npz / stats, or a folder of images")
    p.add_argument("--inception-path", default=None)
    for name, typ in (("steps", int), ("cfg-scale", float), ("shift", float), ("seed", int),
                      ("images-per-prompt", int), ("batch-size", int), ("max-sequence-length", int),
                      ("npz-size", int)):
        p.add_argument(f"--{name}", type=typ, default=None, help="default: the run's task.sample block")
    p.add_argument("--solver", default=None, choices=SOLVERS)
    p.add_argument("--precision", default=None, choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--no-chi", action="store_true", help="encode prompts without SANA's complex human instruction")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)

    from tasks.common.distributed import barrier, cleanup, setup_distributed  # noqa: PLC0415

    info = setup_distributed(args.device)
    device = info.device
    if args.encode_to:
        if not (args.pipeline and args.prompts):
            p.error("--encode-to needs --pipeline and --prompts (a text / jsonl / json prompt file)")
        pipe = load_pipeline(args.pipeline, _placeholder_transformer(), device)
        pp = PipelinePrompts(pipe, read_prompt_list(args.prompts, args.limit),
                             max_sequence_length=args.max_sequence_length or DEFAULTS["max_sequence_length"],
                             use_chi=not args.no_chi)
        if info.is_main:
            print(f"wrote {encode_to_files(pp, args.encode_to, device=device)}", flush=True)
        cleanup(info)
        return 0
    if not args.ckpt:
        p.error("--ckpt is required (a train.py run directory or checkpoint)")
    model, cfg, step = load_sana_checkpoint(args.ckpt, args.weights, device, args.which)
    s = sample_settings(cfg, steps=args.steps, cfg_scale=args.cfg_scale, shift=args.shift, seed=args.seed,
                        solver=args.solver, images_per_prompt=args.images_per_prompt, batch_size=args.batch_size,
                        max_sequence_length=args.max_sequence_length, npz_size=args.npz_size,
                        precision=args.precision, use_chi=False if args.no_chi else None)
    if s["precision"] == "auto":
        s["precision"] = "bf16" if device.type == "cuda" else "fp32"
    if args.images_per_prompt is None and args.prompts and args.prompts.endswith("evaluation_metadata.jsonl"):
        s["images_per_prompt"] = 4  # GenEval's protocol: 4 images per prompt
    pipe = None
    if args.pipeline:
        if not args.prompts:
            p.error("--pipeline needs --prompts (a .txt, GenEval .jsonl or MJHQ meta_data.json)")
        pipe = load_pipeline(args.pipeline, model, device)
        prompts = PipelinePrompts(pipe, read_prompt_list(args.prompts, args.limit),
                                  max_sequence_length=s["max_sequence_length"], use_chi=s["use_chi"])
    elif args.random_prompts:
        c = model.config
        prompts = RandomPrompts(args.random_prompts, int(cfg.task.get("text_len", 8)), c.caption_channels, s["seed"])
    elif args.prompts:
        prompts = FilePrompts(args.prompts, args.negative, args.limit)
    else:
        p.error("pass --prompts (embedding .pt files, or text prompts with --pipeline) or --random-prompts N")
    if s["cfg_scale"] != 1.0 and getattr(prompts, "negative", True) is None:
        p.error("classifier-free guidance needs an unconditional embedding: put negative.pt (the caption "
                "encoder's embedding of \"\") with the prompt files, pass --negative <file.pt> / zeros, or use "
                "--cfg-scale 1")
    decode = None
    if args.vae == "preview":
        decode = preview_decoder
    elif args.vae:
        decode = dcae_decoder(load_dcae(args.vae, device))
    elif pipe is not None and getattr(pipe, "vae", None) is not None:
        decode = dcae_decoder(pipe.vae)
    elif info.is_main:
        print("no --vae: writing latents only (pass --vae <dc-ae folder> for images, FID, CLIP and GenEval)")

    out_dir = os.path.join(args.out, run_name(cfg, step, s))
    run = SampleRun(out_dir, make_jobs(len(prompts), int(s["images_per_prompt"]), int(s["seed"])),
                    int(s["batch_size"]))
    if info.is_main:
        os.makedirs(out_dir, exist_ok=True)
        if decode is not None and not args.no_png:
            write_metadata(out_dir, prompts)
        print(f"{len(prompts)} prompts x {s['images_per_prompt']} images, {s['solver']} {s['steps']} steps, "
              f"cfg {s['cfg_scale']}, shift {s['shift']}, seed {s['seed']} -> {out_dir}", flush=True)
    barrier(info)
    generate(model, prompts, run, s, decode=decode, rank=info.rank, world=info.world_size, device=device,
             write_png=not args.no_png, npz_size=s["npz_size"], progress=True)
    barrier(info)
    if info.is_main:
        res = finalize(run, prompts, s)
        print(f"wrote {res.get('npz') or res.get('latents')} ({res['rows']} rows)", flush=True)
        if "npz" in res:
            del model, pipe
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.reference or args.clip:
                m = evaluate_run(out_dir, reference=args.reference, clip_path=args.clip, device=device,
                                 inception_path=args.inception_path)
                print("final: " + " ".join(f"{k}={v:.4f}" for k, v in m.items() if isinstance(v, float)), flush=True)
            if not args.no_png and all({"tag", "include"} <= set(r["metadata"]) for r in prompts.records):
                print(geneval_command(out_dir), flush=True)  # GenEval prompts: its detector runs elsewhere
    cleanup(info)
    return 0


def _placeholder_transformer():
    """A 1-block SANA so ``SanaPipeline.from_pretrained`` skips loading the real transformer (prompt encoding)."""
    from diffusers import SanaTransformer2DModel  # noqa: PLC0415

    from models.sana import SANA_TINY  # noqa: PLC0415

    return SanaTransformer2DModel(**dict(SANA_TINY, num_layers=1))


if __name__ == "__main__":
    sys.exit(main())
