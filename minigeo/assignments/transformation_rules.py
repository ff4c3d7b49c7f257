"""Assignment 1 (chapter 1): vectors, covectors and the gradient step."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..coords import Reparametrization, transform_covector, transform_metric, transform_vector
from ._kit import CheckReport, _close, _close_or_name, _random_reparametrizations, _random_spd, _rng, _run, _key


def check_transform_vector(
    fn: Callable[[Reparametrization, jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(phi, theta, v)`` against the vector rule :math:`\hat v = J(\theta)\,v`.

    Compared with :func:`minigeo.transform_vector` for polar, softplus, affine and composed
    reparametrizations at several points and random vectors.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(phi, theta, v)``; it returns the transformed vector, for a :class:`~minigeo.coords.Reparametrization` ``phi``, a point ``theta`` and a vector ``v``.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> from minigeo import assignments, transform_vector
    >>> assignments.check_transform_vector(transform_vector).passed
    PASS transform_vector: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, rule (b). Assignment of chapter 1.
    """

    def body() -> str:
        for i, (name, phi, theta) in enumerate(_random_reparametrizations(_key(1))):
            v = jax.random.normal(_key(10 + i), (2,))
            _close(
                fn(phi, theta, v),
                transform_vector(phi, theta, v),
                f"the transformed vector ({name})",
                "A vector's components change with the Jacobian of the forward map: J v (try jax.jvp).",
            )
        return "J v matches minigeo on 5 reparametrizations."

    return _run("transform_vector", body, time_limit)


