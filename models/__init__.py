"""Model definitions. Attention is swapped through adapters (``mhla.adapters``), never by forking a model.

Importing the package registers every timm model it defines, for every attention of the registry:
:mod:`models.deit` (``deit_{tiny,small,base}_patch16_224_<attention>``) and :mod:`models.vlt`
(``vlt_{tiny,small}_<attention>``), so ``import models; timm.create_model("deit_tiny_patch16_224_mhla")``
works and gives a timm model with timm's API. The diffusers- and transformers-based models (``models.sana``,
``models.wan``, ``models.lm``) are imported on use.
"""

from . import deit, vlt  # noqa: F401  (register the DeiT and VLT models with timm)
