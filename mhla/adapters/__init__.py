"""Adapters that put MHLA (or any registered attention) into third-party models without forking them."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def select_layers(names: list[str], layers: Iterable[int] | Callable[[int, str], bool] | None,
                  what: str = "attention layers") -> list[int]:
    """Indices into ``names`` (a model's attention modules, in order) that ``layers`` picks: None (all), an
    iterable of indices, or ``fn(index, name) -> bool``. Used by the diffusers adapter and
    :func:`mhla.convert`."""
    if layers is None:
        return list(range(len(names)))
    if callable(layers):
        return [i for i, n in enumerate(names) if layers(i, n)]
    chosen = sorted({int(i) for i in layers})
    bad = [i for i in chosen if not 0 <= i < len(names)]
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has {len(names)} {what}")
    return chosen