def check_transform_covector(
    fn: Callable[[Reparametrization, jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(phi, theta, omega)`` against the covector rule :math:`\hat\omega = J^{-\top}\omega`.

    Also checks the invariance that defines the rule: the pairing :math:`\hat\omega(\hat v)` equals
    :math:`\omega(v)` for pushed-forward vectors.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(phi, theta, omega)``; it returns the transformed covector.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> from minigeo import assignments, transform_covector
    >>> assignments.check_transform_covector(transform_covector).passed
    PASS transform_covector: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, rule (c). Assignment of chapter 1.
    """

    def body() -> str:
        for i, (name, phi, theta) in enumerate(_random_reparametrizations(_key(2))):
            k1, k2 = jax.random.split(_key(20 + i))
            omega, v = jax.random.normal(k1, (2,)), jax.random.normal(k2, (2,))
            got = fn(phi, theta, omega)
            _close(
                jnp.vdot(got, transform_vector(phi, theta, v)),
                jnp.vdot(omega, v),
                f"the pairing omega(v) after transforming ({name})",
                "omega(v) must not change: the covector has to undo the vector's Jacobian, J^{-T} omega, not J omega.",
            )
            _close(
                got,
                transform_covector(phi, theta, omega),
                f"the transformed covector ({name})",
                "Solve J^T x = omega rather than forming J^{-1}.",
            )
        return "J^-T omega matches minigeo, and the pairing omega(v) is invariant."

    return _run("transform_covector", body, time_limit)


def check_natural_gradient_step(
    fn: Callable[[jax.Array, jax.Array, float], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(G, grad, lr)``: the update vector :math:`\Delta\theta = -\alpha\,G^{-1}\nabla L`.

    Besides the value, it checks equivariance: the step computed in :math:`\psi`-coordinates from the
    transformed metric and gradient equals the pushforward :math:`J\,\Delta\theta` of the step in
    :math:`\theta`-coordinates, the property plain gradient descent (``G = I`` in every coordinate
    system) lacks.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(G, grad, lr)``; it returns the update vector for a metric ``G``, a gradient ``grad`` and a step size ``lr``.
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
    >>> step = lambda G, g, lr: -lr * jnp.linalg.solve(G, g)
    >>> assignments.check_natural_gradient_step(step).passed
    PASS natural_gradient_step: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.2 (equivariance of preconditioned gradient descent).
    Assignment of chapter 1.
    """

    def body() -> str:
        for i, (name, phi, theta) in enumerate(_random_reparametrizations(_key(3))):
            k1, k2 = jax.random.split(_key(30 + i))
            G, grad, lr = _random_spd(k1, 2), jax.random.normal(k2, (2,)), 0.1
            step = fn(G, grad, lr)
            _close(
                step, -lr * jnp.linalg.solve(G, grad), f"the step ({name})", "The step is -lr * G^{-1} grad."
            )
            step_psi = fn(transform_metric(phi, theta, G), transform_covector(phi, theta, grad), lr)
            _close(
                step_psi,
                transform_vector(phi, theta, step),
                f"the step computed in psi-coordinates ({name})",
                "The step must be a vector: the same step in both coordinate systems.",
            )
        return "-lr G^-1 grad is correct and equivariant under 5 reparametrizations."

    return _run("natural_gradient_step", body, time_limit)


def check_chart_gradient_step(
    fn: Callable[[float, jax.Array, jax.Array, float], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(nu, theta, grad, lr)``: plain gradient descent taken in the Box-Cox chart, seen in :math:`\theta`.

    A derivation the chapter leaves out: one step :math:`\psi - \alpha\nabla_\psi\mathcal L` of plain
    gradient descent in the chart :math:`\psi_\nu = (\theta^\nu - 1)/\nu` (element-wise), mapped back to
    :math:`\theta`, to first order in the step size :math:`\alpha`.  The check's truth differentiates the
    inverse chart with ``jax.grad`` (chain rule for the gradient in :math:`\psi`, then the step's
    pushforward back to :math:`\theta`) at random points, exponents and gradients of its seed.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(nu, theta, grad, lr)`` with a float ``nu``, arrays
        ``theta`` (positive) and ``grad`` of shape ``(3,)`` and a float ``lr``; it returns the step in
        :math:`\theta`-coordinates, shape ``(3,)``.
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
    >>> assignments.check_chart_gradient_step(lambda nu, theta, g, lr: -lr * g).passed
    FAIL chart_gradient_step: ...
    False

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), *The geometry of neural nets' parameter spaces under
    reparametrization* (gradient descent is not invariant). Assignment of chapter 1.
    """

    def inverse(nu, psi):  # theta = (1 + nu psi)^(1/nu), one coordinate
        return (1.0 + nu * psi) ** (1.0 / nu)

    def body() -> str:
        rng = _rng(11)
        nus = [0.5, 2.0, -1.0, float(rng.uniform(0.2, 3.0))]
        for nu in nus:
            theta = rng.uniform(0.3, 2.5, size=3)
            grad = rng.normal(size=3)
            lr = float(rng.uniform(0.01, 0.5))
            psi = (theta**nu - 1.0) / nu
            dtheta_dpsi = np.array([float(jax.grad(inverse, argnums=1)(nu, float(p))) for p in psi])
            grad_psi = grad * dtheta_dpsi  # dL/dpsi = dL/dtheta dtheta/dpsi (a covector)
            want = dtheta_dpsi * (-lr * grad_psi)  # the psi-step pushed forward to theta
            got = fn(nu, jnp.asarray(theta), jnp.asarray(grad), lr)
            J = theta ** (nu - 1.0)  # dpsi/dtheta
            mistakes = [
                (-lr * grad, "that is plain gradient descent in theta: the step taken in psi is another one. "
                 "Write the gradient in psi (a covector) and map the psi-step back to theta (a vector)."),
                (-lr * grad / J, "one factor of dtheta/dpsi is missing: the gradient in psi picks up one "
                 "(it is a covector) and mapping the step back to theta another (it is a vector)."),
                (-lr * grad * J**2, "the factor is inverted: dtheta/dpsi = 1/(dpsi/dtheta), and it enters twice."),
                (-lr * grad * J, "the step moved like a vector with dpsi/dtheta: both the gradient and the "
                 "step transform with dtheta/dpsi = theta^(1-nu)."),
            ]
            _close_or_name(
                got,
                want,
                f"the theta-step for nu = {nu:g}",
                "Differentiate through the chart: dL/dpsi from dL/dtheta, the step -lr dL/dpsi, then back to theta.",
                mistakes,
            )
        return "plain gradient descent in a Box-Cox chart is a preconditioned step in theta."

    return _run("chart_gradient_step", body, time_limit)
