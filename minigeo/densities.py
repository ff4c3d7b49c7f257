r"""Densities, volume forms and the Laplace evidence (floor 4, chapter 5).

A density :math:`q(\theta)` with respect to the Lebesgue measure transforms under
:math:`\psi = \varphi(\theta)` with a Jacobian determinant,
:math:`q_\Psi(\psi) = q(\varphi^{-1}(\psi))\,|\det J^{-1}(\psi)|` (Kristiadi et al. 2023, eq. 10), so its
modes move (MAP is not equivariant).  With a metric :math:`G`, the density with
respect to the Riemannian volume form :math:`dV_G = |\det G|^{1/2} d\theta` is
:math:`q^G = q\,|\det G|^{-1/2}` (eq. 11); it transforms as a plain function and
its modes are equivariant.

The Laplace approximation of the log evidence
:math:`\log Z = \log\int e^{-\mathcal L(\theta)}\,d\theta` around a minimum :math:`\theta^*` of the
negative log joint :math:`\mathcal L` is

.. math:: \log Z \approx -\mathcal L(\theta^*) + \tfrac d2 \log 2\pi - \tfrac12\log\det H(\theta^*).

(Kristiadi et al. 2023 prints it as ``-L + log p - d/2 log 2π + 1/2 log det H`` in eq. 14 and
``-L - d/2 log 2π + log det H`` in App. B.2; both signs are off: the Gaussian
integral :math:`\int e^{-\frac12 u^\top H u}du = (2\pi)^{d/2}\det H^{-1/2}`.)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._compile import bind_batch
from ._checks import (
    GeometryError, as_float_point, check_finite, check_key, check_spd, check_square_matrix, check_working_precision,
    is_concrete,
)
from ._spectral import EstimateInfo, slq_logdet
from ._tree import DEFAULT_MAX_DENSE_SIZE, PyTree, check_dense_size, ravel, tree_size
from .coords import Reparametrization
from .curvature import hessian, hvp
from .kronecker import kronecker_eigenbasis
from ._metric import Metric, _matrix_field, metric_field
from ._restrict import restriction
from ._status import Status, raise_for_status

__all__ = [
    "transform_log_density",
    "log_volume_element",
    "log_density_wrt_volume",
    "logdet_slq",
    "LaplaceEvidence",
    "laplace_log_marginal_likelihood",
    "LaplacePosterior",
    "KroneckerLaplacePosterior",
    "DiagonalLaplacePosterior",
    "laplace_posterior",
    "GLMPredictive",
    "glm_predictive",
    "PriorPrecision",
    "optimize_prior_precision",
    "WeightNorm",
    "weight_norm",
]


def transform_log_density(
    log_q: Callable[[PyTree], jax.Array], phi: Reparametrization
) -> Callable[[PyTree], jax.Array]:
    r"""The Lebesgue change of variables of a log density under :math:`\psi = \varphi(\theta)` (Kristiadi et al. 2023, eq. 10).

    .. math:: \log q_\Psi(\psi) = \log q(\varphi^{-1}(\psi)) + \log\lvert\det J^{-1}(\psi)\rvert.

    The result integrates to one with respect to :math:`d\psi`, but its modes are
    not the images of the modes of :math:`q`.  Dense Jacobian (small models).

    Parameters
    ----------
    log_q : callable
        :math:`\theta \mapsto \log q(\theta)`, a log density w.r.t. Lebesgue measure.
    phi : :class:`~minigeo.Reparametrization`
        The reparametrization :math:`\varphi: \theta \mapsto \psi`.

    Returns
    -------
    callable
        :math:`\psi \mapsto \log q_\Psi(\psi)`.

    Raises
    ------
    GeometryError
        When the returned function is called at a ψ outside the codomain, or where the Jacobian of
        :math:`\varphi^{-1}` is singular or not finite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> log_q = lambda t: -t[0]                      # Exp(1) on (0, inf)
    >>> log_q_psi = mg.transform_log_density(log_q, mg.reparam.log())
    >>> round(float(log_q_psi(jnp.array([0.0]))), 6)  # log q(1) + log e^0
    -1.0

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.3, eq. (10). Taught in chapter 5, *Densities and
    volume forms*.
    """

    def log_q_psi(psi: PyTree) -> jax.Array:
        theta = phi.inverse(psi)
        _, logdet = jnp.linalg.slogdet(phi.inverse_jacobian(psi))
        return log_q(theta) + logdet

    return log_q_psi


def log_volume_element(metric: Metric | jax.Array, x: PyTree) -> jax.Array:
    r"""The log density of the Riemannian volume form :math:`dV_G` w.r.t. Lebesgue measure.

    .. math:: \log\lvert\det G(x)\rvert^{1/2} = \sum_i \log L_{ii},\qquad G(x) = LL^\top.

    Parameters
    ----------
    metric : :class:`~minigeo.Metric` or array
        The metric field, e.g. ``mg.metrics.dense(lambda x: G(x))`` (flattened coordinates), or a
        constant square matrix.
    x : array or pytree
        The point.

    Returns
    -------
    jax.Array
        The scalar :math:`\tfrac12\log\det G(x)`.

    Raises
    ------
    GeometryError
        If :math:`G(x)` is not square of the right size or not symmetric positive definite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> polar = mg.metrics.dense(lambda x: jnp.diag(jnp.array([1.0, x[0] ** 2])))
    >>> round(float(mg.log_volume_element(polar, jnp.array([3.0, 0.2]))), 6)
    1.098612

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.3 (the Riemannian volume form, eq. (11)). Taught in
    chapter 5, *Densities and volume forms*.
    """
    metric = metric_field(metric, "log_volume_element")
    if metric is None:  # the Euclidean metric: dV = dx
        return jnp.zeros((), dtype=ravel(x)[0].dtype)
    G = _matrix_field(metric)(x)
    check_square_matrix(G, tree_size(x), "the metric at x")
    check_spd(G, "the metric")
    return jnp.sum(jnp.log(jnp.diag(jnp.linalg.cholesky(G))))


def log_density_wrt_volume(
    log_q: Callable[[PyTree], jax.Array], metric: Metric | jax.Array
) -> Callable[[jax.Array], jax.Array]:
    r"""The density w.r.t. the Riemannian volume form (Kristiadi et al. 2023, eq. 11).

    .. math:: \log q^G(\theta) = \log q(\theta) - \tfrac12\log\lvert\det G(\theta)\rvert.

    Transforms as a plain function: with the Lebesgue-transformed density and the
    transformed metric in :math:`\psi`, it equals the :math:`\theta` value at
    :math:`\varphi^{-1}(\psi)`; its modes are equivariant.

    Parameters
    ----------
    log_q : callable
        :math:`\theta \mapsto \log q(\theta)`, a log density w.r.t. Lebesgue measure.
    metric : :class:`~minigeo.Metric` or array
        The metric field, e.g. ``mg.metrics.dense(lambda x: G(x))`` (flattened coordinates), or a
        constant square matrix.

    Returns
    -------
    callable
        :math:`\theta \mapsto \log q^G(\theta)`; calling it raises :class:`~minigeo.GeometryError`
        where :math:`G` is not symmetric positive definite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> # the Bernoulli Fisher metric
    >>> fisher = mg.metrics.dense(lambda t: jnp.array([[1.0 / (t[0] * (1 - t[0]))]]))
    >>> jeffreys = lambda t: -0.5 * jnp.log(t[0] * (1 - t[0])) - jnp.log(jnp.pi)
    >>> log_p = mg.log_density_wrt_volume(jeffreys, fisher)
    >>> round(float(log_p(jnp.array([0.3]))), 6)   # uniform: 1 / pi
    -1.14473

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.3, eq. (11) (densities w.r.t. the volume form; invariant
    MAP). Taught in chapter 5, *Densities and volume forms*.
    """
    metric = metric_field(metric, "log_density_wrt_volume")
    return lambda x: log_q(x) - log_volume_element(metric, x)


def logdet_slq(
    matvec: Callable[[jax.Array], jax.Array],
    dim: int,
    key: jax.Array,
    *,
    num_probes: int = 20,
    num_iterations: int = 30,
    dtype: Any = None,
    return_info: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, EstimateInfo]:
    r"""Stochastic Lanczos quadrature estimate of :math:`\log\det A` for a symmetric positive-definite operator.

    .. math::

        \log\det A = \mathrm{tr}\log A = \mathbb E_z[z^\top \log(A) z],\qquad
        z^\top\log(A)z \approx \lVert z\rVert^2\sum_k \tau_k^2\log\lambda_k,

    with Ritz values :math:`\lambda_k` and first components :math:`\tau_k` of the Lanczos
    eigenvectors (Ubaru, Chen & Saad 2017).  Probes are
    ``jax.random.rademacher(key, (num_probes, dim))``, vectorised with ``vmap``.

    Parameters
    ----------
    matvec : callable
        :math:`v \mapsto Av` on 1-D arrays of length ``dim``.
    dim : int
        The dimension :math:`d`.
    key : jax.Array
        PRNG key for the probes.
    num_probes : int, optional
        Number of Rademacher probes (Hutchinson samples).
    num_iterations : int, optional
        Lanczos steps per probe (capped at ``dim``).
    dtype : dtype, optional
        Probe dtype (default: JAX's default float).
    return_info : bool, optional
        Also return an :class:`~minigeo.curvature.EstimateInfo`: ``status`` ``NOT_POSITIVE_DEFINITE`` (the
        estimate is NaN under ``jit``) or ``NON_FINITE``; ``num_products`` the products used.

    Returns
    -------
    tuple of jax.Array
        ``(estimate, standard_error)`` over the probes; ``(estimate, standard_error, info)`` with
        ``return_info``.

    Raises
    ------
    GeometryError
        If ``num_probes``, ``dim`` or ``num_iterations`` is not a positive int, or (eagerly) the
        operator is found singular or indefinite (see Notes).

    Notes
    -----
    Exactness: the quadrature is exact for a probe when :math:`A` has at most
    ``num_iterations`` distinct eigenvalues.  Lanczos detects the breakdown of the
    Krylov space and restarts, so :math:`cI` gives exactly
    :math:`d\log c` (the Krylov space is invariant after one step), and
    :math:`I + UU^\top` of rank :math:`r` gives every probe's :math:`z^\top\log(A)z`
    exactly once ``num_iterations`` :math:`\ge r + 1`; what remains is the Hutchinson
    sampling error, zero when :math:`\log A` is diagonal.

    Not positive definite: a probe whose smallest Ritz value is
    :math:`\le 10\sqrt d\,\varepsilon` times its largest one (:math:`\varepsilon` the dtype's
    machine epsilon) shows a singular or indefinite operator.  Eagerly this raises
    :class:`~minigeo.GeometryError`; under ``jit`` (no exception possible) the estimate is
    **NaN** (and so is its standard error), never a finite wrong number.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> A = jnp.diag(jnp.arange(1.0, 6.0))
    >>> key = jax.random.PRNGKey(0)
    >>> est, se = mg.densities.logdet_slq(lambda v: A @ v, 5, key, num_iterations=5)
    >>> # exact with Rademacher probes, diagonal A
    >>> round(float(est), 3), round(float(jnp.log(120.0)), 3)
    (4.787, 4.787)
    >>> est, se = mg.densities.logdet_slq(lambda v: 3.0 * v, 10, key)   # 3 I: exactly 10 log 3
    >>> round(float(est), 4), round(10 * float(jnp.log(3.0)), 4)
    (10.9861, 10.9861)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 4.2, eq. (14) (the log-determinant in the Laplace
    evidence), by stochastic Lanczos quadrature. Taught in chapter 5, *Densities and volume forms*.
    """
    if not (isinstance(dim, (int, np.integer)) and not isinstance(dim, bool) and dim >= 1):
        raise GeometryError(f"logdet_slq: dim must be a positive int, got {dim!r}.")
    dtype = jnp.dtype(dtype or jnp.result_type(float))
    return slq_logdet(
        matvec, int(dim), key, num_probes=num_probes, num_iterations=num_iterations, dtype=dtype, return_info=return_info
    )


class LaplaceEvidence(NamedTuple):
    r"""The Laplace log evidence and its parts: ``log_z = -neg_log_joint + rest``.

    .. math:: \log Z = -\mathcal L(\theta^*) + \tfrac d2\log 2\pi - \tfrac12\log\det H + \tfrac12\log\det G.

    Attributes
    ----------
    log_z : jax.Array
        :math:`-\mathcal L(\theta^*) + \frac d2\log 2\pi - \frac12\log\det H + \frac12\log\det G`.
    neg_log_joint : jax.Array
        :math:`\mathcal L(\theta^*)`.
    rest : jax.Array
        Everything else (the log normalizer of the Gaussian, with the metric correction).
    logdet : jax.Array
        :math:`\log\det H - \log\det G` used (``log det`` of the endomorphism :math:`G^{-1}H`).
    logdet_se : jax.Array
        Its standard error (0 for dense computations).
    num_params : int
        :math:`d`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> ev = mg.laplace_log_marginal_likelihood(lambda t: 0.5 * jnp.sum(t**2), jnp.zeros(2))
    >>> float(ev.log_z), float(jnp.log(2 * jnp.pi))  # exact for a Gaussian: log 2 pi
    (1.837877..., 1.837877...)
    >>> ev.num_params
    2

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 4.2, eq. (14) and Table 1 (the split into
    :math:`-\mathcal L` and "Rest"); MacKay (1992). Taught in chapter 5, *Densities and volume forms*.
    """

    log_z: jax.Array
    neg_log_joint: jax.Array
    rest: jax.Array
    logdet: jax.Array
    logdet_se: jax.Array
    num_params: int




def laplace_log_marginal_likelihood(
    neg_log_joint: Callable[..., jax.Array],
    params: PyTree,
    *,
    batch: Any = None,
    curvature: Metric | None = None,
    prior_precision: float = 0.0,
    metric: Metric | jax.Array | None = None,
    reparametrization: Union[None, Reparametrization, "WeightNorm"] = None,
    method: str = "dense",
    key: jax.Array | None = None,
    num_probes: int = 20,
    num_iterations: int = 30,
    max_size: int = DEFAULT_MAX_DENSE_SIZE,
    structure: str = "full",
    paths: Any = None,
) -> LaplaceEvidence:
    r"""Laplace approximation of :math:`\log\int e^{-\mathcal L(\theta)}d\theta` at a minimum (MacKay 1992; Kristiadi et al. 2023, Sec. 4.2).

    .. math:: \log Z = -\mathcal L(\theta^*) + \tfrac d2\log 2\pi - \tfrac12\log\det H(\theta^*) \;[+\; \tfrac12\log\det G(\theta^*)]

    Parameters
    ----------
    neg_log_joint : callable
        :math:`\mathcal L(\theta) = -\log p(\mathcal D\mid\theta) - \log p(\theta)` (up to the constant you want in :math:`Z`):
        ``neg_log_joint(params, batch)`` with ``batch``, ``neg_log_joint(params)`` (data closed over) without.
    params : array or pytree
        The MAP estimate :math:`\theta^*`.
    batch : pytree, optional
        The data :math:`\mathcal D`, passed as the second argument of ``neg_log_joint`` (minigeo's one
        calling convention).
    curvature : :class:`~minigeo.Metric`, optional
        ``None``: the exact Hessian of ``neg_log_joint``; or a :class:`~minigeo.Metric`
        such as ``mg.ggn(model, nll)``, positive definite even away from a strict minimum.
    prior_precision : float, optional
        Added to the diagonal of the curvature (the Hessian of an isotropic Gaussian
        prior when ``curvature`` is a GGN of the likelihood alone).
    metric : :class:`~minigeo.Metric` or array, optional
        A metric field (e.g. ``mg.metrics.dense(lambda p: G(p))``, flattened coordinates) or a
        constant square matrix: evaluate the evidence w.r.t. the Riemannian
        volume form :math:`dV_G`, i.e. use :math:`\log\det(G^{-1}H)`.  With the metric
        transformed along with the parameters, the result is reparametrization-invariant.
    reparametrization : :class:`~minigeo.Reparametrization` or :class:`~minigeo.densities.WeightNorm`, optional
        If ``params`` are coordinates :math:`\psi` of a model whose original coordinates
        are :math:`\theta`, given as a :class:`~minigeo.Reparametrization`
        (:math:`\theta \mapsto \psi`) or a :class:`~minigeo.densities.WeightNorm`, the evidence is computed in
        :math:`\theta` (Kristiadi et al. 2023, App. B.2): the curvature is the :math:`\theta`-one,
        whatever the number of :math:`\psi` coordinates.
    method : {"dense", "slq"}, optional
        ``"dense"`` (Cholesky/``slogdet``) or ``"slq"`` (stochastic Lanczos quadrature,
        matrix-free; needs ``key``).
    key : jax.Array, optional
        PRNG key for ``method="slq"``.
    num_probes, num_iterations : int, optional
        Passed to :func:`~minigeo.densities.logdet_slq` (``method="slq"`` only).
    max_size : int, optional
        Largest number of parameters for which a dense curvature is formed.
    structure : {"full", "kfac", "diag"}, optional
        The evidence of the structured Laplace posterior of :func:`~minigeo.laplace_posterior`:
        :math:`\log\det H` is the log-determinant of its precision (``"kfac"``: the
        Kronecker-factored one, needs ``curvature=mg.kfac(...)``; ``"diag"``: the diagonal one).
        Other than ``"full"``: ``method="dense"``, no ``metric``, no ``reparametrization``.
    paths : optional
        With ``structure="full"``: the evidence of the posterior over the selected parameters
        :math:`S` (e.g. the last layer), the others fixed at :math:`\theta^*`:
        :math:`d = |S|` and :math:`\log\det(C_{SS} + \tau I)`.

    Returns
    -------
    :class:`~minigeo.densities.LaplaceEvidence`
        ``log_z`` and its parts.

    Raises
    ------
    GeometryError
        If the curvature is not positive definite (not a strict minimum): use a GGN
        curvature or add ``prior_precision``.  Also for an unknown ``method`` or
        ``reparametrization`` type, ``method="slq"`` without ``key``, or a dense curvature
        larger than ``max_size``; ``params`` empty, integer, complex, float16/bfloat16 or (eagerly) not
        finite; ``prior_precision`` not a real scalar or (eagerly) negative or not finite; an unknown
        ``structure``, ``"kfac"`` without a KFAC / EKFAC curvature, ``paths`` with a ``structure`` other
        than ``"full"``, an unknown path, or ``structure`` / ``paths`` with ``method="slq"``, ``metric`` or
        ``reparametrization``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> # N(0, diag(1, 4)), unnormalized
    >>> L = lambda t: 0.5 * jnp.sum(t**2 / jnp.array([1.0, 4.0]))
    >>> ev = mg.laplace_log_marginal_likelihood(L, jnp.zeros(2))
    >>> # exact: log(2 pi sqrt(1 * 4))
    >>> round(float(ev.log_z), 4), round(float(jnp.log(2 * jnp.pi * 2.0)), 4)
    (2.531, 2.531)
    >>> # the diagonal posterior is exact here too
    >>> ev = mg.laplace_log_marginal_likelihood(L, jnp.zeros(2), structure="diag")
    >>> round(float(ev.log_z), 4)
    2.531

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 4.2, eq. (14) (signs corrected, see the module notes) and
    Table 1; MacKay (1992). Taught in chapter 5, *Densities and volume forms*.
    """
    who = "laplace_log_marginal_likelihood"
    params = _check_laplace_inputs(params, prior_precision, who)
    _check_structure(structure, paths, who)
    metric = metric_field(metric, who)
    neg_log_joint = bind_batch(neg_log_joint, batch)
    if structure != "full" or paths is not None:
        if method != "dense" or metric is not None or reparametrization is not None:
            raise GeometryError(
                f"{who}: structure={structure!r} / paths= use the structured posterior's own log-determinant: "
                "only with method='dense' and without metric or reparametrization."
            )
        post = laplace_posterior(
            neg_log_joint, params, curvature=curvature, prior_precision=prior_precision, max_size=max_size,
            structure=structure, paths=paths,
        )
        value = neg_log_joint(params)
        check_finite(value, "neg_log_joint(params)")
        d = tree_size(params) if paths is None else int(post.selection.size)
        logdet = post.log_det_precision()
        rest = 0.5 * d * jnp.log(2 * jnp.pi) - 0.5 * logdet
        return LaplaceEvidence(-value + rest, value, rest, logdet, jnp.zeros((), logdet.dtype), d)
    if reparametrization is not None:
        if isinstance(reparametrization, Reparametrization):
            to_theta, to_psi = reparametrization.inverse, reparametrization.forward
        elif isinstance(reparametrization, WeightNorm):
            to_theta, to_psi = reparametrization.merge, reparametrization.split
        else:
            raise GeometryError(
                "laplace_log_marginal_likelihood: reparametrization must be a Reparametrization (theta -> psi) or a "
                f"WeightNorm; got {type(reparametrization).__name__}."
            )
        return laplace_log_marginal_likelihood(
            lambda theta: neg_log_joint(to_psi(theta)),
            to_theta(params),
            curvature=curvature,
            prior_precision=prior_precision,
            metric=metric,
            method=method,
            key=key,
            num_probes=num_probes,
            num_iterations=num_iterations,
            max_size=max_size,
        )
    d = tree_size(params)
    value = neg_log_joint(params)
    check_finite(value, "neg_log_joint(params)")
    flat, unravel = ravel(params)
    hint = (
        "The curvature at params is not positive definite: params is not a strict minimum of neg_log_joint. "
        "Use a GGN/Fisher curvature (curvature=mg.ggn(model, nll)) or add prior_precision > 0."
    )
    if method == "dense":
        C = _laplace_precision(
            neg_log_joint, params, curvature, prior_precision, max_size, "laplace_log_marginal_likelihood"
        )
        try:
            check_spd(C, "the Laplace curvature")
        except GeometryError as err:
            raise GeometryError(f"{err} {hint}") from None
        logdet = 2.0 * jnp.sum(jnp.log(jnp.diag(jnp.linalg.cholesky(C))))
        logdet_se = jnp.zeros(())
    elif method == "slq":
        if key is None:
            raise GeometryError("laplace_log_marginal_likelihood: method='slq' needs a PRNG key.")
        if curvature is None:
            mv = lambda v: ravel(hvp(neg_log_joint, params, unravel(v)))[0] + prior_precision * v
        else:
            mv = lambda v: ravel(curvature.mv(params, unravel(v)))[0] + prior_precision * v
        try:
            logdet, logdet_se = logdet_slq(
                mv, d, key, num_probes=num_probes, num_iterations=num_iterations, dtype=flat.dtype
            )
        except GeometryError as err:
            raise GeometryError(f"{err} {hint}") from None
    else:
        raise GeometryError(
            f"laplace_log_marginal_likelihood: method must be 'dense' or 'slq', got {method!r}."
        )
    if metric is not None:
        logdet = logdet - 2.0 * log_volume_element(metric, params)
    rest = 0.5 * d * jnp.log(2 * jnp.pi) - 0.5 * logdet
    return LaplaceEvidence(-value + rest, value, rest, logdet, logdet_se, d)


# ---------------------------------------------------------------------------------------------
# The Laplace toolkit: the posterior, its linearized predictive, and the prior precision
# ---------------------------------------------------------------------------------------------


def _laplace_precision(
    neg_log_joint: Callable, params: PyTree, curvature: Metric | None, prior_precision: Any, max_size: int, who: str
) -> jax.Array:
    """The dense Laplace precision ``C + prior_precision * I`` (C the Hessian or ``curvature``)."""
    d = tree_size(params)
    check_dense_size(d, max_size, "The Laplace curvature")
    C = hessian(neg_log_joint, params, max_size=max_size) if curvature is None else curvature.dense(params, max_size=max_size)
    check_finite(C, f"{who}: the curvature")
    return C + jnp.asarray(prior_precision, C.dtype) * jnp.eye(d, dtype=C.dtype)


def _check_laplace_inputs(params: PyTree, prior_precision: Any, who: str) -> PyTree:
    """The public boundary of the Laplace functions: real floating (float32/float64), non-empty, finite
    params (eagerly), and a prior precision that is a real scalar, finite and >= 0 (eagerly)."""
    params = as_float_point(params, f"{who}: params")
    check_working_precision(params, who)
    check_finite(params, f"{who}: params", hint="The Laplace approximation is centred on a finite minimum theta*.")
    if isinstance(prior_precision, (bool, np.bool_)) or not (
        isinstance(prior_precision, (int, float, np.integer, np.floating))
        or (hasattr(prior_precision, "shape") and jnp.shape(prior_precision) == ()
            and jnp.issubdtype(jnp.result_type(prior_precision), jnp.number)
            and not jnp.issubdtype(jnp.result_type(prior_precision), jnp.complexfloating))
    ):
        raise GeometryError(f"{who}: prior_precision must be a real scalar >= 0, got {prior_precision!r}.")
    if is_concrete(prior_precision):
        alpha = float(np.asarray(prior_precision))
        if not (np.isfinite(alpha) and alpha >= 0):
            raise GeometryError(
                f"{who}: prior_precision must be finite and >= 0 (the precision tau of the Gaussian prior "
                f"N(0, I / tau); 0 is a flat prior), got {alpha!r}. A negative value would be subtracted from the "
                "curvature, which no prior does."
            )
    return params


def _laplace_status(params: PyTree, prior_precision: Any, precision: jax.Array, cholesky: jax.Array) -> jax.Array:
    """The :class:`~minigeo.Status` of a Laplace posterior (traceable): ``NON_FINITE`` for non-finite params or
    precision, ``NOT_POSITIVE_DEFINITE`` for a negative prior precision or a failed Cholesky factorization."""
    finite = jnp.all(jnp.isfinite(ravel(params)[0])) & jnp.all(jnp.isfinite(precision))
    alpha = jnp.asarray(prior_precision)
    pd = jnp.isfinite(alpha) & (alpha >= 0) & jnp.all(jnp.isfinite(cholesky))
    return jnp.where(~finite, Status.NON_FINITE, jnp.where(~pd, Status.NOT_POSITIVE_DEFINITE, Status.OK)).astype(jnp.int32)


class LaplacePosterior(NamedTuple):
    r"""The Laplace posterior :math:`\mathcal N(\theta^*, \Sigma)`, :math:`\Sigma = (C + \tau I)^{-1}`, dense.

    .. math:: q(\theta) = \mathcal N\big(\theta;\ \theta^*,\ \Sigma\big),\qquad \Sigma^{-1} = C(\theta^*) + \tau I = L L^\top.

    With ``selection`` (from ``mg.laplace_posterior(..., paths=...)``, e.g. the last layer) it is the
    Gaussian over the selected parameters :math:`S` only, :math:`\Sigma_{SS}^{-1} = C_{SS} + \tau I`
    (the principal sub-block of the curvature), every other parameter fixed at :math:`\theta^*`:
    ``precision`` and ``cholesky`` are then :math:`|S| \times |S|`, samples move only the selected
    entries, and the covariance and marginal variances are exactly 0 outside :math:`S`.

    Attributes
    ----------
    mean : pytree
        :math:`\theta^*`, shaped like the parameters (all of them, also with ``selection``).
    precision : jax.Array
        :math:`\Sigma^{-1}` over the flattened (selected) parameters, ``(d, d)`` (``(|S|, |S|)``).
    cholesky : jax.Array
        The lower Cholesky factor :math:`L` of the precision.
    status : jax.Array
        int32 scalar, a :class:`~minigeo.Status`: ``OK``; ``NON_FINITE`` (non-finite params or curvature)
        or ``NOT_POSITIVE_DEFINITE`` (a negative prior precision, or a precision that is not positive
        definite: then ``cholesky`` is NaN).  Eagerly :func:`~minigeo.laplace_posterior` raises
        instead; under ``jax.jit`` check it yourself.
    selection : jax.Array or None
        ``None``: all parameters.  Otherwise the int32 positions of the selected parameters in the
        flattened ``mean`` (``ravel_pytree`` order, increasing): row ``i`` of ``precision`` belongs
        to the entry ``index[i]``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> L = lambda t: 0.5 * jnp.sum(jnp.array([1.0, 4.0]) * t**2)
    >>> post = mg.laplace_posterior(L, jnp.zeros(2))
    >>> post.covariance()
    Array([[1.  , 0.  ],
           [0.  , 0.25]], dtype=float32)
    >>> post.sample(jax.random.PRNGKey(0), 3).shape
    (3, 2)
    >>> post.covariance_mv(jnp.ones(2))  # Sigma v without forming Sigma
    Array([1.  , 0.25], dtype=float32)

    References
    ----------
    MacKay (1992), *A practical Bayesian framework for backpropagation networks*; Kristiadi, Dangel
    & Hennig (2023), Sec. 4.2. Taught in chapter 5, *Densities and volume forms*.
    """

    mean: PyTree
    precision: jax.Array
    cholesky: jax.Array
    status: jax.Array = Status.OK
    selection: Any = None

    def _inverse_factor(self) -> jax.Array:
        """:math:`L^{-1}` by a triangular solve (no inverse of the precision)."""
        n = self.cholesky.shape[0]
        return jax.scipy.linalg.solve_triangular(self.cholesky, jnp.eye(n, dtype=self.cholesky.dtype), lower=True)

    def _embed(self, flat: jax.Array, sub: jax.Array) -> jax.Array:
        """Zeros shaped like ``flat`` with ``sub`` written at ``selection`` (``sub`` itself without one)."""
        if self.selection is None:
            return sub
        return jnp.zeros_like(flat, dtype=sub.dtype).at[jnp.asarray(self.selection)].set(sub)

    def log_det_precision(self) -> jax.Array:
        r""":math:`\log\det\Sigma^{-1} = 2\sum_i \log L_{ii}` (over the selected parameters with ``selection``).

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> post = mg.laplace_posterior(lambda t: 0.5 * jnp.sum(t**2), jnp.zeros(3),
        ...                             prior_precision=1.0)
        >>> round(float(post.log_det_precision()), 5)  # 3 log 2
        2.07944
        """
        return 2.0 * jnp.sum(jnp.log(jnp.diag(self.cholesky)))

    def covariance(self, max_size: int = DEFAULT_MAX_DENSE_SIZE) -> jax.Array:
        r""":math:`\Sigma = (LL^\top)^{-1}`, ``(d, d)`` (a triangular solve, no explicit inverse of the precision).

        With ``selection``, the ``(d, d)`` matrix over all parameters: :math:`\Sigma_{SS}` on the
        selected rows and columns, zeros elsewhere (small models; ``max_size`` bounds ``d``).

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> post = mg.laplace_posterior(lambda t: 2.0 * jnp.sum(t**2), jnp.zeros(2))
        >>> post.covariance()
        Array([[0.25, 0.  ],
               [0.  , 0.25]], dtype=float32)
        """
        L_inv = self._inverse_factor()
        S = L_inv.T @ L_inv
        if self.selection is None:
            return S
        d = ravel(self.mean)[0].size
        check_dense_size(d, max_size, "The Laplace covariance")
        idx = jnp.asarray(self.selection)
        return jnp.zeros((d, d), S.dtype).at[idx[:, None], idx[None, :]].set(S)

    def covariance_mv(self, v: PyTree) -> PyTree:
        r""":math:`\Sigma v` by two triangular solves, :math:`L^{-\top}(L^{-1}v)`, for ``v`` shaped like the parameters.

        With ``selection``: :math:`\Sigma_{SS}v_S` on the selected entries, zeros elsewhere.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> post = mg.laplace_posterior(lambda t: 2.0 * jnp.sum(t**2), jnp.zeros(2))
        >>> post.covariance_mv(jnp.array([1.0, 2.0]))  # v / 4
        Array([0.25, 0.5 ], dtype=float32)
        """
        flat, unravel = ravel(self.mean)
        u = _flat_like(v, flat, "LaplacePosterior.covariance_mv")
        sub = u if self.selection is None else u[jnp.asarray(self.selection)]
        solve = jax.scipy.linalg.solve_triangular
        w = solve(self.cholesky.T, solve(self.cholesky, sub, lower=True), lower=False)
        return unravel(self._embed(flat, w))

    def marginal_variance(self) -> PyTree:
        r""":math:`\operatorname{diag}\Sigma`, shaped like the parameters (0 outside the selection).

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> post = mg.laplace_posterior(lambda t: 2.0 * jnp.sum(t**2), jnp.zeros(2))
        >>> post.marginal_variance()
        Array([0.25, 0.25], dtype=float32)
        """
        flat, unravel = ravel(self.mean)
        L_inv = self._inverse_factor()
        return unravel(self._embed(flat, jnp.sum(L_inv * L_inv, axis=0)))

    def sample(self, key: jax.Array, num_samples: int) -> PyTree:
        r"""``num_samples`` draws :math:`\theta^* + L^{-\top} z`, :math:`z \sim \mathcal N(0, I)`, stacked on a leading axis of every leaf.

        With ``selection`` only the selected entries move.

        Examples
        --------
        >>> import jax, jax.numpy as jnp
        >>> import minigeo as mg
        >>> post = mg.laplace_posterior(lambda t: 2.0 * jnp.sum(t**2), jnp.zeros(2))
        >>> post.sample(jax.random.PRNGKey(0), 5).shape
        (5, 2)
        """
        check_key(key, "LaplacePosterior.sample")
        flat, unravel = ravel(self.mean)
        n = self.cholesky.shape[0]
        z = jax.random.normal(key, (int(num_samples), n), flat.dtype)
        steps = jax.scipy.linalg.solve_triangular(self.cholesky.T, z.T, lower=False).T  # rows L^{-T} z
        return jax.vmap(lambda s: unravel(flat + self._embed(flat, s)))(steps)


def _flat_like(v: PyTree, flat: jax.Array, who: str) -> jax.Array:
    """``v`` flattened, checked to have as many entries as the parameters."""
    u = ravel(v)[0]
    if u.shape != flat.shape:
        raise GeometryError(f"{who}: v must be shaped like the parameters ({flat.size} entries); got {u.size}.")
    return u


class KroneckerLaplacePosterior(NamedTuple):
    r"""The Laplace posterior with a Kronecker-factored precision, one block per dense layer (never ``d x d``).

    .. math:: \Sigma^{-1} = \mathrm{blockdiag}_\ell\,(Q_{A,\ell}\otimes Q_{B,\ell})\,
        \mathrm{diag}(s_\ell + \tau)\,(Q_{A,\ell}\otimes Q_{B,\ell})^\top,

    the KFAC or EKFAC curvature (:func:`~minigeo.kronecker.kronecker_eigenbasis`) plus the prior precision
    :math:`\tau`.  Log-determinant, samples and marginal variances go through the eigenbases:
    :math:`\log\det\Sigma^{-1} = \sum_{\ell,i,j}\log(s_{\ell,ij} + \tau)`, a sample is
    :math:`\theta^* + \mathrm{vec}\big(Q_A [Z \oslash \sqrt{s + \tau}] Q_B^\top\big)` per layer,
    :math:`Z` standard normal.

    Attributes
    ----------
    mean : pytree
        :math:`\theta^*`.
    blocks : tuple
        Per layer ``(weight leaf index, bias leaf index or -1, QA, QB, s + tau)``.
    status : jax.Array
        int32 :class:`~minigeo.Status`: ``NOT_POSITIVE_DEFINITE`` if some :math:`s + \tau \le 0`
        to working precision, ``NON_FINITE`` for non-finite values; eagerly
        :func:`~minigeo.laplace_posterior` raises instead.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.array([[1.0, 0.0], [0.0, 2.0]])
    >>> model = lambda p, x: x @ p["W"]
    >>> params = {"W": jnp.zeros((2, 1))}
    >>> K = mg.kfac(model, "gaussian", params, batch=(X, None))
    >>> nll = lambda p: 0.5 * jnp.mean(jnp.sum(model(p, X) ** 2, axis=1))
    >>> post = mg.laplace_posterior(nll, params, curvature=K, prior_precision=1.0,
    ...                             structure="kfac")
    >>> post.marginal_variance()["W"].ravel().round(4)  # 1 / (eigenvalues of X^T X / 2 + 1)
    Array([0.6667, 0.3333], dtype=float32)
    >>> float(post.log_det_precision()).__round__(4)  # log(1.5) + log(3)
    1.5041

    References
    ----------
    MacKay (1992); Kristiadi, Dangel & Hennig (2023), Sec. 4.2; Martens & Grosse (2015), "Optimizing
    Neural Networks with Kronecker-factored Approximate Curvature" (ICML) for the factors. Chapter 5.
    """

    mean: PyTree
    blocks: tuple
    status: jax.Array = Status.OK

    def _apply(self, fn: Callable, leaves: list | None = None) -> PyTree:
        """Per layer ``R = fn(QA, QB, D, V)``, written back as the weight rows and the bias row of the
        parameters; ``V`` stacks the same rows of ``leaves`` (``None`` without ``leaves``)."""
        mean, treedef = jax.tree_util.tree_flatten(self.mean)
        out = list(mean if leaves is None else leaves)
        for w, b, QA, QB, D in self.blocks:
            V = None if leaves is None else (leaves[w] if b < 0 else jnp.concatenate([leaves[w], leaves[b][None]], 0))
            R = fn(QA, QB, D, V).astype(mean[w].dtype)
            out[w] = R[: mean[w].shape[0]]
            if b >= 0:
                out[b] = R[mean[w].shape[0]]
        return jax.tree_util.tree_unflatten(treedef, out)

    def log_det_precision(self) -> jax.Array:
        r""":math:`\log\det\Sigma^{-1} = \sum_{\ell,i,j}\log(s_{\ell,ij} + \tau)`."""
        return sum(jnp.sum(jnp.log(D)) for *_, D in self.blocks)

    def marginal_variance(self) -> PyTree:
        r""":math:`\operatorname{diag}\Sigma` per layer, :math:`(Q_A^{\odot 2})\,(1/(s+\tau))\,(Q_B^{\odot 2})^\top`, shaped like the parameters."""
        return self._apply(lambda QA, QB, D, _: (QA * QA) @ (1.0 / D) @ (QB * QB).T)

    def covariance_mv(self, v: PyTree) -> PyTree:
        r""":math:`\Sigma v` per layer, :math:`Q_A\big((Q_A^\top V Q_B)\oslash(s+\tau)\big)Q_B^\top` (never ``d x d``).

        ``v`` is shaped like the parameters; :math:`V` stacks a layer's weight and bias rows.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X, model = jnp.array([[1.0, 0.0], [0.0, 2.0]]), lambda p, x: x @ p["W"]
        >>> p = {"W": jnp.zeros((2, 1))}
        >>> K = mg.kfac(model, "gaussian", p, batch=(X, None))
        >>> nll = lambda q: jnp.sum((X @ q["W"]) ** 2)  # not differentiated for "kfac"
        >>> post = mg.laplace_posterior(nll, p, curvature=K, prior_precision=1.0,
        ...                             structure="kfac")
        >>> v = {"W": jnp.ones((2, 1))}
        >>> post.covariance_mv(v)["W"].ravel().round(4)  # 1 / (0.5 + 1), 1 / (2 + 1)
        Array([0.6667, 0.3333], dtype=float32)
        """
        leaves = jax.tree_util.tree_leaves(v)
        mean_leaves = jax.tree_util.tree_leaves(self.mean)
        if [jnp.shape(a) for a in leaves] != [jnp.shape(a) for a in mean_leaves]:
            raise GeometryError(
                "KroneckerLaplacePosterior.covariance_mv: v must be shaped like the parameters "
                f"(leaf shapes {[jnp.shape(a) for a in mean_leaves]}); got {[jnp.shape(a) for a in leaves]}."
            )
        return self._apply(lambda QA, QB, D, V: QA @ ((QA.T @ V.astype(D.dtype) @ QB) / D) @ QB.T, leaves)

    def covariance(self, max_size: int = DEFAULT_MAX_DENSE_SIZE) -> jax.Array:
        r"""The dense :math:`\Sigma` over the flattened parameters, ``(d, d)``, for small models (checks, plots).

        One :meth:`covariance_mv` per column.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X, model = jnp.array([[1.0, 0.0], [0.0, 2.0]]), lambda p, x: x @ p["W"]
        >>> p = {"W": jnp.zeros((2, 1))}
        >>> K = mg.kfac(model, "gaussian", p, batch=(X, None))
        >>> nll = lambda q: jnp.sum((X @ q["W"]) ** 2)  # not differentiated for "kfac"
        >>> post = mg.laplace_posterior(nll, p, curvature=K, prior_precision=1.0,
        ...                             structure="kfac")
        >>> post.covariance().round(4)
        Array([[0.6667, 0.    ],
               [0.    , 0.3333]], dtype=float32)
        """
        flat, unravel = ravel(self.mean)
        check_dense_size(flat.size, max_size, "The Kronecker Laplace covariance")
        column = lambda e: ravel(self.covariance_mv(unravel(e)))[0]
        return jax.vmap(column)(jnp.eye(flat.size, dtype=flat.dtype)).T

    def sample(self, key: jax.Array, num_samples: int) -> PyTree:
        r"""``num_samples`` draws :math:`\theta^* + \Sigma^{1/2} z`, through the eigenbases, stacked on a leading axis."""
        check_key(key, "KroneckerLaplacePosterior.sample")
        keys = jax.random.split(key, len(self.blocks))
        leaves, treedef = jax.tree_util.tree_flatten(self.mean)
        draws = [jnp.broadcast_to(x, (int(num_samples), *x.shape)) for x in leaves]
        for k, (w, b, QA, QB, D) in zip(keys, self.blocks):
            Z = jax.random.normal(k, (int(num_samples), *D.shape), D.dtype)
            S = jnp.einsum("ik,nkl,jl->nij", QA, Z / jnp.sqrt(D), QB).astype(leaves[w].dtype)
            draws[w] = draws[w] + S[:, : leaves[w].shape[0]]
            if b >= 0:
                draws[b] = draws[b] + S[:, leaves[w].shape[0]]
        return jax.tree_util.tree_unflatten(treedef, draws)


def _kronecker_flatten(post: KroneckerLaplacePosterior) -> tuple[tuple, tuple]:
    """The arrays are the children; the leaf positions ``(w, b)`` of each block are static (aux data), so
    a posterior passes through ``jax.jit`` and ``lax.map`` with them as Python ints."""
    arrays = tuple(tuple(block[2:]) for block in post.blocks)
    layout = tuple((int(block[0]), int(block[1])) for block in post.blocks)
    return (post.mean, arrays, post.status), layout


def _kronecker_unflatten(layout: tuple, children: tuple) -> KroneckerLaplacePosterior:
    mean, arrays, status = children
    return KroneckerLaplacePosterior(mean, tuple((w, b, *a) for (w, b), a in zip(layout, arrays)), status)


jax.tree_util.register_pytree_node(KroneckerLaplacePosterior, _kronecker_flatten, _kronecker_unflatten)


class DiagonalLaplacePosterior(NamedTuple):
    r"""The Laplace posterior with a diagonal precision: :math:`\Sigma^{-1} = \mathrm{diag}(c) + \tau I`.

    .. math:: \log\det\Sigma^{-1} = \sum_i \log(c_i + \tau),\qquad
        \theta = \theta^* + z \oslash \sqrt{c + \tau},\quad z\sim\mathcal N(0, I),

    :math:`c` the diagonal of the curvature (exact for a diagonal metric and for KFAC / EKFAC, whose
    diagonals are :math:`\mathrm{diag}(A)\otimes\mathrm{diag}(B)` and :math:`(Q_A^{\odot 2})\,s\,(Q_B^{\odot 2})^\top`
    per layer; read off the dense matrix otherwise).

    Attributes
    ----------
    mean : pytree
        :math:`\theta^*`.
    precision : pytree
        :math:`c + \tau`, shaped like the parameters.
    status : jax.Array
        int32 :class:`~minigeo.Status` (``NOT_POSITIVE_DEFINITE`` if some entry is :math:`\le 0`).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> L = lambda t: 0.5 * jnp.sum(jnp.array([1.0, 4.0]) * t**2)
    >>> post = mg.laplace_posterior(L, jnp.zeros(2), structure="diag")
    >>> post.marginal_variance()
    Array([1.  , 0.25], dtype=float32)

    References
    ----------
    MacKay (1992); Kristiadi, Dangel & Hennig (2023), Sec. 4.2. Chapter 5.
    """

    mean: PyTree
    precision: PyTree
    status: jax.Array = Status.OK

    def log_det_precision(self) -> jax.Array:
        r""":math:`\sum_i \log(c_i + \tau)`."""
        return jnp.sum(jnp.log(ravel(self.precision)[0]))

    def marginal_variance(self) -> PyTree:
        r""":math:`1 / (c + \tau)`, shaped like the parameters."""
        return jax.tree_util.tree_map(lambda p: 1.0 / p, self.precision)

    def covariance(self, max_size: int = DEFAULT_MAX_DENSE_SIZE) -> jax.Array:
        r"""The dense diagonal :math:`\Sigma`, ``(d, d)`` (small models; ``max_size`` bounds ``d``).

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> L = lambda t: 0.5 * jnp.sum(jnp.array([1.0, 4.0]) * t**2)
        >>> mg.laplace_posterior(L, jnp.zeros(2), structure="diag").covariance()
        Array([[1.  , 0.  ],
               [0.  , 0.25]], dtype=float32)
        """
        prec = ravel(self.precision)[0]
        check_dense_size(prec.size, max_size, "The diagonal Laplace covariance")
        return jnp.diag(1.0 / prec)

    def covariance_mv(self, v: PyTree) -> PyTree:
        r""":math:`\Sigma v = v \oslash (c + \tau)`, for ``v`` shaped like the parameters.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> L = lambda t: 0.5 * jnp.sum(jnp.array([1.0, 4.0]) * t**2)
        >>> post = mg.laplace_posterior(L, jnp.zeros(2), structure="diag")
        >>> post.covariance_mv(jnp.array([1.0, 1.0]))
        Array([1.  , 0.25], dtype=float32)
        """
        flat, unravel = ravel(self.precision)
        return unravel(_flat_like(v, flat, "DiagonalLaplacePosterior.covariance_mv") / flat)

    def sample(self, key: jax.Array, num_samples: int) -> PyTree:
        r"""``num_samples`` draws :math:`\theta^* + z \oslash \sqrt{c + \tau}`, stacked on a leading axis."""
        check_key(key, "DiagonalLaplacePosterior.sample")
        flat, unravel = ravel(self.mean)
        z = jax.random.normal(key, (int(num_samples), flat.size), flat.dtype)
        return jax.vmap(unravel)(flat + z / jnp.sqrt(ravel(self.precision)[0]))


def _curvature_diagonal(neg_log_joint: Callable, params: PyTree, curvature: Any, max_size: int) -> jax.Array:
    """The diagonal of the curvature, flat: from a Kronecker or diagonal structure, else the dense matrix's."""
    if curvature is not None and curvature.diagonal_fn is not None:
        return ravel(curvature.diagonal_fn(params))[0] + curvature.damping
    if curvature is not None and curvature.solve_fn is not None:
        try:
            basis = kronecker_eigenbasis(curvature)
        except GeometryError:
            basis = None
        if basis is not None:  # the diagonal of each block, in the layout of its layer's leaves
            return ravel(curvature.mv_fn.diagonal(params))[0] + curvature.damping
    C = _laplace_precision(neg_log_joint, params, curvature, 0.0, max_size, "laplace_posterior")
    return jnp.diag(C)


def _diagonal_posterior(neg_log_joint: Callable, params: PyTree, curvature: Any, prior_precision: Any,
                        max_size: int) -> DiagonalLaplacePosterior:
    c = _curvature_diagonal(neg_log_joint, params, curvature, max_size)
    prec = c + jnp.asarray(prior_precision, c.dtype)
    finite = jnp.all(jnp.isfinite(prec)) & jnp.all(jnp.isfinite(ravel(params)[0]))
    ok = jnp.min(prec) > prec.size * jnp.finfo(prec.dtype).eps * jnp.max(jnp.abs(prec))
    status = jnp.where(~finite, Status.NON_FINITE, jnp.where(ok, Status.OK, Status.NOT_POSITIVE_DEFINITE)).astype(jnp.int32)
    if is_concrete(status):
        raise_for_status(
            status, "laplace_posterior (structure='diag')",
            detail="Some diagonal entry of the precision is <= 0: use a GGN curvature or prior_precision > 0.",
        )
    return DiagonalLaplacePosterior(params, ravel(params)[1](prec.astype(ravel(params)[0].dtype)), status)


_STRUCTURES = ("full", "kfac", "diag")


def _check_structure(structure: Any, paths: Any, who: str) -> None:
    """``structure`` one of ``_STRUCTURES``; ``paths`` (a sub-block posterior) only with ``"full"``."""
    if not isinstance(structure, str) or structure not in _STRUCTURES:
        raise GeometryError(f"{who}: structure must be one of {_STRUCTURES}, got {structure!r}.")
    if paths is not None and structure != "full":
        raise GeometryError(
            f"{who}: paths= (the dense posterior of selected parameters, e.g. the last layer) combines with "
            f"structure='full' only, got structure={structure!r}. Drop paths for a {structure!r} posterior of "
            "all parameters."
        )


def _selection_index(params: PyTree, paths: Any, who: str) -> np.ndarray:
    """The positions (``ravel_pytree`` order, increasing, int32) of the entries that ``paths`` selects.

    Parsed by :func:`minigeo._restrict.restriction` (the selectors of ``top_eigenvalues(paths=...)``),
    which raises for an unknown path, an index out of range or overlapping selections.  Concrete even
    under ``jit``: it depends on the shapes only."""
    r = restriction(params, paths, who)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    offsets = np.cumsum([0] + [int(np.size(x)) for x in leaves])
    positions = [np.arange(o, o + np.size(x), dtype=np.int32).reshape(np.shape(x)) for o, x in zip(offsets, leaves)]
    with jax.ensure_compile_time_eval():
        sub = r.extract(jax.tree_util.tree_unflatten(treedef, positions))
        index = np.concatenate([np.asarray(a).ravel() for a in jax.tree_util.tree_leaves(sub)])
    return np.sort(index).astype(np.int32)


def _restricted_curvature(
    neg_log_joint: Callable, params: PyTree, curvature: Metric | None, index: np.ndarray, max_size: int, who: str
) -> jax.Array:
    """The principal sub-block :math:`C_{SS}` of the curvature (Hessian or ``curvature``), from
    :math:`|S|` products with zero-padded unit vectors (no ``d x d`` matrix), symmetrized."""
    k = int(index.size)
    check_dense_size(k, max_size, f"{who}: the curvature of the selected parameters")
    flat, unravel = ravel(params)
    idx = jnp.asarray(index)

    def column(j: jax.Array) -> jax.Array:
        e = unravel(jnp.zeros_like(flat).at[j].set(1))
        Ce = hvp(neg_log_joint, params, e) if curvature is None else curvature.mv(params, e)
        return ravel(Ce)[0][idx]

    M = jax.lax.map(column, idx, batch_size=min(k, 64))  # row j: (C e_j)_S
    C = 0.5 * (M + M.T)
    check_finite(C, f"{who}: the curvature of the selected parameters")
    return C


def _kronecker_basis(params: PyTree, curvature: Any, who: str) -> tuple[list, dict]:
    """The eigenbasis of a KFAC / EKFAC curvature, checked to cover exactly the leaves of ``params``,
    and the leaf index of each path."""
    if curvature is None:
        raise GeometryError(
            f"{who}: structure='kfac' needs curvature=mg.kfac(model_fn, likelihood, params, batch=...) "
            "(or mg.ekfac): the Kronecker factors come from the model, not from the loss."
        )
    basis = kronecker_eigenbasis(curvature)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    index = {p: k for k, p in enumerate(paths)}
    covered = {e.weight for e in basis} | {e.bias for e in basis if e.bias is not None}
    leaves = jax.tree_util.tree_leaves(params)
    for e in basis:  # a layer on one block of a scan's stack, or a weight of other than two axes
        whole = e.weight in index and np.shape(leaves[index[e.weight]]) == (
            e.QA.shape[0] - (e.bias is not None), e.QB.shape[0])
        if not whole and (e.weight in index or e.weight.rsplit("[", 1)[0] in index):
            raise GeometryError(
                f"{who}: structure='kfac' needs every layer's weight to be a whole (in, out) leaf, but the "
                f"layer {e.weight} is not (a block of a leaf stacked over a scan, or a weight of other than "
                f"two axes; its factors are {e.QA.shape[0]} x {e.QB.shape[0]}). Use structure='diag', or "
                "structure='full' with paths=."
            )
    if set(paths) != covered:
        raise GeometryError(
            f"{who}: the KFAC curvature was built for parameters {sorted(covered)}, but params has "
            f"{paths}; build it at these parameters."
        )
    return basis, index


def _kronecker_posterior(params: PyTree, curvature: Any, prior_precision: Any) -> KroneckerLaplacePosterior:
    basis, index = _kronecker_basis(params, curvature, "laplace_posterior")
    blocks, ok, finite = [], jnp.asarray(True), jnp.asarray(True)
    for e in basis:
        D = e.eigenvalues + jnp.asarray(curvature.damping + prior_precision, e.eigenvalues.dtype)
        eps = jnp.finfo(D.dtype).eps
        ok = ok & (jnp.min(D) > max(D.shape) * eps * jnp.max(jnp.abs(D)))
        finite = finite & jnp.all(jnp.isfinite(D))
        blocks.append((index[e.weight], -1 if e.bias is None else index[e.bias], e.QA, e.QB, D))
    finite = finite & jnp.all(jnp.isfinite(ravel(params)[0]))
    status = jnp.where(~finite, Status.NON_FINITE, jnp.where(ok, Status.OK, Status.NOT_POSITIVE_DEFINITE)).astype(jnp.int32)
    if is_concrete(status):
        raise_for_status(
            status, "laplace_posterior (structure='kfac')",
            detail="Some eigenvalue of the Kronecker-factored precision is <= 0: use prior_precision > 0.",
        )
    return KroneckerLaplacePosterior(params, tuple(blocks), status)


def laplace_posterior(
    neg_log_joint: Callable[..., jax.Array],
    params: PyTree,
    *,
    batch: Any = None,
    curvature: Metric | None = None,
    prior_precision: float = 0.0,
    max_size: int = DEFAULT_MAX_DENSE_SIZE,
    structure: str = "full",
    paths: Any = None,
) -> LaplacePosterior | KroneckerLaplacePosterior | DiagonalLaplacePosterior:
    r"""The Laplace posterior around a minimum :math:`\theta^*` of the negative log joint (dense, K-FAC, diagonal or last-layer).

    .. math:: p(\theta\mid\mathcal D) \approx \mathcal N\big(\theta^*,\ (C(\theta^*) + \tau I)^{-1}\big),

    with :math:`C` the Hessian of :math:`\mathcal L` (default) or a curvature such as the GGN, and
    :math:`\tau` = ``prior_precision`` (added to the diagonal, as in
    :func:`~minigeo.laplace_log_marginal_likelihood`, whose Gaussian this is).

    Parameters
    ----------
    neg_log_joint : callable
        :math:`\mathcal L(\theta)`: ``neg_log_joint(params, batch)`` with ``batch``, ``neg_log_joint(params)`` without.
    params : array or pytree
        The minimum :math:`\theta^*` (a MAP estimate: converge to a stationary point first).
    batch : pytree, optional
        The data, passed as the second argument of ``neg_log_joint``.
    curvature : :class:`~minigeo.Metric`, optional
        ``None``: the exact Hessian; or e.g. ``mg.ggn(model, nll)`` (positive semi-definite).
    prior_precision : float, optional
        :math:`\tau`, added to the diagonal (the prior's Hessian when ``curvature`` covers the likelihood only).
    max_size : int, optional
        Largest number of parameters for which the dense precision is formed.
    structure : {"full", "kfac", "diag"}, optional
        ``"full"`` (default): the dense precision.  ``"kfac"``: the Kronecker-factored precision of
        ``curvature=mg.kfac(...)`` or ``mg.ekfac(...)`` plus ``prior_precision``, one block per dense
        layer, never ``d x d`` (``neg_log_joint`` is then not differentiated; ``max_size`` does not apply).
        ``"diag"``: the diagonal of the curvature plus ``prior_precision``
        (:class:`~minigeo.densities.DiagonalLaplacePosterior`): without a ``d x d`` matrix for a KFAC / EKFAC
        or diagonal curvature, from the dense matrix (``max_size``) otherwise.
    paths : optional
        With ``structure="full"`` only: the dense posterior over the selected parameters :math:`S`
        (e.g. the last layer, ``paths=[("head", "W"), ("head", "b")]``), precision
        :math:`C_{SS} + \tau I` (the principal sub-block, from :math:`|S|` curvature products,
        ``max_size`` bounds :math:`|S|`), every other parameter fixed at :math:`\theta^*`.
        Selectors as in :func:`~minigeo.top_eigenvalues` (leaf paths, or ``(path, index)`` for a
        sub-array); the result's ``selection`` lists the selected flat positions.

    Returns
    -------
    :class:`~minigeo.densities.LaplacePosterior`, :class:`~minigeo.densities.KroneckerLaplacePosterior` or :class:`~minigeo.densities.DiagonalLaplacePosterior`
        One interface for every structure: ``mean``, ``status``, ``log_det_precision()``,
        ``covariance()`` (dense, small models), ``covariance_mv(v)`` (:math:`\Sigma v`, matrix-free),
        ``marginal_variance()`` and ``sample(key, n)``; :func:`~minigeo.glm_predictive` and
        :func:`~minigeo.laplace_log_marginal_likelihood` accept each.

    Raises
    ------
    GeometryError
        If the precision is not positive definite (``params`` is not a strict minimum: use a GGN
        curvature or ``prior_precision > 0``), not finite, or larger than ``max_size``; if ``params``
        is empty, integer, complex, float16/bfloat16 or (eagerly) not finite; if ``prior_precision`` is
        not a real scalar or (eagerly) negative or not finite; for an unknown ``structure``, ``"kfac"``
        without a KFAC / EKFAC curvature, ``paths`` with a ``structure`` other than ``"full"``, or a
        path that names no parameter.  Under ``jax.jit`` nothing is raised for values: read ``status``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> L = lambda t: 0.5 * jnp.sum(t**2)
    >>> post = mg.laplace_posterior(L, jnp.ones(2), prior_precision=1.0)
    >>> post.marginal_variance().round(6)  # (1 + 1)^-1
    Array([0.5, 0.5], dtype=float32)
    >>> # the last layer only: the other parameters stay at theta*
    >>> p = {"hidden": jnp.ones(2), "last": jnp.ones(1)}
    >>> L2 = lambda p: jnp.sum(p["hidden"] ** 2) + 2.0 * jnp.sum(p["last"] ** 2)
    >>> last = mg.laplace_posterior(L2, p, paths=["last"])
    >>> last.marginal_variance()  # 1 / 4 on the last layer, 0 elsewhere
    {'hidden': Array([0., 0.], dtype=float32), 'last': Array([0.25], dtype=float32)}

    References
    ----------
    MacKay (1992); Kristiadi, Dangel & Hennig (2023), Sec. 4.2. Chapter 5.
    """
    params = _check_laplace_inputs(params, prior_precision, "laplace_posterior")
    _check_structure(structure, paths, "laplace_posterior")
    if structure == "kfac":
        return _kronecker_posterior(params, curvature, prior_precision)
    neg_log_joint = bind_batch(neg_log_joint, batch)
    if structure == "diag":
        if curvature is not None:
            curvature = metric_field(curvature, "laplace_posterior")
        return _diagonal_posterior(neg_log_joint, params, curvature, prior_precision, max_size)
    index = None
    if paths is None:
        P = _laplace_precision(neg_log_joint, params, curvature, prior_precision, max_size, "laplace_posterior")
    else:
        if curvature is not None:
            curvature = metric_field(curvature, "laplace_posterior")
        index = _selection_index(params, paths, "laplace_posterior")
        C = _restricted_curvature(neg_log_joint, params, curvature, index, max_size, "laplace_posterior")
        P = C + jnp.asarray(prior_precision, C.dtype) * jnp.eye(C.shape[0], dtype=C.dtype)
    try:
        check_spd(P, "the Laplace precision")
    except GeometryError as err:
        raise GeometryError(
            f"laplace_posterior: {err} params is not a strict minimum of neg_log_joint: use a GGN curvature "
            "(curvature=mg.ggn(model, nll)) or prior_precision > 0."
        ) from None
    L = jnp.linalg.cholesky(P)
    status = _laplace_status(params, prior_precision, P, L)
    return LaplacePosterior(params, P, L, status, None if index is None else jnp.asarray(index))


class GLMPredictive(NamedTuple):
    r"""The linearized (GLM) predictive: a Gaussian over each example's model output.

    .. math:: f(x, \theta) \approx f(x, \theta^*) + J_x(\theta - \theta^*)\ \Rightarrow\
        f(x) \sim \mathcal N\big(f(x, \theta^*),\ J_x \Sigma J_x^\top\big).

    Attributes
    ----------
    mean : jax.Array
        :math:`f(x_n, \theta^*)`, shape ``(N, K)`` (``(N,)`` for a scalar output).
    covariance : jax.Array
        :math:`J_n\Sigma J_n^\top`, shape ``(N, K, K)`` (``(N,)``, the variances, for a scalar output).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> L = lambda w: 2.0 * jnp.sum(w**2)
    >>> post = mg.laplace_posterior(L, jnp.zeros(1))  # N(0, 1/4)
    >>> pred = mg.glm_predictive(lambda w, x: x * w, post, jnp.array([1.0, 2.0]))
    >>> pred.mean, pred.covariance  # x^2 / 4
    (Array([0., 0.], dtype=float32), Array([0.25, 1.  ], dtype=float32))

    References
    ----------
    No formula from the source papers: MacKay (1992); Immer, Korzepa & Bauer (2021), the GLM
    predictive. Taught in chapter 5, *Densities and volume forms*.
    """

    mean: jax.Array
    covariance: jax.Array


def glm_predictive(
    model_fn: Callable[[PyTree, Any], jax.Array],
    posterior: LaplacePosterior | KroneckerLaplacePosterior | DiagonalLaplacePosterior,
    inputs: Any,
) -> GLMPredictive:
    r"""The linearized predictive of a Laplace posterior at ``inputs``, one Gaussian per example.

    .. math:: \mu_n = f(x_n, \theta^*),\qquad S_n = J_n \Sigma J_n^\top,\qquad J_n = \partial f(x_n, \theta)/\partial\theta\,\big|_{\theta^*},

    for every structure of :func:`~minigeo.laplace_posterior`.  Dense (``structure="full"``, also
    with ``paths``): :math:`S_n = A_n^\top A_n` with :math:`A_n = L^{-1}J_n^\top` (no inverse of the
    precision; with ``paths`` :math:`J_n` is differentiated w.r.t. the selected entries only).
    K-FAC and diagonal: :math:`S_{n,kl} = (J_n^\top e_k)^\top\,\Sigma\,(J_n^\top e_l)` from :math:`K`
    vector-Jacobian products and the posterior's ``covariance_mv``, never a ``d x d`` matrix.  Exact for a model
    linear in :math:`\theta` (Bayesian linear regression). For regression with noise variance
    :math:`\sigma^2`, the predictive of a new target adds :math:`\sigma^2 I`.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs)`` returning one output per example, shape ``(N,)`` or ``(N, K)``.
        Examples must not interact (no batch statistics): each is linearized on its own.
    posterior : :class:`~minigeo.densities.LaplacePosterior`, :class:`~minigeo.densities.KroneckerLaplacePosterior` or :class:`~minigeo.densities.DiagonalLaplacePosterior`
        From :func:`~minigeo.laplace_posterior`.
    inputs : array or pytree
        The inputs, with the examples on the leading axis of every leaf.

    Returns
    -------
    :class:`~minigeo.densities.GLMPredictive`
        ``mean`` and ``covariance`` per example.

    Raises
    ------
    GeometryError
        If ``model_fn`` does not return one output row per example, or returns non-finite values, or
        ``posterior`` is not one of the Laplace posteriors.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> L = lambda w: 0.5 * jnp.sum(w**2)
    >>> post = mg.laplace_posterior(L, jnp.zeros(2))  # N(0, I)
    >>> X = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    >>> mg.glm_predictive(lambda w, x: x @ w, post, X).covariance  # |x|^2
    Array([1., 2.], dtype=float32)
    >>> L4 = lambda w: 0.5 * jnp.sum(jnp.array([1.0, 4.0]) * w**2)
    >>> diag = mg.laplace_posterior(L4, jnp.zeros(2), structure="diag")  # N(0, diag(1, 1/4))
    >>> mg.glm_predictive(lambda w, x: x @ w, diag, X).covariance  # 1, 1 + 1/4
    Array([1.  , 1.25], dtype=float32)

    References
    ----------
    No formula from the source papers: MacKay (1992); Immer, Korzepa & Bauer (2021). Taught in
    chapter 5, *Densities and volume forms*.
    """
    if not isinstance(posterior, (LaplacePosterior, KroneckerLaplacePosterior, DiagonalLaplacePosterior)):
        raise GeometryError(
            "glm_predictive: posterior must come from mg.laplace_posterior (a LaplacePosterior, "
            f"KroneckerLaplacePosterior or DiagonalLaplacePosterior); got {type(posterior).__name__}."
        )
    mean = model_fn(posterior.mean, inputs)
    n = jax.tree_util.tree_leaves(inputs)[0].shape[0]
    if mean.ndim not in (1, 2) or mean.shape[0] != n:
        raise GeometryError(
            f"glm_predictive: model_fn(params, inputs) must return shape (N,) or (N, K) with N = {n} examples; "
            f"got {mean.shape}."
        )
    check_finite(mean, "glm_predictive: model_fn(params, inputs)")
    one_example = lambda x: jax.tree_util.tree_map(lambda a: a[None], x)

    if isinstance(posterior, LaplacePosterior):
        flat, unravel = ravel(posterior.mean)
        if posterior.selection is None:
            point, embed = flat, lambda q: q
        else:
            idx = jnp.asarray(posterior.selection)
            point, embed = flat[idx], lambda q: flat.at[idx].set(q)

        def one(x):
            out = lambda q: jnp.reshape(model_fn(unravel(embed(q)), one_example(x)), (-1,))
            J = jax.jacrev(out)(point) if mean.size // n < point.size else jax.jacfwd(out)(point)  # (K, |S|)
            A = jax.scipy.linalg.solve_triangular(posterior.cholesky, J.T, lower=True)  # L^{-1} J^T
            return A.T @ A

    else:

        def one(x):
            out = lambda p: jnp.reshape(model_fn(p, one_example(x)), (-1,))
            y, pullback = jax.vjp(out, posterior.mean)
            cols = jax.vmap(pullback)(jnp.eye(y.size, dtype=y.dtype))[0]  # J^T e_k, leading axis K
            sigma_cols = jax.vmap(posterior.covariance_mv)(cols)
            pair = lambda a, b: jnp.reshape(a, (a.shape[0], -1)) @ jnp.reshape(b, (b.shape[0], -1)).T
            S = sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(pair, cols, sigma_cols)))
            return 0.5 * (S + S.T)

    S = jax.lax.map(one, inputs)
    return GLMPredictive(mean, S[:, 0, 0] if mean.ndim == 1 else S)


