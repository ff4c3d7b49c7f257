"""issue 30, peer rows: ``top_eigenvalues(k=5)`` against scipy ``eigsh`` on a jitted JAX HVP, side by side.

One process, one MLP (tanh, Gaussian inputs, random labels; sizes from ``--sizes``), float32 and
float64: the first call of ``mg.top_eigenvalues(k=5)`` (compilation included), the median of the
following calls, products (``return_info``), and the same for
``scipy.sparse.linalg.eigsh(LinearOperator(jit(hvp)), k=5, which="LA")`` (products counted, compile
of the HVP included in its first call).  Errors against a dense float64 ``eigh`` when ``d`` is small,
else against eigsh(tol=1e-10) in float64.  Ratio = minigeo / eigsh, second-call medians.

    python benchmarks/bench_eig_speed.py [--sizes 64,96,64,10] [--rounds 3] [--block-sizes 7,5]
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import scipy.sparse.linalg as sla  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _harness  # noqa: E402
import minigeo as mg  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,96,64,10")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-sizes", default="default")
    a = ap.parse_args(argv)
    sizes = tuple(int(s) for s in a.sizes.split(","))
    params64, model, y = _harness.mlp(jax.random.PRNGKey(0), sizes=sizes, batch=a.batch)
    ce = _harness.cross_entropy(y)
    flat64, unravel64 = jax.flatten_util.ravel_pytree(params64)
    d = flat64.size
    print(f"MLP {sizes} batch {a.batch}: d = {d}; {_harness.describe_machine()}")
    # reference (float64)
    loss64 = lambda p: ce(model(p))  # noqa: E731
    hvp64 = jax.jit(lambda v: jax.jvp(jax.grad(lambda x: loss64(unravel64(x))), (flat64,), (v,))[1])
    if d <= 20000:
        H = jax.vmap(hvp64)(jnp.eye(d)) if d <= 4000 else None
    ref = np.sort(sla.eigsh(sla.LinearOperator((d, d), matvec=lambda v: np.asarray(hvp64(jnp.asarray(v))),
                                                dtype=np.float64), k=5, which="LA", tol=1e-12,
                            return_eigenvectors=False))[::-1]
    print("reference top 5 (float64 eigsh tol 1e-12):", np.array2string(ref, precision=6))
    rows = []
    for dtype in (jnp.float32, jnp.float64):
        params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params64)
        flat, unravel = jax.flatten_util.ravel_pytree(params)
        key = jax.random.PRNGKey(7)

        def loss(p):
            X = None  # noqa: F841  (the model closes over its inputs, cast below)
            return ce(model(p).astype(dtype))

        impls = {}
        for bs in a.block_sizes.split(","):
            bsz = None if bs == "default" else int(bs)

            def mg_call(bsz=bsz):
                vals, info = mg.top_eigenvalues(loss, params, key, k=5, block_size=bsz, return_info=True)
                return np.asarray(jax.block_until_ready(vals)), int(info.num_products)

            impls[f"minigeo p={bs}"] = mg_call
        count = [0]
        hvp = jax.jit(lambda v: jax.jvp(jax.grad(lambda x: loss(unravel(x))), (flat,), (v,))[1])

        def matvec(v):
            count[0] += 1
            return np.asarray(hvp(jnp.asarray(v, dtype)))

        v0 = np.random.default_rng(0).standard_normal(d).astype(dtype)

        def eigsh_call():
            count[0] = 0
            op = sla.LinearOperator((d, d), matvec=matvec, dtype=dtype)
            vals = np.sort(sla.eigsh(op, k=5, which="LA", v0=v0, return_eigenvectors=False))[::-1]
            return vals, count[0]

        impls["scipy eigsh (jit hvp)"] = eigsh_call
        res = {n: {"times": []} for n in impls}
        for r in range(a.rounds + 1):
            for n, fn in impls.items():
                t = time.perf_counter()
                vals, prods = fn()
                dt = time.perf_counter() - t
                if r == 0:
                    res[n]["first"] = dt
                else:
                    res[n]["times"].append(dt)
                res[n]["vals"], res[n]["prods"] = vals, prods
        base = np.median(res["scipy eigsh (jit hvp)"]["times"])
        for n, r in res.items():
            med = np.median(r["times"])
            err = np.max(np.abs(r["vals"] - ref) / np.abs(ref))
            rows.append((np.dtype(dtype).name, n, r["first"], med, r["prods"], err, med / base))
    print(f"| dtype | method | first call s | later calls s (median) | products | max rel. err | ratio to eigsh |")
    print("|---|---|---|---|---|---|---|")
    for dt, n, first, med, prods, err, ratio in rows:
        print(f"| {dt} | {n} | {first:.2f} | {med:.3f} | {prods} | {err:.1e} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
