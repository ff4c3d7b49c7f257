"""Accuracy against the matrix-vector budget: traces, diagonals and spectral densities (issue 36).

Run: ``python benchmarks/bench_spectral.py`` (float64, CPU, about a minute).  Prints Markdown tables:

1. trace error vs budget, Hutchinson, Hutch++ and XTrace, on a spectrum decaying like k^-2 and on a
   flat one (median absolute error over 30 keys, relative to the trace; XTrace's median error estimate);
2. diagonal RMS error vs probes for Hutchinson (the m^-1/2 law), and Hutchinson against XDiag at
   equal budget on the k^-2 spectrum;
3. spectral-density moments tr(E^k)/d against the dense truth for E = G^-1 H with a dense metric,
   with the estimator's own standard error (z-scores).
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import minigeo as mg  # noqa: E402


def quadratic(lam: np.ndarray, seed: int = 0):
    d = lam.size
    Q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    A = jnp.asarray(Q @ np.diag(lam) @ Q.T)
    return (lambda x: 0.5 * x @ A @ x), jnp.zeros(d), A


def trace_table(d: int = 200, keys: int = 30) -> str:
    rows = ["| spectrum | budget | Hutchinson | Hutch++ | XTrace | XTrace error estimate | Hutch++ / Hutchinson | XTrace / Hutchinson |",
            "|---|---|---|---|---|---|---|---|"]
    for name, lam in [("k^-2", 1.0 / np.arange(1, d + 1) ** 2), ("flat (uniform on [0.5, 1.5])", np.linspace(0.5, 1.5, d))]:
        f, x, A = quadratic(lam)
        truth = float(jnp.trace(A))
        for budget in (12, 30, 60, 120):
            med = {}
            for method in ("hutchinson", "hutch++", "xtrace"):
                runs = [mg.trace_estimate(f, x, jax.random.PRNGKey(i), num_probes=budget, method=method) for i in range(keys)]
                med[method] = np.median([abs(float(e) - truth) for e, _ in runs]) / truth
                if method == "xtrace":
                    med["xtrace se"] = np.median([float(s) for _, s in runs]) / truth
            h = med["hutchinson"]
            rows.append(f"| {name} | {budget} | {h:.2e} | {med['hutch++']:.2e} | {med['xtrace']:.2e} | {med['xtrace se']:.2e} "
                        f"| {med['hutch++'] / h:.3f} | {med['xtrace'] / h:.3f} |")
    return "\n".join(rows)


def diagonal_table(d: int = 50, keys: int = 20) -> str:
    r = np.random.default_rng(1)
    B = r.normal(size=(d, d))
    A = jnp.asarray(B @ B.T / d + np.diag(r.uniform(0, 2, d)))
    f, x = (lambda v: 0.5 * v @ A @ v), jnp.zeros(d)
    truth = np.asarray(jnp.diag(A))
    rows = ["| probes m | RMS error | RMS error * sqrt(m) | mean reported SE |", "|---|---|---|---|"]
    for m in (4, 16, 64, 256):
        runs = [mg.diagonal_estimate(f, x, jax.random.PRNGKey(i), num_probes=m) for i in range(keys)]
        err = np.sqrt(np.mean([(np.asarray(e) - truth) ** 2 for e, _ in runs]))
        se = np.mean([np.asarray(s) for _, s in runs])
        rows.append(f"| {m} | {err:.3e} | {err * np.sqrt(m):.3f} | {se:.3e} |")
    return "\n".join(rows)


def xdiag_table(d: int = 100, keys: int = 20) -> str:
    f, x, A = quadratic(1.0 / np.arange(1, d + 1) ** 2)
    truth = np.asarray(jnp.diag(A))
    scale = np.sqrt(np.mean(truth**2))
    rows = ["| budget | Hutchinson | XDiag | XDiag mean reported error | XDiag / Hutchinson |", "|---|---|---|---|---|"]
    for budget in (12, 30, 60):
        err = {}
        for method in ("hutchinson", "xdiag"):
            runs = [mg.diagonal_estimate(f, x, jax.random.PRNGKey(i), num_probes=budget, method=method) for i in range(keys)]
            err[method] = np.sqrt(np.mean([(np.asarray(e) - truth) ** 2 for e, _ in runs])) / scale
            if method == "xdiag":
                err["se"] = np.sqrt(np.mean([np.asarray(s) ** 2 for _, s in runs])) / scale
        rows.append(f"| {budget} | {err['hutchinson']:.2e} | {err['xdiag']:.2e} | {err['se']:.2e} | {err['xdiag'] / err['hutchinson']:.3f} |")
    return "\n".join(rows)


def density_table(d: int = 60) -> str:
    r = np.random.default_rng(2)
    lam = np.concatenate([-np.ones(5), np.linspace(0.1, 3.0, d - 5)])
    f, x, H = quadratic(lam, seed=3)
    B = r.normal(size=(d, d))
    G = jnp.asarray(B @ B.T / d + np.eye(d))
    E = np.linalg.solve(np.asarray(G), np.asarray(H))
    dens = mg.spectral_density(f, x, jax.random.PRNGKey(0), metric=mg.metrics.dense(G), num_probes=30, num_iterations=20)
    rows = ["| k | tr(E^k)/d (dense) | SLQ estimate | standard error | z |", "|---|---|---|---|---|"]
    for k in range(1, 5):
        truth = np.trace(np.linalg.matrix_power(E, k)) / d
        est, se = (float(v) for v in dens.moments(k))
        rows.append(f"| {k} | {truth:.5f} | {est:.5f} | {se:.5f} | {(est - truth) / se:+.2f} |")
    return "\n".join(rows) + f"\n\nproducts: {dens.num_products} (30 probes x 20 Lanczos steps), d = {d}"


if __name__ == "__main__":
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, float64\n")
    print("### Trace: median |error| / trace over 30 keys\n")
    print(trace_table())
    print("\n### Diagonal (Hutchinson): RMS error over 20 keys\n")
    print(diagonal_table())
    print("\n### Diagonal, k^-2 spectrum (d = 100): RMS error / RMS diagonal over 20 keys, equal budget\n")
    print(xdiag_table())
    print("\n### Spectral density of E = G^-1 H (dense metric): moments\n")
    print(density_table())
