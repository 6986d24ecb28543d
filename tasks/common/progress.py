"""Progress bars for the long loops (evaluation passes; training and sampling have their own tqdm bars).

    loader = ProgressLoader(eval_loader, "eval", enabled=is_main)   # iterate as the loader, with a bar
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tqdm.auto import tqdm


class ProgressLoader:
    """An iterable that yields what ``loader`` yields, with a tqdm bar (rate and ETA from ``len(loader)``)
    while ``enabled``; every other attribute (``dataset``, ``sampler``, ``generator``, ...) is the loader's.

    The bar closes when the pass ends (``leave=False``: it does not pile up under the training bar)."""

    def __init__(self, loader: Iterable, desc: str, enabled: bool = True):
        self.loader, self.desc, self.enabled = loader, desc, enabled

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name == "loader":  # not set yet (unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator:
        if not self.enabled:
            yield from self.loader
            return

        try:
            total = len(self.loader)
        except TypeError:
            total = None
        with tqdm(self.loader, desc=self.desc, total=total, leave=False, dynamic_ncols=True, unit="batch") as bar:
            yield from bar
