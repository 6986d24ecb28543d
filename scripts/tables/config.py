"""A cell's ``train.py`` config: composed with Hydra as ``train.py`` would (:func:`compose`), what the runner
needs from it (:func:`cell_info`), its CPU proxy's ``scale`` option (:func:`mini_option`) and whether it can
start (:func:`check_config`: it composes, and at full scale its declared inputs are here)."""

from __future__ import annotations

import functools
import os

from omegaconf import open_dict

from mhla.registry import takes_blocks
from tasks.common.config import assumptions, missing_inputs

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


@functools.lru_cache(maxsize=None)
def _assumptions(overrides: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return tuple(assumptions(compose(list(overrides))[0]).items())


def cell_assumptions(cell: Cell) -> dict:
    """``{topic: text}``: the ``assumptions:`` of the cell's full-scale config (where its recipe chooses what the
    paper does not state, or departs from it); ``{}`` when it does not compose."""
    try:
        return dict(_assumptions(tuple(cell.overrides)))
    except Exception:  # noqa: BLE001  (a config being written: composing it reports the error elsewhere)
        return {}


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
    blocks = cfg.get("attn", {}).get("num_blocks") if takes_blocks(cfg.get("attn", {}).get("name")) else None
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


def runner_options(spec: Table, cfg, args) -> dict:
    """The values of the runner options a cell's inputs may name (``option:`` entries): ``fid_ref``, the
    ``--fid-ref`` of the cell's resolution (``--no-fid``: not needed, FID is skipped)."""
    if getattr(args, "no_fid", False):
        return {}
    refs = getattr(args, "fid_refs", None) or {}
    res = cfg.get("data", {}).get("image_size")
    return {"fid_ref": refs.get(int(res)) if isinstance(res, int) else None}


def config_problems(spec: Table, overrides: list[str], scale: str, args=None) -> list[str]:
    """Why a run with ``overrides`` cannot start: it does not compose, or (full scale) inputs its config declares
    (``inputs:``, :func:`tasks.common.config.missing_inputs`) are not here, one message each saying what to
    download and where to put it. ``args``: the runner's options (``--fid-ref``, ``--no-fid``)."""
    try:
        cfg, _ = compose(overrides)
    except Exception as e:  # noqa: BLE001
        return [f"the config does not compose: {str(e).splitlines()[0]}"]
    return missing_inputs(cfg, runner_options(spec, cfg, args)) if scale == "full" else []


def check_config(spec: Table, overrides: list[str], scale: str, args=None) -> str | None:
    """:func:`config_problems` in one line, or None when the run can start."""
    problems = config_problems(spec, overrides, scale, args)
    if not problems:
        return None
    if problems[0].startswith("the config does not compose"):
        return problems[0]
    return "needs inputs that are not here (give the options after --): " + " | ".join(problems)


