"""Assignment 6 (chapter 6): the GL(h) quotient."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..quotient import gl_metric, horizontal_projection, vertical_vector
from ._kit import CheckReport, _close, _close_or_name, _key, _rng, _run


def _pair_cases(key: jax.Array, n: int = 3) -> list[tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
    out = []
    for k in jax.random.split(key, n):
        kG, kH, ka, kb = jax.random.split(k, 4)
        out.append(
            (
                jax.random.normal(kG, (5, 3)),
                jax.random.normal(kH, (4, 3)),
                jax.random.normal(ka, (5, 3)),
                jax.random.normal(kb, (4, 3)),
            )
        )
    return out


def check_vertical_vector(
    fn: Callable[[jax.Array, jax.Array, jax.Array], tuple],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(G, H, Omega)`` = :math:`(-G\Omega, H\Omega^\top)`, the velocity of the orbit through ``(G, H)``.

    Checks the value and that :math:`GH^\top` does not move to first order along it:
    :math:`\xi_G H^\top + G\xi_H^\top = 0`.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(G, H, Omega)``; it returns the pair ``(xi_G, xi_H)``.
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
    >>> assignments.check_vertical_vector(lambda G, H, W: (-G @ W, H @ W.T)).passed
    PASS vertical_vector: ...
    True

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 3.3 and App. B.3. Assignment of chapter 6.
    """

    def body() -> str:
        for i, (G, H, _, _) in enumerate(_pair_cases(_key(6))):
            Om = jax.random.normal(_key(60 + i), (3, 3))
            xG, xH = fn(G, H, Om)
            _close(
                xG @ H.T + G @ xH.T,
                jnp.zeros((5, 4)),
                "the change of G H^T along your vector",
                "Along the orbit (G e^{-t Omega}, H e^{t Omega^T}) the product G H^T is constant.",
            )
            want = vertical_vector((G, H), Om)
            _close(xG, want[0], "xi_G", "xi_G = -G Omega.")
            _close(xH, want[1], "xi_H", "xi_H = H Omega^T.")
        return "(-G Omega, H Omega^T) is correct and leaves G H^T fixed."

    return _run("vertical_vector", body, time_limit)


