"""minigeo.models: the models of the capstone (chapter 7), in plain JAX.

* :mod:`minigeo.models.vit`: a vision transformer from toy size to ViT-B/32 with per-head
  attention weights, and its GL(h) symmetry specification.
* :mod:`minigeo.models.checkpoints`: converters from timm and OpenCLIP checkpoints to that model.
* :mod:`minigeo.models.training`: cross-entropy, error rate, optax steps and epochs.

``import minigeo.models as mm``; the names are also available as ``minigeo.models.<name>``.
"""

from . import checkpoints, training, vit
from .checkpoints import *  # noqa: F403
from .training import *  # noqa: F403
from .vit import *  # noqa: F403

__all__ = [*vit.__all__, *checkpoints.__all__, *training.__all__]
