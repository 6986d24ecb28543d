"""Converting trained softmax models to MHLA: the distillation entry point (``distill.py``) and the experiment
(``experiment.py``); the library part is :mod:`mhla.conversion` and :mod:`mhla.distill`
(docs/conversion.md)."""
