"""KFAC and EKFAC (minigeo.kronecker, issue 52) against the exact GGN, hand-built factors and curvlinops.

Truths: the exact GGN / Fisher built here from a dense ``jax.jacfwd`` Jacobian and the closed-form
output Hessian (never from minigeo's metrics); the Kronecker factors rebuilt by hand from an explicit
forward pass and per-example vector-Jacobian products; dense ``numpy.linalg.solve``; curvlinops'
``KFACLinearOperator`` / ``EKFACLinearOperator`` on the same torch MLP (slow, needs torch).

When KFAC is exact: one example's block is :math:`\\bar x\\bar x^\\top \\otimes \\sum_r g_r g_r^\\top`
exactly, so KFAC equals every diagonal block of the exact GGN for ``N = 1`` (any depth and
activation), and for any ``N`` when one factor is the same for every example: a single linear layer
with a Gaussian likelihood (:math:`\\sum_r g_r g_r^\\top = I/\\sigma^2` for each example).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compiles_during, rng

import minigeo as mg

DTYPES = [jnp.float64, jnp.float32]


def tol(dtype, factor=100.0):
    return factor * float(jnp.finfo(dtype).eps)


def mlp(seed=0, sizes=(3, 5, 4), n=6, dtype=jnp.float64, bias=(True, True), act=jnp.tanh):
    r = rng(seed)
    params = []
    for (m, k), b in zip(zip(sizes[:-1], sizes[1:]), bias):
        layer = {"W": jnp.asarray(r.normal(size=(m, k)) / np.sqrt(m), dtype)}
        if b:
            layer["b"] = jnp.asarray(0.3 * r.normal(size=k), dtype)
        params.append(layer)
    X = jnp.asarray(r.normal(size=(n, sizes[0])), dtype)

    def model(p, x):
        h = x
        for i, layer in enumerate(p):
            h = h @ layer["W"] + (layer["b"] if "b" in layer else 0.0)
            if i < len(p) - 1:
                h = act(h)
        return h

    return params, model, X


def flat_index(params):
    """The positions of every leaf in the flattened (ravel_pytree) parameters, as a pytree of index arrays."""
    sizes = [x.size for x in jax.tree_util.tree_leaves(params)]
    offsets = np.cumsum([0] + sizes)
    leaves = [np.arange(o, o + x.size).reshape(x.shape) for o, x in zip(offsets, jax.tree_util.tree_leaves(params))]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves)


def layer_index(params, layer):
    """Flat positions of a layer's parameters in Kronecker order: rows of W, then b."""
    idx = flat_index(params)[layer]
    rows = idx["W"] if "b" not in idx else np.concatenate([idx["W"], idx["b"][None]], axis=0)
    return rows.ravel()


def output_hessian(z, likelihood, sigma=1.0):
    """Per-example output Hessian of the negative log-likelihood, ``(N, C, C)``, closed form."""
    z = np.asarray(z, np.float64)
    if likelihood == "categorical":
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        return np.stack([np.diag(q) - np.outer(q, q) for q in p])
    return np.stack([np.eye(z.shape[1]) / sigma**2 for _ in z])


def exact_ggn(model, params, X, likelihood="categorical", reduction="mean"):
    """``c sum_n J_n^T H_n J_n`` from the dense Jacobian (jax.jacfwd) and the closed-form output Hessians."""
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    z = model(params, X)
    J = np.asarray(jax.jacfwd(lambda f: model(unravel(f), X))(flat), np.float64)  # (N, C, d)
    H = output_hessian(z, likelihood)
    G = np.einsum("ncd,nce,nef->df", J, H, J)
    return G / X.shape[0] if reduction == "mean" else G


def block_mask(params):
    d = jax.flatten_util.ravel_pytree(params)[0].size
    mask = np.zeros((d, d), bool)
    for layer in range(len(params)):
        i = layer_index(params, layer)
        mask[np.ix_(i, i)] = True
    return mask


def dense(metric, params):
    return np.asarray(metric.dense(params), np.float64)


import jax.flatten_util  # noqa: E402


# ---------------------------------------------------------------------------
# (a) exactness where KFAC is exact
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
@pytest.mark.parametrize("act", [jnp.tanh, lambda h: h, jax.nn.relu, jax.nn.gelu], ids=["tanh", "deep-linear", "relu", "gelu"])
def test_kfac_equals_the_exact_ggn_blocks_for_one_example(dtype, likelihood, act):
    params, model, X = mlp(1, sizes=(3, 5, 4, 3), n=1, dtype=dtype, bias=(True, False, True), act=act)
    G = exact_ggn(model, params, X, likelihood)
    K = dense(mg.kfac(model, likelihood, params, batch=(X, None)), params)
    mask = block_mask(params)
    scale = np.abs(G).max()
    np.testing.assert_allclose(K, np.where(mask, G, 0.0), atol=tol(dtype) * scale, rtol=0)
    assert np.abs(G[~mask]).max() > 1e-3 * scale  # the exact GGN has cross-layer blocks; KFAC drops them


@pytest.mark.parametrize("dtype", DTYPES)
def test_kfac_is_exact_for_a_linear_layer_with_a_gaussian_likelihood_at_any_batch(dtype):
    params, model, X = mlp(2, sizes=(4, 3), n=9, dtype=dtype, bias=(True,))
    G = exact_ggn(model, params, X, "gaussian")
    K = dense(mg.kfac(model, "gaussian", params, batch=(X, None)), params)
    np.testing.assert_allclose(K, G, atol=tol(dtype) * np.abs(G).max(), rtol=0)
    # and not in general: a nonlinear net with several examples differs from its exact blocks
    params, model, X = mlp(3, n=7, dtype=dtype)
    G = exact_ggn(model, params, X)
    K = dense(mg.kfac(model, "categorical", params, batch=(X, None)), params)
    assert np.abs(K - np.where(block_mask(params), G, 0)).max() > 1e-3 * np.abs(G).max()


# ---------------------------------------------------------------------------
# (b) block-diagonal structure, each block the Kronecker product of the hand-built factors
# ---------------------------------------------------------------------------
def hand_factors(model_params, X, likelihood, reduction="mean"):
    """A_l and B_l from an explicit forward pass and per-example backward passes (no program analysis)."""
    p = model_params
    n = X.shape[0]

    def forward(p, x, eps):  # pre-activations s_l = h_{l-1} W_l + b_l + eps_l
        h, inputs = x, []
        for i, layer in enumerate(p):
            inputs.append(h)
            h = h @ layer["W"] + (layer["b"] if "b" in layer else 0.0) + eps[i]
            if i < len(p) - 1:
                h = jnp.tanh(h)
        return h, inputs

    A, B = [], []
    z, inputs = forward(p, X, [0.0] * len(p))
    H = output_hessian(z, likelihood)
    for i, layer in enumerate(p):
        x = np.asarray(inputs[i], np.float64)
        if "b" in layer:
            x = np.concatenate([x, np.ones((n, 1))], axis=1)
        A.append(x.T @ x / n)
        Bi = 0.0
        for k in range(n):
            eps = [jnp.zeros((1, lay["W"].shape[1]), X.dtype) for lay in p]
            _, vjp = jax.vjp(lambda e: forward(p, X[k : k + 1], e)[0], eps)
            lam, Q = np.linalg.eigh(H[k])
            S = Q * np.sqrt(np.maximum(lam, 0))
            for r in range(S.shape[1]):
                g = np.asarray(vjp(jnp.asarray(S[:, r][None], X.dtype))[0][i], np.float64)[0]
                Bi = Bi + np.outer(g, g)
        B.append(Bi / n if reduction == "mean" else Bi)
    return A, B


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kfac_is_block_diagonal_with_the_kronecker_products_of_hand_built_factors(dtype, reduction):
    params, model, X = mlp(4, sizes=(3, 6, 5, 4), n=7, dtype=dtype, bias=(True, False, True))
    K = dense(mg.kfac(model, "categorical", params, batch=(X, None), reduction=reduction), params)
    A, B = hand_factors(params, X, "categorical", reduction)
    factors = mg.kronecker.kfac_factors(model, "categorical", params, batch=(X, None), reduction=reduction)
    assert [(f.weight, f.bias) for f in factors] == [
        ("[0]['W']", "[0]['b']"), ("[1]['W']", None), ("[2]['W']", "[2]['b']")
    ]
    mask = block_mask(params)
    assert np.all(K[~mask] == 0.0)  # cross-layer blocks exactly zero
    for layer in range(len(params)):
        i = layer_index(params, layer)
        block = np.kron(A[layer], B[layer])
        s = np.abs(block).max()
        np.testing.assert_allclose(K[np.ix_(i, i)], block, atol=tol(dtype) * s, rtol=0)
        np.testing.assert_allclose(np.asarray(factors[layer].A), A[layer], atol=tol(dtype) * np.abs(A[layer]).max())
        np.testing.assert_allclose(np.asarray(factors[layer].B), B[layer], atol=tol(dtype) * np.abs(B[layer]).max())


