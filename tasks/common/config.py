"""Start-of-run checks of a composed config: impossible combinations fail here with a fix-it message.

Hydra already rejects unknown keys (``foo=1`` -> "Key 'foo' is not in struct"); :func:`apply_overrides` does
the same for configs read back from a checkpoint (``eval.py``). This module checks what only the values or the
combination of groups can tell: an attention a model cannot take or an ``attn.*`` option that would not take effect
(:func:`model_attention`, the one place a run's attention is resolved), a block layout that does not tile the
model's token grid, a missing data root, a schedule that trains nothing.

It also holds the resolvers of ``hydra.run.dir`` (:func:`register_resolvers`).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from mhla.registry import accepted_options, check_attention, get_attention_class, resolve_attention
from models.attention import attention_contract
from models.lm.configuration_mhla_lm import LEGACY_ATTENTION_FIELDS


class ConfigError(ValueError):
    """A config that cannot run, with a message that says how to fix it."""


def model_attention(cfg) -> dict:
    """The attention this run builds: ``cfg.attn`` resolved against the model's attention contract
    (:func:`models.attention.attention_contract`, :func:`mhla.registry.resolve_attention`): ``{"name": ...,
    option: value, ...}`` with every option set. Raises :class:`ConfigError` for an attention the model cannot
    run (the message lists the ones it can), or an ``attn.*`` option that would not take effect (it names it)."""
    try:
        contract = attention_contract(cfg.model)
        options = resolve_attention(cfg.attn, contract)
        check_attention(options, contract)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return options


# The one mapping of configs written before the attention schema (``attn.*`` for every model): the language models
# kept their attention options as model.* fields, DiG chose GLA with model.token_mixer, MALA / RALA called their
# 2-D RoPE switch attn.rope. (A committed pre-schema checkpoint is loaded in tests/test_eval_dispatch.py.)


def upgrade_config(cfg):
    """``cfg`` (a run's stored config) in today's schema, changed in place and returned; a config of today is
    returned as it is. Options that the stored attention does not take are dropped (the old LM config carried
    every field for every attention); the old LM rule ``out_norm = not normalize`` is kept by the LM itself."""
    model, attn = cfg.get("model"), cfg.get("attn")
    if model is None or attn is None:
        return cfg
    with open_dict(cfg):
        if model.get("kind") == "lm" and any(k in model for k in LEGACY_ATTENTION_FIELDS):
            # the LMs read only attn.name then (the other attn.* values were the vision group's, unused)
            accepted = accepted_options(get_attention_class(attn.name)) or set(LEGACY_ATTENTION_FIELDS.values())
            new_attn = {"name": attn.name}
            for old, new in LEGACY_ATTENTION_FIELDS.items():
                value = model.pop(old, None)
                if new in accepted and value is not None:
                    new_attn[new] = value
            cfg.attn = OmegaConf.create(new_attn)
            model.pop("mhla_num_blocks", None)
            if model.get("max_position_embeddings") is None and cfg.get("data", {}).get("seq_len") is not None:
                model.max_position_embeddings = cfg.data.seq_len  # (MQAR's builder took it from the data then)
        if model.get("kind") == "dig" and "token_mixer" in model:
            mixer, chunk, backend = model.pop("token_mixer"), model.pop("gla_chunk", None), model.pop("gla_backend", None)
            if mixer == "gla":
                cfg.attn = OmegaConf.create({"name": "gla", "chunk": chunk, "backend": backend})
        if cfg.attn.get("name") in ("mala", "rala") and "rope" in cfg.attn:
            cfg.attn.rope_2d = cfg.attn.pop("rope")
        model.pop("attentions", None)
    return cfg


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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive_int(name: str, value, meaning_of_null: str) -> None:
    """``value`` must be null or an integer >= 1."""
    if value is not None and not (_is_int(value) and value >= 1):
        raise ConfigError(f"{name} must be an integer >= 1 or null ({meaning_of_null}), got {value!r}")


def check_eval_batch_size(cfg) -> None:
    """``data.eval_batch_size``: null (use ``data.batch_size``) or >= 1."""
    _check_positive_int("data.eval_batch_size", cfg.data.get("eval_batch_size"), "use data.batch_size")


def check_trainer(cfg) -> None:
    """Schedule and loop settings that would otherwise train nothing, crash mid-run or do something else.

    ``trainer.max_steps``: null (no step limit) or >= 1; ``trainer.max_epochs``: null (no epoch limit) or > 0
    (fractions allowed); at least one of them set. ``trainer.grad_clip``: null or 0 (no clipping) or > 0.
    ``data.eval_batch_size``: null (``data.batch_size``) or >= 1. The step intervals: null or >= 1.
    """
    tcfg = cfg.trainer
    max_steps, max_epochs = tcfg.get("max_steps"), tcfg.get("max_epochs")
    _check_positive_int("trainer.max_steps", max_steps, "no step limit: train for trainer.max_epochs")
    if max_epochs is not None and not (isinstance(max_epochs, (int, float)) and not isinstance(max_epochs, bool)
                                       and max_epochs > 0):
        raise ConfigError(f"trainer.max_epochs must be > 0 or null (no epoch limit: train for trainer.max_steps), "
                          f"got {max_epochs!r}")
    if max_steps is None and max_epochs is None:
        raise ConfigError("trainer.max_steps and trainer.max_epochs are both null: set one of them "
                          "(e.g. trainer.max_steps=1000 or trainer.max_epochs=3)")
    clip = tcfg.get("grad_clip")
    if clip is not None and not (isinstance(clip, (int, float)) and clip >= 0):
        raise ConfigError(f"trainer.grad_clip is the maximum gradient norm: > 0, or null / 0 for no clipping; "
                          f"got {clip!r}")
    check_eval_batch_size(cfg)
    log_every = tcfg.get("log_every", 50)
    if not (_is_int(log_every) and log_every >= 1):
        raise ConfigError(f"trainer.log_every must be an integer >= 1, got {log_every!r}")
    _check_positive_int("trainer.eval_every_steps", tcfg.get("eval_every_steps"), "evaluate every epoch")
    _check_positive_int("trainer.checkpoint_every_steps", tcfg.get("checkpoint_every_steps"),
                        "save at the end of every epoch")
    _check_positive_int("trainer.stop_after_steps", tcfg.get("stop_after_steps"), "run the whole schedule")
    workers = tcfg.get("num_workers", 0)
    if not (_is_int(workers) and workers >= 0):
        raise ConfigError(f"trainer.num_workers must be an integer >= 0, got {workers!r}")


def validate_config(cfg) -> None:
    for key in ("task", "model", "attn", "data", "optim", "sched", "trainer"):
        if key not in cfg or cfg[key] is None:
            raise ConfigError(f"the config has no '{key}' group; add {key}=... to the command")
    check_data(cfg)
    check_trainer(cfg)
    model_attention(cfg)


def apply_overrides(cfg, overrides: list[str]) -> None:
    """Apply ``key=value`` overrides to ``cfg`` in place with Hydra's rule: ``key`` must exist (a misspelled key
    is an error, not a new key); ``+key=value`` adds a key. Used by ``eval.py`` on the config stored in a
    checkpoint, so that it rejects what ``train.py`` rejects."""
    OmegaConf.set_struct(cfg, True)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key = item.split("=", 1)[0]
        try:
            if key.startswith("+"):
                with open_dict(cfg):
                    cfg.merge_with_dotlist([item.lstrip("+")])
            else:
                cfg.merge_with_dotlist([item])
        except (ConfigAttributeError, ConfigKeyError) as e:
            raise ConfigError(f"Could not override '{key}'. To append to the config use +{item}\n"
                              f"{str(e).splitlines()[0]}") from None


# ------------------------------------------------------------------------------ hydra.run.dir resolvers
def launch_id() -> str:
    """An id shared by the processes of one launch: this process's pid, or under ``torchrun`` the pid of the
    elastic agent (the common parent of the ranks). Part of the default run folder, so that two runs started in
    the same second get different folders while the ranks of one run share theirs."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return str(os.getppid() if under_torchrun else os.getpid())


def resume_run_dir(resume, default: str) -> str:
    """The run folder of ``trainer.resume`` when it names another run (its folder, its ``checkpoints/`` folder
    or a checkpoint file in it), so that a resumed run goes on writing there; else ``default``."""
    if resume is None or isinstance(resume, bool) or str(resume) in ("", "auto", "last"):
        return default
    path = Path(str(resume))
    if path.is_file():
        path = path.parent
    if path.name == "checkpoints":
        path = path.parent
    return str(path) if (path / "checkpoints").is_dir() else default


def register_resolvers() -> None:
    """Register ``${launch_id:}`` and ``${resume_run_dir:...}`` (used by ``hydra.run.dir`` in
    ``configs/train.yaml``) with OmegaConf; call before Hydra composes the config."""
    OmegaConf.register_new_resolver("launch_id", launch_id, replace=True)
    OmegaConf.register_new_resolver("resume_run_dir", resume_run_dir, replace=True)
