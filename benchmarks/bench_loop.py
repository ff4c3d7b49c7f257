"""A user's loop over batches, written the ways people write it, against plain eager JAX (issue 30).

For the MLP 784-256-256-10 (batch 128, float32), each row loops over 12 batches and times every
step; the table reports the median over steps 3-12 (after the first compilation) of

* minigeo: ``mg.hvp(f_b, params, v)`` with ``f_b`` made per batch as a lambda, a
  ``functools.partial(loss, batch=b)``, a ``jax.tree_util.Partial``, a bound method of a
  per-batch object, and a lambda scaled by a per-step Python float; and
  ``mg.natural_gradient(mg.ggn(...), params, g)`` with a new damped GGN ``Metric`` per batch;
* plain eager JAX doing the same work with the same callable: ``jax.jvp(jax.grad(f_b))`` and
  ``jax.scipy.sparse.linalg.cg`` on the same damped GGN product (same tol, maxiter);

and the XLA compilations in steps 2-12 (target: 0) and the ratio minigeo / plain (target <= 1.5).

    JAX_PLATFORMS=cpu python benchmarks/bench_loop.py [--steps 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax import monitoring

import minigeo as mg

_COMPILES = [0]


def _listener(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


monitoring.register_event_duration_secs_listener(_listener)


def problem(steps: int, batch: int = 128):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "W1": jax.random.normal(k[0], (784, 256)) / 28.0,
        "W2": jax.random.normal(k[1], (256, 256)) / 16.0,
        "W3": jax.random.normal(k[2], (256, 10)) / 16.0,
    }

    def model(p, x):
        return jnp.tanh(jnp.tanh(x @ p["W1"]) @ p["W2"]) @ p["W3"]

    def loss(p, b):
        x, y = b
        return -jnp.mean(jax.nn.log_softmax(model(p, x))[jnp.arange(x.shape[0]), y])

    batches = [
        (jax.random.normal(jax.random.PRNGKey(10 + i), (batch, 784)), jnp.arange(batch) % 10) for i in range(steps)
    ]
    return params, model, loss, batches


class Trainer:
    def __init__(self, loss, batch):
        self._loss, self.batch = loss, batch

    def loss(self, p):
        return self._loss(p, self.batch)


def time_loops(mg_fn, plain_fn, batches):
    """Both loops interleaved step by step (fair under a noisy machine): medians over steps 3.. and recompiles."""
    t_mg, t_plain, compiles = [], [], []
    for i, b in enumerate(batches):
        before = _COMPILES[0]
        t = time.perf_counter()
        jax.block_until_ready(mg_fn(i, b))
        t_mg.append(time.perf_counter() - t)
        compiles.append(_COMPILES[0] - before)
        t = time.perf_counter()
        jax.block_until_ready(plain_fn(i, b))
        t_plain.append(time.perf_counter() - t)
    return statistics.median(t_mg[2:]) * 1e3, statistics.median(t_plain[2:]) * 1e3, sum(compiles[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    params, model, loss, batches = problem(args.steps)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    plain_hvp = lambda f: jax.jvp(jax.grad(f), (params,), (v,))[1]
    makers = {
        "lambda": lambda i, b: (lambda p: loss(p, b)),
        "functools.partial": lambda i, b: functools.partial(loss, b=b),
        "jax.tree_util.Partial": lambda i, b: jax.tree_util.Partial(loss, b=b),
        "bound method": lambda i, b: Trainer(loss, b).loss,
        "per-step Python float": lambda i, b: (lambda p: (1.0 + 0.01 * i) * loss(p, b)),
    }
    rows = []
    for name, make in makers.items():
        mg_ms, jx_ms, mg_c = time_loops(
            lambda i, b: mg.hvp(make(i, b), params, v), lambda i, b: plain_hvp(make(i, b)), batches
        )
        rows.append(dict(row=f"hvp, {name}", minigeo_ms=mg_ms, plain_ms=jx_ms, ratio=mg_ms / jx_ms, recompiles=mg_c))

    ce = lambda z, y: -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(z.shape[0]), y])
    g = jax.grad(lambda p: loss(p, batches[0]))(params)
    flat_g, unravel = jax.flatten_util.ravel_pytree(g)
    damping, tol, maxiter = 1e-2, 1e-5, 50

    def mg_step(i, b):
        G = mg.ggn(lambda p: model(p, b[0]), lambda z: ce(z, b[1])).with_damping(damping)
        return mg.natural_gradient(G, params, g, tol=tol, maxiter=maxiter, return_info=True)[0]

    def plain_step(i, b):
        f = lambda p: model(p, b[0])

        def mv(u):
            _, Ju = jax.jvp(f, (params,), (u,))
            z = f(params)
            HJu = jax.jvp(jax.grad(lambda zz: ce(zz, b[1])), (z,), (Ju,))[1]
            out = jax.vjp(f, params)[1](HJu)[0]
            return jax.tree_util.tree_map(lambda a, c: a + damping * c, out, u)

        return jax.scipy.sparse.linalg.cg(mv, g, tol=tol, maxiter=maxiter)[0]

    mg_ms, jx_ms, mg_c = time_loops(mg_step, plain_step, batches)
    rows.append(
        dict(row="natural_gradient, new GGN Metric per batch (CG)", minigeo_ms=mg_ms, plain_ms=jx_ms, ratio=mg_ms / jx_ms,
             recompiles=mg_c)
    )
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores, MLP 784-256-256-10, batch 128, float32")
    print(f"{'row':55s} {'minigeo ms':>11s} {'plain JAX ms':>13s} {'ratio':>6s} {'recompiles':>11s}")
    for r in rows:
        print(f"{r['row']:55s} {r['minigeo_ms']:11.2f} {r['plain_ms']:13.2f} {r['ratio']:6.2f} {r['recompiles']:11d}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    import jax.flatten_util  # noqa: F401

    main()
