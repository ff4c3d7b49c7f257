"""Correct and wrong answers for the checks of assignment 5 (chapter 5: densities, volume forms, Laplace).

Gathered by tests/test_assignments.py: ``{check name: (a correct answer, [(a wrong answer, words of its
hint)])}``.  Every wrong answer is a mistake students make, and the hint must name it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LOG_2PI = float(np.log(2 * np.pi))


def _logdet(M):
    return jnp.linalg.slogdet(M)[1]


def _newton(f, x0, steps=60):
    """The solution notebook's newton_maximize: damped Newton steps, compiled."""
    g, h = jax.grad(f), jax.hessian(f)
    step = lambda i, x: x - jnp.clip(jnp.linalg.solve(h(x), g(x)), -0.25, 0.25)
    return jax.jit(lambda x: jax.lax.fori_loop(0, steps, step, x))(x0)


# ------------------------------------------------------------------ task 1: change of variables


def _change_of_variables(log_q, phi, psi):
    return log_q(phi.inverse(psi)) + _logdet(phi.inverse_jacobian(psi))


def _plus_log_det_J(log_q, phi, psi):  # the Jacobian's sign flipped: + log|det J(theta)|
    theta = phi.inverse(psi)
    return log_q(theta) + _logdet(phi.jacobian(theta))


def _wrong_direction(log_q, phi, psi):  # "- log|det J|" with the Jacobian of the inverse map
    return log_q(phi.inverse(psi)) - _logdet(jax.jacfwd(phi.inverse)(psi))


def _jacobian_at_psi(log_q, phi, psi):  # J = d psi / d theta evaluated at psi instead of theta
    return log_q(phi.inverse(psi)) - _logdet(jax.jacfwd(phi.forward)(psi))


def _no_jacobian(log_q, phi, psi):  # transformed like a function
    return log_q(phi.inverse(psi))


def _no_absolute_value(log_q, phi, psi):  # log det instead of log|det|
    return log_q(phi.inverse(psi)) + jnp.log(jnp.linalg.det(phi.inverse_jacobian(psi)))


# ------------------------------------------------------------------ task 2: the invariant MAP


def _invariant_map(log_q, metric, x0):
    return _newton(lambda x: log_q(x) - 0.5 * _logdet(metric(x)), x0)


def _lebesgue_map(log_q, metric, x0):
    return _newton(log_q, x0)


def _map_without_half(log_q, metric, x0):
    return _newton(lambda x: log_q(x) - _logdet(metric(x)), x0)


def _map_plus_half(log_q, metric, x0):
    return _newton(lambda x: log_q(x) + 0.5 * _logdet(metric(x)), x0)


# ------------------------------------------------------------------ task 3: the Laplace evidence


def _laplace_parts(log_lik, log_prior, t):
    H = -jax.hessian(lambda x: log_lik(x) + log_prior(x))(t)
    return log_lik(t) + log_prior(t), t.size, H


def _laplace(log_lik, log_prior, t):
    value, d, H = _laplace_parts(log_lik, log_prior, t)
    return value + 0.5 * d * LOG_2PI - 0.5 * _logdet(H)


def _laplace_plus_half_logdet(log_lik, log_prior, t):
    value, d, H = _laplace_parts(log_lik, log_prior, t)
    return value + 0.5 * d * LOG_2PI + 0.5 * _logdet(H)


def _laplace_covariance(log_lik, log_prior, t):  # -1/2 log det of the covariance H^{-1}
    value, d, H = _laplace_parts(log_lik, log_prior, t)
    return value + 0.5 * d * LOG_2PI - 0.5 * _logdet(jnp.linalg.inv(H))


def _laplace_no_2pi(log_lik, log_prior, t):
    value, d, H = _laplace_parts(log_lik, log_prior, t)
    return value - 0.5 * _logdet(H)


def _laplace_eq14(log_lik, log_prior, t):  # the signs printed in the paper's eq. 14
    value, d, H = _laplace_parts(log_lik, log_prior, t)
    return value - 0.5 * d * LOG_2PI + 0.5 * _logdet(H)


