r"""Adaptive and geodesic sharpness (floor 3, chapters 6 and 7).

**Adaptive sharpness** (Kwon et al. 2021; Andriushchenko et al. 2023) measures how much the
loss can rise under perturbations scaled by the weights' magnitudes,

.. math:: S^\rho_{\max}(w) = \max_{\lVert\delta/|w|\rVert_2 \le \rho} L(w + \delta) - L(w),

which is invariant to element-wise rescalings (GL(1) symmetries) but not to the GL(h)
symmetries of attention.  **Geodesic sharpness** (da Silva et al. 2025, eq. 6/8) maximizes over the
geodesic ball of the quotient manifold instead: horizontal velocities :math:`\xi` with
:math:`\lVert\xi\rVert_g \le \rho` under metric (15) for the GL(h) pairs named in a
:class:`SymmetrySpec`, the adaptive norm for all other weights, and the perturbed point
:math:`w + \xi - \tfrac12\Gamma(\xi,\xi)` (eq. 7).  Both maxima are found by Auto-PGD
(Croce & Hein 2020; da Silva et al. 2025, App. C.2, Algorithm 1): normalized (Riemannian) gradient
ascent with momentum 0.75, projection onto the ball, and step-size halving with restarts
from the best point at checkpoints 0, 0.22, 0.41, ... of the iterations.  Because the ascent's local
maxima near a minimum come in near-antipodal pairs (the loss rises through an even quadratic form
plus smaller odd terms), a run is followed by up to ``n_restarts`` (default 7) runs each started at
the antipode of the previous run's best point, stopping once two runs in a row gained less than
0.1 % (see ``benchmarks/validate_sharpness_optimum.py``: on chapter 6's 50 diagonal networks this
lifts the worst ratio to the exact optimum from 0.77 to above 0.99).

Both functions are jit-compiled end to end (``lax`` loops), deterministic given a PRNG key,
average over a stack of batches, and return the maximizing perturbation.

**The package, in reading order** (each module imports only from the ones above it):

* :mod:`minigeo.sharpness._spec`: the specification types, :class:`SymmetrySpec` (:func:`symmetry_spec`,
  :func:`with_bias`, :class:`WithBias`) and :class:`SharpnessResult` (its status: a :class:`~minigeo.Status`);
* :mod:`minigeo.sharpness._blocks`: the search space, one block type per symmetry kind (GL(h) pair,
  GL(1) pair, element-wise leaf) in coordinates where the ball is Euclidean, side by side in ``_Geometry``;
* :mod:`minigeo.sharpness._ascent`: Auto-PGD with antipodal restarts on those coordinates;
* :mod:`minigeo.sharpness._drivers`: :func:`adaptive_sharpness` and :func:`geodesic_sharpness` (argument
  checks, the compiled search over a stack of batches, status and error bound).

:func:`kendall_tau` lives in :mod:`minigeo.stats` and is re-exported here.
"""

# The private names below (after the public ones) are internals that tests and benchmarks reach as
# ``minigeo.sharpness.<name>``; they may change.
from ..stats import kendall_tau
from ._ascent import N_RESTARTS, _antipodal_restarts, _AutoPGD  # noqa: F401
from ._blocks import _ElementWise, _Geometry, _GL1Pair, _GLhPair, _horizontal_whitened, _normal_like, _sq_norm  # noqa: F401
from ._drivers import _factorize, _rho_limit, _search_batches, adaptive_sharpness, geodesic_sharpness  # noqa: F401
from ._spec import (
    DEFAULT_RTOL,
    DEPRECATED_STATUS_NAMES as _DEPRECATED_STATUS_NAMES,
    SharpnessResult,
    SymmetrySpec,
    WithBias,
    symmetry_spec,
    with_bias,
)

__all__ = [
    "SymmetrySpec",
    "WithBias",
    "with_bias",
    "symmetry_spec",
    "SharpnessResult",
    "adaptive_sharpness",
    "geodesic_sharpness",
    "kendall_tau",
]


def __getattr__(name: str):
    """The old ``STATUS_*`` names of the status codes: the :class:`~minigeo.Status` member, with a warning."""
    if name in _DEPRECATED_STATUS_NAMES:
        import warnings

        from .._status import Status

        member = _DEPRECATED_STATUS_NAMES[name]
        warnings.warn(
            f"minigeo.sharpness.{name} is deprecated: use minigeo.Status.{member}; the old name goes in 0.5.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return Status[member]
    raise AttributeError(f"module 'minigeo.sharpness' has no attribute {name!r}")
