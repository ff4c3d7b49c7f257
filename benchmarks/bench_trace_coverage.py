"""Coverage of the trace estimators' standard errors: how often ``|estimate - trace| <= 2 se`` (issue 55, item 4).

Run: ``PYTHONPATH=. python benchmarks/bench_trace_coverage.py [--runs 400]`` (float64, CPU, a few minutes).

For each method (Hutchinson, Hutch++, XTrace) and budget (products with the matrix), ``--runs``
independent keys of :func:`minigeo.trace_estimate` on quadratics ``0.5 x^T A x`` (``--dim``, default 60) with three
spectra: flat (all eigenvalues 1 +- noise), polynomial decay ``k^-1`` and ``k^-2``.  A 95 % interval
should cover about 95 % of the runs; ``est +- 2 se`` with an honest standard error covers 95.4 %
when the estimate is Gaussian.  Prints a Markdown table of coverage (%) per spectrum, method and
budget.

The numbers quoted in ``trace_estimate``'s docstring and in the tests come from this script.
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import minigeo as mg  # noqa: E402

D = 60


def spectra(d: int) -> dict:
    k = np.arange(1, d + 1, dtype=float)
    rng = np.random.default_rng(1)
    return {"flat": 1.0 + 0.3 * rng.uniform(-1, 1, d), "k^-1": 1.0 / k, "k^-2": 1.0 / k**2}


def quadratic(lam: np.ndarray, seed: int = 0):
    Q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(lam.size, lam.size)))
    A = jnp.asarray(Q @ np.diag(lam) @ Q.T)
    return (lambda x: 0.5 * x @ A @ x), jnp.zeros(lam.size), float(np.sum(lam))


def coverage(method: str, budget: int, lam: np.ndarray, runs: int, width: float = 2.0) -> float:
    f, x0, truth = quadratic(lam)
    run = jax.jit(jax.vmap(lambda k: mg.trace_estimate(f, x0, k, method=method, num_probes=budget)))
    est, se = run(jax.random.split(jax.random.PRNGKey(budget), runs))
    est, se = np.asarray(est), np.asarray(se)
    return float(np.mean(np.abs(est - truth) <= width * se))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--budgets", default="4,6,9,12,20,30,60")
    ap.add_argument("--dim", type=int, default=D)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    print(f"coverage (%) of est +- 2 se over {args.runs} keys, d = {args.dim}, float64\n")
    print("| spectrum | method | " + " | ".join(f"budget {b}" for b in budgets) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in budgets) + " |")
    for name, lam in spectra(args.dim).items():
        for method in ("hutchinson", "hutch++", "xtrace"):
            cells = []
            for b in budgets:
                try:
                    cells.append(f"{100 * coverage(method, b, lam, args.runs):.0f}")
                except mg.GeometryError:
                    cells.append("refused")
            print(f"| {name} | {method} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
