"""Start-of-run checks of a composed config: impossible combinations fail here with a fix-it message.

Hydra already rejects unknown keys (``foo=1`` -> "Key 'foo' is not in struct"); this module checks what
only the combination of groups can tell: an attention a model cannot take, a block layout that does not
tile the model's token grid, a missing data root.
"""

from __future__ import annotations

import os


class ConfigError(ValueError):
    """A config that cannot run, with a message that says how to fix it."""


def _token_grid(model_cfg) -> tuple[int, int] | None:
    if model_cfg.get("kind") not in ("vit", "dit", "dig"):
        return None
    img = int(model_cfg.get("pad_to") or model_cfg.get("img_size") or model_cfg.input_size)  # DiT: input_size
    patch = int(model_cfg.patch_size)
    if img % patch:
        raise ConfigError(f"model.img_size/pad_to={img} is not a multiple of model.patch_size={patch}")
    return img // patch, img // patch


def check_attention_fits_model(cfg) -> None:
    from mhla.registry import list_attentions  # noqa: PLC0415

    attn = cfg.attn
    supported = cfg.model.get("attentions")
    # a model may list its own built-in attention (e.g. SANA's "native" ReLU linear attention)
    model_native = supported is not None and attn.name in supported
    if attn.name not in list_attentions() and not model_native:
        raise ConfigError(f"attn={attn.name} is not a registered attention; choose one of {list_attentions()}")
    if supported is not None and attn.name not in supported:
        raise ConfigError(
            f"model={cfg.model.name} cannot take attn={attn.name}; it supports {list(supported)}")
    if cfg.model.get("kind") == "vlt" and attn.name == "mhla":
        from mhla.layouts import layout_from_num_blocks  # noqa: PLC0415

        size = int(cfg.model.img_size)
        blocks = attn.get("num_blocks")
        for stage, (grid, m) in enumerate(zip((size // 4, size // 8), cfg.model.stage_num_blocks)):
            try:
                layout_from_num_blocks((grid, grid), int(blocks if blocks is not None else m))
            except ValueError as e:
                raise ConfigError(
                    f"VLT stage {stage + 1} has a {grid}x{grid} token grid that M={blocks or m} blocks do not tile "
                    f"({e}); set model.stage_num_blocks (defaults [49, 16] at 224 px) or model.img_size") from None
        return
    grid = _token_grid(cfg.model)
    if grid is None or attn.name != "mhla":
        return
    from mhla.layouts import BlockLayout, layout_from_num_blocks  # noqa: PLC0415

    try:
        if attn.get("block") is not None:
            BlockLayout(grid, tuple(attn.block))
        else:
            layout_from_num_blocks(grid, int(attn.num_blocks))
    except ValueError as e:
        raise ConfigError(
            f"attn=mhla with num_blocks={attn.get('num_blocks')} block={attn.get('block')} does not fit the "
            f"{grid[0]}x{grid[1]} token grid of model={cfg.model.name} ({e}). Choose attn.num_blocks so that "
            f"sqrt(M) divides {grid[0]} (e.g. 4, 16, 64 on a 16x16 grid), or change model.pad_to / image size"
        ) from None


def check_data(cfg) -> None:
    data = cfg.data
    root = data.get("root", None)
    if "root" in data and not root:
        if str(data.name).startswith("imagenet"):
            what = ("an ImageNet-style folder with train/ and val/, one subfolder per class. Download ImageNet-1k "
                    "from image-net.org and pass data.root=/path/to/imagenet")
        else:
            what = (f"the local dataset folder; configs/data/{data.name}.yaml describes the layout it expects "
                    "(nothing is downloaded)")
        raise ConfigError(f"data={data.name} needs data.root=PATH: {what}")
    if root and not os.path.isdir(root):
        raise ConfigError(f"data.root={root} does not exist; point it at the dataset folder")
    if int(data.batch_size) < 1:
        raise ConfigError(f"data.batch_size must be >= 1, got {data.batch_size}")


def validate_config(cfg) -> None:
    for key in ("task", "model", "attn", "data", "optim", "sched", "trainer"):
        if key not in cfg or cfg[key] is None:
            raise ConfigError(f"the config has no '{key}' group; add {key}=... to the command")
    check_data(cfg)
    check_attention_fits_model(cfg)
