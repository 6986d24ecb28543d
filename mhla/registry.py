"""Registry of attention layers: every attention is one registered class that says what it can do.

    from mhla.registry import build_attention, register_attention, Supports
    layer = build_attention({"name": "mhla", "num_blocks": 16}, dim=192, num_heads=3, grid=(16, 16))

    @register_attention("mine")
    class MyAttention(AttentionBase):
        supports = Supports(grid_ranks=(1, 2))        # what it can do, declared at the definition
        def attend(self, q, k, v, *, grid, ...): ...

Four pieces, all of them here:

* :class:`Supports`: what an attention can do (causal or not, which token-grid ranks, class tokens, a decoding
  cache, packed variable-length sequences, rotary tables, running inside a host module's projections).
  A class declares it as the class attribute ``supports``; :func:`register_attention` refuses a class without it.
* :class:`Needs` and :class:`AttentionContract`: what a model asks of its attention (built by the model's own
  ``attention_contract(model_cfg)``), the per-attention defaults of that model (e.g. the paper's language-model
  setting: no normaliser + output RMSNorm), the options the model sets itself (``grid``, ``causal``,
  ``head_dim`` ...) and the model's built-in attentions that are not in the registry (SANA's ReLU attention,
  Wan's own softmax processor, Llama's attention).
* :func:`resolve` (:func:`resolve_attention` + :func:`check_attention`) -> :class:`ResolvedAttention`: the one
  place where an ``attn`` config meets a model, once per run. Options that are ``None`` (unset) take the model's
  default for that attention; every option that is set must be taken by the class (or consumed by the host
  model), else it is refused with a message naming it; an attention the model cannot run is refused with the
  list of those it can.
* What an attention says about itself (its run-tag words, plot label and group, whether the benchmarks time it and
  how, its decoding cache): optional class attributes read by :func:`attention_tag`, :func:`plot_words`,
  :func:`benchmarked`, :func:`bench_options`, ...; the rest of the code asks these instead of comparing names.

Every registered class takes ``(dim, num_heads, **options)`` and is called as ``layer(x)`` with ``x: [B, N, dim]``
(see :class:`mhla.layers.AttentionBase`). This module imports nothing else from the package.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Callable

import torch.nn as nn

_REGISTRY: dict[str, type[nn.Module]] = {}


# ------------------------------------------------------------------------------------------ capabilities
@dataclass(frozen=True)
class Supports:
    """What an attention class can do; declared at its definition as the class attribute ``supports``.

    Attributes:
        bidirectional: runs non-causally over a token grid (vision, diffusion, video).
        grid_ranks: the grid ranks it takes when bidirectional: 1 (a sequence), 2 (an image), 3 (a video).
        causal: runs causally over a 1-D sequence (language models).
        prefix_tokens: class / register tokens in front of the grid tokens.
        decoding: a causal decode cache (chunked prefill, token-by-token decoding).
        varlen: packed variable-length sequences (``cu_seqlens``; padded batches in the language model).
        rope: applies the rotary tables a model passes with each call (option ``rope``: the placement).
        host_projections: runs inside a host module that owns the q/k/v and output projections
            (diffusers attention processors, :mod:`mhla.adapters.diffusers`).
        cross: a cross-attention: queries from the layer's tokens (over a grid of ``grid_ranks``), keys and
            values from a condition of another length with a key padding mask (:mod:`mhla.cross`). A
            cross-attention fits only a model's cross-attention, a self-attention only its self-attention.
    """

    bidirectional: bool = True
    grid_ranks: tuple[int, ...] = (1, 2, 3)
    causal: bool = False
    prefix_tokens: bool = False
    decoding: bool = False
    varlen: bool = False
    rope: bool = False
    host_projections: bool = False
    cross: bool = False


@dataclass(frozen=True)
class Needs:
    """What a model asks of its attention: ``causal`` (else bidirectional over a ``grid_rank``-D grid), and the
    capabilities of :class:`Supports` it uses; ``cross``: the model's cross-attention (queries over the grid,
    keys from a condition)."""

    causal: bool = False
    grid_rank: int | None = None
    prefix_tokens: bool = False
    decoding: bool = False
    varlen: bool = False
    rope: bool = False
    host_projections: bool = False
    cross: bool = False

    def describe(self) -> str:
        """``"causal attention with decoding, varlen"`` / ``"attention over a 2-D token grid with ..."``."""
        base = "causal attention" if self.causal else (
            f"attention over a {self.grid_rank}-D token grid" if self.grid_rank else "bidirectional attention")
        if self.cross:
            where = f"a {self.grid_rank}-D token grid" if self.grid_rank else "tokens"
            base = f"cross-attention from {where} to a condition"
        extra = [name.replace("_", " ") for name in ("prefix_tokens", "decoding", "varlen", "rope",
                                                     "host_projections") if getattr(self, name)]
        return base + (f" with {', '.join(extra)}" if extra else "")


def unmet_needs(supports: Supports, needs: Needs) -> list[str]:
    """The needs that ``supports`` does not meet (empty: the attention fits)."""
    missing = []
    if needs.cross != supports.cross:  # a cross-attention is never a self-attention, nor the reverse
        missing.append("cross-attention (queries and keys of different lengths)" if needs.cross
                       else "self-attention (it is a cross-attention)")
    if needs.causal and not supports.causal:
        missing.append("causal")
    if not needs.causal:
        if not supports.bidirectional:
            missing.append("bidirectional")
        elif needs.grid_rank is not None and needs.grid_rank not in supports.grid_ranks:
            missing.append(f"a {needs.grid_rank}-D grid")
    for name in ("prefix_tokens", "decoding", "varlen", "rope", "host_projections"):
        if getattr(needs, name) and not getattr(supports, name):
            missing.append(name.replace("_", " "))
    return missing


@dataclass
class AttentionContract:
    """How a model builds its attention; a model family's ``attention_contract(model_cfg)`` returns one.

    Attributes:
        model: the model's name, for messages.
        needs: what the model asks (:class:`Needs`).
        defaults: ``{attention name: {option: value}}``, the model's defaults for each attention (``"*"``: for
            every attention, where the class takes the option). They sit between the class's own defaults and the
            options the run sets.
        fixed: options the model sets itself when it builds the layer (``grid``, ``causal``, ``head_dim`` ...);
            setting one in the config is refused.
        host_options: options the host model consumes instead of the layer, by attention name (``"*"``: any);
            e.g. Wan's ``layers`` (which self-attention layers get the attention).
        native: the model's built-in attentions that are not registered (``{name: what it is}``); they take no
            options.
        refused: ``{option: why}``, options the model cannot honour whatever the attention (e.g. ``cpe`` in a
            host that owns the projections).
        probes: the layers to check at start, one per distinct setting: ``(model-set options, {name: defaults of
            this layer})``, e.g. ``({"grid": (56, 56), "dim": 64, "num_heads": 1}, {"mhla": {"num_blocks": 49}})``
            for a VLT stage (``dim`` / ``num_heads``: the layer's width and heads, when an option depends on them);
            :func:`check_attention` builds each on the meta device, so a block grid that does not tile the token
            grid fails before the model is built.
        prepare: what the model does to the resolved options before it builds its layers (e.g. the language
            model's ``block_size="auto"``); the probes see the prepared options.
        native_only: the model runs only its own attentions (e.g. Llama), none of the registry's.
        passes: options the model passes to every layer it builds, whatever the attention (timm's blocks pass
            ``qkv_bias``, ``qk_norm``, ...): an attention whose class does not take them cannot run in the model.
        blocks: the model's default token blocks (``model.token_blocks``: an int M, or ``"auto"``, chosen from the
            token grid): for an attention that splits its tokens into blocks, the option its ``block_options``
            names (MHLA's ``num_blocks``), under the model's defaults for that attention (``defaults``).
    """

    model: str
    needs: Needs = field(default_factory=Needs)
    defaults: dict[str, dict] = field(default_factory=dict)
    fixed: tuple[str, ...] = ()
    host_options: dict[str, tuple[str, ...]] = field(default_factory=dict)
    native: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    probes: tuple[tuple[dict, dict], ...] = ()
    prepare: Callable[[dict], dict] | None = None
    native_only: bool = False
    passes: tuple[str, ...] = ()
    blocks: int | str | None = None

    def host_keys(self, name: str) -> set[str]:
        return set(self.host_options.get("*", ())) | set(self.host_options.get(name, ()))


# ----------------------------------------------------------------------------------------------- registry
def register_attention(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: ``@register_attention("mhla")``. The class must declare ``supports = Supports(...)``."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if not isinstance(cls.__dict__.get("supports", getattr(cls, "supports", None)), Supports):
            raise TypeError(f"attention {name!r} ({cls.__name__}) must declare what it can do: "
                            "supports = Supports(...) (mhla.registry.Supports)")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention {name!r} is already registered to {_REGISTRY[name].__name__}")
        _REGISTRY[name] = cls
        cls.registered_name = name
        return cls

    return wrap


def list_attentions() -> list[str]:
    return sorted(_REGISTRY)


def get_attention_class(name: str) -> type[nn.Module]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention {name!r}; registered: {', '.join(list_attentions())}") from None


def attentions_for(needs: Needs) -> list[str]:
    """The registered attentions that meet ``needs``, sorted."""
    return [n for n in list_attentions() if not unmet_needs(_REGISTRY[n].supports, needs)]


def _init_chain(cls):
    """The ``__init__`` parameters along the class's MRO, up to the first ``__init__`` without ``**kwargs``:
    ``(parameters of each, whether the chain ends there)``."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        closed = not any(p.kind == p.VAR_KEYWORD for p in params.values())
        yield params, closed
        if closed:
            return


def accepted_options(cls) -> set[str] | None:
    """Keyword names the class accepts along its ``__init__`` chain, less its ``excluded_options`` (options of a
    base class it sets itself); None when it takes ``**kwargs`` freely."""
    names: set[str] = set()
    for params, closed in _init_chain(cls):
        names |= {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if closed:
            return names - {"self", "dim", "num_heads"} - set(getattr(cls, "excluded_options", ()))
    return None


def class_defaults(cls) -> dict:
    """The defaults of the keyword options along the class's ``__init__`` chain (the nearest class's wins), less
    ``excluded_options``: what a layer uses for an option that :func:`resolve_attention` leaves out."""
    out: dict = {}
    for params, _ in _init_chain(cls):
        for n, p in params.items():
            if p.default is not p.empty and n not in out:
                out[n] = p.default
    excluded = set(getattr(cls, "excluded_options", ())) | {"dim", "num_heads"}
    return {k: v for k, v in out.items() if k not in excluded}


def effective_options(options: dict, contract: AttentionContract) -> dict:
    """``options`` (from :func:`resolve_attention`) with the class's own defaults filled in under them, less the
    options the model sets itself (``contract.fixed``): every option the layer runs with, for a run's record."""
    cls = _REGISTRY.get(options["name"])
    if cls is None:  # the model's native attention
        return dict(options)
    defaults = {k: v for k, v in class_defaults(cls).items() if k not in contract.fixed}
    return {"name": options["name"], **with_defaults({k: v for k, v in options.items() if k != "name"}, defaults,
                                                     cls)}


def _plain(cfg) -> tuple[str, dict]:
    """``(name, options)`` of a name or a mapping with ``name`` (an OmegaConf ``DictConfig`` works too).

    A mapping may also say where its attention is defined, ``module: my_package.my_attention``: that module is
    imported (its ``@register_attention`` runs) before the name is looked up, so an attention defined outside
    this package needs only its own file and its YAML (``docs/adding_an_attention.md``)."""
    if isinstance(cfg, str):
        return cfg, {}
    if isinstance(cfg, Mapping) or hasattr(cfg, "items"):
        options = {str(k): _plain_value(v) for k, v in cfg.items()}
        name = options.pop("name", None)
        module = options.pop("module", None)
        if name is None:
            raise ValueError(f"attention config needs a 'name'; registered: {', '.join(list_attentions())}")
        if module is not None:
            importlib.import_module(str(module))
        return str(name), options
    raise ValueError(f"attention config must be a name or a mapping, got {type(cfg).__name__}")


def _plain_value(v):
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__") or isinstance(v, Mapping):
        return v
    return list(v)


def resolve_attention(cfg, contract: AttentionContract, key: str = "attn") -> dict:
    """The attention a model builds for config ``cfg``: ``{"name": ..., **options}``, the options to pass.

    Options: ``contract.defaults["*"]`` (where the class takes the option), then ``contract.defaults[name]``, then
    the options of ``cfg`` that are not None (None: "the model's default"). An option none of these sets is left
    out, so the class's own default applies (:func:`effective_options` fills those in, for records).

    ``key``: the config key the messages name (``attn``; ``attn_cross`` for a model's cross-attention).

    Raises:
        ValueError: the attention is not registered (and not native to the model), does not meet the model's
            needs (the message lists those that do), or an option is set that neither the class nor the host
            model takes, or that the model sets itself (the message names it and lists the valid ones).
    """
    name, given = _plain(cfg)
    given = {k: v for k, v in given.items() if v is not None}
    host = contract.host_keys(name)
    if name in contract.native:
        extra = sorted(given)
        if extra:
            named = ", ".join(f"{key}.{k}" for k in extra)
            raise ValueError(f"{key}={name} is {contract.model}'s own attention "
                             f"({contract.native[name]}); it takes no options, but {named} {'is' if len(extra) == 1 else 'are'} "
                             "set: unset them (null) or pick a registered attention")
        return {"name": name, **given}
    if name not in _REGISTRY or contract.native_only:
        raise ValueError(f"{contract.model} cannot take {key}={name}; it takes "
                         f"{', '.join(choices(contract))}")
    cls = _REGISTRY[name]
    missing = unmet_needs(cls.supports, contract.needs)
    if missing:
        raise ValueError(f"{contract.model} needs {contract.needs.describe()}; {key}={name} has no "
                         f"{', '.join(missing)}. Attentions that fit: {', '.join(choices(contract))}")
    accepted = accepted_options(cls)
    passed = [k for k in contract.passes if accepted is not None and k not in accepted]
    if passed:
        raise ValueError(f"{contract.model} builds its attention with {', '.join(passed)}; {key}={name} does not "
                         f"take {'it' if len(passed) == 1 else 'them'}. Attentions that fit: "
                         f"{', '.join(choices(contract))}")
    fixed = sorted(set(given) & set(contract.fixed))
    if fixed:
        named = ", ".join(f"{key}.{k}" for k in fixed)
        raise ValueError(f"{named}: {contract.model} sets {'it' if len(fixed) == 1 else 'them'} "
                         "itself; remove it from the attention config")
    refused = {k: why for k, why in contract.refused.items() if k in given}
    if not contract.needs.rope and given.get("rope", "none") != "none":
        refused["rope"] = "the model passes no rotary tables"
    if refused:
        raise ValueError(f"{contract.model} cannot take "
                         + "; ".join(f"{key}.{k} ({why})" for k, why in refused.items()))
    unknown = sorted(k for k in given if k not in host and accepted is not None and k not in accepted)
    if unknown:
        valid = sorted((accepted or set()) - set(contract.fixed) | host)
        named = ", ".join(f"{key}.{k}" for k in unknown)
        raise ValueError(f"{key}={name} does not take {named} (in {contract.model}); "
                         f"its options: {', '.join(valid)}")
    options = {k: v for k, v in contract.defaults.get("*", {}).items()
               if accepted is None or k in accepted or k in host}
    options.update(with_defaults(contract.defaults.get(name, {}), block_defaults(name, contract.blocks), cls))
    return {"name": name, **with_defaults(given, options, cls)}


def with_defaults(options: dict, defaults: dict, cls) -> dict:
    """``defaults`` under ``options``, where an option of one of the class's ``exclusive_options`` groups (e.g.
    MHLA's ``blocks`` / ``block`` / ``num_blocks``) drops the defaults of its alternatives, and an option turned
    off drops the defaults of the ones that depend on it (``dependent_options``: ``cpe_kernel`` on ``cpe``)."""
    out = dict(defaults)
    for group in getattr(cls, "exclusive_options", ()):
        if set(group) & set(options):
            for k in group:
                out.pop(k, None)
    for child, parent in getattr(cls, "dependent_options", {}).items():  # e.g. cpe_kernel means nothing without cpe
        if parent in options and not options[parent] and child not in options:
            out.pop(child, None)
    out.update(options)
    return out


def check_attention(options: dict, contract: AttentionContract, num_heads: int = 1, head_dim: int = 8,
                    key: str = "attn") -> None:
    """Build each of ``contract.probes`` with the resolved ``options`` (:func:`resolve_attention`) on the meta
    device: a layout that does not fit raises ValueError now, not after the model is built. Native attentions
    are not checked."""
    probe_layers(options, contract, num_heads, head_dim, key)


def probe_layers(options: dict, contract: AttentionContract, num_heads: int = 1,
                 head_dim: int = 8, key: str = "attn") -> list[nn.Module]:
    """The layers of ``contract.probes`` built with the resolved ``options`` on the meta device, one per probe
    (none for a native attention); their ``settings()`` say what the model's layers run with, e.g. the M that
    MHLA's ``num_blocks="auto"`` picks on each token grid. A layer with a ``check_at_start()`` method runs it
    (e.g. a feature map that changes the head dimension under RoPE after the feature map). Raises ValueError
    (naming the model and the grid) for a layer that cannot be built or fails its check."""
    import torch  # noqa: PLC0415  (registry imports nothing heavy at module level)

    name = options["name"]
    if name in contract.native:
        return []
    cls = get_attention_class(name)
    accepted = accepted_options(cls)
    if contract.prepare is not None:
        options = contract.prepare(dict(options))
    layer_options = {k: v for k, v in options.items() if k not in contract.host_keys(name)}
    layers = []
    for fixed, defaults in contract.probes:
        opts = with_defaults(layer_options, defaults.get(name, {}), cls)
        fixed = dict(fixed)
        heads = int(fixed.pop("num_heads", num_heads))
        dim = int(fixed.pop("dim", heads * head_dim))  # the model's width where the probe gives it
        fixed = {k: v for k, v in fixed.items() if accepted is None or k in accepted}
        try:
            with torch.device("meta"):
                layer = build_attention(opts, dim, heads, **fixed)
                check = getattr(layer, "check_at_start", None)  # what only the built layer can tell
                if check is not None:
                    check()
            layers.append(layer)
        except ValueError as e:
            where = f" on its {'x'.join(map(str, fixed['grid']))} token grid" if fixed.get("grid") else ""
            raise ValueError(f"{contract.model}{where}: {key}={name}: {e}") from None
    return layers


def choices(contract: AttentionContract) -> list[str]:
    """The attentions a model can run: the registered ones that fit its needs, then its native ones."""
    fits = [] if contract.native_only else attentions_for(contract.needs)
    if contract.passes:
        fits = [n for n in fits if (accepted_options(_REGISTRY[n]) is None
                                    or set(contract.passes) <= accepted_options(_REGISTRY[n]))]
    return fits + sorted(contract.native)


def split_host_options(options: dict, contract: AttentionContract) -> tuple[dict, dict]:
    """``(layer options, host options)`` of a resolved attention (:func:`resolve_attention`)."""
    host = contract.host_keys(options["name"])
    return ({k: v for k, v in options.items() if k not in host}, {k: v for k, v in options.items() if k in host})


def build_attention(cfg, dim: int, num_heads: int, **overrides) -> nn.Module:
    """Build a registered attention layer.

    Args:
        cfg: a name (``"mhla"``) or a mapping with ``name`` and the layer's options (an OmegaConf ``DictConfig``
            works too; ``None`` values mean the class default).
        dim, num_heads: model width and number of feature heads.
        overrides: options the model knows at build time and sets itself (``grid``, ``causal``, ...).
    Raises:
        ValueError: unknown name, or an option the layer does not take (the message lists valid ones).
    """
    name, options = _plain(cfg)
    options = {k: v for k, v in {**options, **overrides}.items() if v is not None or k in overrides}
    cls = get_attention_class(name)
    accepted = accepted_options(cls)
    if accepted is not None:
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ValueError(f"attention {name!r} does not take {unknown}; valid options: {', '.join(sorted(accepted))}")
    return cls(dim, num_heads, **options)


# ---------------------------------------------------------------------------- one resolution per run
@dataclass(frozen=True)
class ResolvedAttention:
    """An attention resolved against a model's contract (:func:`resolve`): what a run builds, resolved once at its
    start and handed to the task, the model builder, the run's record and its FLOP count.

    Attributes:
        resolved: ``{"name": ..., option: value, ...}``, the options the model builds the layer with
            (:func:`resolve_attention`); :attr:`options` hands out a copy.
        contract: the model's :class:`AttentionContract` it was resolved against.
        key: the config key it came from (``attn``; ``attn_cross`` for a cross-attention).
        cross: the run's cross-attention (``attn_cross``), resolved the same way; None where not resolved.
    """

    resolved: Mapping
    contract: AttentionContract
    key: str = "attn"
    cross: ResolvedAttention | None = None

    @property
    def name(self) -> str:
        return str(self.resolved["name"])

    @property
    def options(self) -> dict:
        """A copy of :attr:`resolved`, for a model builder (which may change its copy)."""
        return dict(self.resolved)

    @property
    def is_native(self) -> bool:
        """The model's own attention (:attr:`AttentionContract.native`), not a registered one."""
        return self.name in self.contract.native

    @property
    def cls(self) -> type[nn.Module] | None:
        """The registered class, None for the model's native attention."""
        return None if self.is_native else get_attention_class(self.name)

    @property
    def effective(self) -> dict:
        """Every option the layer runs with, the class's defaults filled in (:func:`effective_options`)."""
        return effective_options(self.options, self.contract)

    def tag(self) -> str:
        """The attention's part of a run's tag, e.g. ``mhla+cpe+gate-frozen`` (:func:`attention_tag`), with
        ``+x<name>`` for a cross-attention other than the model's own."""
        text = attention_tag(self.options, self.contract)
        if self.cross is not None and not self.cross.is_native:
            text += f"+x{self.cross.name.removesuffix('_cross')}"
        return text


def resolve(cfg, contract: AttentionContract, key: str = "attn") -> ResolvedAttention:
    """:func:`resolve_attention`, then :func:`check_attention` (the start-of-run probes): the attention a model
    builds for ``cfg``, as a :class:`ResolvedAttention`. Raises ValueError as those do."""
    options = resolve_attention(cfg, contract, key=key)
    check_attention(options, contract, key=key)
    return ResolvedAttention(resolved=MappingProxyType(options), contract=contract, key=key)


# ------------------------------------------------------------------------ what an attention says about itself
# A registered class may declare, as class attributes (each optional; the defaults below apply):
#   plot_label: str                 its name in plots and tables (default: the registered name)
#   plot_group: int                 bars within a plot group, left to right: 0 softmax, 1 linear, 2 the other
#                                   attentions (default), 3 MHLA and its variants
#   plot_aliases: tuple[str, ...]   other words that name it in a cell name or a paper row ("flash", "sa")
#   benchmark: bool                 whether the benchmarks (scripts/bench_models.py, bench_generation.py) and the
#                                   length-extrapolation study train and time it by default (default False)
#   benchmark_baseline: str         the attention its benchmark rows are compared with
#   bench_options(n_tokens, **flags) -> dict
#                                   classmethod: its options in a benchmark over n_tokens tokens (default: none)
#   grows_with_context: bool        keeps every key: its cost grows as T^2 and its decoding cache as T (softmax)
#   tag_words(options) -> list[str] classmethod: its own words in a run's tag (MHLA: "-uniform", "-frozen")
#   tag_blocks(options) -> str|None classmethod: its block count for a run's tag (the "M" of run_settings)
#   block_options: dict             the options that take a model's default token blocks (model.token_blocks):
#                                   {option: how the block count maps to it}, e.g. MHLA's {"num_blocks": int}
#   legacy_options: dict            {old option name: new name} for configs stored before a rename
#   check_at_start()                method of a built layer: what only the built layer can tell, run on the
#                                   start-of-run probes (:func:`probe_layers`); raises ValueError
PLOT_GROUP_OTHER = 2


def _describing(name: str):
    return _REGISTRY.get(name)


def plot_label(name: str) -> str:
    cls = _describing(name)
    return str((cls.__dict__.get("plot_label") if cls is not None else None) or name)  # its own, not inherited


def plot_group(name: str) -> int:
    return int(getattr(_describing(name), "plot_group", PLOT_GROUP_OTHER))


def plot_words() -> dict[str, str]:
    """``{word: attention name}``: every registered self-attention's name, plot label and aliases, lower case
    (the words that say which attention a cell name or a paper row is about)."""
    out: dict[str, str] = {}
    for name in list_attentions():
        cls = _REGISTRY[name]
        if cls.supports.cross:
            continue
        for word in (name, plot_label(name), *getattr(cls, "plot_aliases", ())):
            out.setdefault(str(word).lower(), name)
    return out


def has_decoding_cache(name: str) -> bool:
    return bool(_REGISTRY[name].supports.decoding) if name in _REGISTRY else False


def grows_with_context(name: str) -> bool:
    """Whether the attention keeps every key (cost T^2, decoding cache T): softmax's kind."""
    return bool(getattr(_describing(name), "grows_with_context", False))


def benchmarked(needs: Needs | None = None) -> list[str]:
    """The registered attentions that declare ``benchmark = True`` (and meet ``needs`` when given), in plot order
    (:func:`plot_group`, then name)."""
    names = [n for n in list_attentions() if getattr(_REGISTRY[n], "benchmark", False)
             and (needs is None or not unmet_needs(_REGISTRY[n].supports, needs))]
    return sorted(names, key=lambda n: (plot_group(n), n))


def benchmark_baseline(name: str) -> str | None:
    return getattr(_describing(name), "benchmark_baseline", None)


def bench_options(name: str, n_tokens: int | None = None, **flags) -> dict:
    """``{"name": name, **options}`` of the attention in a benchmark over ``n_tokens`` tokens (its
    ``bench_options``; ``flags``: the benchmark's switches, e.g. ``cpe_gate``)."""
    make = getattr(_describing(name), "bench_options", None)
    return {"name": name, **(make(n_tokens, **flags) if make is not None else {})}


def takes_option(name: str, option: str) -> bool:
    """Whether registered attention ``name`` takes ``option`` (False for a name that is not registered)."""
    cls = _describing(name)
    return cls is not None and option in (accepted_options(cls) or ())


def takes_blocks(name: str) -> bool:
    """Whether attention ``name`` splits the tokens into blocks (it declares ``block_options``: MHLA)."""
    return bool(getattr(_describing(name), "block_options", None))


def block_defaults(name: str, blocks) -> dict:
    """The options of attention ``name`` that a model's default token blocks ``blocks`` (an int M, or ``"auto"``)
    set: ``{option: value}`` from its ``block_options``; ``{}`` for an attention without blocks or for
    ``blocks=None``."""
    cls = _describing(name)
    if blocks is None or cls is None:
        return {}
    return {option: convert(blocks) for option, convert in getattr(cls, "block_options", {}).items()}


def attention_tag(options: dict, contract: AttentionContract | None = None) -> str:
    """The attention's part of a run's tag (``tasks.common.config.run_settings``): its name, then the words of the
    shared options that differ from the plain layer (``+cpe``, ``+gate``), the class's own words
    (``tag_words``), the host model's layer selection (``-layers<...>``) and, for an attention whose class takes
    a normaliser, a normaliser other than the default (``-nonorm``). A native attention is its name alone."""
    name = str(options.get("name", ""))
    if contract is not None and name in contract.native:
        return name
    cls = _describing(name)  # None: not registered (a config that does not resolve): the shared words only
    words = [name]
    if options.get("cpe"):
        words.append("+cpe" + (f"{options['cpe_kernel']}" if options.get("cpe_kernel") not in (None, 3) else ""))
    if options.get("gate"):
        words.append("+gate" + (f"-{options['gate']}" if options["gate"] is not True else ""))
    if cls is not None and hasattr(cls, "tag_words"):
        words += list(cls.tag_words(options))
    layers = options.get("layers")
    if layers not in (None, "all"):
        words.append(f"-layers{layers}" if isinstance(layers, str) else "-layers" + ".".join(map(str, layers)))
    if (cls is not None and "normalize" in options and options["normalize"] is not True
            and "normalize" in (accepted_options(cls) or ())):
        words.append("-nonorm" if options["normalize"] is False else f"-norm{options['normalize']}")
    return "".join(words)


def tag_blocks(options: dict) -> str | None:
    """The attention's block count for a run's tag (its ``tag_blocks``), None for an attention without one."""
    make = getattr(_describing(str(options.get("name", ""))), "tag_blocks", None)
    return make(options) if make is not None else None


def supports_fields() -> tuple[str, ...]:
    """The capability names of :class:`Supports` (for documentation tables)."""
    return tuple(f.name for f in fields(Supports))
