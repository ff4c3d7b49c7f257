"""minigeo's trace estimators against matfree's on the same Hessian and budget (issue 36).

matfree is not a dependency of minigeo; install it into a separate environment to run this, e.g.::

    python -m venv /tmp/mfenv && /tmp/mfenv/bin/pip install --no-deps matfree
    PYTHONPATH=<site-packages with jax>:. /tmp/mfenv/bin/python benchmarks/bench_matfree.py

Operator: the Hessian of ``x -> x^T A x / 2`` (``A = Q diag(k^-2) Q^T``, ``d = 200``, float64), reached
only through Hessian-vector products (``jax.jvp`` of ``jax.grad``) in both libraries.  Budget: matrix-vector
products (Hutchinson: one per probe; XTrace: ``budget/2`` test vectors, two products each).  Prints the
median |error| / trace over 30 keys, the largest difference of the two libraries' estimates with the
same key, and the median wall time of one call after a warm-up call (matfree's estimator under
``jax.jit``, as its documentation uses it; minigeo's eagerly, as a user calls it, and under ``jax.jit``).
"""

from __future__ import annotations

import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import minigeo as mg  # noqa: E402

try:
    import matfree
    from matfree import stochtrace
except ImportError:  # pragma: no cover
    matfree = None


def problem(d: int = 200):
    Q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(d, d)))
    A = jnp.asarray(Q @ np.diag(1.0 / np.arange(1, d + 1) ** 2) @ Q.T)
    f = lambda x: 0.5 * x @ A @ x
    return f, jnp.zeros(d), float(jnp.trace(A))


def timed(call, keys):
    call(keys[0])  # warm-up (compilation)
    values, times = [], []
    for k in keys:
        t0 = time.perf_counter()
        v = call(k)
        jax.block_until_ready(v)
        times.append(time.perf_counter() - t0)
        values.append(float(v))
    return np.asarray(values), float(np.median(times))


def main(keys: int = 30) -> str:
    f, x, truth = problem()
    hvp = lambda v: jax.jvp(jax.grad(f), (x,), (v,))[1]
    ks = [jax.random.PRNGKey(i) for i in range(keys)]
    rows = ["| budget | estimator | minigeo error | matfree error | max |minigeo - matfree| / trace | minigeo time (eager) "
            "| minigeo time (jit) | matfree time (jit) |", "|---|---|---|---|---|---|---|---|"]
    for budget in (30, 60):
        for name, method, make in [
            ("Hutchinson", "hutchinson", lambda: stochtrace.estimator_monte_carlo_mean_and_sem(
                stochtrace.monte_carlo_trace(), stochtrace.sampler_signs(x, num=budget))),
            ("XTrace", "xtrace", lambda: stochtrace.estimator_leave_one_out_mean_and_sem(
                stochtrace.leave_one_out_xtrace(), stochtrace.sampler_sphere(x, num=budget // 2))),
        ]:
            mine, t_mine = timed(lambda k: mg.trace_estimate(f, x, k, num_probes=budget, method=method)[0], ks)
            _, t_jit = timed(jax.jit(lambda k: mg.trace_estimate(f, x, k, num_probes=budget, method=method)[0]), ks)
            est = jax.jit(lambda k, e=make(): e(hvp, k)[0])
            theirs, t_theirs = timed(est, ks)
            e_mine = np.median(np.abs(mine - truth)) / truth
            e_theirs = np.median(np.abs(theirs - truth)) / truth
            diff = np.max(np.abs(mine - theirs)) / truth
            rows.append(f"| {budget} | {name} | {e_mine:.2e} | {e_theirs:.2e} | {diff:.1e} | {1e3 * t_mine:.1f} ms "
                        f"| {1e3 * t_jit:.2f} ms | {1e3 * t_theirs:.2f} ms |")
    return "\n".join(rows)


if __name__ == "__main__":
    if matfree is None:
        raise SystemExit("matfree is not installed (it is not a minigeo dependency); see the module docstring.")
    from importlib.metadata import version

    print(f"jax {jax.__version__}, matfree {version('matfree')}, {jax.devices()[0].platform}, float64, d = 200, k^-2 spectrum\n")
    print(main())
