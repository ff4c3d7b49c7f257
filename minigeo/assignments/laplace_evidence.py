"""Assignment 5 (chapter 5): densities, volume forms and the Laplace evidence."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import gammaln, ndtr

from .. import reparam
from ..coords import Reparametrization, transform_metric_field
from ..densities import laplace_log_marginal_likelihood, log_density_wrt_volume, transform_log_density
from ..metrics import dense as dense_metric
from . import _kit
from ._kit import CheckReport, _close, _close_or_name, _Fail, _matches, _run

LOG_2PI = float(np.log(2.0 * np.pi))


# ----------------------------------------------------------------------------- shared helpers


class _Draws(_kit._Draws):
    """512 standard normals per check (see :class:`minigeo.assignments._kit._Draws`), with the shapes
    this assignment draws."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed, size=512)

    def uniform(self, low: float, high: float, *shape: int) -> np.ndarray:
        return low + (high - low) * ndtr(self.normal(*shape))

    def spd(self, d: int) -> np.ndarray:
        M = self.normal(d, d)
        return M @ M.T + 0.5 * np.eye(d)

    def matrix(self) -> np.ndarray:
        """A 2 x 2 matrix with positive determinant, away from singular."""
        A = self.normal(2, 2) + 2.0 * np.eye(2)
        return A * np.sign(np.linalg.det(A))


def _newton_max(f: Callable[[jax.Array], jax.Array], x0: jax.Array, steps: int = 60) -> jax.Array:
    """The maximizer of ``f`` near ``x0`` by damped Newton steps (each coordinate moves at most 0.25)."""
    g, h = jax.grad(f), jax.hessian(f)

    def step(i, x):
        return x - jnp.clip(jnp.linalg.solve(h(x), g(x)), -0.25, 0.25)

    return jax.jit(lambda x: jax.lax.fori_loop(0, steps, step, x))(x0)


def _logdet(M: jax.Array) -> jax.Array:
    return jnp.linalg.slogdet(M)[1]


_IDENTITY = Reparametrization(lambda t: t, lambda t: t, name="theta itself")


def _charts(draws: _Draws) -> dict[str, Reparametrization]:
    """Charts of the positive quadrant: theta itself, polar, a random affine and a softplus-then-affine one."""
    A = jnp.asarray(draws.matrix())
    return {
        "theta itself": _IDENTITY,
        "polar": reparam.polar(),
        "random affine": reparam.affine(A, jnp.array([0.5, -1.0])),
        "softplus then random affine": reparam.compose(reparam.softplus(), reparam.affine(A)),
    }


def _positive_model(draws: _Draws):
    r"""A non-Gaussian log density on the positive quadrant and a position-dependent metric.

    :math:`\log q(\theta) = \sum_i (a_i - 1)\log\theta_i - b_i\theta_i + \kappa\,\theta_1\theta_2` (unnormalized,
    log-concave near its mode) and :math:`G(\theta) = C + \theta\theta^\top`; returns ``(log_q, G, theta0)``
    with ``theta0`` a start point near the modes.
    """
    a, b = jnp.asarray(draws.uniform(4.0, 6.0, 2)), jnp.asarray(draws.uniform(1.5, 2.5, 2))
    kappa, C = float(draws.uniform(-0.15, -0.05, 1)[0]), jnp.asarray(draws.spd(2))

    def log_q(t):
        return jnp.sum((a - 1.0) * jnp.log(t) - b * t) + kappa * t[0] * t[1]

    def G(t):
        return C + jnp.outer(t, t)

    return log_q, G, (a - 1.0) / b


# ------------------------------------------------------------------ task 1: change of variables


def _log_gaussian(x, mu, Sigma):
    r = x - mu
    return -0.5 * r @ jnp.linalg.solve(Sigma, r) - 0.5 * _logdet(2.0 * jnp.pi * Sigma)


def _log_gamma_pair(t, shape, rate):
    """Two independent Gamma(shape_i, rate_i) densities on the positive quadrant."""
    return jnp.sum(shape * jnp.log(rate) - gammaln(shape) + (shape - 1.0) * jnp.log(t) - rate * t)


