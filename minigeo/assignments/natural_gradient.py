"""Assignment 3 (chapter 3): the natural gradient in overparametrized systems."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..natgrad import moore_penrose_inverse, natural_parameter_gradient, span_projection
from ._kit import CheckReport, _as_array, _close, _close_or_name, _Draws, _Fail, _rng, _run

#: Cut-off for the reference pseudo-inverses: the random instances below have nonzero eigenvalues of
#: G far above it and round-off "zero" eigenvalues near 1e-16 of the largest, far below it.
_RCOND = 1e-10


def _instance(draw: _Draws, n: int, d: int, rank: int | None = None):
    """A Jacobian J (n x d, of the given rank, generic), an SPD output metric g and a covector dL."""
    J = draw(n, d) if rank is None else draw(n, rank) @ draw(rank, d)
    M = draw(n, n)
    return J, M @ M.T + 0.5 * np.eye(n), draw(n)


def _invertible(draw: _Draws, d: int) -> np.ndarray:
    """A generic invertible d x d matrix near the identity, as W in chapter 3, Sec. 3.2."""
    return np.eye(d) + 0.5 * draw(d, d) / d**0.5


def _close_to(got, candidates, tol: float = 1e-6) -> bool:
    """Whether ``got`` is (relatively) close to one of ``candidates``: a diagnosis, not a verdict."""
    got = np.asarray(got)
    for c in candidates:
        c = np.asarray(c)
        if got.shape == c.shape and np.linalg.norm(got - c) <= tol * max(np.linalg.norm(c), 1e-300):
            return True
    return False


def _jumps(fn: Callable, y: np.ndarray, perturbed: tuple) -> bool:
    """Whether ``fn`` at slightly perturbed inputs returns something far from ``y``: a diagnosis
    of inverting a singular matrix (an answer that fails later anyway), never a verdict on its own."""
    try:
        y2 = np.asarray(fn(*(jnp.asarray(a) for a in perturbed)))
    except Exception:
        return False
    return y2.shape == y.shape and not np.linalg.norm(y2 - y) <= 1e-3 * np.linalg.norm(y)


def check_function_space_natural_gradient(
    fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(J, g, dL)`` = :math:`\mathbf G^+\nabla_\xi\mathcal L`, computed through the N x N system.

    For a Jacobian :math:`\mathbf J` (N x d) of full row rank N < d, an output metric :math:`g` and the
    output covector :math:`d\mathcal L`, the Gram matrix :math:`\mathbf G = \mathbf J^\top g\mathbf J` is
    singular and the natural parameter gradient is

    .. math:: \mathbf G^+\nabla_\xi\mathcal L = \mathbf J^\top(\mathbf J\mathbf J^\top)^{-1}g^{-1}d\mathcal L,
        \qquad \nabla_\xi\mathcal L = \mathbf J^\top d\mathcal L.

    The check asks that the model step :math:`\mathbf J y` be the ambient gradient :math:`g^{-1}d\mathcal L`
    (Theorem 1, the span of the coordinate vectors being all of :math:`\mathbb R^N`) and compares
    :math:`y` with :func:`minigeo.natural_parameter_gradient` of the d x d Gram matrix.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(J, g, dL)``; it returns the ``(d,)`` natural parameter
        gradient for an ``(N, d)`` Jacobian, an ``(N, N)`` metric and an ``(N,)`` covector.
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
    >>> step = lambda J, g, dL: J.T @ jnp.linalg.solve(J @ J.T, jnp.linalg.solve(g, dL))
    >>> assignments.check_function_space_natural_gradient(step).passed
    PASS function_space_natural_gradient: ...
    True

    References
    ----------
    van Oostrum, Müller & Ay (2023), Def. 3, eq. (7) and Theorem 1, eq. (8). Assignment of chapter 3.
    """

    def body() -> str:
        draw = _Draws(30)
        for n, d in [(4, 9)] * 3:  # one shape: compiled once, shared with the other checks
            J, g, dL = _instance(draw, n, d)
            grad = J.T @ dL
            want = np.asarray(natural_parameter_gradient(jnp.asarray(J.T @ g @ J), jnp.asarray(grad), _RCOND))
            v = np.linalg.solve(g, dL)  # the ambient gradient g^{-1} dL
            y = _as_array(
                fn(jnp.asarray(J), jnp.asarray(g), jnp.asarray(dL)),
                (d,),
                "the natural parameter gradient y",
                "y is a step in parameter space (d entries): solve the N x N system (J J^T) u = g^{-1} dL, "
                "then map u back with J^T (a missing transpose?). G = J^T g J is singular (rank N < d): "
                "never invert it.",
            )
            model = J @ y
            what = f"the model step J y (N = {n}, d = {d})"
            try:
                _close(model, v, what, "")
            except _Fail:  # name the likely mistake
                if _close_to(model, [dL]):
                    hint = (
                        "J y = dL: you left out the metric. The right-hand side of the N x N system is "
                        "g^{-1} dL."
                    )
                elif _close_to(model, [g @ dL]):
                    hint = "J y = g dL: the metric turns the covector dL into a vector with g^{-1}, not g."
                elif _jumps(fn, y, (J + 1e-9 * draw(n, d), g, dL)):
                    hint = (
                        "A change of J by 1e-9 changes your y completely: you invert the singular d x d "
                        "matrix G = J^T g J (rank N < d), and what comes back is round-off. Solve the N x N "
                        "system (J J^T) u = g^{-1} dL instead."
                    )
                else:
                    hint = (
                        "On the model the step must be the ambient gradient v = g^{-1} dL (Theorem 1: J "
                        "has full row rank, so the coordinate vectors span all of R^N). The metric enters "
                        "once, as g^{-1} dL on the right of (J J^T) u = g^{-1} dL; damping (G + lambda I) "
                        "shortens the step by lambda / (sigma_k + lambda) and is not the Moore-Penrose step."
                    )
                _close(model, v, what, hint)
            _close(
                y,
                want,
                f"y (N = {n}, d = {d})",
                "Right on the model, but not the Moore-Penrose step: y must lie in the row space of J "
                "(y = J^T u, orthogonal to ker J), which makes it the solution of G y = grad of smallest "
                "norm. Another solution adds a kernel component.",
            )
        return (
            "J^T (J J^T)^-1 g^-1 dL matches G^+ grad (d x d) and moves the model by g^-1 dL on 3 instances."
        )

    return _run("function_space_natural_gradient", body, time_limit)


