"""Table 5's rows on the task side: each row's config, its commands (fine-tune, then sample), and the sampling of
the evaluation-only row. The table itself (running or printing the commands, ``results/table5.md``) is
:mod:`scripts.tables.table5` (``make reproduce-table5``, ``python scripts/reproduce_table.py --table 5``).

    python -m tasks.video_gen.table5 --sample-pretrained wan_flash --wan /data/Wan2.1-T2V-1.3B-Diffusers \
        --prompts prompts/vbench.txt          # an evaluation-only row: sample the pretrained weights

Each row is its experiment config (``configs/experiment/table5/<row>.yaml``, composed with Hydra). A row with
``task.finetune: false`` (FlashAttention: the paper evaluates the pretrained Wan2.1-T2V-1.3B, not fine-tuned) is
evaluation-only: no ``train.py`` command, its videos are sampled from ``model.pretrained`` directly
(:func:`sample_pretrained`). The other rows are fine-tuned, then sampled from their checkpoint
(``tasks.video_gen.sample``). Every row samples with its config's ``sample.*`` settings (steps, CFG, shift, seed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = ("wan_flash", "wan_linear", "wan_mhla", "wan_mhla_hybrid")
CONFIGS = os.path.join(ROOT, "configs")
SAMPLES = "results/video/samples"


def row_config(row: str, overrides=()):
    """The composed config of Table 5 row ``row`` (``experiment=table5/<row>`` plus ``overrides``)."""
    from hydra import compose, initialize_config_dir  # noqa: PLC0415

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=[f"experiment=table5/{row}", *overrides])


def finetunes(cfg) -> bool:
    """False for an evaluation-only row (``task.finetune: false``): sampled from the pretrained weights."""
    return bool(cfg.task.get("finetune", True))


def sample_settings(cfg) -> dict:
    s = cfg.sample
    return {"steps": int(s.num_steps), "cfg": float(s.guidance_scale), "shift": float(s.shift),
            "seed": int(s.get("seed", 0))}


def commands(row: str, wan: str, data: str, gpus: int, prompts: str, cfg=None) -> list[str]:
    cfg = row_config(row) if cfg is None else cfg
    if not finetunes(cfg):  # evaluation only: no fine-tuning, sample the pretrained weights
        return [f"python -m tasks.video_gen.table5 --sample-pretrained {row} --wan {wan} --prompts {prompts} "
                f"--samples-out {SAMPLES}"]
    launch = f"torchrun --nproc_per_node={gpus} train.py" if gpus > 1 else "python train.py"
    run_dir = f"outputs/table5/{row}"
    flags = " ".join(f"--{k} {v}" for k, v in sample_settings(cfg).items())
    return [
        f"{launch} experiment=table5/{row} model.pretrained={wan} data.root={data} hydra.run.dir={run_dir}",
        f"python -m tasks.video_gen.sample --ckpt {run_dir}/checkpoints/last.pt --wan {wan} --prompts {prompts} "
        f"{flags} --out {SAMPLES}",
    ]


def read_prompts(prompts) -> list[str]:
    """A list of prompts, or one ``.txt`` file with one prompt per line."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if len(prompts) == 1 and prompts[0].endswith(".txt"):
        with open(prompts[0], encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise SystemExit("no prompts: pass --prompts 'a cat ...' or --prompts file.txt")
    return prompts


def sample_pretrained(row: str, wan: str | None, prompts, out: str = SAMPLES, *, overrides=(), device=None,
                      dtype=None, batch_size: int = 1, progress: bool = True) -> str:
    """Sample an evaluation-only row (``task.finetune: false``) from its pretrained weights, no training.

    Writes ``<out>/<row>_steps<S>_cfg<G>_shift<s>_seed<n>/<index>_<prompt slug>.mp4`` / ``.gif`` and
    ``prompts.txt``, the layout ``tasks.video_gen.sample`` writes for the fine-tuned rows (VBench reads it).
    Returns that folder.
    """
    # torch and the Wan stack only here: writing the table and printing the commands need neither
    import torch  # noqa: PLC0415

    from .media import save_gif, save_mp4  # noqa: PLC0415
    from .sample import slug  # noqa: PLC0415
    from .task import VideoGenTask  # noqa: PLC0415

    cfg = row_config(row, [*overrides, *([f"model.pretrained={wan}"] if wan else [])])
    if finetunes(cfg):
        raise SystemExit(f"table5/{row} is fine-tuned (task.finetune=true): train it, then sample its checkpoint "
                         "with python -m tasks.video_gen.sample")
    prompts = read_prompts(prompts)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    task = VideoGenTask(cfg)
    model = task.build_model().to(device, dtype).eval()
    st = sample_settings(cfg)
    folder = os.path.join(out, f"{row}_steps{st['steps']}_cfg{st['cfg']}_shift{st['shift']}_seed{st['seed']}")
    videos = task.generate(model, prompts, device, num_steps=st["steps"], guidance_scale=st["cfg"],
                           shift=st["shift"], seed=st["seed"], batch_size=batch_size, progress=progress)
    fps = int(cfg.sample.get("fps", 16))
    for i, (p, v) in enumerate(zip(prompts, videos)):
        stem = os.path.join(folder, f"{i:04d}_{slug(p)}")
        save_mp4(v, stem + ".mp4", fps=fps)
        save_gif(v, stem + ".gif", fps=fps)
    with open(os.path.join(folder, "prompts.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(prompts) + "\n")
    print(f"wrote {len(videos)} videos of {row} (pretrained, not fine-tuned) to {folder}")
    return folder


def missing_row_inputs(wan: str | None, data: str | None) -> list[str]:
    """What the rows need and is not here (:func:`tasks.common.config.missing_inputs` of each row's config with
    ``--wan`` as ``model.pretrained`` and ``--data`` as ``data.root``), each message once."""
    from tasks.common.config import missing_inputs  # noqa: PLC0415

    given = [f"model.pretrained={wan}" if wan else "model.pretrained=null", f"data.root={data}" if data else
             "data.root=null"]
    return list(dict.fromkeys(m for row in ROWS for m in missing_inputs(row_config(row, given))))


def row_settings(cfg) -> str:
    """What distinguishes a row's self-attention and training, in words (for the results file)."""
    from models.wan import attention_layers  # noqa: PLC0415  (diffusers)

    from tasks.common.config import model_attention  # noqa: PLC0415

    a = model_attention(cfg)  # the attention as the model builds it (null options resolved)
    if a["name"] == "softmax":
        attn = "softmax (the model's own SDPA / FlashAttention)"
    else:
        norm = ("normalised" if a.get("normalize") not in (False, None) else "no normalizer") + (
            ", output RMSNorm" if a.get("out_norm") else ", no output norm")
        layers = attention_layers(a, int(cfg.model.num_layers))
        soft = [i for i in range(int(cfg.model.num_layers)) if i not in layers]
        blocks = a.get("blocks")
        attn = (f"{a['name']} ({norm}, RoPE {a.get('rope')}" + (f", M = {math.prod(blocks)} blocks "
                                                                 f"{'x'.join(map(str, blocks))}" if blocks else "")
                + ")" + (f", softmax kept at layers {', '.join(map(str, soft))}" if soft else ", every layer"))
    train = (f"fine-tuned {int(cfg.trainer.max_steps)} steps at batch {int(cfg.data.batch_size)} per GPU"
             if finetunes(cfg) else "not fine-tuned")
    return f"{attn}; {train}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample-pretrained", metavar="ROW", required=True,
                    help="sample an evaluation-only row (task.finetune=false) from --wan")
    ap.add_argument("--wan", default=os.environ.get("WAN_PATH", ""), help="local Wan2.1-T2V-1.3B-Diffusers folder")
    ap.add_argument("--prompts", default="prompts/vbench.txt", help="one prompt per line (VBench's prompt list)")
    ap.add_argument("--samples-out", default=SAMPLES, help="folder of the sample folders")
    ap.add_argument("--batch-size", type=int, default=1)
    args = ap.parse_args(argv)
    if not (args.wan and os.path.isdir(args.wan)):
        raise SystemExit("--sample-pretrained needs the Wan2.1 weights: --wan /path/to/Wan2.1-T2V-1.3B-Diffusers")
    sample_pretrained(args.sample_pretrained, args.wan, args.prompts, args.samples_out, batch_size=args.batch_size)


if __name__ == "__main__":
    sys.exit(main())
