"""Convert a trained softmax model to MHLA (or any registered attention), keeping its weights:
``mhla.convert``.

    import mhla
    mhla.convert(vit, attn="mhla")                                 # a timm ViT, in place; returns the model
    mhla.convert(lm, attn={"name": "mhla", "block_size": 32})      # our LM with softmax (MHLALMForCausalLM)
    mhla.convert(llama, attn="mhla")                               # transformers' LlamaForCausalLM
    mhla.convert(wan, attn={"name": "mhla", "blocks": [7, 3, 5]})  # diffusers (attn1 self-attention)
    student = mhla.convert(teacher, attn="mhla", copy=True)        # a converted copy; the teacher unchanged

One call for every family; what each maps (docs/conversion.md):

* **timm ViT** (``timm.models.VisionTransformer`` and subclasses, this repo's ``AttnVisionTransformer``
  included): every block's ``attn``. timm's own ``Attention``: its fused ``qkv`` (the same ``[q | k | v]`` x
  heads layout as :class:`mhla.layers.AttentionBase`) and ``proj`` are loaded into the new layer, and its q /
  k norms (timm's ``LayerNorm`` over the head dim) are kept as modules (``layer.q_norm`` is timm's norm). A
  registered layer (softmax, ...): its state dict. The layer is built for the model's patch grid
  ``patch_embed.grid_size`` with the class / register tokens as prefix tokens (``num_prefix_tokens``).
* **Our LM** (``models.lm.MHLALMForCausalLM`` / ``MHLALMModel``): ``config.attn`` becomes the new attention,
  completed with the paper's LM defaults (:func:`mhla.lm_attention.complete_lm_attention`), and
  every block's ``attn`` is rebuilt exactly as a model built from that config builds it, then given the old
  layer's weights (``qkv``, ``proj``, the output gate and its RMSNorm, q / k norms). The converted model is
  the model that ``MHLALMForCausalLM(config)`` builds: ``save_pretrained`` / ``from_pretrained`` /
  ``generate`` work as before.
* **transformers Llama** (``LlamaForCausalLM`` / ``LlamaModel``): every ``self_attn`` becomes a
  :class:`mhla.adapters.transformers.LlamaAttentionAdapter` that keeps ``q_proj`` / ``k_proj`` / ``v_proj`` /
  ``o_proj`` and runs the new layer between them (grouped k / v heads repeated), with Llama's rotary tables
  handed to the layer at its ``rope`` placement (see that module). Defaults: the paper's LM setting without
  the options that belong to projections (no output gate, q/k norm, short conv or CPE: Llama has no weights
  for them), so MHLA is causal with chunks of 64, no normaliser + output RMSNorm, RoPE after the feature map.
* **diffusers** (any model with diffusers self-attention modules: ``set_processor`` + ``to_q``, not
  cross-attention): :func:`mhla.adapters.diffusers.swap_self_attention`, which keeps the host's projections
  and q / k norms. A model with rotary tables (Wan: ``model.rope``) gets ``rope="after_feature_map"`` by
  default (softmax then rotates q, k as the host did). MHLA's block grid: ``attn.blocks`` / ``num_blocks``,
  else derived from ``config.sample_size`` / ``config.patch_size``.
* **Any other module holding registered layers** (DiT, DiG, ...): each layer is rebuilt with the old one's
  grid, prefix tokens, head dims, causality and biases, and loaded with its state dict.

Options. ``attn`` is a registered attention's name or a mapping with ``name`` and options (an OmegaConf config
works). Unset options take the family's defaults above, then the class's. Options that carry weights of the
old layer (``gate``, ``qk_norm``, ``cpe`` / ``cpe_kernel``, ``short_conv``) follow the old layer unless given,
so every old weight has a place. MHLA without a layout on a non-causal grid gets the blocks per axis that
``num_blocks=auto`` picks (:func:`mhla.layouts.auto_blocks`, the paper's ``M^2 <= N`` with square blocks;
8 x 8 tokens: 2 x 2 blocks, M = 4; 16 x 16: 4 x 4, M = 16; docs/choosing_m.md).

``strict`` (default True): an old weight that the new layer has no place for raises. New parameters (MHLA's
mixing matrix, a gate that was not there) keep their initialisation and are listed in
``model.mhla_conversion``, a plain dict ``{"family", "attn", "layers": [module names], "new_parameters":
[names]}``.

``attn="softmax"`` converts to this repository's softmax layer: the converted model computes what the original
did (``tests/layers/test_convert.py`` checks it per family), which is how the weight mapping is tested.

In place or a copy: by default the model is changed in place and returned; ``copy=True`` converts a deep copy.
"""

