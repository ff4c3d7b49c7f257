"""minigeo: Riemannian geometry of neural-network parameter spaces, in JAX.

The companion library of the course *Geometry of Parameter Spaces*.  Public
names are re-exported here; everything else is private and may change.

Modules (floors: a module imports only from floors below it; inside floor 1, from the modules
before it in the order listed; no module imports a private name from a public module; the API
reference's architecture page draws the map and ``tests/test_layering.py`` checks it)

* floor 1 ``_checks``, ``_compile``, ``_status``: validation and error messages; the never-stale compile
  layer; the one :class:`Status` enumeration of every result that can fail under ``jit``.
* floor 1 ``_tree``: pytree helpers; ``_pairs``: metric (15) of a GL(h) pair factored from thin SVDs
  of its sides (shared by :mod:`minigeo.quotient` and :mod:`minigeo.sharpness`);
  :mod:`minigeo.stats`: Kendall's tau, with bootstrap intervals and permutation p-values (chapters 6
  and 7); :mod:`minigeo.parallel`: data parallelism with ``jax.sharding`` (chapter 7).
* floor 1 ``_linalg``, ``_estimators``: Cholesky and conjugate-gradient solves with checks;
  Rademacher probes and standard errors of the randomized estimators.
* floor 1 ``_metric``: the one metric type :class:`Metric` (a pytree), :func:`as_metric` and the
  simple fields, below every module that takes a metric (re-exported by :mod:`minigeo.metrics`).
* floor 1 ``_inverse``: the ``metric=`` argument as ``v -> G^{-1} v`` (shared by
  :mod:`minigeo.curvature` and :mod:`minigeo.operators`); ``_spectral``: the estimators written once
  (Hutchinson trace, certified block Lanczos, SLQ) over a source of products, which the functions
  of :mod:`minigeo.curvature` and :mod:`minigeo.densities` and the operators' methods adapt.
* floor 2 :mod:`minigeo.coords`: reparametrizations, transformation rules, ♭/♯
  (chapter 1); :mod:`minigeo.metrics`: matrix-free metrics (GGN, Fisher, empirical Fisher,
  pullbacks; chapter 2).
* floor 2 :mod:`minigeo.quotient`: GL(h)/GL(1) quotient geometry (metric (15),
  vertical and horizontal spaces, Riemannian gradient, geodesics; chapter 6).
* floor 3 :mod:`minigeo.reparam`: built-in reparametrizations (chapter 1).
* floor 3 :mod:`minigeo.kronecker`: Kronecker-factored metrics of dense layers, KFAC and EKFAC, with
  exact factored solves (chapter 2).
* floor 3 :mod:`minigeo.natgrad`: Gram matrices, Moore-Penrose natural parameter
  gradients, matrix-free natural gradients and an optax preconditioner (chapter 3).
* floor 3 :mod:`minigeo.curvature`: HVPs, Hessians, Christoffel symbols, the
  Riemannian Hessian and the invariant Hessian endomorphism, Hutchinson and
  Lanczos (chapter 4).
* floor 3 :mod:`minigeo.sharpness` (a package: the spec types, the search space with one block per
  symmetry kind, the Auto-PGD ascent, the drivers): adaptive and geodesic sharpness by Auto-PGD,
  symmetry specifications (chapters 6 and 7).
* floor 4 :mod:`minigeo.models` (imported as ``minigeo.models``, names not re-exported
  here): a vision transformer with its symmetry specification, timm and OpenCLIP converters
  (``minigeo.models.checkpoints``), and training helpers (chapter 7).
* floor 4.5 :mod:`minigeo.assignments` (imported as ``minigeo.assignments``, names not
  re-exported here): automatic checks for the assignment notebooks, one per chapter.
* floor 4 :mod:`minigeo.operators`: curvature operators (Hessian, GGN, Fisher, empirical
  Fisher) over whole datasets, batch by batch: products, one-pass Hutchinson, Lanczos
  with the basis in host memory, progress bars (chapters 2 and 4).
* floor 4 :mod:`minigeo.densities`: Lebesgue and volume-form densities, the
  Laplace evidence (dense and stochastic Lanczos quadrature), weight norm
  (chapter 5).

Every module lists its public names in ``__all__``; this file re-exports them
all (``minigeo.metrics.dense`` as ``dense_metric``, to keep the name unambiguous).
"""

from ._toolchain import avoid_ynn_fusions as _avoid_ynn_fusions

_avoid_ynn_fusions()  # jaxlib 0.10.2 miscompiles some CPU reductions (see minigeo._toolchain); before any computation
del _avoid_ynn_fusions

