r"""Rank correlations with their uncertainty (floor 1, chapters 6 and 7).

A Kendall :math:`\tau` between a sharpness measure and the generalization gap of a few dozen
models is a noisy statistic: with :math:`n` unrelated rankings its standard deviation is
:math:`\sqrt{2(2n+5)/(9n(n-1))}` (0.10 at :math:`n = 50`, 0.19 at :math:`n = 16`).  A value is a
result only beside its own error and beside a simple baseline.  This module gives both:

* :func:`kendall_tau`: the point estimate :math:`\tau_b` alone (``scipy.stats.kendalltau``);
* :func:`kendall_tau_ci`: :math:`\tau_b` with a paired-bootstrap percentile confidence interval
  (resampling models, i.e. rows :math:`(x_i, y_i)`) and a two-sided permutation p-value
  (shuffling :math:`y` against :math:`x`);
* :func:`kendall_tau_difference_ci`: the paired-bootstrap interval of
  :math:`\tau(a, y) - \tau(b, y)`, the question "does measure :math:`a` rank better than :math:`b`
  on *these* models?", with both taus computed on the same resamples.

The interval functions are plain NumPy (host-side statistics of a handful of numbers), vectorized
over resamples, deterministic given ``seed``, and agree with ``scipy.stats.kendalltau`` on the point estimate.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from ._checks import GeometryError

__all__ = ["kendall_tau", "RankCorrelation", "kendall_tau_ci", "kendall_tau_difference_ci"]


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    r"""Kendall's rank correlation :math:`\tau_b` of two sequences (``scipy.stats.kendalltau``).

    .. math:: \tau = \frac{2}{M(M-1)}\sum_{i<j}\operatorname{sign}(x_i - x_j)\operatorname{sign}(y_i - y_j)\quad\text{(without ties; } \tau_b \text{ corrects for ties)}

    Parameters
    ----------
    x, y : sequence of float
        Paired values, e.g. sharpness and generalization gap of :math:`M` models.

    Returns
    -------
    float
        :math:`\tau_b \in [-1, 1]`.

    Raises
    ------
    GeometryError
        If the lengths differ or are below 2.

    Examples
    --------
    >>> import minigeo as mg
    >>> round(mg.stats.kendall_tau([1, 2, 3, 4], [10, 20, 40, 30]), 6)
    0.666667

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5 (Kendall's tau, first display). Chapters 6 and 7.
    """
    from scipy.stats import kendalltau

    x, y = list(map(float, x)), list(map(float, y))
    if len(x) != len(y) or len(x) < 2:
        raise GeometryError(
            f"kendall_tau needs two sequences of the same length >= 2; got lengths {len(x)} and {len(y)}."
        )
    return float(kendalltau(x, y).statistic)


class RankCorrelation(NamedTuple):
    """A Kendall :math:`\\tau_b` (or a difference of two) with its uncertainty.

    Attributes
    ----------
    tau : float
        The point estimate on the full sample.
    ci_low : float
        Lower end of the paired-bootstrap percentile interval at level ``confidence``.
    ci_high : float
        Upper end of that interval.
    p_value : float
        Two-sided permutation p-value of "no association" (:func:`kendall_tau_ci`), or the
        two-sided bootstrap p-value of "no difference" (:func:`kendall_tau_difference_ci`).
    n : int
        Number of models (pairs).
    confidence : float
        Level of the interval.

    Examples
    --------
    >>> import minigeo as mg
    >>> print(mg.stats.kendall_tau_ci([1, 2, 3, 4, 5, 6], [1, 3, 2, 4, 6, 5], n_resamples=500))
    +0.73 [+0.11, +1.00] (95 % CI), p = 0.052, n = 6

    References
    ----------
    No formula from the source papers (da Silva, Dangel & Oore 2025, Table 1, report Kendall's tau
    without intervals). Chapters 6 and 7.
    """

    tau: float
    ci_low: float
    ci_high: float
    p_value: float
    n: int
    confidence: float

    def __str__(self) -> str:
        level = f"{100 * self.confidence:g} %"
        return (
            f"{self.tau:+.2f} [{self.ci_low:+.2f}, {self.ci_high:+.2f}] ({level} CI), "
            f"p = {self.p_value:.3f}, n = {self.n}"
        )


def _as_sample(values: Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise GeometryError(f"{name} must be a 1-D sequence of numbers; got shape {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        bad = np.flatnonzero(~np.isfinite(arr))[:5].tolist()
        raise GeometryError(
            f"{name} has non-finite entries (first at positions {bad}); a rank correlation of NaN/inf "
            "values is meaningless: drop those models or fix the computation that produced them."
        )
    return arr


def _check_samples(named: dict[str, np.ndarray]) -> int:
    lengths = {k: len(v) for k, v in named.items()}
    n = next(iter(lengths.values()))
    if any(m != n for m in lengths.values()):
        raise GeometryError(f"the sequences must have the same length; got {lengths}.")
    if n < 4:
        raise GeometryError(f"a bootstrap interval of Kendall's tau needs at least 4 models; got {n}.")
    for k, v in named.items():
        if np.all(v == v[0]):
            raise GeometryError(f"{k} is constant: Kendall's tau is undefined for a sequence without order.")
    return n


def _pair_signs(values: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """sign(v_i - v_j) over the pairs i < j, for a batch of samples ``values`` of shape (B, n)."""
    return np.sign(values[..., i] - values[..., j])


def _tau_b(sx: np.ndarray, sy: np.ndarray) -> np.ndarray:
    r"""Kendall's :math:`\tau_b = \sum s_x s_y / \sqrt{\sum s_x^2 \sum s_y^2}` from pair signs; NaN where
    a resample is constant in one variable."""
    num = np.sum(sx * sy, axis=-1)
    den = np.sqrt(np.sum(sx * sx, axis=-1) * np.sum(sy * sy, axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _resample_chunks(rng: np.random.Generator, n: int, n_resamples: int):
    """Bootstrap index arrays ``(b, n)`` (draws with replacement), ``n_resamples`` rows in all, in chunks
    of at most 500 rows so that the pair signs of a chunk take at most 500 x n(n-1)/2 numbers."""
    for start in range(0, int(n_resamples), 500):
        yield rng.integers(0, n, size=(min(500, int(n_resamples) - start), n))


def _percentile_ci(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    draws = draws[np.isfinite(draws)]
    if draws.size < 100:
        raise GeometryError(
            f"only {draws.size} bootstrap resamples gave a defined tau (the others were constant in one "
            "variable); use more models or more resamples."
        )
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(draws, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def _check_level(confidence: float, n_resamples: int) -> None:
    if not 0.0 < confidence < 1.0:
        raise GeometryError(f"confidence must lie in (0, 1); got {confidence}.")
    if int(n_resamples) < 200:
        raise GeometryError(f"n_resamples must be at least 200 for a percentile interval; got {n_resamples}.")


def kendall_tau_ci(
    x: Sequence[float],
    y: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 4000,
    seed: int = 0,
) -> RankCorrelation:
    r"""Kendall's :math:`\tau_b(x, y)` with a bootstrap confidence interval and a permutation p-value.

    .. math::
        \tau_b = \frac{\sum_{i<j} \operatorname{sgn}(x_i - x_j)\operatorname{sgn}(y_i - y_j)}
        {\sqrt{\sum_{i<j} \operatorname{sgn}(x_i - x_j)^2 \sum_{i<j} \operatorname{sgn}(y_i - y_j)^2}}

    The interval resamples the :math:`n` pairs :math:`(x_i, y_i)` with replacement (models are the
    unit of sampling) and takes percentiles of :math:`\tau_b`; the p-value is the fraction of
    :math:`y`-permutations with :math:`|\tau_b| \ge |\tau_b^{\text{obs}}|` (plus one, over
    ``n_resamples + 1``).

    Parameters
    ----------
    x, y : array-like
        The two measurements of the same :math:`n \ge 4` models, finite, neither constant.
    confidence : float, optional
        Level of the interval (default 0.95).
    n_resamples : int, optional
        Bootstrap resamples and permutations (default 4000, at least 200).
    seed : int, optional
        Seed of NumPy's generator; the result is deterministic given it.

    Returns
    -------
    RankCorrelation
        ``tau``, ``ci_low``, ``ci_high``, ``p_value``, ``n``, ``confidence``.

    Raises
    ------
    GeometryError
        Lengths differ, fewer than 4 models, non-finite or constant input, a level outside (0, 1).

    Examples
    --------
    >>> import minigeo as mg
    >>> r = mg.stats.kendall_tau_ci([1, 2, 3, 4, 5, 6, 7, 8], [2, 1, 4, 3, 6, 5, 8, 7])
    >>> round(r.tau, 4), r.ci_low < r.tau < r.ci_high, r.p_value < 0.05
    (0.7143, True, True)

    References
    ----------
    da Silva, Dangel & Oore (2025), Sec. 5 and Table 1 (Kendall's tau of sharpness against the
    generalization gap; the interval and p-value are ours). Chapters 6 and 7.
    """
    _check_level(confidence, n_resamples)
    xs, ys = _as_sample(x, "x"), _as_sample(y, "y")
    n = _check_samples({"x": xs, "y": ys})
    i, j = np.triu_indices(n, k=1)
    sx_obs = _pair_signs(xs, i, j)
    tau = float(_tau_b(sx_obs, _pair_signs(ys, i, j)))

    rng = np.random.default_rng(seed)
    draws, exceed = [], 0
    for idx in _resample_chunks(rng, n, n_resamples):
        draws.append(_tau_b(_pair_signs(xs[idx], i, j), _pair_signs(ys[idx], i, j)))
        perm = rng.permuted(np.broadcast_to(ys, idx.shape), axis=1)
        exceed += int(np.sum(np.abs(_tau_b(sx_obs, _pair_signs(perm, i, j))) >= abs(tau) - 1e-12))
    lo, hi = _percentile_ci(np.concatenate(draws), confidence)
    p = (1 + exceed) / (int(n_resamples) + 1)
    return RankCorrelation(tau, lo, hi, float(p), n, float(confidence))


def kendall_tau_difference_ci(
    a: Sequence[float],
    b: Sequence[float],
    y: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 4000,
    seed: int = 0,
) -> RankCorrelation:
    r"""The difference of two measures' Kendall :math:`\tau_b` with the same target, with a paired-bootstrap interval.

    .. math:: d = \tau_b(a, y) - \tau_b(b, y)

    Both taus are computed on the *same* resampled models, so the interval accounts for their
    correlation (two measures of the same models are far from independent, and comparing two
    separate intervals would overstate the uncertainty of the difference).  The p-value is the
    two-sided bootstrap p-value of "no difference", :math:`2\min(P(d^* \le 0), P(d^* \ge 0))`.

    Parameters
    ----------
    a, b : array-like
        Two measures (e.g. geodesic and adaptive sharpness) of the same :math:`n \ge 4` models.
    y : array-like
        The target (e.g. the generalization gap).
    confidence, n_resamples, seed
        As in :func:`kendall_tau_ci`.

    Returns
    -------
    RankCorrelation
        ``tau`` holds the difference; ``ci_low``, ``ci_high`` its interval; ``p_value`` as above.

    Raises
    ------
    GeometryError
        As :func:`kendall_tau_ci`.

    Examples
    --------
    >>> import minigeo as mg
    >>> y = [1, 2, 3, 4, 5, 6, 7, 8]
    >>> d = mg.stats.kendall_tau_difference_ci(y, y[::-1], y)
    >>> round(d.tau, 4), round(d.ci_low, 4), round(d.ci_high, 4)
    (2.0, 2.0, 2.0)

    References
    ----------
    da Silva, Dangel & Oore (2025), Table 1 (two measures' taus on the same models; the paired
    interval is ours). Chapters 6 and 7.
    """
    _check_level(confidence, n_resamples)
    av, bv, yv = _as_sample(a, "a"), _as_sample(b, "b"), _as_sample(y, "y")
    n = _check_samples({"a": av, "b": bv, "y": yv})
    i, j = np.triu_indices(n, k=1)
    sy = _pair_signs(yv, i, j)
    diff = float(_tau_b(_pair_signs(av, i, j), sy) - _tau_b(_pair_signs(bv, i, j), sy))

    rng = np.random.default_rng(seed)
    draws = []
    for idx in _resample_chunks(rng, n, n_resamples):
        sy_b = _pair_signs(yv[idx], i, j)
        draws.append(_tau_b(_pair_signs(av[idx], i, j), sy_b) - _tau_b(_pair_signs(bv[idx], i, j), sy_b))
    d = np.concatenate(draws)
    d = d[np.isfinite(d)]
    lo, hi = _percentile_ci(d, confidence)
    p = min(1.0, 2.0 * min(np.mean(d <= 0.0), np.mean(d >= 0.0)))
    return RankCorrelation(diff, lo, hi, float(p), n, float(confidence))
