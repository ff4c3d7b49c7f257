"""Repeated eager calls: does a second call with same-shaped inputs recompile, and how far is it from a jitted call?

For the MLP 784-256-256-10 (batch 256) and minigeo's own tiny ViT (8x8x1 images, patch 2, width 64,
4 heads, 2 blocks, batch 128, ``minigeo.models.vit_apply``), and for each public curvature / metric
function, the script times

* the first eager call (compilation included),
* later eager calls (median), counting the XLA compilations they trigger,
* the same call inside the user's own ``jax.jit`` (median, after warm-up), in rounds that alternate
  with the eager calls,

and prints ``eager / jitted`` (issue 20's target: no compilation on the second call, ratio <= 1.5).

The ``trace`` column is the part of an eager call that no cache may skip: tracing the user's own
callables (the loss, the model) afresh, which is how an eager call sees a global or a closure that
changed since the last call (``minigeo._compile``).  ``floor = (jitted + trace) / jitted`` is the
ratio an eager call would have if everything else it does took no time.

    JAX_PLATFORMS=cpu python benchmarks/bench_eager.py [--repeats 7] [--models mlp,vit] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.flatten_util
import jax.numpy as jnp
from jax import monitoring

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

import minigeo as mg  # noqa: E402
import minigeo._compile as _compile  # noqa: E402  (the benchmark times its tracing of the user's callables)
import minigeo.models as mm  # noqa: E402

_COMPILES = [0]


def _count(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


monitoring.register_event_duration_secs_listener(_count)

_TRACE = [0.0]  # seconds spent tracing the user's callables (minigeo._compile._trace_users)
_trace_users = _compile._trace_users


def _timed_trace_users(*args):
    t0 = time.perf_counter()
    try:
        return _trace_users(*args)
    finally:
        _TRACE[0] += time.perf_counter() - t0


_compile._trace_users = _timed_trace_users


def _block(x):
    return jax.block_until_ready(x)


def interleaved(fn, jitted_fn, fargs, repeats: int):
    """(first eager call s, median eager s, median jitted s, compilations per round, median trace s).

    Eager and jitted calls alternate, round by round, so that a change in the machine's speed
    during the run (other processes, thermal) falls on both alike."""
    t0 = time.perf_counter()
    _block(fn(*fargs))
    first = time.perf_counter() - t0
    _block(jitted_fn(*fargs))  # compile the jitted call outside the timed rounds
    eager, jitted, traced, compiles = [], [], [], 0
    for _ in range(repeats):
        before = _COMPILES[0]
        _TRACE[0] = 0.0
        t0 = time.perf_counter()
        _block(fn(*fargs))
        eager.append(time.perf_counter() - t0)
        traced.append(_TRACE[0])
        compiles += _COMPILES[0] - before
        t0 = time.perf_counter()
        _block(jitted_fn(*fargs))
        jitted.append(time.perf_counter() - t0)
    return first, statistics.median(eager), statistics.median(jitted), compiles, statistics.median(traced)


def models(names):
    key = jax.random.PRNGKey(0)
    if "mlp" in names:
        params, model, labels = _harness.mlp(key)
        X = jax.random.normal(jax.random.split(key, 5)[-2], (256, 784))

        def model_b(p, x):
            h = x
            for layer in p[:-1]:
                h = jnp.tanh(h @ layer["W"] + layer["b"])
            return h @ p[-1]["W"] + p[-1]["b"]

        yield "MLP", params, model, labels, (model_b, X)
    if "vit" in names:
        cfg = mm.ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10, width=64, depth=2, heads=4, mlp_dim=256)
        params = mm.init_vit(key, cfg)
        images = jax.random.normal(jax.random.PRNGKey(1), (128, 8, 8, 1))
        labels = jax.random.randint(jax.random.PRNGKey(2), (128,), 0, 10)
        yield "tiny ViT", params, (lambda p: mm.vit_apply(p, images, cfg)), labels, (
            lambda p, x: mm.vit_apply(p, x, cfg), images)


def _size(p):
    return sum(x.size for x in jax.tree_util.tree_leaves(p))


def _flat(G, p):
    flat, unravel = jax.flatten_util.ravel_pytree(p)
    return lambda u: jax.flatten_util.ravel_pytree(G.mv(p, unravel(u)))[0]


def _ce(z, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=-1))


def cases(params, model, labels, with_inputs):
    ce = _harness.cross_entropy(labels)
    model_b, inputs = with_inputs
    batch = (inputs, labels)
    loss_b = lambda p, b: _ce(model_b(p, b[0]), b[1])
    loss = lambda p: ce(model(p))
    v = jax.tree_util.tree_map(lambda x: jnp.ones_like(x) / x.size, params)
    key = jax.random.PRNGKey(3)
    G = mg.metrics.ggn(model, ce)
    F = mg.metrics.fisher(model, "categorical")
    matvec = _flat(G.with_damping(1.0), params)  # made once: a matvec made per call compiles per call
    # "(batch argument)": the data are an argument of the call (as in a training loop), so the user's
    # jax.jit cannot fold them into its program as constants (minigeo never does: it keeps no data)
    return {
        "hvp": (lambda p, v: mg.hvp(loss, p, v), (params, v)),
        "hvp (batch argument)": (lambda p, v, b: mg.hvp(loss_b, p, v, batch=b), (params, v, batch)),
        "ggn(...).mv (batch argument)": (lambda p, v, b: mg.ggn(model_b, _ce, batch=b).mv(p, v), (params, v, batch)),
        "ggn(...).mv": (lambda p, v: G.mv(p, v), (params, v)),
        "fisher(...).mv": (lambda p, v: F.mv(p, v), (params, v)),
        "ggn(...).solve (CG, damping 1)": (
            lambda p, v: G.with_damping(1.0).solve(p, v, maxiter=200, tol=1e-3), (params, v)),
        "natural_gradient (CG, damping 1)": (
            lambda p, v: mg.natural_gradient(G, p, v, damping=1.0, maxiter=200, tol=1e-3), (params, v)),
        "logdet_slq (GGN + I, 10 probes, 20 steps)": (
            lambda p, k: mg.densities.logdet_slq(matvec, _size(p), k, num_probes=10, num_iterations=20)[0], (params, key)),
        "trace_estimate (10 probes)": (lambda p, k: mg.trace_estimate(loss, p, k)[0], (params, key)),
        "top_eigenvalues (k=5, 30 steps)": (
            lambda p, k: mg.top_eigenvalues(loss, p, k, k=5, num_iterations=30, rtol=None), (params, key)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--models", default="mlp,vit")
    ap.add_argument("--only", default="", help="comma-separated case names (prefix match)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    print(_harness.describe_machine(), f"jax {jax.__version__}")
    rows = []
    for name, params, model, labels, with_inputs in models(args.models.split(",")):
        for case, (fn, fargs) in cases(params, model, labels, with_inputs).items():
            if args.only and not any(case.startswith(o) for o in args.only.split(",")):
                continue
            first, eager, jitted, compiles, trace = interleaved(fn, jax.jit(fn), fargs, args.repeats)
            row = dict(model=name, case=case, first_s=first, eager_ms=1e3 * eager, jitted_ms=1e3 * jitted,
                       ratio=eager / jitted, compiles_per_call=compiles / args.repeats, trace_ms=1e3 * trace,
                       floor=(jitted + trace) / jitted)
            rows.append(row)
            print(f"{name:9s} {case:34s} first {first:7.2f} s  eager {1e3 * eager:9.2f} ms  jitted "
                  f"{1e3 * jitted:8.2f} ms  ratio {eager / jitted:6.2f}  trace {1e3 * trace:6.2f} ms  "
                  f"floor {(jitted + trace) / jitted:5.2f}  compiles/call {compiles / args.repeats:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