def _change_of_variables_cases(draws: _Draws):
    """(name, phi, log_q, theta, closed form of psi -> log q_Psi(psi)), the Jacobians derived by hand."""
    mu, Sigma = jnp.asarray(draws.normal(2) + np.array([1.5, 0.5])), jnp.asarray(draws.spd(2))
    shape, rate = np.asarray(draws.uniform(2.0, 4.0, 2)), jnp.asarray(draws.uniform(0.5, 2.0, 2))
    A = draws.matrix()
    R = jnp.asarray(A @ np.diag([1.0, -1.0]))  # det A > 0 and det R < 0: R reverses orientation
    A, b = jnp.asarray(A), jnp.array([0.5, -1.0])
    log_gauss = lambda t: _log_gaussian(t, mu, Sigma)
    log_gamma = lambda t: _log_gamma_pair(t, shape, rate)

    def polar_closed(psi):  # theta = (r cos a, r sin a), |det d theta / d psi| = r
        r, ang = psi
        return log_gauss(jnp.stack([r * jnp.cos(ang), r * jnp.sin(ang)])) + jnp.log(r)

    def soft_closed(psi):  # theta = softplus(psi), d theta / d psi = sigmoid(psi)
        return log_gamma(jax.nn.softplus(psi)) + jnp.sum(jax.nn.log_sigmoid(psi))

    def affine_closed(M):  # psi = M theta + b is Gaussian: N(M mu + b, M Sigma M^T)
        return lambda psi: _log_gaussian(psi, M @ mu + b, M @ Sigma @ M.T)

    def soft_aff_closed(psi):  # psi = A softplus^{-1}(theta): theta = softplus(A^{-1} psi)
        u = jnp.linalg.solve(A, psi)
        return log_gamma(jax.nn.softplus(u)) + jnp.sum(jax.nn.log_sigmoid(u)) - jnp.log(jnp.linalg.det(A))

    positive = lambda: jnp.asarray(np.abs(draws.normal(2)) + 0.3)
    return [
        (
            "polar",
            reparam.polar(),
            log_gauss,
            jnp.asarray(draws.normal(2) + np.array([0.5, 1.0])),
            polar_closed,
        ),
        ("softplus", reparam.softplus(), log_gamma, positive(), soft_closed),
        ("affine", reparam.affine(A, b), log_gauss, jnp.asarray(draws.normal(2)), affine_closed(A)),
        (
            "softplus then affine",
            reparam.compose(reparam.softplus(), reparam.affine(A)),
            log_gamma,
            positive(),
            soft_aff_closed,
        ),
        (
            "orientation-reversing affine",
            reparam.affine(R, b),
            log_gauss,
            jnp.asarray(draws.normal(2)),
            affine_closed(R),
        ),
    ]