def _laplace_b2(log_lik, log_prior, t):  # the paper's App. B.2
    value, d, H = _laplace_parts(log_lik, log_prior, t)
    return value - 0.5 * d * LOG_2PI + _logdet(H)


def _laplace_likelihood_hessian(log_lik, log_prior, t):  # the prior's curvature forgotten
    H = -jax.hessian(log_lik)(t)
    return log_lik(t) + log_prior(t) + 0.5 * t.size * LOG_2PI - 0.5 * _logdet(H)


# ------------------------------------------------------------------ task 4: the invariant evidence


def _evidence_at(f, x, extra=0.0):
    """Laplace log evidence of exp(f) around x, plus ``extra`` (compiled)."""
    return jax.jit(lambda x: _laplace(f, lambda y: 0.0, x) + extra)(x)


def _invariant_evidence(log_q, metric, x0):
    log_q_vol = lambda x: log_q(x) - 0.5 * _logdet(metric(x))
    x = _invariant_map(log_q, metric, x0)
    return _evidence_at(log_q_vol, x) + 0.5 * _logdet(metric(x))


def _lebesgue_evidence(log_q, metric, x0):  # the naive Laplace evidence of the chart
    return _evidence_at(log_q, _newton(log_q, x0))


def _evidence_without_metric_logdet(log_q, metric, x0):  # log det H instead of log det(G^{-1} H)
    log_q_vol = lambda x: log_q(x) - 0.5 * _logdet(metric(x))
    return _evidence_at(log_q_vol, _invariant_map(log_q, metric, x0))


def _evidence_at_lebesgue_mode(log_q, metric, x0):  # the right formula around the wrong point
    log_q_vol = lambda x: log_q(x) - 0.5 * _logdet(metric(x))
    x = _newton(log_q, x0)
    return _evidence_at(log_q_vol, x) + 0.5 * _logdet(metric(x))


def _evidence_minus_metric_logdet(log_q, metric, x0):
    log_q_vol = lambda x: log_q(x) - 0.5 * _logdet(metric(x))
    x = _invariant_map(log_q, metric, x0)
    return _evidence_at(log_q_vol, x) - 0.5 * _logdet(metric(x))


CASES = {
    "check_change_of_variables": (
        _change_of_variables,
        [
            (_plus_log_det_J, "wrong sign"),
            (_wrong_direction, "wrong direction"),
            (_jacobian_at_psi, "Jacobian of phi at psi"),
            (_no_jacobian, "like a plain function"),
            (_no_absolute_value, "take log|det|"),
        ],
    ),
    "check_invariant_map": (
        _invariant_map,
        [
            (_lebesgue_map, "Lebesgue MAP"),
            (_map_without_half, "missing 1/2"),
            (_map_plus_half, "Wrong sign"),
        ],
    ),
    "check_laplace_log_evidence": (
        _laplace,
        [
            (_laplace_plus_half_logdet, "wrong sign"),
            (_laplace_covariance, "covariance"),
            (_laplace_no_2pi, "d/2 log 2pi is missing"),
            (_laplace_eq14, "eq. 14"),
            (_laplace_b2, "App. B.2"),
            (_laplace_likelihood_hessian, "likelihood alone"),
        ],
    ),
    "check_invariant_laplace_evidence": (
        _invariant_evidence,
        [
            (_lebesgue_evidence, "Lebesgue Laplace evidence"),
            (_evidence_without_metric_logdet, "log det G(x*) is missing"),
            (_evidence_at_lebesgue_mode, "around the Lebesgue MAP"),
            (_evidence_minus_metric_logdet, "Wrong sign on the metric"),
        ],
    ),
    # issue 54: predict the mode in a Box-Cox chart (the chapter prints only the log chart's, a/b)
    "check_chart_map": (
        lambda a, b, nu: (a - nu) / b,
        [
            (lambda a, b, nu: (a - 1) / b, "the MAP moves with the chart"),
            (lambda a, b, nu: a / b, "mode in the log chart"),  # the chapter's example transcribed
            (lambda a, b, nu: (a + nu - 2) / b, "Jacobian factor is inverted"),
            (lambda a, b, nu: (((a - nu) / b) ** nu - 1) / nu, "psi-coordinate"),
        ],
    ),
}