from __future__ import annotations

import copy as copy_module
import sys
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from .adapters import select_layers
from .layers import AttentionBase
from .layouts import auto_blocks
from .registry import _plain, accepted_options, build_attention, get_attention_class, takes_blocks, with_defaults

#: options whose modules hold weights computed from the layer input: they follow the old layer unless given
WEIGHT_OPTIONS = ("qk_norm", "gate", "cpe", "cpe_kernel", "short_conv")
#: options of MHLA that give its block layout
LAYOUT_OPTIONS = ("blocks", "block", "num_blocks", "block_size")
FAMILIES = ("timm_vit", "mhla_lm", "llama", "diffusers", "registered")


# ------------------------------------------------------------------------------------------ helpers
def attention_options(attn) -> tuple[str, dict]:
    """``(name, options)`` of an attention given as a name or a mapping (None values dropped: "the
    default")."""
    name, options = _plain(attn)
    return name, {k: v for k, v in options.items() if v is not None}


def _class_name_in(obj, names: tuple[str, ...]) -> bool:
    return any(cls.__name__ in names for cls in type(obj).__mro__)


def _is_timm_attention(m: nn.Module) -> bool:
    return type(m).__name__ == "Attention" and type(m).__module__.startswith("timm.") and hasattr(m, "qkv")


def _is_llama_attention(m: nn.Module) -> bool:
    return _class_name_in(m, ("LlamaAttention",)) and type(m).__module__.startswith("transformers.")


def _is_adapter(m: nn.Module) -> bool:
    return type(m).__name__ == "LlamaAttentionAdapter"