def check_span_projection(
    fn: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(J, g)`` = :math:`\Pi_\xi = \mathbf J\mathbf G^+\mathbf J^\top g`, the projection of Theorem 1.

    :math:`\Pi_\xi` is the :math:`g`-orthogonal projection of :math:`\mathbb R^N` onto the span of the
    coordinate vectors :math:`\partial_i` (the columns of :math:`\mathbf J`), for a Jacobian of rank
    below both N and d.  The check asks :math:`\Pi\mathbf J = \mathbf J`, range in
    :math:`\operatorname{span}\{\partial_i\}`, :math:`\Pi^2 = \Pi`, :math:`g\Pi` symmetric, Theorem 1
    (:math:`\Pi g^{-1}d\mathcal L = \mathbf J\mathbf G^+\nabla_\xi\mathcal L`) and agreement with
    :func:`minigeo.span_projection`, and that :math:`\Pi` does not change when :math:`\mathbf J` becomes
    :math:`\mathbf J\mathbf W` for an invertible :math:`\mathbf W` (a linear reparametrization).

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(J, g)``; it returns the ``(N, N)`` projection matrix for an
        ``(N, d)`` Jacobian and an ``(N, N)`` metric.
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
    >>> proj = lambda J, g: J @ jnp.linalg.pinv(J.T @ g @ J, hermitian=True) @ J.T @ g
    >>> assignments.check_span_projection(proj).passed
    PASS span_projection: ...
    True

    References
    ----------
    van Oostrum, Müller & Ay (2023), Theorem 1, eq. (8), and Lemma 1, eq. (10). Assignment of chapter 3.
    """

    def body() -> str:
        draw = _Draws(31)
        for n, d, r in [(6, 9, 3)] * 3:  # rank below N and d: a proper subspace, a singular G
            J, g, dL = _instance(draw, n, d, rank=r)
            P = _as_array(
                fn(jnp.asarray(J), jnp.asarray(g)),
                (n, n),
                f"the projection (N = {n}, d = {d}, rank {r})",
                "Pi acts on tangent vectors of Z = R^N, so it is N x N: Pi = J G^+ J^T g with G = J^T g J "
                "(the d x d matrix G^+ G projects in parameter space instead). G is singular: use its "
                "Moore-Penrose inverse, never its inverse.",
            )
            _close(
                P @ J,
                J,
                "Pi J",
                "Pi must fix every coordinate vector (the columns of J): Pi J = J. Build it as "
                "J G^+ J^T g with the Moore-Penrose inverse of G = J^T g J; g goes on the right "
                "(g J G^+ J^T is the transpose of Pi), and without g it fixes nothing.",
            )
            U = np.linalg.svd(J)[0][:, :r]  # an orthonormal basis of span{d_i}
            _close(
                P - U @ (U.T @ P),
                np.zeros((n, n)),
                "the part of Pi's range outside span{d_i}",
                "Pi must map into the span of the coordinate vectors. Here rank J < N, so Pi is not the "
                "identity: the natural gradient on the model is the ambient gradient only when the "
                "coordinate vectors span all of Z.",
            )
            _close(P @ P, P, "Pi Pi", "A projection is idempotent: Pi Pi = Pi.")
            _close(
                (g @ P).T,
                g @ P,
                "(g Pi)^T",
                "Pi is orthogonal for the metric g of Z, so g Pi must be symmetric (Pi is g-self-adjoint). "
                "J J^+ = J (J^T J)^+ J^T is the Euclidean projection: orthogonal for the wrong metric.",
            )
            v = np.linalg.solve(g, dL)  # the ambient gradient
            y = natural_parameter_gradient(jnp.asarray(J.T @ g @ J), jnp.asarray(J.T @ dL), _RCOND)
            hint = "Pi = J G^+ J^T g (Theorem 1, eq. (8))."
            _close(P @ v, J @ np.asarray(y), "Pi g^-1 dL against the pushforward J G^+ grad", hint)
            _close(P @ v, span_projection(jnp.asarray(J), jnp.asarray(g), jnp.asarray(v)), "Pi v", hint)
            JW = J @ _invertible(draw, d)
            _close(
                _as_array(fn(jnp.asarray(JW), jnp.asarray(g)), (n, n), "the projection for J W", hint),
                P,
                "Pi for the reparametrized Jacobian J W",
                "Pi depends only on the span of the coordinate vectors: xi = W theta turns J into J W, "
                "which spans the same subspace, so Pi must not change (the proof of Theorem 2).",
            )
        return (
            "J G^+ J^T g is the g-orthogonal projection onto span{d_i}, gives Theorem 1 and is the same "
            "for J W, on 3 instances."
        )

    return _run("span_projection", body, time_limit)


def check_generalized_inverse(
    fn: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(G, Z)`` = :math:`\mathbf A_Z = \mathbf G^+ + (\mathbf I - \mathbf G^+\mathbf G)\mathbf Z`.

    For a singular Gram matrix :math:`\mathbf G = \mathbf J^\top g\mathbf J` and a random d x d matrix
    :math:`\mathbf Z`, the check asks that :math:`\mathbf A_Z` move the model like the Moore-Penrose
    inverse (:math:`\mathbf J\mathbf A_Z\nabla_\xi\mathcal L = \mathbf J\mathbf G^+\nabla_\xi\mathcal L`),
    be a generalized inverse (:math:`\mathbf G\mathbf A_Z\mathbf G = \mathbf G`, Def. 2), give a
    *different* parameter step, and equal the closed form (with :func:`minigeo.moore_penrose_inverse`).

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(G, Z)``; it returns the ``(d, d)`` matrix
        :math:`\mathbf A_Z` for a symmetric singular ``(d, d)`` Gram matrix and a ``(d, d)`` matrix ``Z``.
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
    >>> def a_z(G, Z):
    ...     Gp = jnp.linalg.pinv(G, hermitian=True)
    ...     return Gp + (jnp.eye(G.shape[0]) - Gp @ G) @ Z
    >>> assignments.check_generalized_inverse(a_z).passed
    PASS generalized_inverse: ...
    True

    References
    ----------
    van Oostrum, Müller & Ay (2023), Def. 2, eq. (3) and Theorem 1. Assignment of chapter 3.
    """

    def body() -> str:
        draw = _Draws(32)
        for n, d in [(4, 9)] * 3:
            J, g, dL = _instance(draw, n, d)
            G = J.T @ g @ J
            G = 0.5 * (G + G.T)
            Z = draw(d, d)
            grad = J.T @ dL
            Gp = np.asarray(moore_penrose_inverse(jnp.asarray(G), rcond=_RCOND))
            A = _as_array(
                fn(jnp.asarray(G), jnp.asarray(Z)),
                (d, d),
                f"A_Z (d = {d})",
                "A_Z is a d x d matrix: A_Z = G^+ + (I - G^+ G) Z.",
            )
            y_mp, y = Gp @ grad, A @ grad
            _close(
                J @ y,
                J @ y_mp,
                "the model step J A_Z grad",
                "Every generalized inverse moves the model like G^+ (J A G = J, Sec. 3.2); yours does not, "
                "so it is not one. The term added to G^+ must lie in ker G: (I - G^+ G) Z, not Z or G^+ G Z.",
            )
            _close(
                G @ A @ G,
                G,
                "G A_Z G",
                "A generalized inverse satisfies G A G = G (Def. 2): add to G^+ only a term in ker G, "
                "(I - G^+ G) Z.",
            )
            if np.linalg.norm(y - y_mp) < 1e-3 * np.linalg.norm(y_mp):
                raise _Fail(
                    "A_Z grad is the Moore-Penrose step itself, so this shows nothing new: the term you add "
                    "vanishes on grad (grad lies in range G). Multiply Z from the left by the kernel "
                    "projector, (I - G^+ G) Z, so that the extra part of the step is a nonzero vector in "
                    "ker G (Z (I - G^+ G) kills grad)."
                )
            _close(
                A,
                Gp + (np.eye(d) - Gp @ G) @ Z,
                f"A_Z (d = {d})",
                "A_Z = G^+ + (I - G^+ G) Z, with the Z you are given (not Z^T).",
            )
        return (
            "G^+ + (I - G^+ G) Z is a generalized inverse: another parameter step, the same model step, "
            "on 3 instances."
        )

    return _run("generalized_inverse", body, time_limit)


def _weighted_min_norm(G: np.ndarray, b: np.ndarray, W_inv: np.ndarray) -> np.ndarray:
    """argmin |W_inv y| subject to G y = b, by least squares over y_MP + ker G (independent of A_W)."""
    evals, evecs = np.linalg.eigh(G)
    K = evecs[:, evals <= _RCOND * evals[-1]]  # a basis of ker G
    y0 = np.linalg.pinv(G, rcond=_RCOND, hermitian=True) @ b
    c = np.linalg.lstsq(W_inv @ K, -W_inv @ y0, rcond=None)[0]
    return y0 + K @ c


def check_reparametrized_mp_step(
    fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(G, grad, W)`` = the Moore-Penrose step computed in coordinates :math:`\theta`, :math:`\xi = \mathbf W\theta`.

    .. math:: \mathbf W(\mathbf W^\top\mathbf G\mathbf W)^+\mathbf W^\top\nabla_\xi\mathcal L,

    the Moore-Penrose natural parameter gradient of :math:`\theta` written back in :math:`\xi`.  For a
    singular :math:`\mathbf G` and a generic invertible :math:`\mathbf W` the check asks for the same
    model step as
    :math:`\mathbf G^+\nabla_\xi\mathcal L` (Theorem 2), a different parameter step (Def. 6 fails), the
    solution of :math:`\mathbf G y = \nabla_\xi\mathcal L` of smallest :math:`\|\mathbf W^{-1}y\|`
    (Remark 2, computed independently by least squares), and for an orthogonal :math:`\mathbf W` the
    Moore-Penrose step itself.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(G, grad, W)``; it returns the ``(d,)`` step in
        :math:`\xi`-coordinates for a singular ``(d, d)`` Gram matrix, a ``(d,)`` gradient
        :math:`\nabla_\xi\mathcal L` and an invertible ``(d, d)`` matrix ``W``.
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
    >>> pinv = lambda M: jnp.linalg.pinv(M, hermitian=True)
    >>> step = lambda G, grad, W: W @ pinv(W.T @ G @ W) @ W.T @ grad
    >>> assignments.check_reparametrized_mp_step(step).passed
    PASS reparametrized_mp_step: ...
    True

    References
    ----------
    van Oostrum, Müller & Ay (2023), Theorem 2, Def. 6 and Remark 2, eq. (33). Assignment of chapter 3.
    """

    def body() -> str:
        draw = _Draws(33)
        for n, d in [(4, 9)] * 3:
            J, g, dL = _instance(draw, n, d)
            G = J.T @ g @ J
            G = 0.5 * (G + G.T)
            grad = J.T @ dL
            y_mp = np.asarray(moore_penrose_inverse(jnp.asarray(G), rcond=_RCOND)) @ grad
            W = _invertible(draw, d)
            shape_hint = "The step is a vector of xi-coordinates with d entries."
            y = _as_array(fn(jnp.asarray(G), jnp.asarray(grad), jnp.asarray(W)), (d,), "the step", shape_hint)
            _close(
                J @ y,
                J @ y_mp,
                "the model step J y",
                "Theorem 2: on the model the step must not depend on the coordinates. Transform as in "
                "chapter 1: the gradient is a covector (grad_theta = W^T grad_xi), the metric becomes "
                "G_theta = W^T G W, and the theta-step is a vector, mapped back to xi by W "
                "(not W^-1 or W^T).",
            )
            if np.linalg.norm(y - y_mp) < 1e-3 * np.linalg.norm(y_mp):
                raise _Fail(
                    "your step is the Moore-Penrose step of xi itself. Computed in theta and mapped back, "
                    "it is another solution of G y = grad (Def. 6 fails when G is singular): take the "
                    "pseudo-inverse of G_theta = W^T G W, not of G."
                )
            _close(
                y,
                _weighted_min_norm(G, grad, np.linalg.inv(W)),
                f"the step (d = {d})",
                "Remark 2: the theta-step mapped back is the solution of G y = grad of smallest |W^-1 y|, "
                "y = W (W^T G W)^+ W^T grad.",
            )
            Q = np.linalg.qr(draw(d, d))[0]
            _close(
                _as_array(fn(jnp.asarray(G), jnp.asarray(grad), jnp.asarray(Q)), (d,), "the step", shape_hint),
                y_mp,
                "the step for an orthogonal W",
                "For an orthogonal W the Moore-Penrose step is the same in both coordinates "
                "(W W^T = I maps ker G into itself, Sec. 3.6): y = W (W^T G W)^+ W^T grad.",
            )
        return (
            "W (W^T G W)^+ W^T grad: the same model step, another parameter step (Remark 2), and G^+ grad "
            "for orthogonal W, on 3 instances."
        )

    return _run("reparametrized_mp_step", body, time_limit)


def _factorization_jacobian_rank(U: np.ndarray, V: np.ndarray) -> int:
    """The rank of the Jacobian of (U, V) -> U V^T, from its columns on the basis E_ij of each factor."""
    cols = []
    for k in range(U.size):
        E = np.zeros(U.shape)
        E.flat[k] = 1.0
        cols.append((E @ V.T).ravel())
    for k in range(V.size):
        E = np.zeros(V.shape)
        E.flat[k] = 1.0
        cols.append((U @ E.T).ravel())
    return int(np.linalg.matrix_rank(np.stack(cols, axis=1)))


def check_gram_rank(
    fn: Callable[[int, int, int], int],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(m, n, k)`` = the rank of the Gram matrix of the factorization :math:`\phi(U, V) = UV^\top`.

    :math:`U\in\mathbb R^{m\times k}`, :math:`V\in\mathbb R^{n\times k}` with :math:`k\le\min(m, n)`, at a
    generic point (both factors of full column rank), with the Euclidean metric on
    :math:`\mathbb R^{m\times n}`.  A count the chapter does not print: the check compares ``fn``'s
    number with the numerical rank of the Jacobian at random factors of its seed.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(m, n, k)`` with integers; it returns the rank, a number.
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
    >>> assignments.check_gram_rank(lambda m, n, k: k * (m + n)).passed
    FAIL gram_rank: ...
    False

    References
    ----------
    van Oostrum, Müller & Ay (2023), *Invariance properties of the natural gradient in
    overparametrised systems* (singular Gram matrices, proper points). Assignment of chapter 3.
    """

    def body() -> str:
        rng = _rng(31)
        cases = [(5, 5, 3), (4, 3, 2), (3, 6, 1), (2, 4, 2), (6, 4, 3)]
        for _ in range(3):
            m, n = int(rng.integers(2, 7)), int(rng.integers(2, 7))
            cases.append((m, n, int(rng.integers(1, min(m, n) + 1))))
        for m, n, k in cases:
            truth = _factorization_jacobian_rank(rng.normal(size=(m, k)), rng.normal(size=(n, k)))
            got = fn(m, n, k)
            mistakes = [
                (
                    k * (m + n),
                    "that is the number of parameters d: G is singular, because (U A^-1, V A^T) gives the "
                    "same U V^T for every invertible k x k matrix A.",
                ),
                (m * n, "that is N, the rank when J has full row rank (task 3.1); here the model is a set of "
                 "rank-k matrices, smaller than R^(m x n)."),
                (
                    k * (m + n) - k,
                    "rescaling each column (k directions) is not the only symmetry: any invertible k x k "
                    "matrix A mixes the columns of U and V.",
                ),
            ]
            _close_or_name(
                got,
                truth,
                f"the rank of G for m = {m}, n = {n}, k = {k}",
                "rank G = d - dim ker J: which changes (dU, dV) leave U V^T fixed to first order?",
                mistakes,
            )
        return "the rank of the Gram matrix of U V^T is right for every shape."

    return _run("gram_rank", body, time_limit)
