"""Registry of attention layers: build any of them from one ``attn`` config by name.

    from mhla.registry import build_attention
    layer = build_attention({"name": "mhla", "grid": [16, 16], "block": [4, 4]}, dim=192, num_heads=3)
    layer = build_attention("softmax", dim=192, num_heads=3)

Every registered class takes ``(dim, num_heads, **options)`` and is called as ``layer(x)`` with
``x: [B, N, dim]``. Attentions register themselves where they are defined, with
``@register_attention("name")`` (:mod:`mhla.layers`: mhla, linear, softmax; :mod:`mhla.baselines`: focused,
inline, mala, rala); ``import mhla`` imports both, so the registry is full once the package is imported.
This module imports nothing else from the package.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Callable

import torch.nn as nn

_REGISTRY: dict[str, type[nn.Module]] = {}


def register_attention(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: ``@register_attention("mhla")``."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention {name!r} is already registered to {_REGISTRY[name].__name__}")
        _REGISTRY[name] = cls
        return cls

    return wrap


def list_attentions() -> list[str]:
    return sorted(_REGISTRY)


def get_attention_class(name: str) -> type[nn.Module]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention {name!r}; registered: {', '.join(list_attentions())}") from None


def _accepted_kwargs(cls) -> set[str] | None:
    """Keyword names the class accepts along its ``__init__`` chain; None when it takes ``**kwargs`` freely."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names |= {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return names
    return None


def build_attention(cfg, dim: int, num_heads: int, **overrides) -> nn.Module:
    """Build an attention layer.

    Args:
        cfg: a name (``"mhla"``) or a mapping with ``name`` and the layer's options (an OmegaConf
            ``DictConfig`` works too).
        dim, num_heads: model width and number of feature heads.
        overrides: options that win over ``cfg`` (e.g. the ``grid`` a model knows at build time).
    Raises:
        ValueError: unknown name, or an option the layer does not take (the message lists valid ones).
    """
    if isinstance(cfg, str):
        name, options = cfg, {}
    elif isinstance(cfg, Mapping) or hasattr(cfg, "items"):
        options = {str(k): v for k, v in cfg.items()}
        name = options.pop("name", None)
        if name is None:
            raise ValueError(f"attention config needs a 'name'; registered: {', '.join(list_attentions())}")
    else:
        raise ValueError(f"attention config must be a name or a mapping, got {type(cfg).__name__}")
    options = {k: (list(v) if hasattr(v, "__iter__") and not isinstance(v, (str, bytes, Mapping)) else v)
               for k, v in {**options, **overrides}.items()}
    cls = get_attention_class(name)
    accepted = _accepted_kwargs(cls)
    if accepted is not None:
        unknown = sorted(set(options) - accepted)
        if unknown:
            valid = ", ".join(sorted(accepted - {"self", "dim", "num_heads"}))
            raise ValueError(f"attention {name!r} does not take {unknown}; valid options: {valid}")
    return cls(dim, num_heads, **options)
