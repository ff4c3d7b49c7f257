"""Assignment 1 (chapter 1): vectors, covectors and the gradient step."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ..coords import Reparametrization, transform_covector, transform_metric, transform_vector
from ._kit import CheckReport, _close, _random_reparametrizations, _random_spd, _run, _key


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
