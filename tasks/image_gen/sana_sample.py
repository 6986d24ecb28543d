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
(SANA's Flow-DPM-Solver: diffusers' ``SanaPipeline`` itself, on our transformer and a ``DPMSolverMultistepScheduler``
with flow sigmas; the default for Table 4, 20 steps) or ``--solver euler``
(:func:`tasks.common.flow_matching.euler_sample`); see :mod:`tasks.image_gen.sana_sampling`.
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
* ``metrics.json`` (:mod:`tasks.image_gen.sana_metrics`): FID / sFID / precision / recall against ``--reference``
  (an ADM ``.npz`` / stats file or a folder of images, e.g. MJHQ-30K, turned into
  ``<out>/reference-<name>-<size>.npz`` once) and the CLIP score (torchmetrics ``CLIPScore`` with a LOCAL
  ``openai/clip-vit-large-patch14`` folder).
* ``latents.npy`` (float32 ``[N, C, h, w]``) when nothing decodes (no ``--vae``).

Determinism: image ``k`` of prompt ``i`` starts from noise drawn by a CPU generator seeded with
``seed * 1_000_003 + i * 1_000 + k``, so the same seed gives the same latents whatever the batch size, device or
number of ranks. Under ``torchrun``, global batch ``j`` is sampled by rank ``j % world_size``; rank 0 assembles.

Modules: :mod:`~tasks.image_gen.sana_checkpoint` (the run's transformer), :mod:`~tasks.image_gen.sana_prompts`,
:mod:`~tasks.image_gen.sana_sampling`, :mod:`~tasks.image_gen.sana_decode`, :mod:`~tasks.image_gen.sana_generate`
(jobs, shards, output folder) and :mod:`~tasks.image_gen.sana_metrics`; this one is the command line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from tasks.common.distributed import barrier, cleanup, setup_distributed
from tasks.image_gen.sana_checkpoint import load_sana_checkpoint
from tasks.image_gen.sana_decode import dcae_decoder, load_dcae, preview_decoder
from tasks.image_gen.sana_generate import SampleRun, finalize, generate, make_jobs, run_name, write_metadata
from tasks.image_gen.sana_metrics import evaluate_run, geneval_command
from tasks.image_gen.sana_prompts import (
    FilePrompts,
    PipelinePrompts,
    RandomPrompts,
    encode_to_files,
    load_pipeline,
    read_prompt_list,
)
from tasks.image_gen.sana_sampling import DEFAULTS, SOLVERS, sample_settings


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

    info = setup_distributed(args.device)
    device = info.device
    if args.encode_to:
        if not (args.pipeline and args.prompts):
            p.error("--encode-to needs --pipeline and --prompts (a text / jsonl / json prompt file)")
        pipe = load_pipeline(args.pipeline, None, device)
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


if __name__ == "__main__":
    sys.exit(main())
