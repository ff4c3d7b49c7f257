"""Correct and wrong answers for the checks of assignment 2 (chapter 2, pullback metrics).

Gathered by tests/test_assignments.py: {check name: (a correct answer, [(a wrong answer, words of its hint)])}.
Each wrong answer is a mistake students make; the words are what the FAIL line must say about it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# ------------------------------------------------------------------ 2.1 the GGN-vector product


def _ggn_vp(model, loss, params, v):
    z, Jv = jax.jvp(model, (params,), (v,))
    HJv = jax.jvp(jax.grad(loss), (z,), (Jv,))[1]
    return jax.vjp(model, params)[1](HJv)[0]


def _gauss_newton_vp(model, loss, params, v):  # forgets the output Hessian: J^T J v
    Jv = jax.jvp(model, (params,), (v,))[1]
    return jax.vjp(model, params)[1](Jv)[0]


def _hessian_vp(model, loss, params, v):  # the full Hessian of loss(model(params))
    return jax.jvp(jax.grad(lambda t: loss(model(t))), (params,), (v,))[1]


def _swapped_jvp(model, loss, params, v):  # H_z evaluated at J v instead of z
    Jv = jax.jvp(model, (params,), (v,))[1]
    HJv = jax.jvp(jax.grad(loss), (Jv,), (Jv,))[1]
    return jax.vjp(model, params)[1](HJv)[0]


def _gradient(model, loss, params, v):  # J^T grad L: the gradient, no Hessian at all
    z, vjp = jax.vjp(model, params)
    return vjp(jax.grad(loss)(z))[0]


# ------------------------------------------------------------- 2.2 the Fisher, 2.3 the empirical Fisher


def _scores(model, params):
    return jax.jacrev(lambda t: jax.nn.log_softmax(model(t), axis=-1))(params)  # (N, C, d)


def _fisher(model, params, labels):
    S, p = _scores(model, params), jax.nn.softmax(model(params), axis=-1)
    return jnp.einsum("nc,nci,ncj->ij", p, S, S) / p.shape[0]


def _fisher_closed_form(model, params, labels):
    z = model(params)
    J = jax.jacfwd(model)(params)  # (N, C, d)
    p = jax.nn.softmax(z, axis=-1)
    Fz = jax.vmap(jnp.diag)(p) - jnp.einsum("na,nb->nab", p, p)
    return jnp.einsum("nai,nab,nbj->ij", J, Fz, J) / z.shape[0]


def _fisher_without_ppT(model, params, labels):  # differentiates the logit z_y, not log softmax(z)_y
    J = jax.jacfwd(model)(params)
    p = jax.nn.softmax(model(params), axis=-1)
    return jnp.einsum("nc,nci,ncj->ij", p, J, J) / p.shape[0]


def _per_example_grads(model, params, labels):
    nll = lambda t: (
        -jnp.take_along_axis(jax.nn.log_softmax(model(t), axis=-1), labels[:, None], axis=-1)[:, 0]
    )  # noqa: E731
    return jax.jacrev(nll)(params)  # (N, d)


def _empirical_fisher(model, params, labels):
    U = _per_example_grads(model, params, labels)
    return U.T @ U / U.shape[0]


def _fisher_unweighted(model, params, labels):  # averages the classes instead of weighting them by p
    S = _scores(model, params)
    return jnp.einsum("nci,ncj->ij", S, S) / (S.shape[0] * S.shape[1])


def _fisher_sum(model, params, labels):  # no 1/N
    return _fisher(model, params, labels) * model(params).shape[0]


def _empirical_fisher_sum(model, params, labels):  # no 1/N
    U = _per_example_grads(model, params, labels)
    return U.T @ U


def _mean_gradient_outer(model, params, labels):  # the outer product of the mean gradient
    g = _per_example_grads(model, params, labels).mean(0)
    return jnp.outer(g, g)


# ------------------------------------------------------------------ 2.4 a natural-gradient step


def _dense(model, loss, params):
    z = model(params)
    J = jax.jacfwd(lambda t: model(t).reshape(-1))(params)
    Hz = jax.hessian(lambda zf: loss(zf.reshape(z.shape)))(z.reshape(-1))
    return J, Hz, jax.grad(lambda t: loss(model(t)))(params)


def _ng_step(model, loss, params, lr, damping):
    # G built column by column from the GGN-vector product of task 2.1
    G = jax.vmap(lambda e: _ggn_vp(model, loss, params, e))(jnp.eye(params.size))
    g = jax.grad(lambda t: loss(model(t)))(params)
    return params - lr * jnp.linalg.solve(G + damping * jnp.eye(params.size), g)


def _gd_step(model, loss, params, lr, damping):
    return params - lr * jax.grad(lambda t: loss(model(t)))(params)


def _newton_step(model, loss, params, lr, damping):
    H = jax.hessian(lambda t: loss(model(t)))(params)
    g = jax.grad(lambda t: loss(model(t)))(params)
    return params - lr * jnp.linalg.solve(H + damping * jnp.eye(params.size), g)


def _undamped_step(model, loss, params, lr, damping):
    J, Hz, g = _dense(model, loss, params)
    return params - lr * jnp.linalg.solve(J.T @ Hz @ J, g)


def _euclidean_pullback_step(model, loss, params, lr, damping):  # G = J^T J, the loss's 1/N forgotten
    J, _, g = _dense(model, loss, params)
    return params - lr * jnp.linalg.solve(J.T @ J + damping * jnp.eye(params.size), g)


def _ascent_step(model, loss, params, lr, damping):
    J, Hz, g = _dense(model, loss, params)
    return params + lr * jnp.linalg.solve(J.T @ Hz @ J + damping * jnp.eye(params.size), g)


CASES = {
    "check_ggn_vector_product": (
        _ggn_vp,
        [
            (_gauss_newton_vp, "output Hessian H_z is missing"),
            (_hessian_vp, "full Hessian"),
            (_swapped_jvp, "primals first"),
            (_gradient, "the gradient"),
        ],
    ),
    "check_categorical_fisher": (
        _fisher,
        [
            (_empirical_fisher, "training labels"),
            (_fisher_without_ppT, "-p p^T term is missing"),
            (_fisher_unweighted, "weight class c by p_c"),
            (_fisher_sum, "divide by N"),
        ],
    ),
    "check_empirical_fisher": (
        _empirical_fisher,
        [
            (_fisher, "plugs in the training labels"),
            (_empirical_fisher_sum, "N times too large"),
            (_mean_gradient_outer, "outer product of the mean gradient"),
        ],
    ),
    "check_natural_gradient_regression": (
        _ng_step,
        [
            (_gd_step, "plain gradient step"),
            (_newton_step, "full Hessian"),
            (_undamped_step, "damping is missing"),
            (_euclidean_pullback_step, "H_z = I/N"),
            (_ascent_step, "wrong sign"),
        ],
    ),
    # issue 54: predict, then compute (the rank is not printed in chapter 2)
    "check_fisher_rank": (
        lambda N, D, C: (C - 1) * min(N, D),
        [
            (lambda N, D, C: min(N, C * D), "bound of the empirical Fisher"),  # transcribed from task 2.3
            (lambda N, D, C: C * min(N, D), "rank C - 1, not C"),  # the softmax's shift invariance forgotten
            (lambda N, D, C: C * D, "only an upper bound"),
            (lambda N, D, C: (C - 1) * N, "span at most D dimensions"),
        ],
    ),
}