def test_params_given_as_a_flat_dict_with_separated_weight_and_bias():
    """Leaves of one layer need not be neighbours in the flattening (sorted keys: W1, W2, b1, b2)."""
    params, model, X = mlp(5, n=1)
    flat = {"W1": params[0]["W"], "b1": params[0]["b"], "W2": params[1]["W"], "b2": params[1]["b"]}
    f = lambda p, x: jnp.tanh(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]
    G = exact_ggn(f, flat, X)
    K = dense(mg.kfac(f, "categorical", flat, batch=(X, None)), flat)
    # with one example every within-layer entry is exact and cross-layer entries are zero
    idx = flat_index(flat)
    l1 = np.concatenate([idx["W1"].ravel(), idx["b1"]])
    mask = np.zeros_like(G, bool)
    mask[np.ix_(l1, l1)] = True
    l2 = np.concatenate([idx["W2"].ravel(), idx["b2"]])
    mask[np.ix_(l2, l2)] = True
    np.testing.assert_allclose(K, np.where(mask, G, 0), atol=1e-13 * np.abs(G).max())


def test_data_closed_over_and_monte_carlo_factors():
    params, model, X = mlp(6, n=5)
    K1 = dense(mg.kfac(lambda p: model(p, X), "categorical", params), params)
    K2 = dense(mg.kfac(model, "categorical", params, batch=(X, None)), params)
    np.testing.assert_allclose(K1, K2, atol=1e-14)
    # MC factors: unbiased for the type-2 ones as the samples grow (B is linear in the sampled outer products)
    key = jax.random.PRNGKey(0)
    KM = dense(mg.kfac(model, "categorical", params, batch=(X, None), mc_samples=4000, key=key), params)
    assert np.abs(KM - K2).max() < 0.05 * np.abs(K2).max()
    assert mg.kfac(model, "categorical", params, batch=(X, None), mc_samples=1, key=key).name.startswith("MC KFAC")


# ---------------------------------------------------------------------------
# (c) solves through the factors, damping, no d x d matrix
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["kfac", "ekfac"])
def test_solve_inverts_the_damped_product_and_matches_a_dense_solve(dtype, which):
    params, model, X = mlp(7, sizes=(3, 6, 4), n=8, dtype=dtype)
    M = getattr(mg, which)(model, "categorical", params, batch=(X, None))
    lam = 0.05
    Md = M.with_damping(lam)
    D = dense(M, params)
    np.testing.assert_allclose(dense(Md, params), D + lam * np.eye(len(D)), atol=tol(dtype) * np.abs(D).max())
    r = rng(8)
    v = jax.tree_util.tree_map(lambda a: jnp.asarray(r.normal(size=a.shape), dtype), params)
    vf = np.asarray(jax.flatten_util.ravel_pytree(v)[0], np.float64)
    x = Md.solve(params, v)
    xf = np.asarray(jax.flatten_util.ravel_pytree(x)[0], np.float64)
    truth = np.linalg.solve(D + lam * np.eye(len(D)), vf)
    cond = np.linalg.cond(D + lam * np.eye(len(D)))
    np.testing.assert_allclose(xf, truth, atol=tol(dtype) * cond * np.abs(truth).max(), rtol=0)
    back = np.asarray(jax.flatten_util.ravel_pytree(Md.mv(params, x))[0], np.float64)
    np.testing.assert_allclose(back, vf, atol=tol(dtype) * cond * np.abs(vf).max(), rtol=0)
    x2 = Md.solve(params, Md.mv(params, v))  # solve(mv(v)) = v
    np.testing.assert_allclose(
        np.asarray(jax.flatten_util.ravel_pytree(x2)[0]), vf, atol=tol(dtype) * cond * np.abs(vf).max(), rtol=0
    )
    # the same answer as conjugate gradients on the products, and as natural_gradient's metric= path
    xcg = np.asarray(jax.flatten_util.ravel_pytree(Md.solve(params, v, method="cg", tol=1e-10 if dtype == jnp.float64 else 1e-5))[0])
    np.testing.assert_allclose(xcg, xf, atol=(1e-8 if dtype == jnp.float64 else 1e-3) * np.abs(xf).max())


def test_solve_never_forms_a_d_by_d_matrix():
    """On an MLP 300-200-10 (d = 62 210; a d x d float64 matrix would take 31 GB) every array in the
    solve's program is at most d entries or a factor's size."""
    params, model, X = mlp(9, sizes=(300, 200, 10), n=16)
    d = sum(x.size for x in jax.tree_util.tree_leaves(params))
    M = mg.kfac(model, "categorical", params, batch=(X, None)).with_damping(1e-3)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    program = jax.make_jaxpr(lambda v: M.solve_fn(params, v, M.damping))(v)
    largest = max(
        int(np.prod(var.aval.shape))
        for eqn in program.jaxpr.eqns
        for var in eqn.outvars
        if hasattr(var.aval, "shape")
    )
    assert largest <= max(d, 301**2), largest
    x = M.solve(params, v)
    back = M.mv(params, x)
    err = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(v)))
    assert err < 1e-6


def test_singular_factors_without_damping_raise_eagerly_and_give_nan_under_jit():
    params, model, X = mlp(10, n=1)  # one example: A = x x^T has rank 1
    M = mg.kfac(model, "categorical", params, batch=(X, None))
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    with pytest.raises(mg.GeometryError, match="NOT_POSITIVE_DEFINITE"):
        M.solve(params, v)
    x, info = jax.jit(lambda v: M.solve(params, v, return_info=True))(v)
    assert int(info.status) == mg.Status.NOT_POSITIVE_DEFINITE and not bool(info.converged)
    assert all(bool(jnp.all(jnp.isnan(a))) for a in jax.tree_util.tree_leaves(x))
    x, info = M.with_damping(1e-2).solve(params, v, return_info=True)
    assert int(info.status) == 0 and bool(info.converged)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_natural_gradient_uses_the_factored_solve_and_cg_agrees(dtype):
    """natural_gradient's default solver for a KFAC metric is its exact factored solve (the same
    numbers as M.with_damping(c).solve, eagerly and under jit); solver="cg" runs CG on the KFAC
    products and agrees to its tolerance; solver="factored" on a metric without factors raises."""
    params, model, X = mlp(11, n=6, dtype=dtype)
    M = mg.kfac(model, "categorical", params, batch=(X, None))
    g = jax.tree_util.tree_map(jnp.ones_like, params)
    x = M.with_damping(0.1).solve(params, g)
    default = mg.natural_gradient(M, params, g, damping=0.1)
    jitted, info = jax.jit(lambda p, v: mg.natural_gradient(M, p, v, damping=0.1, return_info=True))(params, g)
    assert int(info.status) == 0
    by_cg = mg.natural_gradient(M, params, g, damping=0.1, solver="cg", tol=1e-10 if dtype == jnp.float64 else 1e-5)
    for a, b, c, d in zip(*(jax.tree_util.tree_leaves(t) for t in (default, x, jitted, by_cg))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(c), np.asarray(b), rtol=tol(dtype), atol=tol(dtype))
        # CG stops at a relative residual of tol: the error is at most cond(M + 0.1 I) times that
        cg_err = 1e-6 if dtype == jnp.float64 else 1e-2
        np.testing.assert_allclose(np.asarray(d), np.asarray(b), rtol=cg_err, atol=cg_err * float(jnp.max(jnp.abs(b))))
    with pytest.raises(mg.GeometryError, match="solver='factored' needs a metric with a factored inverse"):
        mg.natural_gradient(mg.ggn(lambda p: model(p, X), lambda z: jnp.mean(z**2)), params, g, solver="factored")


