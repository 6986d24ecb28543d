"""Model definitions. Attention is swapped through adapters (``mhla.adapters``), never by forking a model.

Importing the package registers every timm model it defines (:mod:`models.deit`: ``deit_{tiny,small,base}_
patch16_224_<attention>``), so ``import models; timm.create_model("deit_tiny_patch16_224_mhla")`` works. The
diffusers- and transformers-based models (``models.sana``, ``models.wan``, ``models.lm``) are imported on use.
"""

from . import deit  # noqa: F401  (registers the DeiT models with timm)
