"""Top eigenvalues with multiplicity (issue 31, item 1): minigeo's block Lanczos against scipy's eigsh.

For each case, dtype and path (``mg.top_eigenvalues`` eagerly with the adaptive default, and
``CurvatureOperator.top_eigenvalues`` over 2-3 batches), the largest relative error of the top k
against the dense ``numpy.linalg.eigh`` (float64), the products with the matrix, and the same for
``scipy.sparse.linalg.eigsh(which="LA", tol=1e-3)`` from a random start vector (ARPACK, implicitly
restarted single-vector Lanczos, products counted by a LinearOperator).

Cases: a Hessian with eigenvalues 10, 10, 10, 5, ... (d = 60); multi-output least squares (3 outputs,
every eigenvalue 3-fold, d = 120); a linear softmax classifier's GGN at W = 0 (every eigenvalue
(c - 1)-fold, c = 4, d = 64); a spectrum with 1, 1, 0.9 at the top and -100 below (d = 50); and the
MLP 784-256-256-10 of ``_harness.mlp`` (float32, clustered top five; reference: eigsh in float64
with tol 1e-10, so no dense matrix).

Run: ``PYTHONPATH=. python benchmarks/bench_eigen_multiplicity.py [--no-mlp]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.flatten_util

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse.linalg as sla  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import minigeo as mg  # noqa: E402
from minigeo import _eigen  # noqa: E402


def spectrum_matrix(lam, seed):
    r = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(r.normal(size=(len(lam), len(lam))))
    return (Q * lam) @ Q.T


def dense_cases():
    r = np.random.default_rng(0)
    out = {}
    out["mult-3 Hessian (d=60)"] = (spectrum_matrix(np.r_[10.0, 10.0, 10.0, 5.0, r.uniform(0, 4, 56)], 1), 3)
    X = r.normal(size=(50, 40)) / np.sqrt(50)
    out["multi-output LS (d=120)"] = (np.kron(X.T @ X, np.eye(3)), 3)
    Xs = r.normal(size=(64, 16)) * np.linspace(1.5, 0.5, 16)
    c = 4
    out["softmax GGN at W=0 (d=64)"] = (np.kron(Xs.T @ Xs / 64, np.eye(c) / c - np.ones((c, c)) / c**2), 4)
    out["indefinite, -100 (d=50)"] = (spectrum_matrix(np.r_[1.0, 1.0, 0.9, 0.8, -100.0, r.uniform(-1, 0.5, 45)], 2), 3)
    return out


def eigsh_row(matvec, d, k, dtype, exact, tol=1e-3):
    count = [0]

    def mv(v):
        count[0] += 1
        return np.asarray(matvec(jnp.asarray(np.ravel(v), dtype)), np.float64 if dtype == jnp.float64 else np.float32)

    op = sla.LinearOperator((d, d), matvec=mv, dtype=np.float64 if dtype == jnp.float64 else np.float32)
    v0 = np.random.default_rng(0).standard_normal(d)
    vals = np.sort(sla.eigsh(op, k=k, which="LA", v0=v0, tol=tol, return_eigenvectors=False))[::-1]
    return rel_err(vals, exact), count[0]


def rel_err(got, exact):
    got = np.asarray(got, np.float64)
    return float(np.max(np.abs(got - exact)) / np.max(np.abs(exact)))


def run_dense(rows):
    for name, (A64, k) in dense_cases().items():
        d = A64.shape[0]
        exact = np.sort(np.linalg.eigvalsh(A64))[::-1][:k]
        for dtype in (jnp.float32, jnp.float64):
            A = jnp.asarray(A64, dtype)
            f = lambda x: 0.5 * x @ (A @ x)
            got = mg.top_eigenvalues(f, jnp.zeros(d, dtype), jax.random.PRNGKey(0), k=k)
            fun = (rel_err(got, exact), _eigen.last_run["products"])
            data = mg.operators.batches_of(jnp.ones((6, 1), dtype), 2)
            op = mg.operators.hessian_operator(lambda w, x: 0.5 * jnp.mean(x[:, 0]) * (w @ (A @ w)), jnp.zeros(d, dtype))
            got_op = op.top_eigenvalues(jax.random.PRNGKey(0), data, k=k)
            opr = (rel_err(got_op, exact), _eigen.last_run["products"])
            es = eigsh_row(lambda v: A @ v, d, k, dtype, exact)
            rows.append((name, k, dtype.__name__, fun, opr, es))
            print(rows[-1], flush=True)


def run_mlp(rows):
    import _harness

    # the harness's network (x64 is on here, so cast: float32 weights and inputs, as without x64)
    params, model, y = _harness.mlp(jax.random.PRNGKey(0))
    keys = jax.random.split(jax.random.PRNGKey(0), 5)  # the harness's inputs, regenerated as it does
    X = jnp.asarray(jax.random.normal(keys[-2], (256, 784)), jnp.float32)
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
    loss = lambda p: loss_of_logits(_mlp_apply(p, X), y)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    d = flat.size
    # float64 reference by eigsh (tol 1e-10), on the same float32 weights and inputs cast to float64
    p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    X64 = jnp.asarray(X, jnp.float64)
    loss64 = lambda p: loss_of_logits(_mlp_apply(p, X64), y)
    unravel64 = jax.flatten_util.ravel_pytree(p64)[1]
    hvp64 = jax.jit(lambda v: jax.flatten_util.ravel_pytree(mg.hvp(loss64, p64, unravel64(v)))[0])
    ref_count = [0]

    def mv64(v):
        ref_count[0] += 1
        return np.asarray(hvp64(jnp.asarray(v, jnp.float64)))

    op64 = sla.LinearOperator((d, d), matvec=mv64, dtype=np.float64)
    v0 = np.random.default_rng(0).standard_normal(d)
    exact = np.sort(sla.eigsh(op64, k=5, which="LA", v0=v0, tol=1e-10, return_eigenvectors=False))[::-1]
    print("MLP reference (float64 eigsh, tol 1e-10):", exact, ref_count[0], "products", flush=True)
    got = mg.top_eigenvalues(loss, params, jax.random.PRNGKey(0), k=5)
    print("function", np.asarray(got), flush=True)
    fun = (rel_err(got, exact), _eigen.last_run["products"])
    jitted = jax.jit(lambda p: mg.top_eigenvalues(loss, p, jax.random.PRNGKey(0), k=5))(params)
    print("jit", np.asarray(jitted), flush=True)
    p = _eigen.default_block_size(5)
    jit_row = (rel_err(jitted, exact), _eigen.default_num_products(5, p))
    op = mg.operators.hessian_operator(lambda q, b: loss_of_logits(_mlp_apply(q, b[0]), b[1]), params)
    got_op = op.top_eigenvalues(jax.random.PRNGKey(0), mg.operators.batches_of((X, y), 128), k=5)
    opr = (rel_err(got_op, exact), _eigen.last_run["products"])
    hvp32 = jax.jit(lambda v: jax.flatten_util.ravel_pytree(mg.hvp(loss, params, unravel(v)))[0])
    es = eigsh_row(hvp32, d, 5, jnp.float32, exact)
    rows.append(("MLP 784-256-256-10 top-5", 5, "float32", fun, opr, es))
    rows.append(("MLP 784-256-256-10 top-5, jit default", 5, "float32", jit_row, ("-", "-"), ("-", "-")))
    print(rows[-2:], flush=True)


def _mlp_apply(p, X):
    h = X
    for layer in p[:-1]:
        h = jnp.tanh(h @ layer["W"] + layer["b"])
    return h @ p[-1]["W"] + p[-1]["b"]


def loss_of_logits(z, yy):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), yy[:, None], axis=1))


def fmt(x):
    return x if isinstance(x, str) else (f"{x:.1e}" if isinstance(x, float) else str(x))


def table(rows):
    lines = [
        "| case | k | dtype | function: max rel. error | products | operator: max rel. error | products | eigsh (tol 1e-3): max rel. error | products |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, k, dt, fun, opr, es in rows:
        lines.append(
            f"| {name} | {k} | {dt} | {fmt(fun[0])} | {fmt(fun[1])} | {fmt(opr[0])} | {fmt(opr[1])} | {fmt(es[0])} | {fmt(es[1])} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-mlp", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    run_dense(rows)
    if not args.no_mlp:
        run_mlp(rows)
    print()
    print(f"jax {jax.__version__}, {jax.default_backend()}")
    print(table(rows))


if __name__ == "__main__":
    main()