# ---------------------------------------------------------------------------
# (e) bad input raises clearly
# ---------------------------------------------------------------------------
def test_parameters_outside_dense_layers_are_named():
    params, model, X = mlp(12, n=4)
    p = {"net": params, "scale": jnp.ones(4)}
    f = lambda p, x: model(p["net"], x) * p["scale"]
    with pytest.raises(mg.GeometryError, match=r"not in a dense layer.*\['scale'\] \(4,\)"):
        mg.kfac(f, "categorical", p, batch=(X, None))


def test_a_weight_used_twice_is_not_a_dense_layer():
    W = jnp.eye(3)
    f = lambda p, x: (x @ p["W"]) @ p["W"]
    with pytest.raises(mg.GeometryError, match=r"\['W'\] \(3, 3\)"):
        mg.kfac(f, "categorical", {"W": W}, batch=(jnp.ones((2, 3)), None))


def test_a_three_axis_weight_is_not_a_dense_layer():
    f = lambda p, x: jnp.einsum("ni,hij->nj", x, p["W"])
    with pytest.raises(mg.GeometryError, match=r"not in a dense layer"):
        mg.ekfac(f, "categorical", {"W": jnp.ones((2, 3, 4))}, batch=(jnp.ones((2, 3)), None))


def test_vectors_and_params_of_other_shapes_raise():
    params, model, X = mlp(13, n=4)
    M = mg.kfac(model, "categorical", params, batch=(X, None))
    bad = jax.tree_util.tree_map(jnp.ones_like, params)
    bad[0]["W"] = jnp.ones((2, 2))
    with pytest.raises(mg.GeometryError):
        M.mv(params, bad)
    with pytest.raises(mg.GeometryError, match="built for parameters"):
        M.mv(bad, bad)
    with pytest.raises(mg.GeometryError, match="built for parameters"):
        M.with_damping(1.0).solve(bad, bad)


def test_negative_damping_raises():
    params, model, X = mlp(14, n=4)
    M = mg.kfac(model, "categorical", params, batch=(X, None))
    with pytest.raises(mg.GeometryError, match="damping"):
        M.with_damping(-1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"reduction": "max"}, "reduction"),
        ({"mc_samples": 3}, "PRNG key"),
        ({"mc_samples": 0, "key": jax.random.PRNGKey(0)}, "mc_samples"),
    ],
)
def test_bad_options_raise(kwargs, match):
    params, model, X = mlp(15, n=4)
    with pytest.raises(mg.GeometryError, match=match):
        mg.kfac(model, "categorical", params, batch=(X, None), **kwargs)


def test_unknown_likelihood_and_outputs_without_classes_raise():
    params, model, X = mlp(16, n=4)
    with pytest.raises(mg.GeometryError, match="unknown likelihood"):
        mg.kfac(model, "poisson", params, batch=(X, None))
    with pytest.raises(mg.GeometryError, match=r"shape \(N, C\)"):
        mg.kfac(lambda p, x: model(p, x)[:, 0], "gaussian", params, batch=(X, None))


# ---------------------------------------------------------------------------
# (f) under jit: works, compiles once per shape
# ---------------------------------------------------------------------------
def test_under_jit_equal_to_eager_and_compiled_once_per_shape():
    params, model, X = mlp(17, n=6)
    traces = [0]

    def counted(p, x):
        traces[0] += 1
        return model(p, x)

    @jax.jit
    def step(p, x, v):
        M = mg.kfac(counted, "categorical", p, batch=(x, None)).with_damping(0.1)
        return M.solve(p, v), M.mv(p, v)

    v = jax.tree_util.tree_map(jnp.ones_like, params)
    (x, y), n1 = compiles_during(step, params, X, v)
    eager = mg.kfac(model, "categorical", params, batch=(X, None)).with_damping(0.1)
    for a, b in zip(jax.tree_util.tree_leaves((x, y)), jax.tree_util.tree_leaves((eager.solve(params, v), eager.mv(params, v)))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)
    seen = traces[0]
    X2 = X + 1.0
    _, n2 = compiles_during(step, params, X2, v)
    assert n1 >= 1 and n2 == 0 and traces[0] == seen  # same shapes: no new trace, no compilation
    _, n3 = compiles_during(step, params, jnp.concatenate([X, X2]), v)
    assert n3 >= 1 and traces[0] > seen  # a new batch size compiles once more
    _, n4 = compiles_during(step, params, jnp.concatenate([X2, X]), v)
    assert n4 == 0


def test_eager_construction_compiles_once_per_shape():
    params, model, X = mlp(18, n=6)
    v = jax.tree_util.tree_map(jnp.ones_like, params)

    def build_and_solve(x):
        M = mg.kfac(model, "categorical", params, batch=(x, None)).with_damping(0.1)
        return M.solve(params, v)

    build_and_solve(X)
    _, n = compiles_during(build_and_solve, X + 1.0)  # new data, same shapes: no compilation
    assert n == 0


# ---------------------------------------------------------------------------
# (g) EKFAC
# ---------------------------------------------------------------------------
def _sym_eigh(M):
    return np.linalg.eigh(0.5 * (M + M.T))[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ekfac_eigenvalues_are_the_exact_second_moments_in_the_kronecker_eigenbasis(dtype):
    params, model, X = mlp(19, sizes=(3, 5, 4), n=9, dtype=dtype)
    G = exact_ggn(model, params, X)
    E = dense(mg.ekfac(model, "categorical", params, batch=(X, None)), params)
    factors = mg.kronecker.kfac_factors(model, "categorical", params, batch=(X, None))
    assert np.all(E[~block_mask(params)] == 0.0)
    for layer, f in enumerate(factors):
        i = layer_index(params, layer)
        Q = np.kron(_sym_eigh(np.asarray(f.A, np.float64)), _sym_eigh(np.asarray(f.B, np.float64)))
        in_basis = Q.T @ E[np.ix_(i, i)] @ Q
        exact = np.diag(Q.T @ G[np.ix_(i, i)] @ Q)
        s = np.abs(exact).max()
        # float32: the eigenbasis itself is computed in float32 (rotations within near-equal eigenvalues)
        t = tol(dtype) if dtype == jnp.float64 else 1e-4
        np.testing.assert_allclose(np.diag(in_basis), exact, atol=t * s, rtol=0)
        np.testing.assert_allclose(in_basis - np.diag(np.diag(in_basis)), 0, atol=t * s)


@pytest.mark.parametrize("seed", range(5))
def test_ekfac_is_at_least_as_close_to_the_exact_ggn_as_kfac(seed):
    params, model, X = mlp(seed + 100, sizes=(4, 6, 5, 3), n=12)
    G = exact_ggn(model, params, X)
    K = dense(mg.kfac(model, "categorical", params, batch=(X, None)), params)
    E = dense(mg.ekfac(model, "categorical", params, batch=(X, None)), params)
    eK, eE = np.linalg.norm(K - G), np.linalg.norm(E - G)
    assert eE <= eK * (1 + 1e-12), (eE, eK)
    assert eE < eK  # strictly, on these nets


# ---------------------------------------------------------------------------
# (d) curvlinops parity (torch)
# ---------------------------------------------------------------------------
def _torch_mlp(params, torch, dtype):
    layers = []
    for i, layer in enumerate(params):
        m, k = layer["W"].shape
        lin = torch.nn.Linear(m, k, bias="b" in layer, dtype=dtype)  # made in dtype: no float32 rounding
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.asarray(layer["W"]).T.copy()))
            if "b" in layer:
                lin.bias.copy_(torch.from_numpy(np.asarray(layer["b"]).copy()))
        layers.append(lin)
        if i < len(params) - 1:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def _to_torch_order(params, tree):
    """Our pytree -> curvlinops' list (weights transposed to (out, in), biases)."""
    out = []
    for layer, t in zip(params, tree):
        out.append(np.asarray(t["W"], np.float64).T)
        if "b" in layer:
            out.append(np.asarray(t["b"], np.float64))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["kfac", "ekfac"])
