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
from ._checks import GeometryError, check_finite, check_spd, check_square_matrix, is_concrete
from ._spectral import EstimateInfo, slq_logdet
from ._tree import DEFAULT_MAX_DENSE_SIZE, PyTree, check_dense_size, ravel, tree_size
from .coords import Reparametrization
from .curvature import hessian, hvp
from ._metric import Metric, _matrix_field, metric_field

__all__ = [
    "transform_log_density",
    "log_volume_element",
    "log_density_wrt_volume",
    "logdet_slq",
    "LaplaceEvidence",
    "laplace_log_marginal_likelihood",
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
        The metric field, e.g. ``mg.dense_metric(lambda x: G(x))`` (flattened coordinates), or a
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
    >>> polar = mg.dense_metric(lambda x: jnp.diag(jnp.array([1.0, x[0] ** 2])))
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
        The metric field, e.g. ``mg.dense_metric(lambda x: G(x))`` (flattened coordinates), or a
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
    >>> fisher = mg.dense_metric(lambda t: jnp.array([[1.0 / (t[0] * (1 - t[0]))]]))
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
        Also return an :class:`~minigeo.EstimateInfo`: ``status`` ``NOT_POSITIVE_DEFINITE`` (the
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
    >>> est, se = mg.logdet_slq(lambda v: A @ v, 5, key, num_iterations=5)
    >>> # exact with Rademacher probes, diagonal A
    >>> round(float(est), 3), round(float(jnp.log(120.0)), 3)
    (4.787, 4.787)
    >>> est, se = mg.logdet_slq(lambda v: 3.0 * v, 10, key)   # 3 I: exactly 10 log 3
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
        A metric field (e.g. ``mg.dense_metric(lambda p: G(p))``, flattened coordinates) or a
        constant square matrix: evaluate the evidence w.r.t. the Riemannian
        volume form :math:`dV_G`, i.e. use :math:`\log\det(G^{-1}H)`.  With the metric
        transformed along with the parameters, the result is reparametrization-invariant.
    reparametrization : :class:`~minigeo.Reparametrization` or :class:`~minigeo.WeightNorm`, optional
        If ``params`` are coordinates :math:`\psi` of a model whose original coordinates
        are :math:`\theta`, given as a :class:`~minigeo.Reparametrization`
        (:math:`\theta \mapsto \psi`) or a :class:`~minigeo.WeightNorm`, the evidence is computed in
        :math:`\theta` (Kristiadi et al. 2023, App. B.2): the curvature is the :math:`\theta`-one,
        whatever the number of :math:`\psi` coordinates.
    method : {"dense", "slq"}, optional
        ``"dense"`` (Cholesky/``slogdet``) or ``"slq"`` (stochastic Lanczos quadrature,
        matrix-free; needs ``key``).
    key : jax.Array, optional
        PRNG key for ``method="slq"``.
    num_probes, num_iterations : int, optional
        Passed to :func:`~minigeo.logdet_slq` (``method="slq"`` only).
    max_size : int, optional
        Largest number of parameters for which a dense curvature is formed.

    Returns
    -------
    :class:`~minigeo.LaplaceEvidence`
        ``log_z`` and its parts.

    Raises
    ------
    GeometryError
        If the curvature is not positive definite (not a strict minimum): use a GGN
        curvature or add ``prior_precision``.  Also for an unknown ``method`` or
        ``reparametrization`` type, ``method="slq"`` without ``key``, or a dense curvature
        larger than ``max_size``.

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

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 4.2, eq. (14) (signs corrected, see the module notes) and
    Table 1; MacKay (1992). Taught in chapter 5, *Densities and volume forms*.
    """
    metric = metric_field(metric, "laplace_log_marginal_likelihood")
    neg_log_joint = bind_batch(neg_log_joint, batch)
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
        check_dense_size(d, max_size, "The Laplace curvature")
        C = (
            hessian(neg_log_joint, params, max_size=max_size)
            if curvature is None
            else curvature.dense(params, max_size=max_size)
        )
        C = C + prior_precision * jnp.eye(d, dtype=C.dtype)
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
    r"""A :class:`~minigeo.WeightNorm` for the given top-level keys of a parameter dict.

    .. math:: W = r\,\eta/\lVert\eta\rVert\quad\text{for each listed weight } W.

    Parameters
    ----------
    keys : str or sequence of str
        One key or several keys of the weights to normalize.

    Returns
    -------
    :class:`~minigeo.WeightNorm`
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
