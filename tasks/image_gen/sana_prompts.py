"""Prompts for the SANA sampler: caption embeddings from ``.pt`` files, random ones, or text encoded by a LOCAL
diffusers SANA pipeline (Gemma-2), and the unconditional (empty-prompt) embedding of classifier-free guidance.

    prompts = FilePrompts("/data/mjhq_embeds")                                # .pt files + negative.pt
    prompts = PipelinePrompts(load_pipeline("/models/Sana_600M_1024px_diffusers", model),
                              read_prompt_list("geneval/prompts/evaluation_metadata.jsonl"))
    (text, mask), uncond = prompts.encode([0, 1, 2], device)                  # uncond: (text, mask) or None

Every source has ``records`` (``[{"prompt", "id", "metadata"}]``), ``len()`` and ``encode(indices, device)``.
"""

from __future__ import annotations

import glob
import inspect
import json
import os

import torch
from tqdm.auto import tqdm

from models.sana import SANA_TINY
from models.weights import require_local_weights

PIPELINE_REPO = "Efficient-Large-Model/Sana_600M_1024px_diffusers"
NEGATIVE_FILE = "negative.pt"  # the unconditional caption embedding beside prompt / training .pt files
Cond = tuple  # (text [B, L, D], mask [B, L] or None)


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


def load_pipeline(path: str, transformer=None, device="cpu", text_dtype=None):
    """``SanaPipeline.from_pretrained(path, transformer=<our model>, local_files_only=True)``: the Gemma-2
    tokenizer / text encoder and DC-AE of a LOCAL diffusers SANA folder around our (MHLA) transformer
    (``None``: a 1-block placeholder, so that prompt encoding alone does not load the folder's transformer)."""
    require_local_weights(path, what="diffusers SANA pipeline folder", repo=PIPELINE_REPO, option="--pipeline {dir}",
                          example_dir="/models/Sana_600M_1024px_diffusers", marker="model_index.json",
                          contents="model_index.json, text_encoder/, tokenizer/, vae/")
    from diffusers import SanaPipeline, SanaTransformer2DModel  # noqa: PLC0415

    if transformer is None:
        transformer = SanaTransformer2DModel(**dict(SANA_TINY, num_layers=1))
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
        return (pe, pm), (ne, nm)  # the text encoder's dtype; sana_sampling.sample_latents casts to fp32


def encode_to_files(prompts: PipelinePrompts, out_dir: str, batch_size: int = 16, device="cpu",
                    progress: bool = True) -> str:
    """Write ``<out_dir>/<index:05d>.pt`` and ``negative.pt``, the inputs of :class:`FilePrompts`: ``text [L, D]``
    in the encoder's dtype (bf16 on CUDA) cut after the last unmasked token, ``mask [L]``, ``prompt``, ``id``,
    ``metadata``. The cut padding is masked out of cross-attention either way, so sampling is unchanged."""
    os.makedirs(out_dir, exist_ok=True)
    starts = range(0, len(prompts), batch_size)
    if progress:
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