def test_agrees_with_curvlinops_on_a_torch_mlp(which, dtype):
    torch = pytest.importorskip("torch")
    curvlinops = pytest.importorskip("curvlinops")
    torch.manual_seed(0)
    params, model, X = mlp(20, sizes=(6, 8, 7, 4), n=32, dtype=dtype, bias=(True, False, True))
    y = np.zeros(32, np.int64)  # type-2 factors do not read the labels
    tdtype = torch.float32 if dtype == jnp.float32 else torch.float64
    net = _torch_mlp(params, torch, tdtype)
    data = [(torch.from_numpy(np.array(X)), torch.from_numpy(y))]
    loss = torch.nn.CrossEntropyLoss(reduction="mean")
    cls = curvlinops.KFACLinearOperator if which == "kfac" else curvlinops.EKFACLinearOperator
    op = cls(net, loss, list(net.parameters()), data, fisher_type="type-2", separate_weight_and_bias=False,
             check_deterministic=False)
    M = getattr(mg, which)(model, "categorical", params, batch=(X, None))
    r = rng(21)
    worst = 0.0
    for _ in range(3):
        v = jax.tree_util.tree_map(lambda a: jnp.asarray(r.normal(size=a.shape), dtype), params)
        ours = np.concatenate([a.ravel() for a in _to_torch_order(params, M.mv(params, v))])
        vt = [torch.from_numpy(a.astype(np.dtype(dtype))) for a in _to_torch_order(params, v)]
        theirs = op @ torch.cat([t.ravel() for t in vt])
        theirs = np.asarray(theirs.detach().numpy(), np.float64).ravel()
        worst = max(worst, np.abs(ours - theirs).max() / np.abs(theirs).max())
    print(f"{which} {np.dtype(dtype).name}: max relative difference to curvlinops {worst:.2e}")
    assert worst < tol(dtype), worst


# ---------------------------------------------------------------------------
# (5) the Kronecker-factored Laplace posterior against the dense one of the same precision
# ---------------------------------------------------------------------------
def _laplace_pair(which, dtype, alpha=0.5):
    params, model, X = mlp(30, sizes=(3, 5, 4), n=8, dtype=dtype, bias=(True, False))
    M = getattr(mg, which)(model, "categorical", params, batch=(X, None))
    nll = lambda p: jnp.sum(model(p, X) ** 2)  # not differentiated: the curvature is given
    full = mg.laplace_posterior(nll, params, curvature=M, prior_precision=alpha)
    kron = mg.laplace_posterior(nll, params, curvature=M, prior_precision=alpha, structure="kfac")
    return params, full, kron


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["kfac", "ekfac"])
def test_kronecker_laplace_matches_the_dense_posterior_of_the_kfac_matrix(which, dtype):
    params, full, kron = _laplace_pair(which, dtype)
    assert isinstance(kron, mg.densities.KroneckerLaplacePosterior) and int(kron.status) == 0
    logdet = 2 * np.sum(np.log(np.diag(np.asarray(full.cholesky, np.float64))))
    d = len(full.precision)
    np.testing.assert_allclose(float(kron.log_det_precision()), logdet, rtol=0, atol=tol(dtype) * d)
    C = np.asarray(full.covariance(), np.float64)
    np.testing.assert_allclose(np.asarray(kron.covariance(), np.float64), C, atol=tol(dtype) * np.abs(C).max())
    mv_full = np.asarray(jax.flatten_util.ravel_pytree(full.marginal_variance())[0], np.float64)
    mv_kron = np.asarray(jax.flatten_util.ravel_pytree(kron.marginal_variance())[0], np.float64)
    np.testing.assert_allclose(mv_kron, mv_full, atol=tol(dtype) * np.abs(mv_full).max())


def test_kronecker_laplace_samples_have_the_dense_covariance():
    params, full, kron = _laplace_pair("kfac", jnp.float64)
    n = 40_000
    draws = kron.sample(jax.random.PRNGKey(3), n)
    flat = np.asarray(jax.vmap(lambda t: jax.flatten_util.ravel_pytree(t)[0])(draws))
    mean = np.asarray(jax.flatten_util.ravel_pytree(params)[0])
    steps = flat - mean
    P = np.asarray(full.precision)
    d = len(P)
    # the Mahalanobis norms are chi-square with d degrees of freedom: mean d, standard error sqrt(2 d / n)
    maha = np.einsum("ni,ij,nj->n", steps, P, steps)
    assert abs(maha.mean() - d) < 5 * np.sqrt(2 * d / n)
    C = np.asarray(full.covariance())
    emp = steps.T @ steps / n
    assert np.abs(emp - C).max() < 5 * np.sqrt(2.0 / n) * np.abs(np.diag(C)).max()
    assert np.abs(steps.mean(0)).max() < 5 * np.sqrt(np.diag(C).max() / n)


def test_kronecker_laplace_bad_inputs_raise():
    params, model, X = mlp(31, n=6)
    nll = lambda p: jnp.sum(model(p, X) ** 2)
    with pytest.raises(mg.GeometryError, match="structure must be"):
        mg.laplace_posterior(nll, params, structure="diagonal")
    with pytest.raises(mg.GeometryError, match="needs curvature=mg.kfac"):
        mg.laplace_posterior(nll, params, structure="kfac")
    with pytest.raises(mg.GeometryError, match="mg.kfac or mg.ekfac"):
        mg.laplace_posterior(nll, params, curvature=mg.fisher(model, batch=(X, None)), structure="kfac")
    one = mlp(31, n=1)  # one example: singular factors, and no prior
    K = mg.kfac(one[1], "categorical", one[0], batch=(one[2], None))
    with pytest.raises(mg.GeometryError, match="NOT_POSITIVE_DEFINITE"):
        mg.laplace_posterior(nll, one[0], curvature=K, structure="kfac")
    post = jax.jit(lambda p: mg.laplace_posterior(nll, p, curvature=K, structure="kfac").status)(one[0])
    assert int(post) == mg.Status.NOT_POSITIVE_DEFINITE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["kfac", "ekfac", "fisher"])
def test_diagonal_laplace_is_the_diagonal_of_the_curvature_plus_the_prior(which, dtype):
    params, model, X = mlp(32, sizes=(3, 5, 4), n=8, dtype=dtype, bias=(True, False))
    if which == "fisher":
        M = mg.fisher(model, "categorical", batch=(X, None))  # no structure: read off the dense matrix
    else:
        M = getattr(mg, which)(model, "categorical", params, batch=(X, None))
    nll = lambda p: jnp.sum(model(p, X) ** 2)
    alpha = 0.25
    post = mg.laplace_posterior(nll, params, curvature=M, prior_precision=alpha, structure="diag")
    assert isinstance(post, mg.densities.DiagonalLaplacePosterior) and int(post.status) == 0
    truth = np.diag(dense(M, params)) + alpha
    got = np.asarray(jax.flatten_util.ravel_pytree(post.precision)[0], np.float64)
    np.testing.assert_allclose(got, truth, atol=tol(dtype) * truth.max())
    np.testing.assert_allclose(float(post.log_det_precision()), np.sum(np.log(truth)), atol=tol(dtype) * len(truth))
    mv = np.asarray(jax.flatten_util.ravel_pytree(post.marginal_variance())[0], np.float64)
    np.testing.assert_allclose(mv, 1 / truth, rtol=tol(dtype))
    draws = post.sample(jax.random.PRNGKey(0), 4)
    assert jax.tree_util.tree_leaves(draws)[0].shape[0] == 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_estimators_solve_a_kfac_metric_through_its_factors(dtype):
    """``metric=mg.kfac(...)`` in ``top_eigenvalues`` and ``trace_estimate`` applies :math:`K^{-1}` through
    the factors, not by conjugate gradients: with ``maxiter=1`` (one CG step, far from converged on
    this metric) the eigenvalues of :math:`K^{-1}H` still match ``scipy.linalg.eigh(H, K)`` of the
    dense matrices, eagerly and under ``jit``, and the Hutchinson trace is unbiased around
    :math:`\\mathrm{tr}(K^{-1}H)` within its standard error."""
    import scipy.linalg

    params, model, X = mlp(11, n=8, dtype=dtype)
    y = jnp.asarray(rng(12).integers(0, 4, size=8))
    loss = lambda p: -jnp.mean(jax.nn.log_softmax(model(p, X))[jnp.arange(8), y])
    K = mg.kfac(model, "categorical", params, batch=(X, None)).with_damping(1e-2)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    H = np.asarray(jax.hessian(lambda f: loss(unravel(f)))(flat), np.float64)
    Kd = np.asarray(K.dense(params), np.float64)
    truth = scipy.linalg.eigh(H, Kd, eigvals_only=True)[::-1]
    scale = np.abs(truth).max() * np.linalg.cond(Kd)
    key = jax.random.PRNGKey(3)
    eager = mg.top_eigenvalues(loss, params, key, k=3, metric=K, maxiter=1)
    jitted = jax.jit(lambda p: mg.top_eigenvalues(loss, p, key, k=3, metric=K, maxiter=1))(params)
    for got in (eager, jitted):
        np.testing.assert_allclose(np.asarray(got, np.float64), truth[:3], rtol=0, atol=tol(dtype, 1e3) * scale)
    est, se = mg.trace_estimate(loss, params, key, metric=K, num_probes=200, maxiter=1)
    exact = float(np.trace(np.linalg.solve(Kd, H)))
    assert abs(float(est) - exact) < 5 * float(se) + tol(dtype, 1e3) * abs(exact), (float(est), exact, float(se))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("maker", [mg.kfac, mg.ekfac], ids=["kfac", "ekfac"])