def check_change_of_variables(
    fn: Callable[[Callable, Reparametrization, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(log_q, phi, psi)`` against the change of variables :math:`\log q_\Psi(\psi) = \log q(\varphi^{-1}(\psi)) + \log\lvert\det J^{-1}(\psi)\rvert`.

    With :math:`J = \partial\psi/\partial\theta`, the same as :math:`\log q(\theta) - \log\lvert\det J(\theta)\rvert` at
    :math:`\theta = \varphi^{-1}(\psi)`.  Compared with :func:`minigeo.transform_log_density` and with closed
    forms derived by hand (a Gaussian pushed through polar, affine and orientation-reversing affine maps, a
    pair of Gamma densities through softplus and softplus-then-affine charts), at random densities and points.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(log_q, phi, psi)``; it returns the scalar log density in
        :math:`\psi`-coordinates of the density whose log in :math:`\theta`-coordinates is ``log_q``, for a
        :class:`~minigeo.Reparametrization` ``phi`` (:math:`\theta \mapsto \psi`) and a point ``psi``.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import assignments
    >>> def log_q_psi(log_q, phi, psi):
    ...     log_det = jnp.linalg.slogdet(phi.inverse_jacobian(psi))[1]
    ...     return log_q(phi.inverse(psi)) + log_det
    >>> assignments.check_change_of_variables(log_q_psi).passed
    PASS change_of_variables: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.3, eq. (10). Assignment of chapter 5.
    """

    def body() -> str:
        hint = (
            "log q_Psi(psi) = log q(theta) + log|det J^{-1}(psi)| with theta = phi.inverse(psi) and "
            "J^{-1}(psi) = d theta / d psi = phi.inverse_jacobian(psi); use jnp.linalg.slogdet for log|det|."
        )
        nan_hint = hint + " A volume is positive: take log|det|, not log det (a map may reverse orientation)."
        for name, phi, log_q, theta, closed in _change_of_variables_cases(_Draws(501)):

            def truths(t, phi=phi, log_q=log_q, closed=closed):
                psi = phi.forward(t)
                return psi, transform_log_density(log_q, phi)(psi), closed(psi)

            def wrongs(psi, phi=phi, log_q=log_q):  # the common mistakes (evaluated only for a wrong answer)
                theta = phi.inverse(psi)
                return (
                    log_q(theta) - _logdet(phi.inverse_jacobian(psi)),
                    log_q(theta),
                    log_q(theta) - _logdet(jax.jacfwd(phi.forward)(psi)),
                )

            psi, want, closed_value = jax.jit(truths)(theta)
            got = fn(log_q, phi, psi)
            memo: dict = {}
            nth = lambda i: memo.setdefault("v", jax.jit(wrongs)(psi))[i]
            mistakes = [
                (
                    lambda: nth(0),
                    "The Jacobian term has the wrong sign, or it is the Jacobian of the wrong direction: the "
                    "density picks up |det J^{-1}(psi)| = 1/|det J(theta)| with J = d psi / d theta, so ADD "
                    "log|det phi.inverse_jacobian(psi)| (equivalently subtract log|det phi.jacobian(theta)|).",
                ),
                (
                    lambda: nth(1),
                    "You transformed the density like a plain function, q(phi^{-1}(psi)): a density also "
                    "picks up the volume change |det J^{-1}(psi)| (without it, it does not integrate to one in psi).",
                ),
                (
                    lambda: nth(2),
                    "You evaluated the Jacobian of phi at psi: J = d psi / d theta must be taken at "
                    "theta = phi.inverse(psi) (or use phi.inverse_jacobian(psi) directly).",
                ),
            ]
            _close_or_name(got, want, f"log q_Psi ({name})", nan_hint, mistakes)
            _close(got, closed_value, f"log q_Psi against the closed form ({name})", hint)
        return "log q(phi^-1(psi)) + log|det J^-1| matches minigeo and closed forms in 5 charts."

    return _run("change_of_variables", body, time_limit)


# ------------------------------------------------------------------ task 2: the invariant MAP


def check_invariant_map(
    fn: Callable[[Callable, Callable, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(log_q, metric, x0)``: the mode of the density w.r.t. the volume form, :math:`\arg\max\,\log q - \tfrac12\log\det G`.

    .. math:: x^* = \arg\max_x\; \log q(x) - \tfrac12\log\det G(x),\qquad q^G = q\,\lvert\det G\rvert^{-1/2}.

    ``log_q`` is a Lebesgue log density and ``metric`` a callable :math:`x \mapsto G(x)` in one chart;
    ``x0`` is a start point near the mode.  The check calls ``fn`` in :math:`\theta`-coordinates, in a random
    affine chart and in polar coordinates (the density transformed by eq. 10, the metric as
    :math:`J^{-\top}GJ^{-1}`) and asks for the same point every time: the answer must map back to the mode in
    :math:`\theta` (equivariance), which the Lebesgue MAP does not.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(log_q, metric, x0)``; it returns the mode (a 1-D array).
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from minigeo import assignments
    >>> def invariant_map(log_q, metric, x0):
    ...     f = lambda x: log_q(x) - 0.5 * jnp.linalg.slogdet(metric(x))[1]
    ...     newton = lambda x: jnp.linalg.solve(jax.hessian(f)(x), jax.grad(f)(x))
    ...     step = lambda i, x: x - jnp.clip(newton(x), -0.25, 0.25)
    ...     return jax.jit(lambda x: jax.lax.fori_loop(0, 60, step, x))(x0)
    >>> assignments.check_invariant_map(invariant_map).passed
    PASS invariant_map: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.3, eq. (11) (densities w.r.t. the volume form; invariant MAP).
    Assignment of chapter 5.
    """

    def body() -> str:
        draws = _Draws(502)
        log_q, G, theta0 = _positive_model(draws)
        charts = _charts(draws)
        metric = dense_metric(G)
        theta_star = _newton_max(log_density_wrt_volume(log_q, metric), theta0)
        hint = (
            "Maximize the log density w.r.t. the volume form, log q(x) - 1/2 log det G(x), starting at x0 "
            "(e.g. with newton_maximize)."
        )
        for name in ("theta itself", "random affine", "polar"):
            phi = charts[name]
            log_q_psi = transform_log_density(log_q, phi)
            G_psi = transform_metric_field(phi, metric).dense
            x0, target = jax.jit(lambda a, b, phi=phi: (phi.forward(a), phi.forward(b)))(theta0, theta_star)
            got = fn(log_q_psi, G_psi, x0)
            mistakes = [
                (
                    lambda: _newton_max(log_q_psi, x0),
                    "You found the Lebesgue MAP, the mode of log q alone: it moves with the chart. Subtract "
                    "1/2 log det G(x), the log of the volume element sqrt(det G).",
                ),
                (
                    lambda: _newton_max(lambda x: log_q_psi(x) - _logdet(G_psi(x)), x0),
                    "You subtracted log det G: the volume element is sqrt(det G), so subtract 1/2 log det G "
                    "(a missing 1/2).",
                ),
                (
                    lambda: _newton_max(lambda x: log_q_psi(x) + 0.5 * _logdet(G_psi(x)), x0),
                    "Wrong sign: the density w.r.t. dV_G = sqrt(det G) dx is q / sqrt(det G), so subtract "
                    "1/2 log det G, do not add it.",
                ),
            ]
            what = f"the mode found in the {name} chart (compared with phi(theta*), the mode in theta mapped there)"
            _close_or_name(got, target, what, hint, mistakes, 1e-7)
        return "the mode of q / sqrt(det G) is the same point in theta, in a random affine chart and in polar coordinates."

    return _run("invariant_map", body, time_limit)


# ------------------------------------------------------------------ task 3: the Laplace evidence


def _lr_log_lik(t, X, y, sigma):  # log N(y | X t, sigma^2 I)
    r = y - X @ t
    return -0.5 * jnp.sum(r**2) / sigma**2 - y.size * jnp.log(sigma) - 0.5 * y.size * LOG_2PI


def _lr_log_prior(t, tau):  # log N(t | 0, tau^{-1} I)
    return -0.5 * tau * jnp.sum(t**2) + 0.5 * t.size * jnp.log(tau) - 0.5 * t.size * LOG_2PI


def _logistic_log_lik(t, X, y):
    z = X @ t
    return jnp.sum(y * jax.nn.log_sigmoid(z) + (1.0 - y) * jax.nn.log_sigmoid(-z))


def _logistic_log_prior(t):  # log N(t | 0, I)
    return -0.5 * jnp.sum(t**2) - 0.5 * t.size * LOG_2PI


@jax.jit
def _lr_reference(X, y, sigma, tau, t):
    """minigeo's Laplace log evidence of a Bayesian linear regression."""
    nlj = lambda x: -_lr_log_lik(x, X, y, sigma) - _lr_log_prior(x, tau)
    return laplace_log_marginal_likelihood(nlj, t).log_z


@jax.jit
def _logistic_reference(X, y, t):
    """minigeo's Laplace log evidence of a Bayesian logistic regression."""
    nlj = lambda x: -_logistic_log_lik(x, X, y) - _logistic_log_prior(x)
    return laplace_log_marginal_likelihood(nlj, t).log_z


def _linear_regression(draws: _Draws, d: int = 3, n: int = 20):
    """A Bayesian linear regression with a random design: its MAP and its exact log evidence (numpy)."""
    X = draws.normal(n, d)
    sigma, tau = float(draws.uniform(0.3, 1.0, 1)[0]), float(draws.uniform(0.5, 2.0, 1)[0])
    y = X @ draws.normal(d) + sigma * draws.normal(n)
    theta_star = np.linalg.solve(X.T @ X / sigma**2 + tau * np.eye(d), X.T @ y / sigma**2)
    C = sigma**2 * np.eye(n) + X @ X.T / tau  # the marginal y ~ N(0, sigma^2 I + X X^T / tau)
    exact = -0.5 * y @ np.linalg.solve(C, y) - 0.5 * np.linalg.slogdet(2.0 * np.pi * C)[1]
    return jnp.asarray(X), jnp.asarray(y), sigma, tau, jnp.asarray(theta_star), exact


def _logistic_regression(draws: _Draws, d: int = 3, n: int = 20):
    """A Bayesian logistic regression (not Gaussian: Laplace is an approximation) and its MAP (numpy Newton)."""
    X = draws.normal(n, d)
    y = (ndtr(draws.normal(n)) < 1.0 / (1.0 + np.exp(-X @ draws.normal(d)))).astype(float)
    t = np.zeros(d)
    for _ in range(30):
        p = 1.0 / (1.0 + np.exp(-X @ t))
        t = t + np.linalg.solve(X.T @ (X * (p * (1 - p))[:, None]) + np.eye(d), X.T @ (y - p) - t)
    return jnp.asarray(X), jnp.asarray(y), jnp.asarray(t)


def _laplace_cases(draws: _Draws):
    """(name, log_lik, log_prior, theta_star, exact log Z or None, minigeo's Laplace log Z)."""
    cases = []
    for i in range(3):
        X, y, sigma, tau, t, exact = _linear_regression(draws)
        log_lik = lambda x, X=X, y=y, sigma=sigma: _lr_log_lik(x, X, y, sigma)
        log_prior = lambda x, tau=tau: _lr_log_prior(x, tau)
        reference = _lr_reference(X, y, sigma, tau, t)
        cases.append((f"linear regression {i + 1}", log_lik, log_prior, t, exact, reference))
    X, y, t = _logistic_regression(draws)
    log_lik = lambda x: _logistic_log_lik(x, X, y)
    cases.append(("logistic regression", log_lik, _logistic_log_prior, t, None, _logistic_reference(X, y, t)))
    return cases


def check_laplace_log_evidence(
    fn: Callable[[Callable, Callable, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(log_lik, log_prior, theta_star)`` against the Laplace log evidence.

    .. math::
        \begin{aligned}
        \log Z &\approx \log p(\mathcal D\mid\theta^*) + \log p(\theta^*) + \tfrac d2\log 2\pi - \tfrac12\log\det H, \\
        H &= -\nabla^2\big(\log p(\mathcal D\mid\theta) + \log p(\theta)\big)\big|_{\theta^*}.
        \end{aligned}

    On Bayesian linear regressions with random designs (three weights) the Laplace approximation is
    exact, so the answer must equal the closed-form evidence :math:`\log\mathcal N(y\mid 0, \sigma^2 I +
    XX^\top/\tau)`; on a logistic regression it must equal :func:`minigeo.laplace_log_marginal_likelihood`.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(log_lik, log_prior, theta_star)``; it returns the scalar log evidence
        for the log likelihood ``log_lik``, the log prior density ``log_prior`` (both functions of
        :math:`\theta`) and the MAP estimate ``theta_star``.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from minigeo import assignments
    >>> def laplace(log_lik, log_prior, t):
    ...     H = -jax.hessian(lambda x: log_lik(x) + log_prior(x))(t)
    ...     d = t.size
    ...     log_joint = log_lik(t) + log_prior(t)
    ...     return log_joint + d / 2 * np.log(2 * np.pi) - 0.5 * jnp.linalg.slogdet(H)[1]
    >>> assignments.check_laplace_log_evidence(laplace).passed
    PASS laplace_log_evidence: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 4.2, eq. (14) and App. B.2 (signs corrected, as in chapter 5);
    MacKay (1992). Assignment of chapter 5.
    """

    def body() -> str:
        hint = (
            "log Z = log p(D|theta*) + log p(theta*) + d/2 log 2pi - 1/2 log det H, with H = minus the Hessian "
            "of log p(D|theta) + log p(theta) at theta* (jax.hessian; jnp.linalg.slogdet)."
        )
        for name, log_lik, log_prior, t, exact, reference in _laplace_cases(_Draws(503)):
            got = fn(log_lik, log_prior, t)
            log_joint = lambda x: log_lik(x) + log_prior(x)
            mistakes = []
            if not _matches(got, reference, 1e-8):  # name the mistake (computed only for a wrong answer)
                d = t.size
                ld = _logdet(-jax.hessian(log_joint)(t))
                right = log_joint(t) + 0.5 * d * LOG_2PI - 0.5 * ld
                mistakes = [
                    (
                        lambda: right + ld,
                        "The log-determinant has the wrong sign: it is -1/2 log det H of the precision H (the "
                        "Hessian of the negative log joint); +1/2 log det H, or -1/2 log det of the covariance "
                        "H^{-1}, flips it. A sharper posterior (larger H) means a smaller evidence.",
                    ),
                    (
                        lambda: right - 0.5 * d * LOG_2PI,
                        "The Gaussian integral is (2 pi)^{d/2} det(H)^{-1/2}: the term +d/2 log 2pi is missing.",
                    ),
                    (
                        lambda: right - d * LOG_2PI + ld,
                        "These are the signs printed in the paper's eq. 14 (-d/2 log 2pi + 1/2 log det H); the "
                        "derivation in chapter 5 gives +d/2 log 2pi - 1/2 log det H.",
                    ),
                    (
                        lambda: right - d * LOG_2PI + 1.5 * ld,
                        "This is the paper's App. B.2 (-d/2 log 2pi + log det H): both signs are off and the 1/2 is "
                        "missing; the chapter derives +d/2 log 2pi - 1/2 log det H.",
                    ),
                    (
                        lambda: right - 0.5 * ld,
                        "det(H)^{-1/2} contributes -1/2 log det H, not -log det H (a missing 1/2).",
                    ),
                    (
                        lambda: right - log_prior(t),
                        "The term log p(theta*) is missing: the integrand is the joint p(D|theta) p(theta).",
                    ),
                    (
                        lambda: right + 0.5 * ld - 0.5 * _logdet(-jax.hessian(log_lik)(t)),
                        "H must be the Hessian of the negative log JOINT (likelihood and prior), not of the "
                        "likelihood alone.",
                    ),
                ]
            _close_or_name(got, reference, f"log Z ({name})", hint, mistakes)
            if exact is not None:
                _close(got, exact, f"log Z against the exact evidence ({name})", hint)
        return (
            "the Laplace log evidence equals the exact evidence of 3 Bayesian linear regressions and minigeo's "
            "on a logistic regression."
        )

    return _run("laplace_log_evidence", body, time_limit)


# ------------------------------------------------------------------ task 4: the invariant evidence


def _volume_laplace(log_q: Callable, G: Callable, x0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """minigeo's Laplace log evidence w.r.t. the volume form of ``G`` and its mode, as in chapter 5 (jitted)."""

    def evidence(x0):
        metric = dense_metric(G)
        L = lambda x: -log_density_wrt_volume(log_q, metric)(x)
        mode = _newton_max(lambda x: -L(x), x0)
        return laplace_log_marginal_likelihood(L, mode, metric=metric).log_z, mode

    return jax.jit(evidence)(x0)


def _volume_laplace_at_lebesgue_mode(log_q: Callable, G: Callable, x0: jax.Array) -> jax.Array:
    """The volume-form Laplace formula evaluated at the wrong point, the mode of q (a common mistake)."""

    def evidence(x0):
        metric = dense_metric(G)
        L = lambda x: -log_density_wrt_volume(log_q, metric)(x)
        return laplace_log_marginal_likelihood(L, _newton_max(log_q, x0), metric=metric).log_z

    return jax.jit(evidence)(x0)


def _lebesgue_laplace(log_q: Callable, x0: jax.Array) -> jax.Array:
    """The naive Laplace log evidence of the chart: the mode of q and log det H, no metric (jitted)."""

    def evidence(x0):
        return laplace_log_marginal_likelihood(lambda x: -log_q(x), _newton_max(log_q, x0)).log_z

    return jax.jit(evidence)(x0)


def _gaussian_model(draws: _Draws, n: int = 20, sigma: float = 0.5):
    """A Bayesian linear regression on two weights (its mode in the positive quadrant), a constant random
    metric, a start point near the mode and the exact log evidence: ``(log_joint, G, theta0, log Z)``."""
    X = draws.normal(n, 2)
    y = X @ np.array([1.2, 0.8]) + sigma * draws.normal(n)
    Cy = sigma**2 * np.eye(n) + X @ X.T  # the marginal y ~ N(0, sigma^2 I + X X^T)
    exact = -0.5 * y @ np.linalg.solve(Cy, y) - 0.5 * np.linalg.slogdet(2.0 * np.pi * Cy)[1]
    theta_star = np.linalg.solve(X.T @ X / sigma**2 + np.eye(2), X.T @ y / sigma**2)
    X, y, C = jnp.asarray(X), jnp.asarray(y), jnp.asarray(draws.spd(2))

    def log_joint(t):  # log N(y | X t, sigma^2 I) + log N(t | 0, I)
        r = y - X @ t
        return (
            -0.5 * jnp.sum(r**2) / sigma**2
            - n * np.log(sigma)
            - 0.5 * (n + 2) * LOG_2PI
            - 0.5 * jnp.sum(t**2)
        )

    return log_joint, (lambda t: C), jnp.asarray(theta_star + 0.1), exact


def check_invariant_laplace_evidence(
    fn: Callable[[Callable, Callable, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(log_q, metric, x0)``: the Laplace log evidence w.r.t. the volume form, the same in every chart.

    .. math::
        \begin{aligned}
        \log Z_G &= \log q^G(x^*) + \tfrac d2\log 2\pi - \tfrac12\log\det\big(G(x^*)^{-1}H\big), \\
        q^G &= q\,\lvert\det G\rvert^{-1/2},\quad H = -\nabla^2\log q^G(x^*),
        \end{aligned}

    with :math:`x^*` the mode of :math:`q^G` (near ``x0``).  ``log_q`` is the Lebesgue log joint density and
    ``metric`` a callable :math:`x \mapsto G(x)` in one chart.  For a non-Gaussian model with a
    position-dependent metric the check evaluates it in two random charts (affine, softplus-then-affine):
    both values must equal :func:`minigeo.laplace_log_marginal_likelihood` with ``metric=`` in
    :math:`\theta`-coordinates.  For a Bayesian linear regression with a constant random metric in
    :math:`\theta`, evaluated in a random affine chart, it must equal the exact evidence.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(log_q, metric, x0)``; it returns the scalar log evidence.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from minigeo import assignments
    >>> def evidence(log_q, metric, x0):
    ...     f = lambda x: log_q(x) - 0.5 * jnp.linalg.slogdet(metric(x))[1]
    ...     newton = lambda x: jnp.linalg.solve(jax.hessian(f)(x), jax.grad(f)(x))
    ...     step = lambda i, x: x - jnp.clip(newton(x), -0.25, 0.25)
    ...     x = jax.jit(lambda x: jax.lax.fori_loop(0, 60, step, x))(x0)
    ...     H = -jax.hessian(f)(x)
    ...     logdet = jnp.linalg.slogdet(H)[1] - jnp.linalg.slogdet(metric(x))[1]
    ...     return f(x) + x.size / 2 * np.log(2 * np.pi) - 0.5 * logdet
    >>> assignments.check_invariant_laplace_evidence(evidence).passed
    PASS invariant_laplace_evidence: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 4.2 and App. B.2 (the Laplace evidence is invariant when the
    Gaussian is normalized against the volume form). Assignment of chapter 5.
    """

    def body() -> str:
        hint = (
            "At the mode x* of q^G = q / sqrt(det G) (invariant_map), log Z = log q^G(x*) + d/2 log 2pi - "
            "1/2 log det(G^{-1} H), with H = minus the Hessian of log q^G at x*."
        )
        draws = _Draws(504)
        log_q_lr, G_lr, x0_lr, exact = _gaussian_model(draws)
        log_q_nl, G_nl, x0_nl = _positive_model(draws)
        charts = _charts(draws)
        truth_nl = _volume_laplace(log_q_nl, G_nl, x0_nl)[0]  # minigeo, in theta
        for model, log_q, G, theta0, truth, names in [
            ("linear regression", log_q_lr, G_lr, x0_lr, exact, ("random affine",)),
            (
                "non-Gaussian model",
                log_q_nl,
                G_nl,
                x0_nl,
                truth_nl,
                ("random affine", "softplus then random affine"),
            ),
        ]:
            metric = dense_metric(G)
            for name in names:
                phi = charts[name]
                log_q_psi = transform_log_density(log_q, phi)
                G_psi = transform_metric_field(phi, metric).dense
                x0 = jax.jit(phi.forward)(theta0)
                got = fn(log_q_psi, G_psi, x0)
                if not _matches(got, truth, 1e-8):  # name the mistake (computed only for a wrong answer)
                    want, mode = _volume_laplace(log_q_psi, G_psi, x0)
                    ld_G = _logdet(G_psi(mode))
                    mistakes = [
                        (
                            lambda: _lebesgue_laplace(log_q_psi, x0),
                            "This is the Lebesgue Laplace evidence of the chart (the mode of q, log det H): it "
                            "changes with the chart. Expand log q^G = log q - 1/2 log det G around its own mode "
                            "and use log det(G^{-1} H).",
                        ),
                        (
                            lambda: want - 0.5 * ld_G,
                            "The Gaussian must be normalized against dV_G = sqrt(det G) dx: use "
                            "log det(G^{-1} H) = log det H - log det G (the +1/2 log det G(x*) is missing).",
                        ),
                        (
                            lambda: want - ld_G,
                            "Wrong sign on the metric: log det(G^{-1} H) = log det H - log det G, so log Z gets "
                            "+1/2 log det G(x*), not -1/2 log det G(x*).",
                        ),
                        (
                            lambda: _volume_laplace_at_lebesgue_mode(log_q_psi, G_psi, x0),
                            "You expanded around the Lebesgue MAP (the mode of q): expand around the mode of "
                            "q^G = q / sqrt(det G), which is the same point in every chart.",
                        ),
                    ]
                    _close_or_name(got, want, f"log Z_G ({model}, {name} chart)", hint, mistakes)
                _close(
                    got,
                    truth,
                    f"log Z_G in the {name} chart ({model})",
                    "The volume-form evidence must be the same number in every chart. " + hint,
                )
        return (
            "the volume-form Laplace evidence of a non-Gaussian model is the same in theta and in 2 random "
            f"charts, and exact in a random chart for a linear regression (log Z = {float(exact):.4f})."
        )

    return _run("invariant_laplace_evidence", body, time_limit)


def _box_cox_mode_truth(a: float, b: float, nu: float) -> float:
    """theta at the mode of the density of psi = (theta^nu - 1)/nu for theta ~ Gamma(a, rate b), found
    numerically: log q_Psi(psi) = log q(theta(psi)) + log|dtheta/dpsi|, the derivative of the inverse
    chart by ``jax.grad``; the mode is bracketed on a grid and its stationarity equation (``jax.grad``
    again) solved by Brent's method."""
    from scipy.optimize import brentq

    def inverse(psi):
        return (1.0 + nu * psi) ** (1.0 / nu)

    def log_q_psi(psi):
        theta = inverse(psi)
        return (a - 1.0) * jnp.log(theta) - b * theta + jnp.log(jnp.abs(jax.grad(inverse)(psi)))

    slope = jax.jit(jax.grad(log_q_psi))
    thetas = np.geomspace(1e-2 / b, 50.0 * a / b, 801)
    psis = (thetas**nu - 1.0) / nu
    psis = np.sort(psis)
    signs = np.sign(np.asarray(jax.vmap(slope)(jnp.asarray(psis))))
    i = int(np.flatnonzero((signs[:-1] > 0) & (signs[1:] < 0))[0])
    psi_star = brentq(lambda p: float(slope(p)), psis[i], psis[i + 1], xtol=1e-14, rtol=1e-14)
    return float(inverse(psi_star))


def check_chart_map(
    fn: Callable[[float, float, float], float],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(a, b, nu)`` = where the MAP of a Gamma density lands in the Box-Cox chart :math:`\psi_\nu`.

    :math:`\theta\sim\mathrm{Gamma}(a, b)` (shape :math:`a`, rate :math:`b`) has its mode at
    :math:`(a-1)/b`.  Written as a density of :math:`\psi_\nu = (\theta^\nu - 1)/\nu` it has another
    mode; ``fn`` returns that mode expressed as a value of :math:`\theta` (i.e.
    :math:`\varphi^{-1}(\psi^*)`).  A prediction the chapter does not print: the check maximizes the
    transformed density numerically (the inverse chart's derivative by finite differences) for
    random :math:`a > \max(1, \nu)`, :math:`b` and :math:`\nu` of its seed.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(a, b, nu)`` with floats; it returns a number.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> from minigeo import assignments
    >>> assignments.check_chart_map(lambda a, b, nu: (a - 1) / b).passed
    FAIL chart_map: ...
    False

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eq. 10 (the change of variables; the MAP estimate is not
    invariant). Assignment of chapter 5.
    """

    def body() -> str:
        rng = _kit._rng(53)
        cases = [(3.0, 2.0, 0.5), (4.5, 1.0, 2.0), (2.5, 0.7, -1.0)]
        for _ in range(3):
            nu = float(rng.choice([-1.5, -0.5, 0.3, 0.7, 1.5, 2.5]))
            cases.append((float(rng.uniform(max(1.0, nu) + 0.5, 6.0)), float(rng.uniform(0.5, 3.0)), nu))
        for a, b, nu in cases:
            truth = _box_cox_mode_truth(a, b, nu)
            got = fn(a, b, nu)
            mistakes = [
                ((a - 1.0) / b, "that is the mode of q in theta: the MAP moves with the chart, because the density "
                 "in psi carries the factor |dtheta/dpsi|."),
                (a / b, "a/b is the mode in the log chart (the chapter's example, the limit nu -> 0); the Box-Cox "
                 "chart's Jacobian dpsi/dtheta = theta^(nu - 1) depends on nu."),
                ((a + nu - 2.0) / b, "the Jacobian factor is inverted: q_Psi = q |dtheta/dpsi|, "
                 "not q |dpsi/dtheta|."),
                ((((a - nu) / b) ** nu - 1.0) / nu, "that is the mode's psi-coordinate: return it as a value of theta."),
            ]
            _close_or_name(
                got,
                truth,
                f"the theta of the psi-mode for a = {a:.3g}, b = {b:.3g}, nu = {nu:g}",
                "Write log q_Psi(psi) as a function of theta = phi^-1(psi) and set its derivative to zero.",
                mistakes,
                tol=1e-6,
            )
        return "the MAP in the Box-Cox chart is right: it is not phi of the MAP in theta."

    return _run("chart_map", body, time_limit)
