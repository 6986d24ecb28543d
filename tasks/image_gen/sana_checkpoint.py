"""The SANA transformer of a ``train.py`` run, rebuilt for sampling (its attention swapped as it was trained).

    model, cfg, step = load_sana_checkpoint("outputs/sana_finetune/<run>")   # EMA weights, eval mode
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from models.sana import sana_config, swap_attention, swap_cross
from tasks.common.checkpoint import find_checkpoint, load_checkpoint, model_weights, run_config
from tasks.common.config import model_attention, model_cross_attention


def transformer_config(model_cfg) -> dict:
    """``SanaTransformer2DModel`` kwargs of a run: the config recorded at training time
    (``model.transformer_config``, written by :class:`tasks.image_gen.sana_task.SanaFinetuneTask`), else the
    ``config.json`` of ``model.pretrained`` when that folder exists here, else the named ``model.config``."""
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
    """Rebuild the SANA transformer of a ``train.py`` run and load the EMA weights when the checkpoint has them
    (``weights="model"``: the raw ones). ``ckpt``: a ``.pt`` file, or a run directory (its
    ``checkpoints/<which>.pt``, ``which``: last / best; :func:`tasks.common.checkpoint.find_checkpoint`).

    Returns ``(model, cfg, step)`` with ``model`` in eval mode on ``device`` (fp32 weights).
    """
    from diffusers import SanaTransformer2DModel  # noqa: PLC0415

    state = load_checkpoint(find_checkpoint(ckpt, which), map_location="cpu")
    cfg = run_config(state)
    model = SanaTransformer2DModel(**transformer_config(OmegaConf.to_container(cfg.model, resolve=True)))
    swap_attention(model, model_attention(cfg))
    swap_cross(model, model_cross_attention(cfg))
    model.load_state_dict(model_weights(state, weights))
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device).eval(), cfg, int(state.get("step", 0))