def test_spectral_density_draws_probes_from_the_factored_square_root(dtype, maker):
    """Without probes=, a KFAC / EKFAC metric draws z = (G + eps I)^{1/2} xi through its factors; the
    density equals the one from probes built with the dense symmetric square root (numpy eigh)."""
    params, model, X = mlp(seed=3, dtype=dtype)
    t = jnp.asarray(rng(4).integers(0, 4, size=X.shape[0]))

    def loss(p, batch):
        x, y = batch
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(model(p, x)), y[:, None], axis=1))

    G = maker(model, "categorical", params, batch=(X, None)).with_damping(0.05)
    Gd = np.asarray(G.dense(params), np.float64)
    lam, Q = np.linalg.eigh(0.5 * (Gd + Gd.T))
    L = Q @ np.diag(np.sqrt(lam)) @ Q.T
    d, P, m = Gd.shape[0], 4, 5
    key = jax.random.PRNGKey(7)
    xi = np.asarray(jax.random.rademacher(key, (P, d), dtype=dtype), np.float64)
    drawn = mg.spectral_density(loss, params, key, batch=(X, t), metric=G, num_probes=P, num_iterations=m)
    given = mg.spectral_density(loss, params, key, batch=(X, t), metric=G, probes=jnp.asarray(xi @ L.T, dtype),
                                num_iterations=m)
    cond = lam.max() / lam.min()
    scale = float(np.max(np.abs(given.nodes)))
    np.testing.assert_allclose(drawn.nodes, given.nodes, atol=tol(dtype, 1e2) * cond * scale)
    np.testing.assert_allclose(drawn.weights, given.weights, atol=tol(dtype, 1e2) * cond)
    # the probes' G^-1-norms are xi^T xi = d: every probe's weights sum to one
    np.testing.assert_allclose(np.asarray(drawn.weights.sum(axis=1)), 1.0, rtol=tol(dtype, 1e2))


# ---------------------------------------------------------------------------
# (6) layers shared by tokens: KFAC-expand and KFAC-reduce (Eschenhagen et al. 2023)
# ---------------------------------------------------------------------------
def token_net(seed=0, n=5, T=3, d_in=4, h=6, C=3, dtype=jnp.float64):
    """A token-wise layer (shared by T tokens), mean pooling over tokens, a head; and its pre-activation map."""
    r = rng(seed)
    params = {
        "tok": {"W": jnp.asarray(r.normal(size=(d_in, h)) / 2, dtype), "b": jnp.asarray(0.3 * r.normal(size=h), dtype)},
        "head": {"W": jnp.asarray(r.normal(size=(h, C)) / 2, dtype), "b": jnp.asarray(0.3 * r.normal(size=C), dtype)},
    }
    X = jnp.asarray(r.normal(size=(n, T, d_in)), dtype)

    def after(p, y):  # the logits from the token layer's outputs y (T, h) of one example
        return jnp.mean(jnp.tanh(y), axis=0) @ p["head"]["W"] + p["head"]["b"]

    def model(p, x):
        return jax.vmap(lambda xn: after(p, xn @ p["tok"]["W"] + p["tok"]["b"]))(x)

    return params, model, X, after


def _token_truth(params, X, after, sharing, fisher):
    """The token layer's factors from the forward pass and J_nt = dz_n / dy_nt (jax.jacfwd), F_n given:
    expand: A = mean_{n,t} xb xb^T, B = (1/N) sum_{n,t} J_nt^T F_n J_nt; reduce: the mean input and sum_t J_nt;
    and the exact GGN block of (W; b), (1/N) sum_n sum_{t,s} (xb_nt xb_ns^T) kron (J_nt^T F_n J_ns)."""
    P = {k: {kk: np.asarray(vv, np.float64) for kk, vv in v.items()} for k, v in params.items()}
    X = np.asarray(X, np.float64)
    n, T, _ = X.shape
    Xb = np.concatenate([X, np.ones((n, T, 1))], axis=2)
    units, block = [], 0.0
    for i in range(n):
        y = X[i] @ P["tok"]["W"] + P["tok"]["b"]
        z = np.asarray(after(P, jnp.asarray(y)))
        J = np.asarray(jax.jacfwd(lambda yy: after(P, yy))(jnp.asarray(y)))  # (C, T, h)
        F = fisher(z)
        block = block + sum(np.kron(np.outer(Xb[i, t], Xb[i, s]), J[:, t, :].T @ F @ J[:, s, :]) / n
                            for t in range(T) for s in range(T))
        if sharing == "expand":
            for t in range(T):
                units.append((Xb[i, t], J[:, t, :].T @ F @ J[:, t, :] / n))
        else:
            Js = J.sum(axis=1)
            units.append((Xb[i].mean(axis=0), Js.T @ F @ Js / n))
    A = sum(np.outer(x, x) for x, _ in units) / len(units)
    B = sum(b for _, b in units)
    return A, B, block


