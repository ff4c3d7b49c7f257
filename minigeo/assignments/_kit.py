"""The machinery every assignment check shares: reports, float64, tolerances, time limits."""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading
import time
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import reparam
from ..coords import Reparametrization

NOT_IMPLEMENTED = "not implemented yet: replace the `raise NotImplementedError` line with your code"


#: The grader's seed (``assignments/grade.py`` sets a fresh secret one per submission): ``None``
#: draws every check's instances from its fixed seeds, an integer folds it into each of them.
_GRADING_SEED: int | None = None


@contextlib.contextmanager
def grading_seed(seed: int | None) -> Iterator[None]:
    """Draw the checks' random instances from ``seed`` (folded into each check's own seed) inside."""
    global _GRADING_SEED
    old, _GRADING_SEED = _GRADING_SEED, None if seed is None else int(seed) % 2**31
    try:
        yield
    finally:
        _GRADING_SEED = old


def _key(n: int) -> jax.Array:
    """``jax.random.PRNGKey(n)``, with the grader's seed folded in when one is set."""
    key = jax.random.PRNGKey(n)
    return key if _GRADING_SEED is None else jax.random.fold_in(key, _GRADING_SEED)


def _rng(n: int) -> np.random.Generator:
    """``np.random.default_rng(n)``, with the grader's seed mixed in when one is set."""
    return np.random.default_rng(n if _GRADING_SEED is None else [n, _GRADING_SEED])


def _time_limit() -> float:
    """The package-level default ``minigeo.assignments.TIME_LIMIT``, read at every call."""
    return float(importlib.import_module("minigeo.assignments").TIME_LIMIT)


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
    No formula from the source papers (the report of an assignment check). Used by the assignments of every chapter.
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


def _as_array(answer, shape: tuple[int, ...], what: str, hint: str) -> np.ndarray:
    """The student's answer as a finite float (or complex) NumPy array of ``shape``, else a FAIL with the hint.

    A complex answer keeps its imaginary part (the right value + 5j must not pass); :func:`_close`
    reports it unless it is round-off.
    """
    try:
        got = np.asarray(answer)
        if not (np.issubdtype(got.dtype, np.number) or np.issubdtype(got.dtype, np.bool_)):
            raise TypeError
    except (TypeError, ValueError):
        raise _Fail(f"{what} is not an array of numbers (got {type(answer).__name__}). {hint}") from None
    if got.shape != tuple(shape):
        raise _Fail(f"{what} has shape {got.shape}, expected {tuple(shape)}. {hint}")
    if not np.all(np.isfinite(got)):
        raise _Fail(f"{what} contains NaN or inf. {hint}")
    return got.astype(complex if np.iscomplexobj(got) else float)


def _close(got, want, what: str, hint: str, tol: float = 1e-8) -> None:
    """FAIL with ``hint`` unless ``got`` equals ``want`` to ``tol`` relative to ``max(1, |want|)``."""
    want = np.asarray(want)
    want = want.astype(complex if np.iscomplexobj(want) else float)
    got = _as_array(got, want.shape, what, hint)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    imag = float(np.max(np.abs(got.imag))) if np.iscomplexobj(got) and got.size else 0.0
    if imag > tol * scale and not np.iscomplexobj(want):
        raise _Fail(f"{what} has an imaginary part (up to {imag:.2e}), but the answer is real. {hint}")
    if err > tol * scale:
        raise _Fail(f"{what} is off by {err:.2e} (tolerance {tol * scale:.0e}). {hint}")


def _matches(got, value, tol: float = 1e-8) -> bool:
    """Whether ``got`` equals ``value`` to ``tol`` relative to ``max(1, |value|)``: a diagnosis, not a
    verdict (False for anything not comparable: another shape, complex, non-finite, not numbers)."""
    try:
        got, value = np.asarray(got), np.asarray(value)
        if np.iscomplexobj(got) or np.iscomplexobj(value):
            return False
        got, value = got.astype(float), value.astype(float)
    except (TypeError, ValueError):
        return False
    if got.shape != value.shape or not (np.all(np.isfinite(got)) and np.all(np.isfinite(value))):
        return False
    scale = max(1.0, float(np.max(np.abs(value), initial=0.0)))
    return bool(np.max(np.abs(got - value), initial=0.0) <= tol * scale)


#: How close (relative) an answer must be to a known wrong answer to be told it is that mistake.
_MISTAKE_TOL = 1e-6


def _close_or_name(got, want, what: str, hint: str, mistakes=(), tol: float = 1e-8) -> None:
    """:func:`_close`, but a wrong answer that equals a known mistake is told which one it is.

    ``mistakes`` holds ``(wrong, sentence)`` pairs: ``wrong`` is what that mistake gives, or a function
    computing it (called only for a wrong answer, so a right one costs nothing extra; one that raises
    is skipped), and ``sentence`` names the mistake and its fix.  A mistake that gives the right
    answer on this instance is never named.
    """
    if not _matches(got, want, tol):
        for wrong, sentence in mistakes:
            if callable(wrong):
                try:
                    wrong = wrong()
                except Exception:  # a mistake that cannot be evaluated here cannot be the student's
                    continue
            if _matches(got, wrong, _MISTAKE_TOL) and not _matches(want, wrong, _MISTAKE_TOL):
                err = float(np.max(np.abs(np.asarray(got, dtype=float) - np.asarray(want, dtype=float))))
                raise _Fail(f"{what} is off by {err:.2e}: {sentence}")
    _close(got, want, what, hint, tol)


class _Draws:
    """Standard normal numbers from one ``jax.random`` key, handed out in order as float64 NumPy arrays.

    One draw of a fixed ``size`` per check (compiled once, for every check) instead of one
    compilation per shape; ``draws(*shape)`` and ``draws.normal(*shape)`` are the same.
    """

    def __init__(self, seed: int, size: int = 2048) -> None:
        self._z = np.asarray(jax.random.normal(_key(seed), (size,)), dtype=float)
        self._next = 0

    def normal(self, *shape: int) -> np.ndarray:
        n = int(np.prod(shape))
        if self._next + n > self._z.size:
            raise RuntimeError(f"_Draws: {self._z.size} numbers are not enough (asked for {self._next + n})")
        out = self._z[self._next : self._next + n].reshape(shape)
        self._next += n
        return out

    __call__ = normal


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
    limit = _time_limit() if time_limit is None else float(time_limit)
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