class PriorPrecision(NamedTuple):
    r"""The evidence-maximizing prior precision :math:`\tau` of an isotropic Gaussian prior.

    Attributes
    ----------
    prior_precision : jax.Array
        :math:`\tau`, the root of :math:`\tau = \gamma(\tau)/\lVert\theta^*-m\rVert^2`.
    log_z : jax.Array
        The Laplace log evidence at :math:`\tau` (likelihood, prior and Gaussian normalizer).
    effective_num_params : jax.Array
        :math:`\gamma = \sum_i \lambda_i/(\lambda_i+\tau)`, the well-determined directions.
    num_iterations : jax.Array
        Fixed-point iterations used.
    status : jax.Array
        ``Status.OK``, or ``MAX_ITERATIONS``, ``NOT_POSITIVE_DEFINITE``, ``NON_FINITE``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> nll = lambda w: 0.5 * jnp.sum((w - 2.0) ** 2)
    >>> r = mg.optimize_prior_precision(nll, jnp.ones(2))
    >>> int(r.status), int(r.num_iterations) > 1
    (0, True)

    References
    ----------
    No formula from the source papers: MacKay (1992), *Bayesian interpolation*. Chapter 5.
    """

    prior_precision: jax.Array
    log_z: jax.Array
    effective_num_params: jax.Array
    num_iterations: jax.Array
    status: jax.Array