def check_quotient_metric(
    fn: Callable[[jax.Array, jax.Array, tuple, tuple], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(G, H, eta, zeta)`` = metric (15), :math:`\mathrm{tr}((G^\top G)^{-1}\eta_G^\top\zeta_G) + \mathrm{tr}((H^\top H)^{-1}\eta_H^\top\zeta_H)`.

    Checks the value against :func:`minigeo.quotient.gl_metric` and its GL(h) invariance: moving the point to
    :math:`(GA^{-1}, HA^\top)` and the vectors with it leaves the inner product unchanged.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(G, H, eta, zeta)``; it returns the scalar inner product of the pairs ``eta`` and ``zeta`` at ``(G, H)``.
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
    >>> from minigeo.quotient import gl_metric
    >>> assignments.check_quotient_metric(lambda G, H, e, z: gl_metric((G, H), e, z)).passed
    PASS quotient metric (15): ...
    True

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (15). Assignment of chapter 6.
    """

    def body() -> str:
        for i, (G, H, a, b) in enumerate(_pair_cases(_key(7))):
            k1, k2 = jax.random.split(_key(70 + i))
            eta, zeta = (a, b), (jax.random.normal(k1, (5, 3)), jax.random.normal(k2, (4, 3)))
            val = fn(G, H, eta, zeta)
            _close(
                val,
                gl_metric((G, H), eta, zeta),
                "the inner product",
                "Use metric (15) with P = G^T G and Q = H^T H.",
            )
            A = jax.random.normal(_key(75 + i), (3, 3)) + 3.0 * jnp.eye(3)
            Ai = jnp.linalg.inv(A)
            moved = fn(G @ Ai, H @ A.T, (eta[0] @ Ai, eta[1] @ A.T), (zeta[0] @ Ai, zeta[1] @ A.T))
            _close(
                moved, val, "the inner product at a GL(h)-equivalent point", "Metric (15) is GL(h)-invariant."
            )
        return "metric (15) is correct and GL(h)-invariant."

    return _run("quotient metric (15)", body, time_limit)


def check_horizontal_projection(
    fn: Callable[[jax.Array, jax.Array, tuple], tuple],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(G, H, xi)``: the metric-(15)-orthogonal projection of ``xi = (xi_G, xi_H)`` onto the horizontal space.

    Checks, on random points and vectors: the result matches :func:`minigeo.quotient.horizontal_projection`;
    vertical vectors are sent to zero; projecting twice changes nothing; the removed part is
    vertical; and the result is orthogonal, in metric (15), to every vertical vector.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(G, H, xi)``; it returns the projected pair.
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
    >>> from minigeo.quotient import horizontal_projection
    >>> project = lambda G, H, xi: horizontal_projection((G, H), xi)
    >>> assignments.check_horizontal_projection(project).passed
    PASS horizontal_projection: ...
    True

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.2 (horizontal space, Sylvester equation)
    and App. B.3. Assignment of chapter 6.
    """

    def body() -> str:
        for i, (G, H, a, b) in enumerate(_pair_cases(_key(8))):
            xi = (a, b)
            got = fn(G, H, xi)
            hint_orth = (
                "The projection must be orthogonal in metric (15), not in the Euclidean inner product."
            )
            for j in range(3):
                E = jnp.zeros((3, 3)).at[j, (j + 1) % 3].set(1.0)
                _close(
                    gl_metric((G, H), got, vertical_vector((G, H), E)),
                    0.0,
                    "the metric-(15) inner product of your result with a vertical vector",
                    hint_orth,
                )
            ver = vertical_vector((G, H), jax.random.normal(_key(80 + i), (3, 3)))
            pv = fn(G, H, ver)
            for side, z in zip(("G", "H"), pv):
                _close(
                    z,
                    jnp.zeros_like(z),
                    f"the projection of a vertical vector ({side} side)",
                    "Vertical vectors must go to zero.",
                )
            again = fn(G, H, got)
            _close(again[0], got[0], "projecting twice (G side)", "A projection is idempotent.")
            want = horizontal_projection((G, H), xi)
            _close(got[0], want[0], "xi_G", hint_orth)
            _close(got[1], want[1], "xi_H", hint_orth)
        return "matches minigeo; kills vertical vectors; idempotent; metric-orthogonal to the orbit."

    return _run("horizontal_projection", body, time_limit)


def _vertical_dimension_truth(G: np.ndarray, H: np.ndarray) -> int:
    """The rank of Omega -> (-G Omega, H Omega^T), from its matrix on the basis E_ij of R^{h x h}."""
    h = G.shape[1]
    columns = []
    for k in range(h * h):
        E = np.zeros((h, h))
        E.flat[k] = 1.0
        columns.append(np.concatenate([(-G @ E).ravel(), (H @ E.T).ravel()]))
    return int(np.linalg.matrix_rank(np.stack(columns, axis=1)))


def check_vertical_dimension(
    fn: Callable[[int, int, int], int],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(h, rank_G, rank_H)`` = the vertical space's dimension at a pair ``(G, H)`` of those ranks.

    A derivation the chapter leaves out: at a pair with full column rank the vertical space has
    dimension :math:`h^2`; when both :math:`G` and :math:`H` are rank-deficient, some
    :math:`\Omega` move neither.  The check draws random pairs :math:`G\in\mathbb R^{5\times h}`,
    :math:`H\in\mathbb R^{4\times h}` of the given ranks and compares ``fn``'s prediction with the
    rank of :math:`\Omega\mapsto(-G\Omega, H\Omega^\top)` computed from its matrix.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(h, rank_G, rank_H)`` with integers; it returns the
        dimension, a number.
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
    >>> assignments.check_vertical_dimension(lambda h, r, s: h * h).passed
    FAIL vertical_dimension: ...
    False

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 3.3 (the orbits of GL(h)). Assignment of chapter 6.
    """

    def body() -> str:
        rng = _rng(9)
        cases = [(3, 3, 1), (3, 2, 2), (4, 1, 3), (4, 2, 2), (2, 1, 1)]
        for _ in range(3):  # and three drawn at random
            h = int(rng.integers(2, 5))
            cases.append((h, int(rng.integers(1, h + 1)), int(rng.integers(1, min(h, 4) + 1))))
        for h, r_G, r_H in cases:
            G = rng.normal(size=(5, r_G)) @ rng.normal(size=(r_G, h))
            H = rng.normal(size=(4, r_H)) @ rng.normal(size=(r_H, h))
            truth = _vertical_dimension_truth(G, H)
            got = fn(h, r_G, r_H)
            what = f"the vertical dimension for h = {h}, rank G = {r_G}, rank H = {r_H}"
            mistakes = [
                (
                    h * h,
                    "h^2 is the dimension of GL(h), and of the vertical space only when G or H has full "
                    "column rank: which Omega give G Omega = 0 and H Omega^T = 0 at once?",
                ),
                (
                    r_G * r_H,
                    "rank G x rank H is not it: count the Omega that move neither G nor H (G Omega = 0 and "
                    "H Omega^T = 0) and subtract them from h^2.",
                ),
                (
                    h * h - (h - r_G) - (h - r_H),
                    "the Omega with G Omega = 0 and H Omega^T = 0 are not a sum of the two kernels: their "
                    "columns lie in ker G and their rows in ker H.",
                ),
            ]
            _close_or_name(
                got,
                truth,
                what,
                "The vertical space is the image of Omega -> (-G Omega, H Omega^T): h^2 minus the dimension "
                "of its kernel.",
                mistakes,
            )
        return "the vertical dimension is right for full-rank and rank-deficient pairs."

    return _run("vertical_dimension", body, time_limit)
