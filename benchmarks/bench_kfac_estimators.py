#!/usr/bin/env python
"""Estimators with a K-FAC metric: solves through the factors against conjugate gradients, side by side.

``mg.top_eigenvalues(loss, params, key, k=5, metric=K)`` and ``mg.trace_estimate(..., metric=K)`` apply
:math:`K^{-1}` through the Kronecker factors of ``K = mg.kfac(...).with_damping(eps)`` (exact, no
iterations).  The baseline is the same operator without its structure tag: ``mg.Metric(K.mv_fn,
damping=eps)``, whose inverse the estimators apply by conjugate gradients (``tol=1e-6``, float32),
as they did for every K-FAC metric before.  On an MLP (tanh, float32, batch 256, mean cross-entropy)
the script prints, per estimator, the median eager time of both (second call onwards: compiled once),
their ratio factored / CG, and the relative difference of the results.

Usage: ``python benchmarks/bench_kfac_estimators.py [--sizes 256 128 128 10] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import cross_entropy, describe_machine, mlp, n_params  # noqa: E402

import minigeo as mg  # noqa: E402

EPS = 1e-2


def eager_median(fn, repeats: int) -> tuple[float, object]:
    out = jax.block_until_ready(fn())  # the first call compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 128, 128, 10])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    params, _, y = mlp(jax.random.PRNGKey(0), sizes=tuple(args.sizes))
    X = jax.random.normal(jax.random.PRNGKey(1), (y.shape[0], args.sizes[0]))

    def net(p, x):  # the harness MLP, with its inputs as an argument (mg.kfac reads the layers' inputs)
        for layer in p[:-1]:
            x = jnp.tanh(x @ layer["W"] + layer["b"])
        return x @ p[-1]["W"] + p[-1]["b"]

    loss = lambda p: cross_entropy(y)(net(p, X))  # noqa: E731
    K = mg.kfac(net, "categorical", params, batch=(X, None)).with_damping(EPS)
    K_cg = mg.Metric(K.mv_fn, "KFAC products only (CG)", EPS)
    key = jax.random.PRNGKey(2)
    print(f"# {describe_machine()}; MLP {'-'.join(map(str, args.sizes))}, d = {n_params(params)}, "
          f"float32, damping {EPS}, CG tol 1e-6")
    runs = {
        "top_eigenvalues k=5": lambda M, **o: mg.top_eigenvalues(loss, params, key, k=5, metric=M, **o),
        "trace_estimate 20 probes": lambda M, **o: mg.trace_estimate(loss, params, key, metric=M, num_probes=20,
                                                                     **o)[0],
    }
    print(f"{'estimator':26s} {'factored s':>11s} {'CG s':>9s} {'ratio':>7s} {'rel. diff':>10s}")
    for name, run in runs.items():
        t_f, out_f = eager_median(lambda: run(K), args.repeats)
        t_c, out_c = eager_median(lambda: run(K_cg, tol=1e-6, maxiter=1000), args.repeats)
        a, b = np.asarray(out_f, np.float64), np.asarray(out_c, np.float64)
        diff = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        print(f"{name:26s} {t_f:11.3f} {t_c:9.3f} {t_f / t_c:7.2f} {diff:10.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