def _categorical_F(z):
    p = np.exp(z - z.max())
    p = p / p.sum()
    return np.diag(p) - np.outer(p, p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
# EKFAC's two ways to the per-example gradients' projections: T^2 (in + out) > in * out (3 tokens,
# 5 x 6: one column at a time) and <= (2 tokens, 9 x 8: the token Gram matrices)
@pytest.mark.parametrize("T, d_in, h", [(3, 4, 6), (2, 8, 8)], ids=["per-example", "gram"])
def test_token_layer_factors_match_the_forward_pass_and_jacobians(T, d_in, h, sharing, dtype):
    params, model, X, after = token_net(T=T, d_in=d_in, h=h, dtype=dtype)
    A, B, block = _token_truth(params, X, after, sharing, _categorical_F)
    tok, head = mg.kronecker.kfac_factors(model, "categorical", params, batch=(X, None), weight_sharing=sharing)
    assert (tok.weight, tok.bias) == ("['tok']['W']", "['tok']['b']")
    np.testing.assert_allclose(np.asarray(tok.A, np.float64), A, atol=tol(dtype) * np.abs(A).max())
    np.testing.assert_allclose(np.asarray(tok.B, np.float64), B, atol=tol(dtype) * np.abs(B).max())
    # EKFAC: s = the diagonal of the exact block (cross-token products included) in the eigenbasis of
    # the expand / reduce factors, index i * out + j of q_Ai kron q_Bj
    (e_tok, _) = mg.kronecker.kronecker_eigenbasis(
        mg.ekfac(model, "categorical", params, batch=(X, None), weight_sharing=sharing)
    )
    QA, QB = np.asarray(e_tok.QA, np.float64), np.asarray(e_tok.QB, np.float64)
    Q = np.kron(QA, QB)
    S = np.diag(Q.T @ block @ Q).reshape(QA.shape[0], QB.shape[0])
    np.testing.assert_allclose(np.asarray(e_tok.eigenvalues, np.float64), S, atol=tol(dtype) * np.abs(S).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_kfac_reduce_is_exact_for_a_mean_pooled_linear_token_layer(dtype):
    """y_nt = W^T x_nt + b, z_n = mean_t y_nt, Gaussian: the GGN is (1/N) sum_n xbar_n xbar_n^T (x) I, which
    KFAC-reduce gives exactly; KFAC-expand gives (1/(N T)) sum_{n,t} x x^T (x) I / T, not the same."""
    r = rng(5)
    n, T, d_in, C = 6, 4, 3, 2
    params = {"W": jnp.asarray(r.normal(size=(d_in, C)), dtype), "b": jnp.asarray(r.normal(size=C), dtype)}
    X = jnp.asarray(r.normal(size=(n, T, d_in)), dtype)
    model = lambda p, x: jnp.mean(x @ p["W"] + p["b"], axis=1)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    Jz = jax.jacfwd(lambda w: model(unravel(w), X).ravel())(flat)
    G = np.asarray(Jz, np.float64).T @ np.asarray(Jz, np.float64) / n  # the exact GGN, Gaussian sigma = 1
    reduce_ = np.asarray(mg.kfac(model, "gaussian", params, batch=(X, None), weight_sharing="reduce").dense(params))
    expand = np.asarray(mg.kfac(model, "gaussian", params, batch=(X, None)).dense(params))
    np.testing.assert_allclose(reduce_, G, atol=tol(dtype) * np.abs(G).max())
    assert np.abs(expand - G).max() > 0.1 * np.abs(G).max()


def test_weight_sharing_must_be_expand_or_reduce():
    params, model, X, _ = token_net()
    with pytest.raises(mg.GeometryError, match="weight_sharing must be 'expand' or 'reduce'"):
        mg.kfac(model, "categorical", params, batch=(X, None), weight_sharing="mean")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("which", ["kfac", "ekfac"])
def test_token_layers_agree_with_curvlinops(which, sharing, dtype):
    torch = pytest.importorskip("torch")
    curvlinops = pytest.importorskip("curvlinops")
    params, model, X, _ = token_net(seed=8, n=7, T=5, dtype=dtype)
    tdtype = torch.float32 if dtype == jnp.float32 else torch.float64

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Linear(*params["tok"]["W"].shape, dtype=tdtype)
            self.head = torch.nn.Linear(*params["head"]["W"].shape, dtype=tdtype)
            with torch.no_grad():
                for lin, name in ((self.tok, "tok"), (self.head, "head")):
                    lin.weight.copy_(torch.from_numpy(np.asarray(params[name]["W"]).T.copy()))
                    lin.bias.copy_(torch.from_numpy(np.asarray(params[name]["b"]).copy()))

        def forward(self, x):
            return self.head(torch.tanh(self.tok(x)).mean(dim=1))

    net = Net()
    data = [(torch.from_numpy(np.array(X)), torch.zeros(X.shape[0], dtype=torch.int64))]
    cls = curvlinops.KFACLinearOperator if which == "kfac" else curvlinops.EKFACLinearOperator
    op = cls(
        net, torch.nn.CrossEntropyLoss(), list(net.parameters()), data, fisher_type="type-2",
        kfac_approx=sharing, separate_weight_and_bias=False, check_deterministic=False,
    )
    K = getattr(mg, which)(model, "categorical", params, batch=(X, None), weight_sharing=sharing)
    order = lambda t: [np.asarray(t[k][w], np.float64).T if w == "W" else np.asarray(t[k][w], np.float64)
                       for k in ("tok", "head") for w in ("W", "b")]
    r = rng(9)
    worst = 0.0
    for _ in range(3):
        v = jax.tree_util.tree_map(lambda a: jnp.asarray(r.normal(size=a.shape), dtype), params)
        ours = np.concatenate([a.ravel() for a in order(K.mv(params, v))])
        vt = torch.cat([torch.from_numpy(a.astype(np.dtype(dtype))).ravel() for a in order(v)])
        theirs = np.asarray((op @ vt).detach().numpy(), np.float64).ravel()
        worst = max(worst, np.abs(ours - theirs).max() / np.abs(theirs).max())
    print(f"{which}-{sharing} {np.dtype(dtype).name}: max relative difference to curvlinops {worst:.2e}")
    assert worst < tol(dtype), worst


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_bias_added_after_a_residual_sum_is_the_layer_s_and_a_product_used_twice_has_none(dtype):
    """x + (h @ W) + b: b's gradient is the product's (the sums pass it on), so b joins W's block, which is then
    KFAC's exact block for one example; y used twice (y + b and y again): b's gradient is not y's, so b is
    refused instead of being given y's factor."""
    r = rng(12)
    d = 3
    params = {"W": jnp.asarray(r.normal(size=(d, d)), dtype), "b": jnp.asarray(r.normal(size=d), dtype)}
    X = jnp.asarray(r.normal(size=(1, d)), dtype)
    residual = lambda p, x: jnp.tanh(x + x @ p["W"] + p["b"])
    (f,) = mg.kronecker.kfac_factors(residual, "gaussian", params, batch=(X, None))
    assert (f.weight, f.bias) == ("['W']", "['b']")
    K = mg.kfac(residual, "gaussian", params, batch=(X, None)).dense(params)
    G = mg.ggn(residual, lambda z, t: 0.5 * jnp.sum(z**2), batch=(X, jnp.zeros((1, d), dtype))).dense(params)
    np.testing.assert_allclose(np.asarray(K), np.asarray(G), atol=tol(dtype) * float(jnp.abs(G).max()))
    with pytest.raises(mg.GeometryError, match=r"\['b'\]"):
        mg.kfac(lambda p, x: jnp.tanh((y := x @ p["W"]) + p["b"]) + y**2, "gaussian", params, batch=(X, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kronecker_laplace_of_a_token_model_matches_the_dense_posterior_of_its_kfac_matrix(dtype):
    params, model, X, _ = token_net(seed=13, dtype=dtype)
    M = mg.ekfac(model, "categorical", params, batch=(X, None), weight_sharing="reduce")
    nll = lambda p: jnp.sum(model(p, X) ** 2)  # not differentiated: the curvature is given
    full = mg.laplace_posterior(nll, params, curvature=M, prior_precision=0.5)
    kron = mg.laplace_posterior(nll, params, curvature=M, prior_precision=0.5, structure="kfac")
    logdet = 2 * np.sum(np.log(np.diag(np.asarray(full.cholesky, np.float64))))
    np.testing.assert_allclose(float(kron.log_det_precision()), logdet, rtol=0, atol=tol(dtype) * len(full.precision))
    C = np.asarray(full.covariance(), np.float64)
    np.testing.assert_allclose(np.asarray(kron.covariance(), np.float64), C, atol=tol(dtype) * np.abs(C).max())


_TOKEN_GAIN = 1.0  # a notebook-style global the model below reads


@pytest.mark.parametrize("dtype", DTYPES)
def test_factors_follow_a_global_the_model_reads_and_the_weight_sharing_asked_for(dtype):
    """Never stale: the model reads a global; between calls the global (and weight_sharing) change, and
    each call's factors equal the forward-pass / jax.jacfwd truth computed afresh with today's value."""
    global _TOKEN_GAIN
    params, _, X, _ = token_net(seed=14, dtype=dtype)

    def after(p, y):
        return jnp.mean(jnp.tanh(_TOKEN_GAIN * y), axis=0) @ p["head"]["W"] + p["head"]["b"]

    def model(p, x):
        return jax.vmap(lambda xn: after(p, xn @ p["tok"]["W"] + p["tok"]["b"]))(x)

    try:
        for gain in (1.0, 2.5, 1.0):
            _TOKEN_GAIN = gain
            for sharing in ("expand", "reduce"):
                A, B, _ = _token_truth(params, X, after, sharing, _categorical_F)
                tok, _ = mg.kronecker.kfac_factors(model, "categorical", params, batch=(X, None),
                                                   weight_sharing=sharing)
                np.testing.assert_allclose(np.asarray(tok.A, np.float64), A, atol=tol(dtype) * np.abs(A).max())
                np.testing.assert_allclose(np.asarray(tok.B, np.float64), B, atol=tol(dtype) * np.abs(B).max())
    finally:
        _TOKEN_GAIN = 1.0


_PRECISION = 1.0  # a notebook-style global the likelihood below reads


@pytest.mark.parametrize("dtype", DTYPES)
def test_factors_follow_a_global_the_likelihood_reads(dtype):
    """Never stale: a user's Gaussian likelihood reads its precision from a global.  B is linear in it
    (F_z = precision * I), A does not depend on it, and KFAC's and EKFAC's products follow it: each
    call's values equal the precision times those of a call at precision 1, also after going back."""
    global _PRECISION
    params, _, X, _ = token_net(seed=15, dtype=dtype)
    lik = mg.metrics.Likelihood(
        "gaussian",
        lambda z, u: _PRECISION * u,
        lambda key, z: z + jax.random.normal(key, z.shape, z.dtype) / jnp.sqrt(_PRECISION),
        lambda z, t: 0.5 * _PRECISION * jnp.sum((t - z) ** 2, axis=-1),
    )
    v = jax.tree_util.tree_map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)
    tok_model = lambda p, x: jax.vmap(lambda xn: jnp.mean(jnp.tanh(xn @ p["tok"]["W"] + p["tok"]["b"]), axis=0)
                                      @ p["head"]["W"] + p["head"]["b"])(x)

    def values():
        factors = mg.kronecker.kfac_factors(tok_model, lik, params, batch=(X, None))
        products = [mg.kfac(tok_model, lik, params, batch=(X, None)).mv(params, v),
                    mg.ekfac(tok_model, lik, params, batch=(X, None)).mv(params, v)]
        return [f.A for f in factors], [f.B for f in factors], jax.tree_util.tree_leaves(products)

    try:
        _PRECISION = 1.0
        A1, B1, P1 = values()
        for precision in (3.0, 1.0):
            _PRECISION = precision
            A, B, P = values()
            for got, want, scale in [*zip(A, A1, [1.0] * len(A)), *zip(B, B1, [precision] * len(B)),
                                     *zip(P, P1, [precision] * len(P))]:
                want = scale * np.asarray(want, np.float64)
                np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol(dtype) * np.abs(want).max())
    finally:
        _PRECISION = 1.0


# ---------------------------------------------------------------------------
# (7) a vision transformer: per-head projections, blocks under lax.scan, the other parameters held fixed
# ---------------------------------------------------------------------------
from minigeo.models import vit as _vit  # noqa: E402

_VIT = _vit.ViTConfig(image_size=8, patch_size=4, channels=3, num_classes=5, width=8, depth=2, heads=2, mlp_dim=12)
def vit_net(seed=0, n=3, dtype=jnp.float64):
    """A tiny ViT split as a user would: the dense parameters (a flat dict by path) and the rest, held
    fixed by the model's closure (layer norms, class token, position embedding)."""
    params = _vit.init_vit(jax.random.PRNGKey(seed), _VIT, dtype)
    r = rng(seed + 1)  # nonzero biases and layer norms, so that every term of the truth is exercised
    params = jax.tree_util.tree_map(lambda x: x + jnp.asarray(0.2 * r.normal(size=x.shape), dtype), params)
    dense_p, merge = _vit.vit_dense_params(params)
    X = jnp.asarray(r.normal(size=(n, 8, 8, 3)), dtype)
    return dense_p, merge, (lambda d, x: _vit.vit_apply(merge(d), x, _VIT)), X


def _vit_matrices(d):
    """Each layer's (in + 1, out) matrix [W; b] in program order, written out by hand from the leaves:
    per-head W_q (h, d, e) is the (d, h*e) matrix, W_o (h, d, e) contracting h and e the (h*e, d) one."""
    mats = [jnp.concatenate([d[("patch_embed", "kernel")], d[("patch_embed", "bias")][None]], 0)]
    for l in range(_VIT.depth):
        for w in "qkv":
            W, b = d[("blocks", "attn", f"W_{w}")][l], d[("blocks", "attn", f"b_{w}")][l]
            mats.append(jnp.concatenate([jnp.transpose(W, (1, 0, 2)).reshape(W.shape[1], -1), b.reshape(1, -1)], 0))
        Wo = d[("blocks", "attn", "W_o")][l]
        mats.append(jnp.concatenate([jnp.transpose(Wo, (0, 2, 1)).reshape(-1, Wo.shape[1]),
                                     d[("blocks", "attn", "b_o")][l][None]], 0))
        for fc in ("fc1", "fc2"):
            mats.append(jnp.concatenate([d[("blocks", "mlp", fc, "kernel")][l], d[("blocks", "mlp", fc, "bias")][l][None]], 0))
    mats.append(jnp.concatenate([d[("head", "kernel")], d[("head", "bias")][None]], 0))
    return mats


def _vit_by_hand(mats, probes, merge, X):
    """The tiny ViT written out layer by layer (no scan): outputs and every layer's inputs (with the 1 of
    its bias); each layer's product gets its probe added, so d z / d probe are the columns g."""
    p = merge({})
    it = iter(range(len(mats)))
    xs = []

    def dense_(x, k):
        xb = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], -1)
        xs.append(xb)
        return xb @ mats[k] + probes[k]

    def ln(x, q):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + _VIT.ln_eps) * q["scale"] + q["bias"]

    n, h = X.shape[0], _VIT.heads
    x = dense_(_vit.patchify(X, _VIT.patch_size), next(it))
    x = jnp.concatenate([jnp.broadcast_to(p["cls_token"], (n, 1, _VIT.width)), x], 1) + p["pos_embed"]
    for l in range(_VIT.depth):
        blk = jax.tree_util.tree_map(lambda a: a[l], p["blocks"])
        y = ln(x, blk["ln1"])
        q, k, v = (dense_(y, next(it)).reshape(n, -1, h, _VIT.head_dim).transpose(0, 2, 1, 3) for _ in range(3))
        a = jax.nn.softmax(jnp.einsum("bhte,bhse->bhts", q, k) / np.sqrt(_VIT.head_dim), axis=-1)
        mixed = jnp.einsum("bhts,bhse->bhte", a, v).transpose(0, 2, 1, 3).reshape(n, -1, h * _VIT.head_dim)
        x = x + dense_(mixed, next(it))
        y = jax.nn.gelu(dense_(ln(x, blk["ln2"]), next(it)), approximate=False)
        x = x + dense_(y, next(it))
    return dense_(ln(x[:, 0], p["ln_final"]), next(it)), xs