def optimize_prior_precision(
    neg_log_likelihood: Callable[..., jax.Array],
    params: PyTree,
    *,
    batch: Any = None,
    curvature: Metric | None = None,
    prior_mean: PyTree | None = None,
    init: float = 1.0,
    rtol: float | None = None,
    max_iterations: int = 500,
    max_size: int = DEFAULT_MAX_DENSE_SIZE,
    structure: str = "full",
    paths: Any = None,
) -> PriorPrecision:
    r"""MacKay's fixed point for the prior precision :math:`\tau` of :math:`\mathcal N(m, \tau^{-1}I)` that maximizes the Laplace evidence.

    With :math:`\lambda_i` the eigenvalues of the likelihood curvature :math:`C` at :math:`\theta^*` and
    :math:`s = \lVert\theta^*-m\rVert^2`, the Laplace log evidence is

    .. math:: \log Z(\tau) = -\mathcal L_{\mathrm{lik}}(\theta^*) - \tfrac\tau2 s + \tfrac d2\log\tau
        - \tfrac12\sum_i\log(\lambda_i+\tau),

    (the prior's and the Gaussian's :math:`\frac d2\log 2\pi` cancel), and :math:`d\log Z/d\tau = 0` is
    :math:`\tau = \gamma(\tau)/s` with :math:`\gamma(\tau) = \sum_i \lambda_i/(\lambda_i+\tau)`,
    iterated from ``init`` until the relative change is below ``rtol``. :math:`\theta^*` is held fixed
    (post hoc); for a model whose MAP moves with :math:`\tau`, alternate refitting and this call.

    The same fixed point for every structure of :func:`~minigeo.laplace_posterior`, with
    :math:`\lambda_i` the eigenvalues of the structured curvature: ``"kfac"`` the per-layer
    eigenvalues of :func:`~minigeo.kronecker.kronecker_eigenbasis` (plus the curvature's damping;
    no ``d x d`` matrix), ``"diag"`` the curvature's diagonal, and with ``paths`` (a last-layer
    posterior) the eigenvalues of the principal sub-block :math:`C_{SS}`, with
    :math:`s = \lVert\theta^*_S - m_S\rVert^2` and :math:`d = |S|` (the prior covers the selected
    parameters only).  ``log_z`` is then the evidence of that structured posterior.

    Parameters
    ----------
    neg_log_likelihood : callable
        :math:`\mathcal L_{\mathrm{lik}}(\theta) = -\log p(\mathcal D\mid\theta)`: ``f(params, batch)`` or ``f(params)``.
    params : array or pytree
        :math:`\theta^*`.
    batch : pytree, optional
        The data, passed as the second argument of ``neg_log_likelihood``.
    curvature : :class:`~minigeo.Metric`, optional
        ``None``: the Hessian of the likelihood term; or e.g. ``mg.ggn(model, nll)`` (then every
        :math:`\lambda_i \ge 0` and the root is unique).
    prior_mean : pytree, optional
        :math:`m` (default 0).
    init : float, optional
        Starting :math:`\tau > 0`.
    rtol : float, optional
        Relative tolerance on :math:`\tau` (default ``100 * eps`` of the dtype, at least 1e-12).
    max_iterations : int, optional
        Iteration cap (``status = MAX_ITERATIONS`` beyond it).
    max_size : int, optional
        Largest number of parameters for which the dense curvature is formed.
    structure : {"full", "kfac", "diag"}, optional
        The structure of the curvature, as in :func:`~minigeo.laplace_posterior` (``"kfac"`` needs
        ``curvature=mg.kfac(...)`` or ``mg.ekfac(...)``).
    paths : optional
        With ``structure="full"``: tune the prior of the selected parameters only (e.g. the last
        layer), selectors as in :func:`~minigeo.laplace_posterior`.

    Returns
    -------
    :class:`~minigeo.densities.PriorPrecision`
        :math:`\tau`, the log evidence there, :math:`\gamma`, the iterations and a status.

    Raises
    ------
    GeometryError
        Eagerly: ``init <= 0``, :math:`\theta^* = m`, a non-finite curvature or likelihood, no
        convergence, or :math:`C + \tau I` not positive definite at the result. Under ``jit`` the
        failure is in ``status`` instead.  Always: an unknown ``structure``, ``"kfac"`` without a
        KFAC / EKFAC curvature, ``paths`` with a ``structure`` other than ``"full"``, an unknown path.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> nll = lambda w: 0.5 * jnp.sum((w - 2.0) ** 2)  # one observation per weight
    >>> r = mg.optimize_prior_precision(nll, jnp.ones(2))  # the MAP at tau = 1
    >>> # tau = gamma / s = (2 / (1 + tau)) / 2: the golden ratio's inverse
    >>> round(float(r.prior_precision), 5), round(float(r.effective_num_params), 5)
    (0.61803, 1.23607)
    >>> # a diagonal curvature (here exact): the same root
    >>> r = mg.optimize_prior_precision(nll, jnp.ones(2), structure="diag")
    >>> round(float(r.prior_precision), 5)
    0.61803

    References
    ----------
    No formula from the source papers: MacKay (1992), *Bayesian interpolation* (the re-estimation of
    the prior precision, his alpha, through gamma); Bishop (2006), Sec. 3.5.2. Taught in chapter 5.
    """
    who = "optimize_prior_precision"
    _check_structure(structure, paths, who)
    neg_log_likelihood = bind_batch(neg_log_likelihood, batch)
    flat, _ = ravel(params)
    dtype = flat.dtype
    if is_concrete(init) and not float(init) > 0:
        raise GeometryError(f"{who}: init must be a positive prior precision; got {init}.")
    m = jnp.zeros_like(flat) if prior_mean is None else ravel(prior_mean)[0]
    if m.shape != flat.shape:
        raise GeometryError(f"{who}: prior_mean has {m.size} entries, params {flat.size}.")
    lam, index = _structured_eigenvalues(neg_log_likelihood, params, curvature, structure, paths, max_size, who)
    diff = flat - m if index is None else (flat - m)[jnp.asarray(index)]
    s = jnp.sum(diff**2)
    value = neg_log_likelihood(params)
    tol = max(100 * float(jnp.finfo(dtype).eps), 1e-12) if rtol is None else float(rtol)
    d = lam.size

    def gamma(a):
        return jnp.sum(lam / (lam + a))

    def cond(state):
        a, a_prev, i = state
        return (i < max_iterations) & (jnp.abs(a - a_prev) > tol * jnp.abs(a)) & jnp.isfinite(a) & (a > 0)

    def body(state):
        a, _, i = state
        return gamma(a) / s, a, i + 1

    a0 = jnp.asarray(init, dtype)
    a, a_prev, iters = jax.lax.while_loop(cond, body, (gamma(a0) / s, a0, jnp.int32(1)))
    log_z = -value - 0.5 * a * s + 0.5 * d * jnp.log(a) - 0.5 * jnp.sum(jnp.log(lam + a))
    finite_inputs = jnp.all(jnp.isfinite(lam)) & jnp.isfinite(value) & (s > 0)
    positive = jnp.min(lam) + a > 0  # False for a NaN alpha too (negative curvature drives it there)
    converged = jnp.abs(a - a_prev) <= tol * jnp.abs(a)
    status = jnp.where(
        ~finite_inputs,
        Status.NON_FINITE,
        jnp.where(
            ~positive,
            Status.NOT_POSITIVE_DEFINITE,
            jnp.where(~converged, Status.MAX_ITERATIONS, jnp.where(jnp.isfinite(log_z), Status.OK, Status.NON_FINITE)),
        ),
    ).astype(jnp.int32)
    result = PriorPrecision(a, log_z, gamma(a), iters, status)
    if is_concrete(status):
        detail = ""
        if float(s) == 0.0:
            detail = "params equals the prior mean, so no finite precision maximizes the evidence."
        elif int(status) == Status.NOT_POSITIVE_DEFINITE:
            detail = (
                f"The likelihood curvature has eigenvalue {float(jnp.min(lam)):.3g} and the iteration reached "
                f"tau = {float(a):.3g}: C + tau I is not positive definite, params is not a minimum of the joint."
            )
        elif int(status) == Status.MAX_ITERATIONS:
            detail = f"tau = {float(a):.6g} after {int(iters)} iterations; raise max_iterations or start closer (init)."
        raise_for_status(status, who, detail=detail)
    return result


