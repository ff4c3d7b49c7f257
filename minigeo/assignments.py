r"""Automatic checks for the course's assignments (floor 4; imported as ``minigeo.assignments``).

A student fills in a function in an assignment notebook and passes it to a ``check_*`` function
here.  The check calls it on random points, random reparametrizations and random group elements,
compares it with minigeo's reference implementation and with the invariances the chapter proves,
prints one line per check (``PASS`` or ``FAIL`` with a hint), and returns a :class:`CheckReport`.
A student's function that still raises ``NotImplementedError`` fails with the message
"not implemented yet", and any other exception is reported in one line instead of a traceback, so a
check cell never stops the notebook.

Checks run in float64 (inside ``jax.enable_x64``) so that a correct answer passes with tolerance
``1e-8`` whatever the notebook's default precision.  A complex answer is compared with its imaginary
part (a right real part plus ``5j`` fails).  Every check has a time limit (its ``time_limit``
argument in seconds, by default ``minigeo.assignments.TIME_LIMIT`` = 120): a student's function
that loops forever fails with "timed out after N s" instead of hanging the notebook.  The limit
interrupts Python code (a ``SIGALRM`` timer on the main thread on POSIX; elsewhere a watchdog
thread, which leaves the runaway function running in the background).

The assignments live in the repository's ``assignments/`` folder; the lecturers' guide in the book
explains how to adapt them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import reparam
from .coords import (
    Reparametrization,
    transform_covector,
    transform_endomorphism,
    transform_metric,
    transform_vector,
)
from .curvature import christoffel_symbols, riemannian_hessian
from .metrics import dense as dense_metric
from .quotient import gl_metric, horizontal_projection, vertical_vector

__all__ = [
    "CheckReport",
    "check_transform_vector",
    "check_transform_covector",
    "check_natural_gradient_step",
    "check_hessian_endomorphism",
    "check_invariant_trace",
    "check_riemannian_hessian",
    "check_vertical_vector",
    "check_quotient_metric",
    "check_horizontal_projection",
]

NOT_IMPLEMENTED = "not implemented yet: replace the `raise NotImplementedError` line with your code"

#: Default time limit of one ``check_*`` call, in seconds (the correct answers take a few seconds,
#: mostly compilation).  Pass ``time_limit=`` to a check, or set this, to change it.
TIME_LIMIT: float = 120.0


class CheckReport(NamedTuple):
    """The outcome of one ``check_*`` call: the task's name, whether it passed, and the message printed.

    Attributes
    ----------
    task : str
        The task's name.
    passed : bool
        Whether every check passed.
    message : str
        The line printed (``PASS ...`` or ``FAIL ...`` with a hint).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import assignments
    >>> trace = lambda H, G: jnp.trace(jnp.linalg.solve(G, H))
    >>> report = assignments.check_invariant_trace(trace)
    PASS invariant trace tr(G^-1 H): ...
    >>> report.passed
    True

    References
    ----------
    No formula from the source papers (the report of an assignment check). Chapters 1, 4 and 6.
    """

    task: str
    passed: bool
    message: str


class _Fail(Exception):
    """A check's verdict that the student's answer is wrong (message = the hint)."""


@contextlib.contextmanager
def _float64() -> Iterator[None]:
    ctx = getattr(jax, "enable_x64", None)
    if ctx is None:  # older jax
        from jax.experimental import enable_x64 as ctx
    with ctx(True):
        yield


def _close(got, want, what: str, hint: str, tol: float = 1e-8) -> None:
    answer = got
    try:
        got = np.asarray(answer)
        if not (np.issubdtype(got.dtype, np.number) or np.issubdtype(got.dtype, np.bool_)):
            raise TypeError
    except (TypeError, ValueError):
        raise _Fail(f"{what} is not an array of numbers (got {type(answer).__name__}). {hint}") from None
    # complex answers keep their imaginary part: right value + 5j must not pass
    got = got.astype(complex if np.iscomplexobj(got) else float)
    want = np.asarray(want)
    want = want.astype(complex if np.iscomplexobj(want) else float)
    if got.shape != want.shape:
        raise _Fail(f"{what} has shape {got.shape}, expected {want.shape}. {hint}")
    if not np.all(np.isfinite(got)):
        raise _Fail(f"{what} contains NaN or inf. {hint}")
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    imag = float(np.max(np.abs(got.imag))) if np.iscomplexobj(got) and got.size else 0.0
    if imag > tol * scale and not np.iscomplexobj(want):
        raise _Fail(f"{what} has an imaginary part (up to {imag:.2e}), but the answer is real. {hint}")
    if err > tol * scale:
        raise _Fail(f"{what} is off by {err:.2e} (tolerance {tol * scale:.0e}). {hint}")


class _TimedOut(BaseException):
    """Raised inside a check that ran past its time limit (a BaseException, so that a student's
    ``except Exception`` cannot swallow it)."""


def _call_with_time_limit(body: Callable[[], str], limit: float) -> str:
    """``body()``, interrupted with :class:`_TimedOut` after ``limit`` seconds.

    On the main thread of a POSIX process (a notebook kernel, a script, pytest) a ``SIGALRM`` timer
    interrupts pure-Python loops; a timer that was already running (e.g. pytest-timeout's) is
    restored afterwards.  Elsewhere (Windows, a worker thread) the body runs in a daemon thread that
    is abandoned, still running, when it times out.  A function stuck inside one long compiled call
    is interrupted only when that call returns.
    """
    if limit is None or limit <= 0:
        with _float64():
            return body()
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():

        def _alarm(signum, frame):
            raise _TimedOut()

        start = time.monotonic()
        old_handler = signal.signal(signal.SIGALRM, _alarm)
        old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            with _float64():
                return body()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay > 0:  # give an outer timer back what is left of it
                remaining = max(old_delay - (time.monotonic() - start), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, remaining, old_interval)
    result: dict = {}

    def target() -> None:
        try:
            with _float64():
                result["value"] = body()
        except BaseException as err:  # handed to the calling thread
            result["error"] = err

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise _TimedOut()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _run(task: str, body: Callable[[], str], time_limit: float | None = None) -> CheckReport:
    """Run ``body`` (which raises _Fail or returns a success note) and print a one-line verdict."""
    limit = TIME_LIMIT if time_limit is None else float(time_limit)
    try:
        note = _call_with_time_limit(body, limit)
        report = CheckReport(task, True, f"PASS {task}: {note}")
    except _TimedOut:
        report = CheckReport(
            task,
            False,
            f"FAIL {task}: timed out after {limit:g} s: your function may loop forever (check the loop's "
            "stopping condition), or is far too slow.",
        )
    except _Fail as fail:
        report = CheckReport(task, False, f"FAIL {task}: {fail}")
    except NotImplementedError:
        report = CheckReport(task, False, f"FAIL {task}: {NOT_IMPLEMENTED}.")
    except Exception as err:  # report a student's error in one line instead of a traceback
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        report = CheckReport(task, False, f"FAIL {task}: your function raised {type(err).__name__}: {first}")
    print(report.message)
    return report


def _random_reparametrizations(key: jax.Array) -> list[tuple[str, Reparametrization, jax.Array]]:
    """(name, phi, theta) triples: polar, softplus, a random affine map and a composition."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    A = jax.random.normal(k1, (2, 2)) + 2.0 * jnp.eye(2)
    return [
        ("polar", reparam.polar(), jnp.array([0.7, -1.3])),
        ("softplus", reparam.softplus(), jnp.abs(jax.random.normal(k2, (2,))) + 0.3),
        ("affine", reparam.affine(A, jnp.array([0.5, -1.0])), jax.random.normal(k3, (2,))),
        (
            "softplus then affine",
            reparam.compose(reparam.softplus(), reparam.affine(A)),
            jnp.array([0.4, 1.7]),
        ),
        ("polar (another point)", reparam.polar(), jax.random.normal(k4, (2,)) + jnp.array([2.0, 0.0])),
    ]


def _random_spd(key: jax.Array, d: int) -> jax.Array:
    M = jax.random.normal(key, (d, d))
    return M @ M.T + 0.5 * jnp.eye(d)


# ---------------------------------------------------------------------------------------------
# Chapter 1: vectors, covectors and the gradient step
# ---------------------------------------------------------------------------------------------


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
        for i, (name, phi, theta) in enumerate(_random_reparametrizations(jax.random.PRNGKey(1))):
            v = jax.random.normal(jax.random.PRNGKey(10 + i), (2,))
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
        for i, (name, phi, theta) in enumerate(_random_reparametrizations(jax.random.PRNGKey(2))):
            k1, k2 = jax.random.split(jax.random.PRNGKey(20 + i))
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
        for i, (name, phi, theta) in enumerate(_random_reparametrizations(jax.random.PRNGKey(3))):
            k1, k2 = jax.random.split(jax.random.PRNGKey(30 + i))
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


# ---------------------------------------------------------------------------------------------
# Chapter 4: the Hessian endomorphism and its invariants
# ---------------------------------------------------------------------------------------------


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
        for i, (H, G) in enumerate(_hessian_cases(jax.random.PRNGKey(4))):
            E = fn(H, G)
            _close(
                E,
                jnp.linalg.solve(G, H),
                "E",
                "E = G^{-1} H (solve with G; the order matters: H G^{-1} is wrong).",
            )
            A = jax.random.normal(jax.random.PRNGKey(40 + i), (3, 3)) + 3.0 * jnp.eye(3)
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
        for i, (H, G) in enumerate(_hessian_cases(jax.random.PRNGKey(5))):
            t = fn(H, G)
            _close(
                t,
                jnp.trace(jnp.linalg.solve(G, H)),
                "the trace",
                "The invariant trace is tr(G^{-1} H), not tr(H) (a bilinear form has no coordinate-free trace).",
            )
            A = jax.random.normal(jax.random.PRNGKey(50 + i), (3, 3)) + 3.0 * jnp.eye(3)
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


# ---------------------------------------------------------------------------------------------
# Chapter 6: the GL(h) quotient
# ---------------------------------------------------------------------------------------------


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
        for i, (G, H, _, _) in enumerate(_pair_cases(jax.random.PRNGKey(6))):
            Om = jax.random.normal(jax.random.PRNGKey(60 + i), (3, 3))
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

    Checks the value against :func:`minigeo.gl_metric` and its GL(h) invariance: moving the point to
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
    >>> from minigeo import assignments, gl_metric
    >>> assignments.check_quotient_metric(lambda G, H, e, z: gl_metric((G, H), e, z)).passed
    PASS quotient metric (15): ...
    True

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (15). Assignment of chapter 6.
    """

    def body() -> str:
        for i, (G, H, a, b) in enumerate(_pair_cases(jax.random.PRNGKey(7))):
            k1, k2 = jax.random.split(jax.random.PRNGKey(70 + i))
            eta, zeta = (a, b), (jax.random.normal(k1, (5, 3)), jax.random.normal(k2, (4, 3)))
            val = fn(G, H, eta, zeta)
            _close(
                val,
                gl_metric((G, H), eta, zeta),
                "the inner product",
                "Use metric (15) with P = G^T G and Q = H^T H.",
            )
            A = jax.random.normal(jax.random.PRNGKey(75 + i), (3, 3)) + 3.0 * jnp.eye(3)
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

    Checks, on random points and vectors: the result matches :func:`minigeo.horizontal_projection`;
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
    >>> from minigeo import assignments, horizontal_projection
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
        for i, (G, H, a, b) in enumerate(_pair_cases(jax.random.PRNGKey(8))):
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
            ver = vertical_vector((G, H), jax.random.normal(jax.random.PRNGKey(80 + i), (3, 3)))
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