def _vit_truth(d, merge, X, exact_blocks=True):
    """Expand-sharing K-FAC factors and the exact GGN blocks of every layer, from the hand-written ViT:
    A = mean_{n,t} xb xb^T; B = (1/N) sum_{n,t,r} g g^T, g the columns of S_n (S_n S_n^T = diag p - p p^T)
    backpropagated to the layer's output; the exact block (1/N) sum_n J_n^T H_n J_n (jax.jacfwd; left
    out, [], with ``exact_blocks=False``)."""
    mats = [jnp.asarray(m, jnp.float64) for m in _vit_matrices(d)]
    X = jnp.asarray(X, jnp.float64)
    z, xs = _vit_by_hand(mats, [0.0] * len(mats), merge, X)
    probes = [jnp.zeros(x.shape[:-1] + (m.shape[1],)) for x, m in zip(xs, mats)]
    H = output_hessian(z, "categorical")
    lam, U = np.linalg.eigh(H)
    S = U * np.sqrt(np.maximum(lam, 0.0))[:, None, :]  # (N, C, R)
    _, vjp = jax.vjp(lambda pr: _vit_by_hand(mats, pr, merge, X)[0], probes)
    n = X.shape[0]
    A, B, blocks = [], [], []
    cols = [vjp(jnp.asarray(S[:, :, r]))[0] for r in range(S.shape[2])]
    for k, (x, m) in enumerate(zip(xs, mats)):
        x = np.asarray(x).reshape(-1, m.shape[0])
        A.append(x.T @ x / x.shape[0])
        B.append(sum(np.asarray(c[k]).reshape(-1, m.shape[1]).T @ np.asarray(c[k]).reshape(-1, m.shape[1])
                     for c in cols) / n)
        if not exact_blocks:
            continue

        def zk(mk, k=k):
            return _vit_by_hand([mk if j == k else mj for j, mj in enumerate(mats)], [0.0] * len(mats), merge, X)[0]

        J = np.asarray(jax.jacfwd(zk)(mats[k])).reshape(n, z.shape[1], -1)
        blocks.append(np.einsum("ncd,nce,nef->df", J, H, J) / n)
    return A, B, blocks


