"""Assignment 4 (chapter 4): the Hessian endomorphism and its invariants."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .. import reparam
from ..coords import transform_endomorphism
from ..curvature import christoffel_symbols, riemannian_hessian
from ..metrics import dense as dense_metric
import numpy as np

from ._kit import CheckReport, _close, _close_or_name, _random_spd, _rng, _run, _key


def _hessian_cases(key: jax.Array, n: int = 4) -> list[tuple[jax.Array, jax.Array]]:
    cases = []
    for k in jax.random.split(key, n):
        k1, k2 = jax.random.split(k)
        S = jax.random.normal(k1, (3, 3))
        cases.append((S + S.T, _random_spd(k2, 3)))
    return cases


def check_hessian_endomorphism(
    fn: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(H, G)`` = :math:`E = G^{-1}H` and that it transforms as :math:`J E J^{-1}`.

    The transformation check feeds ``fn`` the transformed bilinear Hessian :math:`J^{-\top}HJ^{-1}`
    and metric :math:`J^{-\top}GJ^{-1}` under random invertible linear maps.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(H, G)``; it returns the endomorphism for a bilinear Hessian ``H`` and a metric ``G``.
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
    >>> assignments.check_hessian_endomorphism(lambda H, G: jnp.linalg.solve(G, H)).passed
    PASS hessian_endomorphism: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1, eq. (6). Assignment of chapter 4.
    """

    def body() -> str:
        for i, (H, G) in enumerate(_hessian_cases(_key(4))):
            E = fn(H, G)
            _close(
                E,
                jnp.linalg.solve(G, H),
                "E",
                "E = G^{-1} H (solve with G; the order matters: H G^{-1} is wrong).",
            )
            A = jax.random.normal(_key(40 + i), (3, 3)) + 3.0 * jnp.eye(3)
            phi, theta = reparam.affine(A), jnp.zeros(3)
            Ai = jnp.linalg.inv(A)
            _close(
                fn(Ai.T @ H @ Ai, Ai.T @ G @ Ai),
                transform_endomorphism(phi, theta, E),
                "E computed from the transformed H and G",
                "An endomorphism transforms as J E J^{-1}.",
            )
        return "G^-1 H is correct and transforms as J E J^-1."

    return _run("hessian_endomorphism", body, time_limit)


