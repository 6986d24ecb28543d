"""Start-of-run checks of a composed config: impossible combinations fail here with a fix-it message.

Hydra already rejects unknown keys (``foo=1`` -> "Key 'foo' is not in struct"); :func:`apply_overrides` does
the same for configs read back from a checkpoint (``eval.py``). This module checks what only the values or the
combination of groups can tell: the inputs a recipe declares (``inputs:``: data, weights) that are not on disk,
an attention a model cannot take or an ``attn.*`` option that would not take effect (:func:`resolve_run_attention`,
the one place a run's attention is resolved, once, into the :class:`~mhla.registry.ResolvedAttention` the task
shares), a block layout that does not tile the model's token grid, a missing data root, a schedule that trains
nothing. It also words a run's settings (:func:`run_settings`: the attention's part from what the attention says
about itself, mhla/registry.py).

It also holds the resolvers of ``hydra.run.dir`` (:func:`register_resolvers`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from mhla.registry import (
    ResolvedAttention,
    accepted_options,
    attention_tag,
    block_defaults,
    get_attention_class,
    list_attentions,
    probe_layers,
    resolve,
    tag_blocks,
)
from models.attention import attention_contract, cross_attention_contract
from models.lm.configuration_mhla_lm import LEGACY_ATTENTION_FIELDS


class ConfigError(ValueError):
    """A config that cannot run, with a message that says how to fix it."""


ATTN_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "attn"


def import_config_attentions(folder: str | os.PathLike = ATTN_CONFIGS) -> list[str]:
    """Import the ``module:`` of every attention config in ``folder`` (``configs/attn/*.yaml``), so that the
    attentions defined outside the package (``examples/cosine_attention.py``) are registered too: what lists
    attentions (plots, benchmarks) calls this first. Returns the modules imported."""
    import importlib  # noqa: PLC0415

    modules = []
    for path in sorted(Path(folder).glob("*.yaml")):
        module = OmegaConf.load(path).get("module")
        if module:
            importlib.import_module(str(module))
            modules.append(str(module))
    return modules


def resolve_run_attention(cfg) -> ResolvedAttention:
    """The run's attention and cross-attention, resolved once at its start (train.py; a task builds from
    :attr:`Task.attention <tasks.common.task.Task.attention>`): ``cfg.attn`` against the model's attention
    contract (:func:`models.attention.attention_contract`, :func:`mhla.registry.resolve`), with
    ``cfg.attn_cross`` against its cross-attention contract as ``.cross``. Raises :class:`ConfigError` for an
    attention the model cannot run (the message lists the ones it can), or an option that would not take effect
    (it names it)."""
    return replace(resolve_model_attention(cfg), cross=_cross(cfg))


def _resolved(given, contract_of, model_cfg, key: str) -> ResolvedAttention:
    try:
        return resolve(given, contract_of(model_cfg), key=key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _cross(cfg) -> ResolvedAttention:
    """``cfg.attn_cross`` resolved (``native`` when the config has none, e.g. one stored before the group
    existed): ``native`` keeps the model's own cross-attention (softmax in Wan and SANA); a model without a
    cross-attention takes only ``native`` (docs/cross_attention.md)."""
    given = cfg.get("attn_cross") if hasattr(cfg, "get") else None
    return _resolved(given if given is not None else "native", cross_attention_contract, cfg.model, "attn_cross")


def resolve_model_attention(cfg) -> ResolvedAttention:
    """:func:`resolve_run_attention` without the cross-attention (``.cross`` is None)."""
    return _resolved(cfg.attn, attention_contract, cfg.model, "attn")


def model_attention(cfg) -> dict:
    """The options of the attention a stored run built (:func:`resolve_model_attention`'s ``.options``), for the
    readers of a checkpoint that need only them."""
    return resolve_model_attention(cfg).options


def model_cross_attention(cfg) -> dict:
    """The options of the run's cross-attention (``attn_cross``; ``native``: the model's own), as
    :func:`model_attention` for the self-attention."""
    return _cross(cfg).options


AUTO_OPTIONS = ("num_blocks", "block_size")  # MHLA's options that take "auto" (from the token grid / context)


def attention_line(attention: ResolvedAttention) -> str:
    """The ``attention: name=mhla num_blocks=... ...`` line that train.py prints for the run's resolved attention
    (:func:`resolve_run_attention`). An option set to ``auto`` (MHLA's ``num_blocks`` on a grid, ``block_size``
    in a language model) shows what it resolves to in the model's layers (the start-of-run probes), e.g.
    ``num_blocks=auto(M=16: 4x4 blocks of 4x4 tokens on the 16x16 grid)``."""
    options = attention.options
    auto = [k for k in AUTO_OPTIONS if options.get(k) == "auto"]
    resolved = []
    if auto:
        try:
            layers = probe_layers(options, attention.contract)
        except ValueError:
            layers = []
        resolved = list(dict.fromkeys(auto_resolution(layer.settings()) for layer in layers))
    parts = []
    for k, v in options.items():
        if k in auto:
            v = f"auto({'; '.join(resolved) or 'per layer at build, from its token grid'})"
        parts.append(f"{k}={v}")
    return "attention: " + " ".join(parts)


def auto_resolution(settings: dict) -> str:
    """What ``auto`` resolved to in a built MHLA layer, from its ``settings()``."""
    if settings.get("causal"):
        return f"block_size={settings['block_size']}, {settings['num_blocks']} learned blocks"
    grid, blocks, block = settings.get("grid"), settings.get("blocks"), settings.get("block")
    text = f"M={settings['num_blocks']}"
    if blocks is not None and block is not None and grid is not None:
        text += (f": {'x'.join(map(str, blocks))} blocks of {'x'.join(map(str, block))} tokens on the "
                 f"{'x'.join(map(str, grid))} grid")
    return text


# The one mapping of configs written before the attention schema (``attn.*`` for every model): the language models
# kept their attention options as model.* fields, DiG chose GLA with model.token_mixer, MALA / RALA called their
# 2-D RoPE switch attn.rope. (A committed pre-schema checkpoint is loaded in tests/tasks/test_eval_dispatch.py.)


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
            if mixer in list_attentions():  # (the one registered then: gla)
                cfg.attn = OmegaConf.create({"name": mixer, "chunk": chunk, "backend": backend})
        if cfg.attn.get("name") in list_attentions():  # options renamed since (MALA / RALA: rope -> rope_2d)
            for old, new in getattr(get_attention_class(cfg.attn.name), "legacy_options", {}).items():
                if old in cfg.attn:
                    cfg.attn[new] = cfg.attn.pop(old)
        if "mhla_num_blocks" in model:  # the model's default token blocks, named for MHLA until the registry said it
            model.token_blocks = model.pop("mhla_num_blocks")
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


# ------------------------------------------------------------------------------ declared inputs
# A full-scale recipe declares what it reads from disk under the top-level ``inputs:`` of its config (the task
# configs of the paper recipes, and cells with inputs of their own): ``{name: entry}`` with
#   what:   the input in words;  get: where / how to download it;  put: an example local path (the message's fix)
#   key:    the config option that points to it (checked by train.py and by scripts/reproduce_table.py), or
#   option: an option of scripts/reproduce_table.py (``fid_ref``: ``--fid-ref RES=PATH``), checked by the runner, or
#   step:   the later command that reads it and checks it itself (listed in the message, never blocking)
#   file:   true for a single file (default: a folder);  marker: path(s) inside the folder that must exist
# The CPU proxies (scale=mini/...) replace the task, so their configs declare nothing.
RUNNER_OPTIONS = {"fid_ref": "--fid-ref {res}={path} (make: REF='{res}={path}')"}


def _top_mapping(cfg, key: str) -> dict:
    node = cfg.get(key) if hasattr(cfg, "get") else None
    if not node:
        return {}
    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    return {name: entry for name, entry in plain.items() if entry}


def declared_inputs(cfg) -> dict:
    """``{name: entry}`` of the config's ``inputs:`` (resolved; entries set to null dropped)."""
    return _top_mapping(cfg, "inputs")


def assumptions(cfg) -> dict:
    """``{topic: text}`` of the config's ``assumptions:``: what a cell's recipe chooses where the paper is silent,
    or where it departs from the paper (entries set to null dropped: a cell can drop one it inherits). The results
    writers print them beside the cell's numbers."""
    return _top_mapping(cfg, "assumptions")


def _input_problem(entry: dict, value) -> str | None:
    """Why ``value`` (the path given for ``entry``) does not hold the input, or None."""
    if value in (None, "", "???"):
        return "not set"
    path = os.path.expanduser(str(value))
    if not os.path.exists(path):
        return f"{path} does not exist"
    if entry.get("file"):
        return None if os.path.isfile(path) else f"{path} is not a file"
    if not os.path.isdir(path):
        return f"{path} is not a folder"
    markers = entry.get("marker") or []
    absent = [m for m in ([markers] if isinstance(markers, str) else markers)
              if not os.path.exists(os.path.join(path, m))]
    return f"{path} has no {' or '.join(absent)}" if absent else None


def input_message(name: str, entry: dict, problem: str, res=None) -> str:
    """One missing input: what it is, why it is refused, what to download and where to put it."""
    put = entry.get("put", "/path/to/" + name)
    if entry.get("key"):
        where = f"pass {entry['key']}={put}"
    else:
        where = "pass " + RUNNER_OPTIONS.get(entry.get("option"), "--{option} {path}").format(
            res=res, path=put, option=entry.get("option"))
    return (f"{entry.get('what', name)} ({entry.get('key') or entry.get('option')}: {problem}). Get it: "
            f"{entry.get('get', 'see the config')}. Put it at e.g. {put} and {where}")


def missing_inputs(cfg, options: dict | None = None) -> list[str]:
    """Messages for the declared inputs (:func:`declared_inputs`) that are unset or absent on disk: entries with a
    ``key`` always; entries with an ``option`` when ``options`` has it (the runner passes its option values,
    ``{"fid_ref": path or None}``; train.py none); ``step`` entries never (their command checks them)."""
    out = []
    res = OmegaConf.select(cfg, "data.image_size", default=None) if OmegaConf.is_config(cfg) else None
    for name, entry in declared_inputs(cfg).items():
        if entry.get("key"):
            value = OmegaConf.select(cfg, entry["key"], default=None)
        elif entry.get("option") in (options or {}):
            value = options[entry["option"]]
        else:
            continue
        problem = _input_problem(entry, value)
        if problem:
            out.append(input_message(name, entry, problem, res))
    return out


def check_inputs(cfg) -> None:
    """Refuse to start a recipe whose declared inputs (``key`` entries) are missing: one message listing each,
    with what to download and where to put it (nothing is downloaded at run time)."""
    missing = missing_inputs(cfg)
    if missing:
        raise ConfigError("this recipe needs inputs that are not here (nothing is downloaded at run time):\n- "
                          + "\n- ".join(missing))


# ------------------------------------------------------------------------------ what distinguishes two runs
def run_settings(cfg, attention: ResolvedAttention | None = None) -> dict:
    """The settings that tell two table cells (or two seeds of one) apart, from a composed config: ``model``,
    ``resolution`` (px, video ``FxHxW`` px, LM context), ``attention`` (name and its non-default options, in the
    words the attention gives, :meth:`mhla.registry.ResolvedAttention.tag`), ``M`` (the attention's token
    blocks, e.g. MHLA's token-level heads), ``seed`` and ``schedule`` (steps or epochs). Sample folders, run
    folders and result records carry them (:func:`settings_tag`). ``attention``: the run's, when resolved
    already (:func:`resolve_run_attention`)."""
    m, d, t = cfg.model, cfg.get("data") or {}, cfg.get("trainer") or {}
    if attention is None:
        attention = _resolved_or_none(lambda: resolve_model_attention(cfg))
        if attention is not None:
            attention = replace(attention, cross=_resolved_or_none(lambda: _cross(cfg)))
    if attention is not None:  # the attention as the model builds it (null options resolved), its cross's word
        a, attn = attention.options, attention.tag()
    else:  # a cell train.py does not run (e.g. the fla baselines): its config as it stands
        a = {k: v for k, v in (cfg.get("attn") or {}).items() if v is not None}
        attn = attention_tag(a)
    if attention is None or attention.cross is None:  # an unresolved cross-attention: a registered one's word
        cross_name = str((cfg.get("attn_cross") or {}).get("name", ""))
        if cross_name in list_attentions():
            attn += f"+x{cross_name.removesuffix('_cross')}"
    model = str(m.get("name"))
    if m.get("arch") not in (None, "mhla_lm"):
        model += f"-{m.arch}"
    if d.get("num_frames") and d.get("height"):
        res = f"{d.num_frames}x{d.height}x{d.width}"
    elif d.get("image_size") and m.get("kind") in ("dit", "dig"):
        res = str(d.image_size)
    elif m.get("img_size"):
        res = str(m.get("input_size") or m.img_size) + (f"pad{m.pad_to}" if m.get("pad_to") and
                                                        m.pad_to != (m.get("input_size") or m.img_size) else "")
    elif d.get("seq_len"):
        res = f"ctx{d.seq_len}"
    else:
        res = None
    if m.get("pretrained"):
        model += "-ft"  # fine-tuned from released weights
    blocks = tag_blocks(a)
    if blocks is None and m.get("stage_num_blocks") and block_defaults(str(a.get("name", "")), 1):
        blocks = "-".join(map(str, m.stage_num_blocks))  # VLT: the blocks of each linear stage
    steps = t.get("max_steps")
    schedule = f"{steps}steps" if steps else (f"{t.get('max_epochs')}ep" if t.get("max_epochs") else None)
    return {"model": model, "resolution": res, "attention": attn, "M": blocks, "seed": cfg.get("seed"),
            "schedule": schedule}


def _resolved_or_none(resolve_it) -> ResolvedAttention | None:
    try:
        return resolve_it()
    except ConfigError:
        return None


def settings_tag(settings) -> str:
    """:func:`run_settings` (or a config) as one folder-safe name, e.g.
    ``dit_s_2-256px-mhla+cpe+gate-M16-seed0-400000steps``."""
    s = settings if isinstance(settings, dict) else run_settings(settings)
    parts = [s["model"], f"{s['resolution']}px" if s.get("resolution") and s["resolution"][0].isdigit()
             else s.get("resolution"), s["attention"], f"M{s['M']}" if s.get("M") else None,
             f"seed{s['seed']}" if s.get("seed") is not None else None, s.get("schedule")]
    return "-".join(str(p).replace("/", "_").replace(" ", "") for p in parts if p)


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
    ``trainer.accumulate``: ``auto`` or an integer >= 1 (:func:`resolve_accumulation`).
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
    strategy = tcfg.get("strategy", "ddp")
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"trainer.strategy must be ddp or fsdp (how torchrun's processes share the model; "
                          f"docs/training.md), got {strategy!r}")
    accumulate = tcfg.get("accumulate", "auto")
    if accumulate != "auto" and not (_is_int(accumulate) and accumulate >= 1):
        raise ConfigError(f"trainer.accumulate must be auto (the recipe's global batch decides) or an integer >= 1 "
                          f"(micro-batches per optimizer step), got {accumulate!r}")


def recipe_global_batch(cfg) -> tuple[int, str] | None:
    """The global batch (samples per optimizer step) the recipe states, and the words saying where it comes
    from: ``task.global_batch``, or ``task.tokens_per_step`` / ``data.seq_len`` (sequences of ``seq_len``
    tokens); None when the recipe states neither. Refuses a token count that is not whole sequences, and two
    keys that disagree."""
    task = cfg.task
    batch, tokens = task.get("global_batch"), task.get("tokens_per_step")
    if tokens is not None:
        seq_len = cfg.data.get("seq_len")
        if not seq_len or int(tokens) % int(seq_len):
            raise ConfigError(f"task.tokens_per_step={tokens} is not a whole number of data.seq_len={seq_len} "
                              f"token sequences: set task.tokens_per_step to a multiple of data.seq_len")
        from_tokens = int(tokens) // int(seq_len)
        if batch is not None and int(batch) != from_tokens:
            raise ConfigError(f"task.global_batch={batch} and task.tokens_per_step={tokens} (= {from_tokens} "
                              f"sequences of {seq_len} tokens) disagree: set one of them to null")
        return from_tokens, f"task.tokens_per_step={tokens} / data.seq_len={seq_len}"
    if batch is None:
        return None
    return int(batch), f"task.global_batch={batch}"


def resolve_accumulation(cfg, world_size: int) -> int:
    """The micro-batches per optimizer step (gradient accumulation) of a run on ``world_size`` processes.

    ``trainer.accumulate``: an integer forces it; ``auto`` (the default) forms the recipe's global batch
    (:func:`recipe_global_batch`) exactly: ``global batch / (data.batch_size x world_size)``, refusing a global
    batch that this per-process batch and process count cannot form; 1 when the recipe states no global batch.
    """
    accumulate = cfg.trainer.get("accumulate", "auto")
    if accumulate != "auto":
        return int(accumulate)
    recipe = recipe_global_batch(cfg)
    if recipe is None:
        return 1
    global_batch, source = recipe
    per_step = int(cfg.data.batch_size) * world_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    procs = f"{world_size} process{'es' * (world_size != 1)}"
    fix = ("trainer.accumulate=<k> trains another global batch (k x data.batch_size x processes; then scale "
           "optim.lr)")
    if global_batch % world_size:
        hint = f"the number of processes must divide {global_batch}"
    else:
        per_process = global_batch // world_size
        fits = max(d for d in range(1, min(per_process, int(cfg.data.batch_size)) + 1) if per_process % d == 0)
        hint = (f"data.batch_size must divide {global_batch} / {world_size} = {per_process}: e.g. "
                f"data.batch_size={fits} ({per_process // fits} accumulation steps)")
    raise ConfigError(f"the recipe's global batch {global_batch} ({source}) cannot be formed from "
                      f"data.batch_size={cfg.data.batch_size} x {procs} = {per_step} per micro-step: "
                      f"{global_batch} / {per_step} is not a whole number of accumulation steps; {hint}, or "
                      f"{fix}")


def validate_config(cfg) -> ResolvedAttention:
    """The start-of-run checks; returns the run's attention, resolved (:func:`resolve_run_attention`)."""
    for key in ("task", "model", "attn", "data", "optim", "sched", "trainer"):
        if key not in cfg or cfg[key] is None:
            raise ConfigError(f"the config has no '{key}' group; add {key}=... to the command")
    check_inputs(cfg)
    check_data(cfg)
    check_trainer(cfg)
    return resolve_run_attention(cfg)


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
#: under torchrun: the (start time, launcher id) that the ranks agreed on, per launch
_AGREED: dict[tuple, tuple[float, str]] = {}
_STORE_TIMEOUT_S = 1800  # the ranks of one launch may start their Python minutes apart (cold nodes)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _agreed_launch() -> tuple[float, str] | None:
    """Under ``torchrun`` (its elastic agents' store at ``MASTER_ADDR:MASTER_PORT``): the start time and the
    id of the launcher (the elastic agent's pid) of the first rank of this launch to ask, the same for every
    rank on every node; None where there is no such store (another launcher). A key in that store, set once
    per launch."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        return None
    key = (env["MASTER_ADDR"], env["MASTER_PORT"], env.get("TORCHELASTIC_RUN_ID"))
    if key not in _AGREED:
        import datetime  # noqa: PLC0415
        import time  # noqa: PLC0415

        import torch.distributed as dist  # noqa: PLC0415

        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S))
        mine = f"{time.time()!r} {os.getppid()}"
        agreed = store.compare_set("mhla/run_dir/launch", "", mine).decode()  # the first rank's value wins
        start, launcher = agreed.split()
        _AGREED[key] = (float(start), launcher)
    return _AGREED[key]


def launch_id() -> str:
    """An id shared by the processes of one launch: this process's pid; under ``torchrun`` the pid of the
    elastic agent (the common parent of a node's ranks) of the launch's first rank, agreed through torchrun's
    store so that the ranks on every node share it (else this node's agent). Part of the default run folder,
    so that two runs started in the same second get different folders while the ranks of one run share
    theirs."""
    if not _under_torchrun():
        return str(os.getpid())
    agreed = _agreed_launch()
    return agreed[1] if agreed is not None else str(os.getppid())


def launch_time(fmt: str = "%Y-%m-%d_%H-%M-%S") -> str:
    """The start time of this launch, formatted (``strftime``): now; under ``torchrun`` the time its first
    rank asked, agreed as :func:`launch_id` is, so that ranks that resolve the run folder a second apart (or
    on nodes started apart) name the same folder."""
    import datetime  # noqa: PLC0415

    agreed = _agreed_launch() if _under_torchrun() else None
    when = datetime.datetime.fromtimestamp(agreed[0]) if agreed is not None else datetime.datetime.now()
    return when.strftime(fmt)


def resume_run_dir(resume, default: str) -> str:
    """The run folder of ``trainer.resume`` when it names another run (its folder, its ``checkpoints/`` folder
    or a checkpoint in it: a file or an FSDP run's DCP folder), so that a resumed run goes on writing there;
    else ``default``."""
    if resume is None or isinstance(resume, bool) or str(resume) in ("", "auto", "last"):
        return default
    path = Path(str(resume))
    if path.is_file() or (path / ".metadata").is_file():
        path = path.parent
    if path.name == "checkpoints":
        path = path.parent
    return str(path) if (path / "checkpoints").is_dir() else default


def register_resolvers() -> None:
    """Register ``${launch_time:FORMAT}``, ``${launch_id:}`` and ``${resume_run_dir:...}`` (used by
    ``hydra.run.dir`` in ``configs/train.yaml``) with OmegaConf; call before Hydra composes the config."""
    OmegaConf.register_new_resolver("launch_time", launch_time, replace=True)
    OmegaConf.register_new_resolver("launch_id", launch_id, replace=True)
    OmegaConf.register_new_resolver("resume_run_dir", resume_run_dir, replace=True)