from . import coords, curvature, densities, kronecker, metrics, natgrad, operators, parallel, quotient, reparam, sharpness, stats
from ._checks import GeometryError
from ._status import Status
from .coords import *  # noqa: F403
from .curvature import *  # noqa: F403
from .densities import *  # noqa: F403
from .kronecker import *  # noqa: F403
from .metrics import *  # noqa: F403
from .natgrad import *  # noqa: F403
from .operators import *  # noqa: F403
from .sharpness import *  # noqa: F403

from . import assignments, models  # noqa: E402  (floor 4: import the floors below)

# Names reached through their module only (issue 53): the top level keeps the names the chapters
# teach with; the GL(h) quotient geometry, the statistics, data parallelism, the exact diagonals,
# the special metrics and the result types are ``mg.quotient.gl_metric``, ``mg.stats.kendall_tau``,
# ``mg.metrics.dense``, ``mg.curvature.Eigenpairs``, ...
IN_NAMESPACE: dict[str, tuple[str, ...]] = {
    "quotient": tuple(quotient.__all__),
    "stats": tuple(stats.__all__),
    "parallel": tuple(parallel.__all__),
    "metrics": ("dense", "diagonal", "as_metric", "ggn_diagonal", "fisher_diagonal", "empirical_fisher_diagonal"),
    "curvature": ("EstimateInfo", "SpectralDensity", "Eigenpairs"),
    "densities": (
        "logdet_slq", "LaplaceEvidence", "LaplacePosterior", "KroneckerLaplacePosterior", "DiagonalLaplacePosterior",
        "GLMPredictive", "PriorPrecision", "WeightNorm",
    ),
    "kronecker": ("KroneckerFactor", "KroneckerEigenbasis", "kfac_factors", "kronecker_eigenbasis"),
    "sharpness": ("SymmetrySpec", "WithBias", "SharpnessResult"),
    # the dataset operators, one family: mg.operators.hessian_operator(loss, params), ...
    "operators": tuple(operators.__all__),
}
# the top-level names of 0.3.0 that moved: old name -> (module, name); each still works, with a
# DeprecationWarning, until 0.5.0 (CHANGELOG, 0.4.0).  Names new in 0.4.0 never were top-level.
_NEW_IN_0_4 = {"KroneckerFactor", "KroneckerEigenbasis", "kfac_factors", "kronecker_eigenbasis",
               "KroneckerLaplacePosterior", "DiagonalLaplacePosterior"}
_MOVED: dict[str, tuple[str, str]] = {
    name: (module, name) for module, names in IN_NAMESPACE.items() for name in names if name not in _NEW_IN_0_4
}
_MOVED["dense_metric"] = ("metrics", "dense")
for _name in list(_MOVED) + list(_NEW_IN_0_4) + ["dense"]:
    globals().pop(_name, None)
del _name


def __getattr__(name: str):
    if name in _MOVED:
        import warnings

        module, attr = _MOVED[name]
        warnings.warn(
            f"minigeo.{name} is minigeo.{module}.{attr} since 0.4.0; the top-level name goes in 0.5.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(globals()[module], attr)
    raise AttributeError(f"module 'minigeo' has no attribute {name!r}")


def _read_version() -> str:
    """The version in ``pyproject.toml``, its one source (issue 50).

    From a source checkout (an editable install, or ``minigeo`` on ``sys.path``) the file itself is
    read, so a version bump shows at once, even before the editable install's metadata is rebuilt;
    an installed wheel has no ``pyproject.toml`` next to the package and reads its metadata, which
    the build copied from the file.
    """
    import re
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        # the [project] table up to the next table; a regex, since tomllib needs Python 3.11
        table = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", pyproject.read_text(), re.M | re.S)
        if table and re.search(r'^name\s*=\s*"minigeo"', table.group(1), re.M):
            version = re.search(r'^version\s*=\s*"([^"]+)"', table.group(1), re.M)
            if version:
                return version.group(1)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minigeo")
    except PackageNotFoundError:  # the package copied somewhere without its metadata
        return "0+unknown"


__version__ = _read_version()
del _read_version

__all__ = [
    "__version__",
    "GeometryError",
    "Status",
    # namespaces: the names they hold only (IN_NAMESPACE) are not repeated here
    "reparam",
    "metrics",
    "curvature",
    "densities",
    "kronecker",
    "operators",
    "quotient",
    "sharpness",
    "stats",
    "parallel",
    *(name for module in (coords, metrics, natgrad, curvature, densities, kronecker, operators, sharpness)
      for name in module.__all__ if name not in _MOVED and name not in IN_NAMESPACE.get(module.__name__.rpartition(".")[2], ())),
    "models",
    "assignments",
]
