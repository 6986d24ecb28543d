"""A cell's ``train.py`` config: composed with Hydra as ``train.py`` would (:func:`compose`), what the runner
needs from it (:func:`cell_info`), its CPU proxy's ``scale`` option (:func:`mini_option`) and whether it can
start (:func:`check_config`)."""

from __future__ import annotations

import os

from omegaconf import OmegaConf, open_dict

from .registry import CONFIGS, Cell, Table

SCALE_DIR = os.path.join(CONFIGS, "scale")


def compose(overrides: list[str]):
    """``train.py``'s config for ``overrides`` (``hydra.*`` ones left out) and the chosen config groups."""
    from hydra import compose as hydra_compose  # noqa: PLC0415  (hydra only where a config is composed)
    from hydra import initialize_config_dir  # noqa: PLC0415
    from hydra.core.global_hydra import GlobalHydra  # noqa: PLC0415

    overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = hydra_compose("train", overrides=overrides, return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        cfg.pop("hydra")
    return cfg, choices


def cell_kind(task_module: str) -> str:
    if "sana" in task_module:
        return "sana"
    if "image_gen" in task_module:
        return "generation"
    if "classification" in task_module:
        return "classification"
    return "other"


def cell_info(cell: Cell) -> dict:
    """What the runner needs from the cell's full-scale config: its model choice, kind, resolution and M."""
    cfg, choices = compose(cell.overrides)
    blocks = cfg.get("attn", {}).get("num_blocks") if cfg.get("attn", {}).get("name") == "mhla" else None
    return {"model": choices.get("model"), "kind": cell_kind(str(cfg.task.get("target", ""))),
            "image_size": cfg.data.get("image_size"), "num_blocks": blocks}


def mini_option(info: dict) -> str:
    """The ``scale`` option of a cell's CPU proxy: ``mini/<model>_<resolution>`` if there is one, else
    ``mini/<model>`` (``configs/scale/mini/``)."""
    names = ([f"{info['model']}_{info['image_size']}"] if info.get("image_size") else []) + [str(info["model"])]
    for name in names:
        if os.path.isfile(os.path.join(SCALE_DIR, "mini", name + ".yaml")):
            return f"mini/{name}"
    raise ValueError(f"no CPU proxy for model={info['model']}: add configs/scale/mini/{info['model']}.yaml")


def check_config(spec: Table, overrides: list[str], scale: str) -> str | None:
    """Why a run with ``overrides`` cannot start (it does not compose, or a key the full scale needs is unset),
    or None."""
    try:
        cfg, _ = compose(overrides)
    except Exception as e:  # noqa: BLE001
        return f"the config does not compose: {str(e).splitlines()[0]}"
    if scale == "full":
        unset = [k for k in spec.requires if OmegaConf.select(cfg, k, default=None) in (None, "", "???")]
        if unset:
            return "needs " + ", ".join(f"{k}=..." for k in unset) + " (give it after --)"
    return None


