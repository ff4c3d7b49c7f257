"""Chapter 7: is the chapter's Auto-PGD search (4 iterations at SIZE = "cpu") converged?

Trains the first seed pair of the chapter (pre-training seed 0, family seed 0, 16 fine-tunes) with
the chapter's own code (book/_capstone_study.py) and measures the three sharpness values at
rho = 0.1 and rho = 1 with the chapter's 4 iterations and with 20 (the reference implementation's
default), and prints the ratio long / short per measure (median and max over the 16 models) and
the Kendall tau of each with the gap. Usage (about 10 CPU-minutes):

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/ch7_search_convergence.py
"""

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "book"))
import _capstone_study as cs  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
short, long = cs.make_study(n_iter=4), cs.make_study(n_iter=20)
fam, stats = short.family(short.pretrain(jax.random.PRNGKey(0)), 0)
for rho in (0.1, 1.0):
    a, b = short.measure(fam, rho), long.measure(fam, rho)
    for k in ("adaptive", "geodesic", "straight"):
        q = b[k] / a[k]
        ta, tb = (cs.mg.stats.kendall_tau(v[k], stats["gap"]) for v in (a, b))
        print(
            f"rho {rho:4.1f} {k:9s} 20 it / 4 it: median {np.median(q):.3f}, max {q.max():.3f}; "
            f"tau with the gap {ta:+.2f} (4 it) {tb:+.2f} (20 it)", flush=True,
        )