@pytest.mark.parametrize("dtype, n", [(jnp.float64, 3), (jnp.float32, 3), (jnp.float32, 256)])
def test_vit_kfac_factors_and_ekfac_eigenvalues_against_a_hand_written_vit(dtype, n):
    """Per-head projections (the (d, h*e) and (h*e, d) matrices), blocks unrolled from the scan, biases
    through the transposes and broadcasts, against the ViT written out by hand: the factors, and EKFAC's s
    as the diagonal of the exact block (jax.jacfwd) in the factors' eigenbasis.  Batch 256 in float32: on
    jaxlib 0.10.2 with its YNNPACK fusions on (minigeo._toolchain) this case fails: every entry of the patch
    embedding's B differs."""
    d, merge, model, X = vit_net(seed=3, n=n, dtype=dtype)
    z_hand, _ = _vit_by_hand(_vit_matrices(d), [0.0] * 14, merge, X)
    np.testing.assert_allclose(np.asarray(model(d, X)), np.asarray(z_hand), atol=tol(dtype) * 10)
    A, B, blocks = _vit_truth(d, merge, X)
    factors = mg.kronecker.kfac_factors(model, "categorical", d, batch=(X, None))
    names = [f.weight for f in factors]
    assert len(factors) == 14 and names[0] == "[('patch_embed', 'kernel')]" and names[-1] == "[('head', 'kernel')]"
    assert names[1:7] == [f"[('blocks', {s})][0]" for s in ("'attn', 'W_q'", "'attn', 'W_k'", "'attn', 'W_v'",
                                                            "'attn', 'W_o'", "'mlp', 'fc1', 'kernel'",
                                                            "'mlp', 'fc2', 'kernel'")]
    assert factors[4].bias == "[('blocks', 'attn', 'b_o')][0]" and factors[7].bias == "[('blocks', 'attn', 'b_q')][1]"
    for f, a, b in zip(factors, A, B):
        np.testing.assert_allclose(np.asarray(f.A, np.float64), a, atol=tol(dtype) * np.abs(a).max(), err_msg=f.weight)
        np.testing.assert_allclose(np.asarray(f.B, np.float64), b, atol=tol(dtype) * np.abs(b).max(), err_msg=f.weight)
    basis = mg.kronecker.kronecker_eigenbasis(mg.ekfac(model, "categorical", d, batch=(X, None)))
    for e, G in zip(basis, blocks):
        Q = np.kron(np.asarray(e.QA, np.float64), np.asarray(e.QB, np.float64))
        s = np.diag(Q.T @ G @ Q).reshape(e.eigenvalues.shape)
        np.testing.assert_allclose(np.asarray(e.eigenvalues, np.float64), s, atol=tol(dtype) * np.abs(s).max() * 10,
                                   err_msg=e.weight)


_VIT_GAIN = 1.0  # a notebook-style global the model below reads


@pytest.mark.parametrize("dtype", DTYPES)
def test_vit_factors_second_call_compiles_nothing_and_follows_new_images_and_a_global(dtype):
    """The compiled statistics are reused across eager calls (a new model closure, new images of the same
    shape), and nothing is stale: each call's factors equal the hand-written truth for that call's images
    and the value of a global the model reads (a gain on the images)."""
    global _VIT_GAIN
    d, merge, _, X = vit_net(seed=5, n=2, dtype=dtype)
    rel = 1e-12 if dtype == jnp.float64 else tol(dtype)
    X2 = jnp.flip(X, axis=1) + 0.5
    try:
        for k, (gain, images) in enumerate([(1.0, X), (1.0, X2), (2.0, X2)]):
            _VIT_GAIN = gain
            model = lambda p, x: _vit.vit_apply(merge(p), _VIT_GAIN * x, _VIT)
            if k == 0:
                factors = mg.kronecker.kfac_factors(model, "categorical", d, batch=(images, None))
            else:
                factors, n = compiles_during(mg.kronecker.kfac_factors, model, "categorical", d, batch=(images, None))
                assert n == 0, f"call {k} compiled {n} programs"
            A, B, _ = _vit_truth(d, merge, gain * images, exact_blocks=False)
            for f, a, b in zip(factors, A, B):
                assert f.A.dtype == dtype and f.B.dtype == dtype
                np.testing.assert_allclose(np.asarray(f.A, np.float64), a, atol=rel * np.abs(a).max(), err_msg=f.weight)
                np.testing.assert_allclose(np.asarray(f.B, np.float64), b, atol=rel * np.abs(b).max(), err_msg=f.weight)
    finally:
        _VIT_GAIN = 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_vit_kfac_products_solves_and_diagonal_land_on_the_right_entries(dtype):
    """The metric's product, damped solve and diagonal, read back through the hand-written layer
    matrices: (A kron B) vec V = vec(A V B) per layer, the solve inverts the damped product, and the
    diagonal is the dense matrix's (so the stacked leaves are put back together at the right blocks)."""
    d, merge, model, X = vit_net(seed=4, dtype=dtype)
    K = mg.kfac(model, "categorical", d, batch=(X, None))
    factors = mg.kronecker.kfac_factors(model, "categorical", d, batch=(X, None))
    r = rng(5)
    v = {k: jnp.asarray(r.normal(size=x.shape), dtype) for k, x in d.items()}
    out = _vit_matrices(K.mv(d, v))
    for f, V, R in zip(factors, _vit_matrices(v), out):
        want = np.asarray(f.A, np.float64) @ np.asarray(V, np.float64) @ np.asarray(f.B, np.float64)
        np.testing.assert_allclose(np.asarray(R, np.float64), want, atol=tol(dtype) * np.abs(want).max() * 10)
    Kd = K.with_damping(0.1)
    back = Kd.mv(d, Kd.solve(d, v))
    for k in v:
        np.testing.assert_allclose(np.asarray(back[k]), np.asarray(v[k]), atol=tol(dtype) * 1e3)
    flat_diag = jax.flatten_util.ravel_pytree(K.mv_fn.diagonal(d))[0]
    np.testing.assert_allclose(np.asarray(flat_diag), np.diag(np.asarray(K.dense(d))), atol=tol(dtype) * 10)
    with pytest.raises(mg.GeometryError, match=r"whole \(in, out\) leaf.*\('blocks', 'attn', 'W_q'\)\]\[0\]"):
        mg.laplace_posterior(lambda q: jnp.sum(model(q, X) ** 2), d, curvature=K, structure="kfac")
    with pytest.raises(mg.GeometryError, match=r"not in a dense layer.*ln1.*pos_embed"):
        mg.kfac(lambda p, x: _vit.vit_apply(p, x, _VIT), "categorical", merge(d), batch=(X, None))


def test_layers_in_a_reversed_scan_inside_a_nested_jit_equal_the_unrolled_model():
    """Scans are unrolled (reverse order included) and nested jit calls inlined: the factors equal those
    of the same model written as a Python loop, block by block."""
    r = rng(6)
    L, a, n = 3, 4, 5
    params = {"W": jnp.asarray(r.normal(size=(L, a, a)) / 2, jnp.float64), "b": jnp.asarray(r.normal(size=(L, a)), jnp.float64),
              "out": jnp.asarray(r.normal(size=(a, 3)), jnp.float64)}
    X = jnp.asarray(r.normal(size=(n, a)), jnp.float64)

    @jax.jit
    def blocks(p, x):
        return jax.lax.scan(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), x, (p["W"], p["b"]), reverse=True)[0]

    scanned = lambda p, x: blocks(p, x) @ p["out"]

    def looped(p, x):
        for l in reversed(range(L)):
            x = jnp.tanh(x @ p[f"W{l}"] + p[f"b{l}"])
        return x @ p["out"]

    split = {**{f"W{l}": params["W"][l] for l in range(L)}, **{f"b{l}": params["b"][l] for l in range(L)}, "out": params["out"]}
    got = mg.kronecker.kfac_factors(scanned, "categorical", params, batch=(X, None))
    want = mg.kronecker.kfac_factors(looped, "categorical", split, batch=(X, None))
    assert [f.weight for f in got] == ["['W'][2]", "['W'][1]", "['W'][0]", "['out']"]
    assert [f.bias for f in got] == ["['b'][2]", "['b'][1]", "['b'][0]", None]
    for f, g in zip(got, want):
        np.testing.assert_allclose(np.asarray(f.A), np.asarray(g.A), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(np.asarray(f.B), np.asarray(g.B), rtol=1e-12, atol=1e-14)
    K = mg.ekfac(scanned, "categorical", params, batch=(X, None))
    Ks = mg.ekfac(looped, "categorical", split, batch=(X, None))
    v = {"W": jnp.ones((L, a, a)), "b": jnp.ones((L, a)), "out": jnp.ones((a, 3))}
    vs = {**{f"W{l}": v["W"][l] for l in range(L)}, **{f"b{l}": v["b"][l] for l in range(L)}, "out": v["out"]}
    got_v, want_v = K.mv(params, v), Ks.mv(split, vs)
    np.testing.assert_allclose(np.asarray(got_v["W"]), np.stack([want_v[f"W{l}"] for l in range(L)]), rtol=1e-10)
    np.testing.assert_allclose(np.asarray(got_v["b"]), np.stack([want_v[f"b{l}"] for l in range(L)]), rtol=1e-10)