def _structured_eigenvalues(
    neg_log_likelihood: Callable, params: PyTree, curvature: Any, structure: str, paths: Any, max_size: int, who: str
) -> tuple[jax.Array, np.ndarray | None]:
    """The eigenvalues of the structured likelihood curvature, flat, and the selection's positions (or None)."""
    if curvature is not None and structure != "kfac":
        curvature = metric_field(curvature, who)
    if structure == "kfac":
        basis, _ = _kronecker_basis(params, curvature, who)
        lam = jnp.concatenate([jnp.ravel(e.eigenvalues) for e in basis])
        lam = lam + jnp.asarray(curvature.damping, lam.dtype)
        check_finite(lam, f"{who}: the Kronecker-factored curvature")
        return lam.astype(ravel(params)[0].dtype), None
    if structure == "diag":
        c = _curvature_diagonal(neg_log_likelihood, params, curvature, max_size)
        check_finite(c, f"{who}: the curvature's diagonal")
        return c, None
    if paths is None:
        C = _laplace_precision(neg_log_likelihood, params, curvature, 0.0, max_size, who)
        return jnp.linalg.eigvalsh(0.5 * (C + C.T)), None
    index = _selection_index(params, paths, who)
    return jnp.linalg.eigvalsh(_restricted_curvature(neg_log_likelihood, params, curvature, index, max_size, who)), index


