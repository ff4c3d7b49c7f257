"""minigeo: Riemannian geometry of neural-network parameter spaces, in JAX.

The companion library of the course *Geometry of Parameter Spaces*.  Public
names are re-exported here; everything else is private and may change.

Modules (floors: a module imports only from floors below it)

* floor 1 ``_checks``, ``_tree``: validation and error messages, pytree helpers.
* floor 2 :mod:`minigeo.coords`: reparametrizations, transformation rules, ♭/♯
  (chapter 1); :mod:`minigeo.reparam`: built-in reparametrizations.
"""

from . import reparam
from ._checks import GeometryError
from .coords import (
    MetricLike,
    Reparametrization,
    flat,
    inner,
    pair,
    pullback_covector,
    pushforward,
    sharp,
    transform_bilinear,
    transform_covector,
    transform_endomorphism,
    transform_function,
    transform_metric,
    transform_metric_field,
    transform_vector,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "GeometryError",
    "MetricLike",
    "Reparametrization",
    "reparam",
    "transform_function",
    "transform_vector",
    "transform_covector",
    "transform_metric",
    "transform_bilinear",
    "transform_endomorphism",
    "transform_metric_field",
    "pushforward",
    "pullback_covector",
    "pair",
    "inner",
    "flat",
    "sharp",
]