def check_invariant_trace(
    fn: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(H, G)`` = :math:`\mathrm{tr}(G^{-1}H)`, invariant under reparametrization, unlike :math:`\mathrm{tr}\,H`.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(H, G)``; it returns the scalar trace for a bilinear Hessian ``H`` and a metric ``G``.
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
    >>> assignments.check_invariant_trace(jnp.trace)  # the bilinear trace is not invariant
    FAIL invariant trace tr(G^-1 H): ...
    CheckReport(task='invariant trace tr(G^-1 H)', passed=False, message=...)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1; App. A.2, eq. (18). Assignment of chapter 4.
    """

    def body() -> str:
        for i, (H, G) in enumerate(_hessian_cases(_key(5))):
            t = fn(H, G)
            _close(
                t,
                jnp.trace(jnp.linalg.solve(G, H)),
                "the trace",
                "The invariant trace is tr(G^{-1} H), not tr(H) (a bilinear form has no coordinate-free trace).",
            )
            A = jax.random.normal(_key(50 + i), (3, 3)) + 3.0 * jnp.eye(3)
            Ai = jnp.linalg.inv(A)
            _close(
                fn(Ai.T @ H @ Ai, Ai.T @ G @ Ai),
                t,
                "the trace after a reparametrization",
                "It must not change.",
            )
        return "tr(G^-1 H) is correct and invariant."

    return _run("invariant trace tr(G^-1 H)", body, time_limit)


def _metric_field(x: jax.Array) -> jax.Array:
    """A position-dependent metric on R^2 (non-zero Christoffel symbols)."""
    return jnp.array([[1.0 + x[1] ** 2, 0.3 * x[0]], [0.3 * x[0], 2.0 + jnp.sin(x[0]) ** 2]])


def _f(x: jax.Array) -> jax.Array:
    return jnp.sin(x[0]) * x[1] + 0.5 * x[0] ** 2 * x[1] ** 2 + x[1]


def check_riemannian_hessian(
    fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(hess, grad, gamma)`` = :math:`\partial_i\partial_j f - \Gamma^k_{ij}\partial_k f`.

    ``hess`` is the matrix of second derivatives, ``grad`` the gradient and ``gamma[k, i, j]`` the
    Christoffel symbols :math:`\Gamma^k_{ij}` at a non-critical point of a function on the plane
    with a position-dependent metric.  Compared with :func:`minigeo.riemannian_hessian`.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(hess, grad, gamma)``; it returns the Riemannian Hessian matrix.
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
    >>> ok = lambda hess, grad, gamma: hess - jnp.einsum("kij,k->ij", gamma, grad)
    >>> assignments.check_riemannian_hessian(ok).passed
    PASS riemannian_hessian: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eq. (5); Kristiadi (2023), *The Invariance of the Hessian*
    (blog post). Assignment of chapter 4.
    """

    def body() -> str:
        for x in (jnp.array([0.3, -0.8]), jnp.array([1.2, 0.5]), jnp.array([-0.6, 1.1])):
            metric = dense_metric(_metric_field)
            got = fn(jax.hessian(_f)(x), jax.grad(_f)(x), christoffel_symbols(metric, x))
            _close(
                got,
                riemannian_hessian(_f, metric, x),
                "the Riemannian Hessian",
                "Subtract Gamma^k_ij times the k-th gradient component: contract gamma's first index with grad.",
            )
        return "the Christoffel correction matches minigeo at 3 non-critical points."

    return _run("riemannian_hessian", body, time_limit)


def _christoffel_from_definition(metric: Callable, theta: jax.Array) -> np.ndarray:
    """Gamma^k_ij = 1/2 G^{kl} (d_i G_lj + d_j G_li - d_l G_ij), the derivatives by dense jax.jacfwd."""
    G = metric(theta)
    dG = jax.jacfwd(metric)(theta)  # dG[a, b, c] = d_c G_ab
    lower = 0.5 * (jnp.einsum("lji->ijl", dG) + jnp.einsum("lij->ijl", dG) - dG)  # [i, j, l]
    return np.asarray(jnp.einsum("kl,ijl->kij", jnp.linalg.inv(G), lower))


def check_christoffel_derivation(
    fn: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(C, theta)`` = the Christoffel symbols of :math:`\mathbf G(\theta) = \mathrm{diag}(e^{2(C\theta)_1}, \dots, e^{2(C\theta)_d})`.

    A derivation the chapter leaves out (it computes Christoffel symbols with automatic
    differentiation only): for this diagonal metric, :math:`\Gamma^k_{ij}` in closed form.  The check
    compares ``fn(C, theta)[k, i, j]`` with :math:`\Gamma^k_{ij}` computed from the definition with
    dense ``jax.jacfwd`` derivatives of the metric, at random :math:`C` and :math:`\theta` of its seed.
    ``mg.christoffel_symbols`` is blocked when the grader runs the notebook.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(C, theta)`` with ``C`` of shape ``(d, d)`` and ``theta`` of
        shape ``(d,)``; it returns ``gamma`` of shape ``(d, d, d)`` with ``gamma[k, i, j]`` = :math:`\Gamma^k_{ij}`.
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
    >>> assignments.check_christoffel_derivation(lambda C, theta: jnp.zeros((3, 3, 3))).passed
    FAIL christoffel_derivation: ...
    False

    References
    ----------
    Kristiadi, Dangel & Hennig (2023) (Christoffel symbols of the Levi-Civita connection).
    Assignment of chapter 4.
    """

    def body() -> str:
        rng = _rng(43)
        for d in (2, 3, 3):
            C = jnp.asarray(rng.normal(size=(d, d)) * 0.7)
            theta = jnp.asarray(rng.normal(size=d) * 0.5)
            metric = lambda t, C=C: jnp.diag(jnp.exp(2.0 * (C @ t)))
            want = _christoffel_from_definition(metric, theta)
            got = fn(C, theta)
            G = np.asarray(metric(theta))
            dG = np.asarray(jax.jacfwd(metric)(theta))
            plus_last = np.einsum(
                "kl,ijl->kij",
                np.linalg.inv(G),
                0.5 * (np.einsum("lji->ijl", dG) + np.einsum("lij->ijl", dG) + dG),
            )
            mistakes = [
                (np.zeros_like(want), "the metric changes from point to point, so its Christoffel symbols are not "
                 "zero: Gamma = 0 holds only for a constant metric."),
                (2.0 * want, "a factor 2 too large: Gamma^k_ij = 1/2 G^{kl}(d_i G_lj + d_j G_li - d_l G_ij)."),
                (plus_last, "the last term has the wrong sign: - d_l G_ij, not + d_l G_ij."),
                (np.transpose(want, (1, 2, 0)), "the index order: gamma[k, i, j] = Gamma^k_ij, the upper "
                 "index first (as mg.christoffel_symbols returns it)."),
                (np.transpose(want, (2, 0, 1)), "the index order: gamma[k, i, j] = Gamma^k_ij, the upper "
                 "index first (as mg.christoffel_symbols returns it)."),
            ]
            _close_or_name(
                got,
                want,
                f"gamma for d = {d}",
                "For a diagonal metric only G_kk = exp(2 (C theta)_k) is non-zero, and d_i G_kk = 2 C_ki G_kk.",
                mistakes,
            )
        return "the Christoffel symbols of the diagonal exponential metric are right."

    return _run("christoffel_derivation", body, time_limit)
