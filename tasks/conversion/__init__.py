"""Converting trained softmax models to MHLA: the distillation entry point (``distill.py``); the library part is
:mod:`mhla.conversion` and :mod:`mhla.distill`, the experiment that compares conversion with training from
scratch :mod:`scripts.tables.conversion` (docs/conversion.md)."""