def _check_nonzero_columns(norm: jax.Array, key: str, what: str) -> None:
    """Weight normalization needs a direction per unit: refuse zero columns (concrete values only)."""
    if not is_concrete(norm):
        return
    zero = np.flatnonzero(np.asarray(norm).reshape(-1) == 0)
    if zero.size:
        raise GeometryError(
            f"weight_norm: {what} {key!r} has {zero.size} zero column(s) (units {zero[:5].tolist()}), whose "
            "direction eta = W / |W| is undefined. Weight normalization needs every unit's weights to be non-zero: "
            "initialize them randomly, or leave this layer out of weight_norm."
        )


class WeightNorm(NamedTuple):
    r"""Weight normalization :math:`W = r\,\eta/\lVert\eta\rVert` of chosen dense-layer weights in a parameter pytree.

    .. math:: \theta = r\,\eta,\qquad r = \lVert W\rVert,\quad \eta = W/\lVert W\rVert \in S^{d-1}\ \text{(per unit)}.

    Each listed leaf ``W`` (a dict key of the top-level pytree) with units along
    ``axis`` = -1 becomes ``{"r": r, "eta": eta}``: one length :math:`r` per unit and
    a direction :math:`\eta` with the shape of ``W`` (norm over the fan-in axes).  Use
    :meth:`split` (:math:`\theta \to \psi`, unit-norm :math:`\eta`) and :meth:`merge`
    (:math:`\psi \to \theta`).

    Parameters
    ----------
    keys : sequence of str
        The top-level keys of the weights to normalize (build it with :func:`~minigeo.weight_norm`).

    Raises
    ------
    GeometryError
        From :meth:`split` if a key is missing or a weight is a scalar; from :meth:`split` and
        :meth:`merge` for a unit whose weight column (or direction :math:`\eta`) is zero, when the
        values are concrete (under ``jit`` the check cannot run and the result is NaN).

    Notes
    -----
    It adds one coordinate per unit without adding degrees of freedom (Salimans & Kingma 2016;
    Kristiadi et al. 2023, Example 1(b)), so it is not a :class:`~minigeo.Reparametrization`
    in the strict sense.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> wn = mg.weight_norm("W")
    >>> psi = wn.split({"W": jnp.array([[3.0], [4.0]])})
    >>> psi["W"]["r"].tolist(), psi["W"]["eta"].ravel().tolist()
    ([5.0], [0.6..., 0.8...])
    >>> bool(jnp.allclose(wn.merge(psi)["W"], jnp.array([[3.0], [4.0]])))
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Example 1(b) and Sec. 4.2 (Table 1); Salimans & Kingma
    (2016). Taught in chapter 5, *Densities and volume forms*.
    """

    keys: Sequence[str]

    def merge(self, psi: dict) -> dict:
        """:math:`\\psi \\mapsto \\theta`: rebuild each weight as ``r * eta / |eta|``."""
        theta = dict(psi)
        for k in self.keys:
            eta, r = psi[k]["eta"], psi[k]["r"]
            norm = jnp.sqrt(jnp.sum(eta**2, axis=tuple(range(eta.ndim - 1))))
            _check_nonzero_columns(norm, k, "eta")
            theta[k] = eta * (r / norm)
        return theta

    def split(self, theta: dict) -> dict:
        """:math:`\\theta \\mapsto \\psi` with :math:`r = \\lVert W\\rVert` per unit and the unit direction :math:`\\eta = W/\\lVert W\\rVert`."""
        missing = [k for k in self.keys if k not in theta]
        if missing:
            raise GeometryError(
                f"weight_norm: keys {missing} are not in the parameter pytree (keys: {sorted(theta)})."
            )
        psi = dict(theta)
        for k in self.keys:
            W = theta[k]
            if jnp.ndim(W) < 1:
                raise GeometryError(f"weight_norm: {k!r} must be an array of weights, got a scalar.")
            norm = jnp.sqrt(jnp.sum(W**2, axis=tuple(range(W.ndim - 1))))
            _check_nonzero_columns(norm, k, "the weight")
            psi[k] = {"r": norm, "eta": W / norm}
        return psi