def model_family(model: nn.Module) -> str:
    """Which of :data:`FAMILIES` ``model`` is (module docstring); raises ValueError for a model of none."""
    if _class_name_in(model, ("MHLALMForCausalLM", "MHLALMModel")):
        return "mhla_lm"
    if (_class_name_in(model, ("VisionTransformer",)) and hasattr(model, "patch_embed")
            and hasattr(model, "blocks")):
        return "timm_vit"
    if any(_is_llama_attention(m) or _is_adapter(m) for m in model.modules()):
        return "llama"
    if "diffusers" in sys.modules:
        from .adapters.diffusers import self_attention_modules  # noqa: PLC0415

        if self_attention_modules(model):
            return "diffusers"
    if any(isinstance(m, AttentionBase) and m.projections for m in model.modules()):
        return "registered"
    raise ValueError(f"mhla.convert: {type(model).__name__} is none of the families it converts (a timm "
                     "VisionTransformer, our MHLALMForCausalLM, transformers' Llama, a diffusers transformer "
                     "with self-attention modules, or a model holding registered attention layers)")


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the attention modules of ``model`` as its host calls them (the modules that
    :func:`convert` replaces or re-processes): timm ``Attention``, registered layers with their projections,
    ``LlamaAttention`` / its adapter, diffusers self-attention modules. A teacher and its converted copy list
    the same names, which is how :func:`mhla.distill.distill_attention` pairs them."""
    out = {}
    diffusers = set()
    if "diffusers" in sys.modules:
        from .adapters.diffusers import self_attention_modules  # noqa: PLC0415

        diffusers = {id(m) for _, m in self_attention_modules(model)}
    for name, m in model.named_modules():
        if id(m) in diffusers or _is_timm_attention(m) or _is_llama_attention(m) or _is_adapter(m) or (
                isinstance(m, AttentionBase) and m.projections):
            out[name] = m
    return out


def _chosen(names: list[str], layers) -> list[str]:
    """The names among ``names`` that ``layers`` picks (:func:`mhla.adapters.select_layers`)."""
    return [names[i] for i in select_layers(names, layers)]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _inherited(old: AttentionBase, given: dict, cls) -> dict:
    """The weight-carrying options (:data:`WEIGHT_OPTIONS`) of ``old`` that ``given`` does not set."""
    accepted = accepted_options(cls)
    s = old.settings()
    out = {"qk_norm": bool(s.get("qk_norm", False)), "gate": s["gate"], "cpe": s["cpe"],
           "short_conv": s["short_conv"]}
    if s["cpe"]:
        out["cpe_kernel"] = s["cpe_kernel"]
    return {k: v for k, v in out.items() if k not in given and (accepted is None or k in accepted)}


def _with_layout(name: str, options: dict, grid, causal: bool) -> dict:
    """MHLA on a non-causal grid without a layout: the ``num_blocks=auto`` blocks of the grid."""
    if takes_blocks(name) and not causal and grid is not None and not set(LAYOUT_OPTIONS) & set(options):
        return {**options, "blocks": list(auto_blocks(grid))}
    return options


def _to_like(new: nn.Module, weight: torch.Tensor) -> nn.Module:
    """``new`` on ``weight``'s device, its floating parameters in its dtype (MHLA's mixing matrix stays
    fp32)."""
    new.to(weight.device)
    for pname, p in new.named_parameters():
        if p.is_floating_point() and "mixing" not in pname.split("."):
            p.data = p.data.to(weight.dtype)
    return new


def _load(new: nn.Module, state: dict, strict: bool, where: str) -> list[str]:
    """Load ``state`` into ``new`` (shapes must match); returns the new layer's parameters that were not in
    it."""
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected and strict:
        raise ValueError(f"mhla.convert: {where}: the new attention has no place for {sorted(unexpected)} of "
                         "the old layer (set the option that holds them, e.g. gate / cpe / qk_norm, or "
                         "strict=False)")
    return list(missing)


# -------------------------------------------------------------------------------- registered layers
def _replace_registered(old: AttentionBase, name: str, given: dict, strict: bool, where: str,
                        defaults: dict | None = None) -> tuple[AttentionBase, list[str]]:
    """A new registered layer with ``old``'s shape (grid, prefix tokens, head dims, causality, biases) and
    weights."""
    cls = get_attention_class(name)
    options = with_defaults(given, {**(defaults or {}), **_inherited(old, given, cls)}, cls)
    options = _with_layout(name, options, old.grid, old.causal)
    fixed = dict(head_dim=old.head_dim, value_dim=old.value_dim, causal=old.causal, grid=old.grid,
                 num_prefix_tokens=old.num_prefix_tokens, qkv_bias=old.qkv.bias is not None,
                 proj_bias=old.proj.bias is not None, attn_drop=old.attn_drop.p, proj_drop=old.proj_drop.p)
    clash = sorted(set(given) & set(fixed))
    if clash:
        raise ValueError(f"mhla.convert: {', '.join(clash)} come from the model's layer; remove them from "
                         "attn")
    new = _to_like(build_attention({"name": name, **options}, old.dim, old.num_heads, **fixed),
                   old.qkv.weight)
    return new, _load(new, old.state_dict(), strict, where)


def _replace_timm(old: nn.Module, name: str, given: dict, grid, num_prefix: int, where: str
                  ) -> tuple[AttentionBase, list[str]]:
    """A registered layer in place of timm's ``Attention``: its ``qkv`` and ``proj`` loaded, its q / k norms
    kept."""
    if not isinstance(getattr(old, "norm", nn.Identity()), nn.Identity):
        raise ValueError(f"mhla.convert: {where} uses timm's scale_norm (a norm before proj); not supported")
    if getattr(old, "gate", None) is not None:
        raise ValueError(f"mhla.convert: {where} has timm's sigmoid output gate (gated=True); not supported")
    if "qk_norm" in given:
        raise ValueError("mhla.convert: a timm ViT keeps its own q / k norms; remove qk_norm from attn")
    dim = old.qkv.in_features
    if old.proj.out_features != dim:
        raise ValueError(f"mhla.convert: {where} changes the width (dim_out); not supported")
    options = _with_layout(name, dict(given), grid, False)
    new = build_attention({"name": name, **options}, dim, old.num_heads, head_dim=old.head_dim,
                          value_dim=old.head_dim, grid=tuple(grid), num_prefix_tokens=num_prefix,
                          qkv_bias=old.qkv.bias is not None, proj_bias=old.proj.bias is not None,
                          attn_drop=old.attn_drop.p, proj_drop=old.proj_drop.p)
    new = _to_like(new, old.qkv.weight)
    new.qkv.load_state_dict(old.qkv.state_dict())
    new.proj.load_state_dict(old.proj.state_dict())
    # timm's LayerNorm over the head dim, applied as the layer's q / k norm
    if not isinstance(old.q_norm, nn.Identity):
        new.q_norm, new.k_norm = old.q_norm, old.k_norm
    carried = {f"{m}.{k}" for m in ("qkv", "proj", "q_norm", "k_norm") for k in getattr(new, m).state_dict()}
    return new, sorted(k for k in new.state_dict() if k not in carried)


def _convert_vit(model, name, given, layers, strict) -> tuple[list[str], list[str], dict]:
    grid = tuple(int(g) for g in model.patch_embed.grid_size)
    if getattr(model, "dynamic_img_size", False):
        raise ValueError("mhla.convert: a timm ViT with dynamic_img_size=True has no fixed patch grid; build "
                         "it with dynamic_img_size=False")
    num_prefix = int(getattr(model, "num_prefix_tokens", 0))
    mods = attention_modules(model)
    names, new_params = _chosen(list(mods), layers), []
    resolved = None
    for n in names:
        old = mods[n]
        if _is_timm_attention(old):
            new, fresh = _replace_timm(old, name, given, grid, num_prefix, n)
        else:
            new, fresh = _replace_registered(old, name, given, strict, n)
        _set_module(model, n, new)
        new_params += [f"{n}.{p}" for p in fresh]
        resolved = resolved or {"name": name, **_with_layout(name, dict(given), grid, False)}
    return names, new_params, resolved


# ------------------------------------------------------------------------------------- our LM
def _convert_mhla_lm(model, name, given, layers, strict) -> tuple[list[str], list[str], dict]:
    from .lm_attention import build_lm_attention, complete_lm_attention  # noqa: PLC0415

    if layers is not None:
        raise ValueError("mhla.convert: our LM has one attention for every block (config.attn); layers= is "
                         "for the other families")
    config = model.config
    mods = attention_modules(model)
    first = next(iter(mods.values()))
    cls = get_attention_class(name)
    attn = complete_lm_attention({"name": name, **with_defaults(given, _inherited(first, given, cls), cls)},
                                 config.max_position_embeddings)
    config.attn = attn
    new_params = []
    for n, old in mods.items():
        new = _to_like(build_lm_attention(config), old.qkv.weight)
        new_params += [f"{n}.{p}" for p in _load(new, old.state_dict(), strict, n)]
        _set_module(model, n, new)
    return list(mods), new_params, dict(attn)


# ----------------------------------------------------------------------------------------- Llama
#: options of the paper's LM setting that belong to projections Llama does not have
LLAMA_REFUSED = {"gate": False, "qk_norm": False, "cpe": False, "short_conv": 0}


def llama_attention(config, attn) -> dict:
    """The options a converted Llama's layers are built with: ``attn`` over the paper's LM defaults, without
    the projection options (:data:`LLAMA_REFUSED`: Llama has no weights for them)."""
    from .lm_attention import complete_lm_attention  # noqa: PLC0415

    name, given = attention_options(attn)
    bad = sorted(k for k, off in LLAMA_REFUSED.items() if given.get(k, off) != off)
    if bad:
        raise ValueError(f"mhla.convert: Llama's attention has no weights for {', '.join(bad)}; unset them")
    cls = get_attention_class(name)
    accepted = accepted_options(cls)
    base = {k: v for k, v in LLAMA_REFUSED.items() if accepted is None or k in accepted}
    out = complete_lm_attention({"name": name, **base, **given}, int(config.max_position_embeddings))
    return {k: v for k, v in out.items() if k not in LLAMA_REFUSED and k != "cpe_kernel"}


def _convert_llama(model, name, given, layers, strict) -> tuple[list[str], list[str], dict]:
    from .adapters.transformers import LlamaAttentionAdapter  # noqa: PLC0415

    config = model.config
    options = llama_attention(config, {"name": name, **given})
    mods = {n: m for n, m in attention_modules(model).items() if _is_llama_attention(m) or _is_adapter(m)}
    names, new_params = _chosen(list(mods), layers), []
    for n in names:
        host = mods[n]
        if _is_adapter(host):
            raise ValueError(f"mhla.convert: {n} is converted already")
        w = host.q_proj.weight
        layer = build_attention(options, config.hidden_size, config.num_attention_heads, projections=False,
                                causal=True, head_dim=host.head_dim, value_dim=host.head_dim)
        adapter = LlamaAttentionAdapter(host, _to_like(layer, w))
        _set_module(model, n, adapter)
        new_params += [f"{n}.attention.{p}" for p, _ in layer.named_parameters()]
    config.mhla_attention = dict(options)  # (saved with the config: how to rebuild the converted model)
    return names, new_params, options


# -------------------------------------------------------------------------------------- diffusers
def _convert_diffusers(model, name, given, layers, strict) -> tuple[list[str], list[str], dict]:
    from .adapters.diffusers import self_attention_modules, swap_self_attention  # noqa: PLC0415

    options = dict(given)
    cls = get_attention_class(name)
    accepted = accepted_options(cls)
    if isinstance(getattr(model, "rope", None), nn.Module) and "rope" not in options and (
            accepted is None or "rope" in accepted):
        options["rope"] = "after_feature_map"  # the host rotated q, k with its tables: the layer applies them
    grid = None
    config = getattr(model, "config", None)
    sample, patch = getattr(config, "sample_size", None), getattr(config, "patch_size", None)
    if isinstance(sample, int) and isinstance(patch, int) and patch:
        grid = (sample // patch, sample // patch)
    if takes_blocks(name) and not set(LAYOUT_OPTIONS) & set(options):
        if grid is None:
            raise ValueError(f"mhla.convert: {type(model).__name__}'s token grid is not in its config; give "
                             "MHLA's layout: attn={'name': 'mhla', 'blocks': [...]} (blocks per grid axis) "
                             "or num_blocks")
        options["blocks"] = list(auto_blocks(grid))
    modules = self_attention_modules(model)
    names = _chosen([n for n, _ in modules], layers)
    index = {n: i for i, (n, _) in enumerate(modules)}
    swap_self_attention(model, {"name": name, **options}, layers=[index[n] for n in names], grid=grid)
    new_params = [f"{n}.attention.{p}" for n in names
                  for p, _ in model.get_submodule(n).attention.named_parameters()]
    return names, new_params, {"name": name, **options}


# ------------------------------------------------------------------------------------------ convert
def convert(model: nn.Module, attn="mhla", *,
            layers: Iterable[int] | Callable[[int, str], bool] | None = None, copy: bool = False,
            strict: bool = True) -> nn.Module:
    """Replace the attention of a trained model with the registered attention ``attn``, keeping its weights.

    Args:
        model: a timm ViT, our ``MHLALMForCausalLM`` / ``MHLALMModel``, transformers' ``LlamaForCausalLM`` /
            ``LlamaModel``, a diffusers transformer, or any module holding registered attention layers.
        attn: a registered attention's name (``"mhla"``, ``"linear"``, ``"softmax"``, ...) or a mapping with
        ``name``
            and options; unset options take the family's defaults (module docstring).
        layers: which attention layers (indices into :func:`attention_modules`' order, or ``fn(index,
        name)``);
            None: all. Not for our LM (one ``config.attn`` for every block).
        copy: convert a deep copy and leave ``model`` unchanged (default: in place).
        strict: raise when an old weight has no place in the new layer.

    Returns:
        The converted model (``model`` itself unless ``copy``), with ``model.mhla_conversion`` (module
        docstring). The model keeps its library's API: timm's forward, transformers' forward / ``generate``,
        diffusers' forward.
    """
    name, given = attention_options(attn)
    get_attention_class(name)  # a clear error for an unknown name
    if copy:
        model = copy_module.deepcopy(model)
    family = model_family(model)
    fn = {"timm_vit": _convert_vit, "mhla_lm": _convert_mhla_lm, "llama": _convert_llama,
          "diffusers": _convert_diffusers, "registered": _convert_registered}[family]
    names, new_params, resolved = fn(model, name, given, layers, strict)
    if not names:
        raise ValueError(f"mhla.convert: no attention layer of {type(model).__name__} was selected")
    model.mhla_conversion = {"family": family, "attn": resolved, "layers": names,
                             "new_parameters": new_params}
    return model


def _convert_registered(model, name, given, layers, strict) -> tuple[list[str], list[str], dict]:
    mods = attention_modules(model)
    names, new_params = _chosen(list(mods), layers), []
    for n in names:
        new, fresh = _replace_registered(mods[n], name, given, strict, n)
        _set_module(model, n, new)
        new_params += [f"{n}.{p}" for p in fresh]
    return names, new_params, {"name": name, **given}


def converted_pairs(teacher: nn.Module, student: nn.Module, layers: Iterable[str] | None = None
                    ) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(name, teacher module, student module)`` for the attention layers a conversion changed (``layers``,
    else ``student.mhla_conversion["layers"]``, else every attention module the two share)."""
    t_mods, s_mods = attention_modules(teacher), attention_modules(student)
    if layers is None:
        layers = ((getattr(student, "mhla_conversion", None) or {}).get("layers")
                  or [n for n in s_mods if n in t_mods])
    missing = [n for n in layers if n not in t_mods or n not in s_mods]
    if missing:
        raise ValueError(f"attention layers {missing} are not in both the teacher and the student")
    return [(n, t_mods[n], s_mods[n]) for n in layers]


def new_parameter_names(teacher_module: nn.Module, student_module: nn.Module) -> list[str]:
    """Parameters of a converted attention module that its teacher module has no weight for (e.g.
    ``mixing.raw``)."""
    old = set(teacher_module.state_dict())
    return [n for n, _ in student_module.named_parameters() if n not in old]


__all__ = ["FAMILIES", "attention_modules", "attention_options", "convert", "converted_pairs",
           "llama_attention", "model_family", "new_parameter_names"]
