"""One Lanczos recurrence, two drivers (issue 53): the host driver against the compiled device loop.

``minigeo._eigen`` writes the block Lanczos steps once; :func:`~minigeo._eigen.block_lanczos` runs
them in one compiled ``fori_loop`` and :class:`~minigeo._eigen.ResumableBlockLanczos` runs the same
steps one by one from Python (for products a compiled loop cannot call: a pass over a dataset, an
eager solve), its basis in host memory.  Side by side in one process, on the benchmark MLP's size
(d = 13 098, block p = 5, 30 block steps, float32) with a cheap product (a rank-64 matrix plus a
small shift), so the recurrence itself, not the product, is what is timed:

* the first run of each (compilation included), and the median of later runs;
* the host driver extended as the adaptive eager path extends it (10, 15, 23, 30 blocks);
* the largest difference between the two drivers' projected matrices ``T`` (the same steps: round-off).

    JAX_PLATFORMS=cpu python benchmarks/bench_lanczos_drivers.py [--repeats 5] [--dim 13098]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

from minigeo._eigen import ResumableBlockLanczos, block_lanczos  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dim", type=int, default=13098)
    args = ap.parse_args()
    d, p, m = args.dim, 5, 30
    r = np.random.default_rng(0)
    B = jnp.asarray(r.standard_normal((d, 64)) / np.sqrt(d), jnp.float32)
    lam = jnp.asarray(np.geomspace(10, 0.01, 64), jnp.float32)
    h = lambda v: ((v @ B) * lam) @ B.T + 1e-3 * v  # noqa: E731
    h_block = jax.jit(jax.vmap(h))
    Z = jax.random.normal(jax.random.PRNGKey(0), (p, d), jnp.float32)
    key = jax.random.PRNGKey(1)

    device = jax.jit(lambda Z: block_lanczos(h, None, Z, m, key=key))

    def host(Z):
        run = ResumableBlockLanczos(h_block, None, Z, key=key)
        for steps in (10, 15, 23, m):
            out = run.projected(steps)
        return out

    results = {}
    for name, fn in (("device loop (jit)", device), ("host driver, 10-15-23-30 blocks", host)):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(Z))
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(Z))
            times.append(time.perf_counter() - t0)
        results[name] = (first, statistics.median(times), out)
    print(_harness.describe_machine())
    print(f"d = {d}, p = {p}, {m} block steps ({m * p} products), float32\n")
    print("| driver | first run (with compilation) s | later runs, median ms |")
    print("| --- | ---: | ---: |")
    for name, (first, median, _) in results.items():
        print(f"| {name} | {first:.2f} | {median * 1e3:.1f} |")
    (_, dev_t, dev), (_, host_t, hst) = results.values()
    diff = float(np.max(np.abs(np.asarray(dev[0], np.float64) - np.asarray(hst[0], np.float64))))
    print(f"\nhost / device, later runs: {host_t / dev_t:.2f}; max |T_host - T_device| = {diff:.2e} "
          f"(|T| max {float(np.max(np.abs(np.asarray(dev[0])))):.3g})")


if __name__ == "__main__":
    main()