def weight_norm(keys: Union[str, Sequence[str]]) -> WeightNorm:
    r"""A :class:`~minigeo.densities.WeightNorm` for the given top-level keys of a parameter dict.

    .. math:: W = r\,\eta/\lVert\eta\rVert\quad\text{for each listed weight } W.

    Parameters
    ----------
    keys : str or sequence of str
        One key or several keys of the weights to normalize.

    Returns
    -------
    :class:`~minigeo.densities.WeightNorm`
        With ``split`` (:math:`\theta \to \psi`) and ``merge`` (:math:`\psi \to \theta`).

    Raises
    ------
    GeometryError
        If ``keys`` is empty.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> wn = mg.weight_norm("W")
    >>> theta = {"W": jnp.array([[3.0], [4.0]]), "b": jnp.zeros(1)}
    >>> psi = wn.split(theta)
    >>> float(psi["W"]["r"][0]), bool(jnp.allclose(wn.merge(psi)["W"], theta["W"]))
    (5.0, True)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Example 1(b); Salimans & Kingma (2016). Taught in chapter 5,
    *Densities and volume forms*.
    """
    keys = [keys] if isinstance(keys, str) else list(keys)
    if not keys:
        raise GeometryError("weight_norm needs at least one key.")
    return WeightNorm(tuple(keys))
