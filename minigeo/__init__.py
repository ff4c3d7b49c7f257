"""minigeo: Riemannian geometry of neural-network parameter spaces, in JAX.

The companion library of the course *Geometry of Parameter Spaces*.  Public
names are re-exported here; everything else is private and may change.

Modules (floors: a module imports only from floors below it)

* floor 1 ``_checks``, ``_tree``: validation and error messages, pytree helpers.
* floor 1 ``_linalg``: Cholesky and conjugate-gradient solves with checks.
* floor 2 :mod:`minigeo.coords`: reparametrizations, transformation rules, ♭/♯
  (chapter 1); :mod:`minigeo.reparam`: built-in reparametrizations;
  :mod:`minigeo.metrics`: matrix-free metrics (GGN, Fisher, empirical Fisher,
  pullbacks; chapter 2).
* floor 2 :mod:`minigeo.quotient`: GL(h)/GL(1) quotient geometry (metric (15),
  vertical and horizontal spaces, Riemannian gradient, geodesics; chapter 6).
* floor 3 :mod:`minigeo.curvature`: HVPs, Hessians, Christoffel symbols, the
  Riemannian Hessian and the invariant Hessian endomorphism, Hutchinson and
  Lanczos (chapter 4).
* floor 4 :mod:`minigeo.densities`: Lebesgue and volume-form densities, the
  Laplace evidence (dense and stochastic Lanczos quadrature), weight norm
  (chapter 5).
* floor 3 :mod:`minigeo.natgrad`: Gram matrices, Moore-Penrose natural parameter
  gradients, matrix-free natural gradients and an optax preconditioner (chapter 3).
"""

from . import metrics, reparam
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
from .curvature import (
    christoffel_symbols,
    endomorphism_eigenvalues,
    endomorphism_slogdet,
    endomorphism_trace,
    hessian,
    hessian_endomorphism,
    hvp,
    riemannian_hessian,
    top_eigenvalues,
    trace_estimate,
)
from .densities import (
    LaplaceEvidence,
    WeightNorm,
    laplace_log_marginal_likelihood,
    log_density_wrt_volume,
    log_volume_element,
    logdet_slq,
    transform_log_density,
    weight_norm,
)
from .metrics import (
    Likelihood,
    Metric,
    categorical_likelihood,
    diagonal,
    empirical_fisher,
    euclidean,
    fisher,
    gaussian_likelihood,
    ggn,
    pullback,
)
from .metrics import dense as dense_metric
from .natgrad import (
    gram_matrix,
    moore_penrose_inverse,
    natural_gradient,
    natural_parameter_gradient,
    precondition_by_metric,
    span_projection,
)
from .quotient import (
    christoffel_quadratic,
    geodesic_step,
    gl1_geodesic,
    gl1_horizontal_projection,
    gl1_metric,
    gl_metric,
    horizontal_projection,
    riemannian_gradient,
    vertical_vector,
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
    "metrics",
    "Metric",
    "Likelihood",
    "euclidean",
    "diagonal",
    "dense_metric",
    "pullback",
    "ggn",
    "fisher",
    "empirical_fisher",
    "categorical_likelihood",
    "gaussian_likelihood",
    "gram_matrix",
    "moore_penrose_inverse",
    "natural_parameter_gradient",
    "span_projection",
    "natural_gradient",
    "precondition_by_metric",
    "hvp",
    "hessian",
    "christoffel_symbols",
    "riemannian_hessian",
    "hessian_endomorphism",
    "endomorphism_eigenvalues",
    "endomorphism_trace",
    "endomorphism_slogdet",
    "trace_estimate",
    "top_eigenvalues",
    "transform_log_density",
    "log_volume_element",
    "log_density_wrt_volume",
    "logdet_slq",
    "LaplaceEvidence",
    "laplace_log_marginal_likelihood",
    "WeightNorm",
    "weight_norm",
    "gl_metric",
    "vertical_vector",
    "horizontal_projection",
    "riemannian_gradient",
    "christoffel_quadratic",
    "geodesic_step",
    "gl1_metric",
    "gl1_horizontal_projection",
    "gl1_geodesic",
]
