"""Correct and wrong answers for assignment 3 (chapter 3, natural gradient in overparametrized systems).

Gathered by tests/test_assignments.py:
{check name: (a correct answer, [(a wrong answer, words of its hint)])}.
"""

from __future__ import annotations

import jax.numpy as jnp


def _pinv(G):
    return jnp.linalg.pinv(G, hermitian=True)


# ---------------------------------------------------------------- task 1: the N x N system


def _fs_step(J, g, dL):
    return J.T @ jnp.linalg.solve(J @ J.T, jnp.linalg.solve(g, dL))


def _fs_no_metric(J, g, dL):  # the Euclidean output metric instead of g
    return J.T @ jnp.linalg.solve(J @ J.T, dL)


def _fs_metric_not_inverted(J, g, dL):  # g dL instead of g^-1 dL
    return J.T @ jnp.linalg.solve(J @ J.T, g @ dL)


def _fs_metric_outside(J, g, dL):  # g^-1 on the wrong side of (J J^T)^-1
    return J.T @ jnp.linalg.solve(g, jnp.linalg.solve(J @ J.T, dL))


def _fs_no_transpose(J, g, dL):  # u, the coefficients in function space, not mapped back by J^T
    return jnp.linalg.solve(J @ J.T, jnp.linalg.solve(g, dL))


def _fs_singular_inverse(J, g, dL):  # the d x d Gram matrix is singular: inverting it is round-off
    return jnp.linalg.inv(J.T @ g @ J) @ (J.T @ dL)


def _fs_damped(J, g, dL):  # damping in parameter space: not the Moore-Penrose step
    G = J.T @ g @ J
    return jnp.linalg.solve(G + 1e-6 * jnp.eye(G.shape[0]), J.T @ dL)


def _fs_euclidean_damped(J, g, dL):  # J^T J + tiny damping: the wrong space's metric, and damped
    G = J.T @ J
    return jnp.linalg.solve(G + 1e-10 * jnp.eye(G.shape[0]), J.T @ dL)


def _fs_kernel_component(J, g, dL):  # right on the model, plus a vector of ker J
    d = J.shape[1]
    return _fs_step(J, g, dL) + (jnp.eye(d) - jnp.linalg.pinv(J) @ J) @ jnp.ones(d)


# ---------------------------------------------------------------- task 2: the projection of Theorem 1


def _projection(J, g):
    return J @ _pinv(J.T @ g @ J) @ J.T @ g


# ---------------------------------------------------------------- task 3: another generalized inverse


def _a_z(G, Z):
    Gp = _pinv(G)
    return Gp + (jnp.eye(G.shape[0]) - Gp @ G) @ Z


# ---------------------------------------------------------------- task 4: Moore-Penrose in other coordinates


def _a_w_step(G, grad, W):
    return W @ _pinv(W.T @ G @ W) @ W.T @ grad


CASES = {
    "check_function_space_natural_gradient": (
        _fs_step,
        [
            (_fs_no_metric, "you left out the metric"),
            (_fs_metric_not_inverted, "with g^{-1}, not g"),
            (_fs_metric_outside, "The metric enters once"),
            (_fs_no_transpose, "a missing transpose"),
            (_fs_singular_inverse, "singular"),
            (_fs_damped, "damping"),
            (_fs_euclidean_damped, "you left out the metric"),
            (_fs_kernel_component, "row space of J"),
        ],
    ),
    "check_span_projection": (
        _projection,
        [
            (lambda J, g: J @ jnp.linalg.pinv(J), "Euclidean projection"),  # the wrong metric
            (lambda J, g: J @ _pinv(J.T @ g @ J) @ J.T, "without g"),  # g dropped
            (lambda J, g: g @ J @ _pinv(J.T @ g @ J) @ J.T, "transpose of Pi"),  # g on the wrong side
            (lambda J, g: jnp.eye(J.shape[0]), "not the identity"),  # the ambient gradient, unprojected
            (lambda J, g: _pinv(J.T @ g @ J) @ J.T @ g @ J, "N x N"),  # G^+ G: parameter space
            (lambda J, g: J @ jnp.linalg.inv(J.T @ g @ J) @ J.T @ g, "Moore-Penrose"),  # G^-1 of singular G
        ],
    ),
    "check_generalized_inverse": (
        _a_z,
        [
            (lambda G, Z: _pinv(G) + Z, "not one"),  # Z not projected onto ker G
            (lambda G, Z: _pinv(G) + _pinv(G) @ G @ Z, "(I - G^+ G) Z, not Z or G^+ G Z"),  # onto range G
            (
                lambda G, Z: _pinv(G) + Z @ (jnp.eye(G.shape[0]) - _pinv(G) @ G),  # projector on the right
                "Multiply Z from the left",
            ),
            (lambda G, Z: _pinv(G), "Moore-Penrose step itself"),
            (lambda G, Z: _a_z(G, Z.T), "not Z^T"),
        ],
    ),
    "check_reparametrized_mp_step": (
        _a_w_step,
        [
            (lambda G, grad, W: _pinv(G) @ grad, "Moore-Penrose step of xi itself"),  # W ignored
            (lambda G, grad, W: _pinv(W.T @ G @ W) @ W.T @ grad, "mapped back to xi by W"),  # theta-step
            (
                lambda G, grad, W: W @ _pinv(W.T @ G @ W) @ jnp.linalg.solve(W, grad),  # grad as a vector
                "the gradient is a covector",
            ),
            (
                lambda G, grad, W: jnp.linalg.solve(W.T, _pinv(W.T @ G @ W) @ W.T @ grad),  # back by W^-T
                "not W^-1 or W^T",
            ),
        ],
    ),
    # issue 54: a count the chapter does not print
    "check_gram_rank": (
        lambda m, n, k: k * (m + n) - k * k,
        [
            (lambda m, n, k: k * (m + n), "number of parameters d"),  # G taken as invertible
            (lambda m, n, k: m * n, "full row rank"),  # transcribed from task 3.1's assumption
            (lambda m, n, k: k * (m + n) - k, "rescaling each column"),
        ],
    ),
}
