"""Kendall's tau with its uncertainty, against scipy and against simulation truth."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as ss

import minigeo as mg


def correlated(rng, n, r):
    x = rng.normal(size=n)
    return x, r * x + np.sqrt(1 - r**2) * rng.normal(size=n)


@pytest.mark.parametrize("n", [6, 17, 50])
def test_point_estimate_matches_scipy_tau_b_with_ties(n):
    rng = np.random.default_rng(n)
    x = rng.integers(0, 4, size=n).astype(float)  # many ties: tau-b, not tau-a
    y = x + rng.integers(0, 3, size=n)
    res = mg.stats.kendall_tau_ci(x, y, n_resamples=500)
    assert res.tau == pytest.approx(ss.kendalltau(x, y).statistic, abs=1e-12)
    assert res.tau == pytest.approx(mg.stats.kendall_tau(x, y), abs=1e-12)
    assert res.ci_low <= res.tau <= res.ci_high


def test_interval_matches_scipy_bootstrap_percentile():
    rng = np.random.default_rng(3)
    x, y = correlated(rng, 40, 0.5)
    ours = mg.stats.kendall_tau_ci(x, y, n_resamples=8000, seed=1)
    ref = ss.bootstrap(
        (x, y),
        lambda a, b: ss.kendalltau(a, b).statistic,
        paired=True,
        vectorized=False,
        method="percentile",
        n_resamples=2000,
        random_state=np.random.default_rng(2),
    ).confidence_interval
    # Monte-Carlo error of a 2.5 % quantile from 2000 draws is ~0.02 here
    assert ours.ci_low == pytest.approx(ref.low, abs=0.05)
    assert ours.ci_high == pytest.approx(ref.high, abs=0.05)


def test_permutation_p_value_matches_exact_null_distribution():
    # without ties scipy's exact p-value is the permutation p-value with all n! permutations
    rng = np.random.default_rng(5)
    for r in (0.0, 0.4, 0.8):
        x, y = correlated(rng, 12, r)
        exact = ss.kendalltau(x, y, method="exact").pvalue
        ours = mg.stats.kendall_tau_ci(x, y, n_resamples=8000, seed=7).p_value
        se = np.sqrt(max(exact * (1 - exact), 1e-4) / 8000)
        assert abs(ours - exact) < 5 * se + 2 / 8000


def test_interval_coverage_on_simulated_families():
    # population tau of a bivariate normal with correlation r is (2/pi) arcsin r
    r, n, reps = 0.5, 30, 150
    truth = 2 / np.pi * np.arcsin(r)
    rng = np.random.default_rng(11)
    covered = 0
    for k in range(reps):
        x, y = correlated(rng, n, r)
        res = mg.stats.kendall_tau_ci(x, y, n_resamples=400, seed=k)
        covered += res.ci_low <= truth <= res.ci_high
    # nominal 0.95; binomial sd over 150 replications is 0.018 (percentile intervals run slightly low)
    assert 0.86 <= covered / reps <= 0.995


def test_interval_shrinks_like_one_over_sqrt_n():
    rng = np.random.default_rng(2)
    widths = []
    for n in (25, 100, 400):
        x, y = correlated(rng, n, 0.3)
        res = mg.stats.kendall_tau_ci(x, y, n_resamples=1000)
        widths.append(res.ci_high - res.ci_low)
    assert widths[0] / widths[1] == pytest.approx(2.0, rel=0.3)
    assert widths[1] / widths[2] == pytest.approx(2.0, rel=0.3)


def test_deterministic_given_seed():
    x, y = correlated(np.random.default_rng(0), 20, 0.2)
    assert mg.stats.kendall_tau_ci(x, y, seed=3) == mg.stats.kendall_tau_ci(x, y, seed=3)
    assert mg.stats.kendall_tau_ci(x, y, seed=3) != mg.stats.kendall_tau_ci(x, y, seed=4)


def test_difference_is_paired_and_detects_a_better_measure():
    rng = np.random.default_rng(4)
    y = rng.normal(size=60)
    good = y + 0.3 * rng.normal(size=60)
    bad = y + 3.0 * rng.normal(size=60)
    d = mg.stats.kendall_tau_difference_ci(good, bad, y, n_resamples=2000)
    assert d.tau == pytest.approx(ss.kendalltau(good, y).statistic - ss.kendalltau(bad, y).statistic, abs=1e-12)
    assert 0 < d.ci_low < d.tau < d.ci_high and d.p_value < 0.01
    # a measure against itself: the difference is exactly zero in every resample
    same = mg.stats.kendall_tau_difference_ci(good, good, y, n_resamples=500)
    assert same.tau == same.ci_low == same.ci_high == 0.0
    # paired interval of two strongly correlated measures is narrower than either tau's own interval
    close = good + 0.05 * rng.normal(size=60)
    dc = mg.stats.kendall_tau_difference_ci(good, close, y, n_resamples=2000)
    own = mg.stats.kendall_tau_ci(good, y, n_resamples=2000)
    assert dc.ci_high - dc.ci_low < 0.5 * (own.ci_high - own.ci_low)


def test_str_reports_interval_p_and_n():
    res = mg.stats.kendall_tau_ci([1, 2, 3, 4, 5], [1, 2, 3, 5, 4], n_resamples=300)
    text = str(res)
    assert "95 % CI" in text and "n = 5" in text and "p = " in text


@pytest.mark.parametrize(
    "x, y, match",
    [
        ([1, 2, 3, 4], [1, 2, 3], "same length"),
        ([1, 2, 3], [1, 2, 3], "at least 4"),
        ([1, 2, np.nan, 4], [1, 2, 3, 4], "non-finite"),
        ([1, 2, 3, 4], [1, np.inf, 3, 4], "non-finite"),
        ([2, 2, 2, 2], [1, 2, 3, 4], "constant"),
        ([[1, 2], [3, 4]], [1, 2, 3, 4], "1-D"),
    ],
)
def test_bad_input_raises(x, y, match):
    with pytest.raises(mg.GeometryError, match=match):
        mg.stats.kendall_tau_ci(x, y)
    with pytest.raises(mg.GeometryError, match=match):
        mg.stats.kendall_tau_difference_ci(x, x, y) if match != "constant" else mg.stats.kendall_tau_difference_ci(y, y, x)


@pytest.mark.parametrize("kw, match", [({"confidence": 1.0}, "confidence"), ({"n_resamples": 50}, "n_resamples")])
def test_bad_settings_raise(kw, match):
    with pytest.raises(mg.GeometryError, match=match):
        mg.stats.kendall_tau_ci([1, 2, 3, 4, 5], [1, 2, 3, 5, 4], **kw)
