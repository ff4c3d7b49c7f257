"""Peers of minigeo's randomized spectral estimators (issue 36): PyHessian's density, curvlinops' traces and diagonals.

One process, one model in both frameworks (``bench_peers.build_mlp``: identical weights, inputs and
labels in JAX and torch), small enough for a dense float64 Hessian and GGN in JAX as the truth
(default MLP 64-32-32-10, tanh, batch 256, cross-entropy: d = 3,466).  The estimators run in
float32 in both libraries, as they would be used; torch with ``torch.set_num_threads(2)``.

1. **Spectral density of the Hessian** (stochastic Lanczos quadrature): ``mg.spectral_density``
   against PyHessian's ``hessian.density(iter, n_v)`` with the same probes count and Lanczos
   steps; the moments tr(H^k)/d, k = 1..4, of the average Gauss rule against the dense spectrum
   (median relative error over ``--density-seeds`` seeds) and the median wall time of one call.
   PyHessian 0.1 calls ``torch.eig``, removed in torch 1.9; the script runs it with a shim that
   answers from ``torch.linalg.eigh`` (the tridiagonal matrix is symmetric), nothing else changed.
2. **Trace** of the GGN and of the Hessian against the matrix-vector budget: minigeo's Hutchinson,
   Hutch++ and XTrace against curvlinops' ``hutchinson_trace``, ``hutchpp_trace`` and ``xtrace``
   (and PyHessian's ``trace(maxIter=budget)``, Hutchinson, for the Hessian); median |error| / |trace|
   over ``--seeds`` seeds, and the median time of one estimate.
3. **Diagonal** of the GGN and of the Hessian against the budget: minigeo's Hutchinson and XDiag
   against curvlinops' ``hutchinson_diag`` and ``xdiag``; median ||error|| / ||diag||.

The peers are test-only extras, never needed by the book or the tests::

    pip install -r requirements-parity.txt -r benchmarks/requirements-peers.txt
    JAX_PLATFORMS=cpu python benchmarks/bench_spectral_peers.py            # about 5-10 minutes
    JAX_PLATFORMS=cpu python benchmarks/bench_spectral_peers.py --sizes 32,16,10 --seeds 5   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libgomp's default active spin-wait made a torch HVP 10x slower on the shared, loaded 2-core machine
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peers  # noqa: E402  (the model builders, the peer imports and versions)

import minigeo as mg  # noqa: E402

TRACE_METHODS = ("hutchinson", "hutch++", "xtrace")
DIAG_METHODS = ("hutchinson", "xdiag")


# ---------------------------------------------------------------------------
# pure numerics (no torch): moments of Gauss rules, error summaries, tables
# ---------------------------------------------------------------------------
def rule_moments(nodes, weights, ks=(1, 2, 3, 4)) -> dict:
    """Moments ``mean_l sum_i w_li theta_li^k`` of per-probe Gauss rules (rows = probes)."""
    nodes, weights = np.asarray(nodes, np.float64), np.asarray(weights, np.float64)
    return {k: float(np.mean(np.sum(weights * nodes**k, axis=1))) for k in ks}


def spectrum_moments(eigenvalues, ks=(1, 2, 3, 4)) -> dict:
    """The exact moments tr(H^k)/d of a dense spectrum."""
    lam = np.asarray(eigenvalues, np.float64)
    return {k: float(np.mean(lam**k)) for k in ks}


def relative_errors(estimates: dict, truth: dict) -> dict:
    return {k: abs(estimates[k] - truth[k]) / abs(truth[k]) for k in truth}


def median(xs) -> float:
    return float(statistics.median(xs))


def markdown(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# dense float64 truth (JAX)
# ---------------------------------------------------------------------------
def dense_truth(P, chunk: int = 256) -> dict:
    """Dense float64 Hessian and GGN of ``P`` (columns by batched products), their spectra and diagonals."""
    with jax.enable_x64(True):
        p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), P.params)
        flat, unravel = ravel_pytree(p64)
        d = flat.size
        G = mg.metrics.ggn(P.model_fn, P.ce)
        hv = jax.jit(jax.vmap(lambda e: ravel_pytree(mg.hvp(P.loss, p64, unravel(e)))[0]))
        gv = jax.jit(jax.vmap(lambda e: ravel_pytree(G.mv(p64, unravel(e)))[0]))
        out = {"d": d}
        for name, mv in (("hessian", hv), ("ggn", gv)):
            cols = [np.asarray(mv(jnp.eye(d, dtype=jnp.float64)[i : i + chunk])) for i in range(0, d, chunk)]
            A = np.concatenate(cols, axis=0)
            A = 0.5 * (A + A.T)
            lam = np.linalg.eigvalsh(A)
            out[name] = {"trace": float(np.trace(A)), "diag": np.diag(A).copy(), "eigenvalues": lam}
    return out


# ---------------------------------------------------------------------------
# the estimators of both libraries on the same curvature
# ---------------------------------------------------------------------------
def minigeo_trace_fn(P, curvature, method, budget):
    """A jitted ``key -> (estimate, se)`` of minigeo on the Hessian or the GGN of ``P``."""
    if curvature == "hessian":
        return jax.jit(lambda k: mg.trace_estimate(P.loss, P.params, k, num_probes=budget, method=method))
    op, batch = ggn_op(P), one_batch(P)
    return jax.jit(lambda k: op.trace_estimate(k, batch, num_probes=budget, method=method))


def minigeo_diag_fn(P, curvature, method, budget):
    if curvature == "hessian":
        f = jax.jit(lambda k: mg.diagonal_estimate(P.loss, P.params, k, num_probes=budget, method=method)[0])
    else:
        op, batch = ggn_op(P), one_batch(P)
        f = jax.jit(lambda k: op.diagonal_estimate(k, batch, num_probes=budget, method=method)[0])
    return lambda k: ravel_pytree(f(k))[0]


def ggn_op(P):
    """minigeo's GGN operator of ``P``: the model closes over its inputs, so the batch is a placeholder
    of the right length (one batch: the 1/N weights cancel)."""
    return mg.operators.ggn_operator(lambda p, _x: P.model_fn(p), lambda z, _t: P.ce(z), P.params)


def one_batch(P):
    n = int(P.x.shape[0])
    return [(jnp.zeros(n), jnp.zeros(n))]


def curvlinops_operator(torch, P, curvature):
    from curvlinops import GGNLinearOperator, HessianLinearOperator

    cls = GGNLinearOperator if curvature == "ggn" else HessianLinearOperator
    params = [p for p in P.net.parameters()]
    return cls(P.net, torch.nn.CrossEntropyLoss(), params, [(P.x, P.y)], check_deterministic=False)


def torch_flat_to_jax(torch, P, vec) -> np.ndarray:
    """A flat vector in torch's parameter order as a flat vector in minigeo's (W transposed, JAX leaf order)."""
    shapes = [p.shape for p in P.net.parameters()]
    parts = torch.split(vec.detach(), [int(np.prod(s)) for s in shapes])
    tensors = [t.reshape(s) for t, s in zip(parts, shapes)]
    return np.asarray(ravel_pytree(P.to_jax(tensors))[0], np.float64)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------------------
# 1. spectral density
# ---------------------------------------------------------------------------
def pyhessian_density_fn(torch, P, iters, n_v):
    import pyhessian  # noqa: F401

    pyh_mod = sys.modules["pyhessian.hessian"]
    crit = torch.nn.CrossEntropyLoss()

    def call(seed):
        torch.manual_seed(seed)
        P.net.zero_grad(set_to_none=True)  # PyHessian reads p.grad
        H = pyh_mod.hessian(P.net, crit, data=(P.x, P.y), cuda=False)
        nodes, weights = H.density(iter=iters, n_v=n_v)
        P.net.zero_grad(set_to_none=True)
        return np.asarray(nodes), np.asarray(weights)

    return call


def install_torch_eig_shim(torch):
    """PyHessian 0.1's ``density`` calls ``torch.eig(T, eigenvectors=True)`` (removed in torch 1.9) and
    reads ``a_[:, 0]`` (real parts) and ``b_`` (eigenvectors as columns); answer from ``eigh``."""
    try:  # torch 2.x keeps a stub that raises
        torch.eig(torch.eye(2), eigenvectors=True)
        return False
    except (AttributeError, RuntimeError):
        pass

    def eig(T, eigenvectors=False):
        w, V = torch.linalg.eigh(T)
        return torch.stack([w, torch.zeros_like(w)], dim=1), V

    torch.eig = eig
    return True


def density_section(torch, P, truth, probes, iters, seeds) -> str:
    shim = install_torch_eig_shim(torch)
    exact = spectrum_moments(truth["hessian"]["eigenvalues"])
    mg_fn = jax.jit(
        lambda k: mg.spectral_density(P.loss, P.params, k, num_probes=probes, num_iterations=iters)[:2]
    )
    _, mg_first = timed(mg_fn, jax.random.PRNGKey(0))
    pyh = pyhessian_density_fn(torch, P, iters, probes)
    errs = {"minigeo": [], "PyHessian": []}
    times = {"minigeo": [], "PyHessian": []}
    wsum = []
    for s in range(seeds):  # interleaved, so that the load of the shared machine hits both alike
        (nodes, weights), t = timed(mg_fn, jax.random.PRNGKey(1000 + s))
        errs["minigeo"].append(relative_errors(rule_moments(nodes, weights), exact))
        times["minigeo"].append(t)
        (nodes, weights), t = timed(pyh, 1000 + s)
        errs["PyHessian"].append(relative_errors(rule_moments(nodes, weights), exact))
        times["PyHessian"].append(t)
        wsum.append(float(np.max(np.abs(weights.sum(axis=1) - 1))))
    rows = []
    for k in (1, 2, 3, 4):
        rows.append([k, f"{exact[k]:.4e}"] + [f"{median(e[k] for e in errs[n]):.2e}" for n in errs])
    table = markdown(["k", "tr(H^k)/d (dense, float64)", "minigeo median rel. error", "PyHessian median rel. error"], rows)
    t_mg, t_pyh = median(times["minigeo"]), median(times["PyHessian"])
    lam = truth["hessian"]["eigenvalues"]
    return (
        f"{table}\n\n| library | median seconds per call | products |\n|---|---|---|\n"
        f"| minigeo `spectral_density` (jit, warm; first call with compile {mg_first:.2f} s) | {t_mg:.3f} | {probes * iters} |\n"
        f"| PyHessian `density(iter={iters}, n_v={probes})` (incl. its gradient graph) | {t_pyh:.3f} | {probes * iters} |\n\n"
        f"{probes} probes x {iters} Lanczos steps, {seeds} seeds; dense spectrum in [{lam[0]:.3g}, {lam[-1]:.3g}]; "
        f"PyHessian's per-probe weights sum to 1 within {max(wsum):.1e}; torch.eig shim installed: {shim}; "
        f"minigeo / PyHessian time ratio {t_mg / t_pyh:.2f}"
    )


# ---------------------------------------------------------------------------
# 2./3. trace and diagonal against the budget
# ---------------------------------------------------------------------------
def estimate_section(torch, P, truth, curvature, budgets, seeds, kind) -> str:
    import curvlinops

    A = curvlinops_operator(torch, P, curvature)
    if kind == "trace":
        ref = truth[curvature]["trace"]
        methods = TRACE_METHODS
        peers = {"hutchinson": curvlinops.hutchinson_trace, "hutch++": curvlinops.hutchpp_trace, "xtrace": curvlinops.xtrace}
        mg_make = minigeo_trace_fn
        err_mg = lambda out: abs(float(out[0]) - ref) / abs(ref)  # noqa: E731
        err_cl = lambda out: abs(float(out) - ref) / abs(ref)  # noqa: E731
    else:
        ref = truth[curvature]["diag"]
        methods = DIAG_METHODS
        peers = {"hutchinson": curvlinops.hutchinson_diag, "xdiag": curvlinops.xdiag}
        mg_make = minigeo_diag_fn
        nrm = np.linalg.norm(ref)
        err_mg = lambda out: float(np.linalg.norm(np.asarray(out, np.float64) - ref) / nrm)  # noqa: E731
        err_cl = lambda out: float(np.linalg.norm(torch_flat_to_jax(torch, P, out) - ref) / nrm)  # noqa: E731
    pyh_trace = kind == "trace" and curvature == "hessian"
    rows = []
    for budget in budgets:
        for method in methods:
            fn = mg_make(P, curvature, method, budget)
            jax.block_until_ready(fn(jax.random.PRNGKey(0)))  # compile
            e_mg, t_mg, e_cl, t_cl = [], [], [], []
            for s in range(seeds):
                out, t = timed(fn, jax.random.PRNGKey(1 + s))
                e_mg.append(err_mg(out))
                t_mg.append(t)
                torch.manual_seed(1 + s)
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = peers[method](A, budget)
                t_cl.append(time.perf_counter() - t0)
                e_cl.append(err_cl(out))
            m_mg, m_cl = median(e_mg), median(e_cl)
            rows.append([budget, method, f"{m_mg:.2e}", f"{m_cl:.2e}", f"{m_mg / m_cl:.2f}",
                         f"{1e3 * median(t_mg):.1f}", f"{1e3 * median(t_cl):.1f}"])
        if pyh_trace:
            e, t = pyhessian_trace(torch, P, budget, seeds, ref)
            rows.append([budget, "PyHessian trace (Hutchinson)", "-", f"{e:.2e}", "-", "-", f"{1e3 * t:.1f}"])
    err = "median abs. error / trace" if kind == "trace" else "median ‖error‖ / ‖diag‖"
    header = ["budget", "method", f"minigeo {err}", f"curvlinops {err}", "ratio", "minigeo ms", "curvlinops ms"]
    return markdown(header, rows)


def pyhessian_trace(torch, P, budget, seeds, ref):
    from pyhessian import hessian as PyHessian

    crit = torch.nn.CrossEntropyLoss()
    errs, times = [], []
    for s in range(seeds):
        torch.manual_seed(1 + s)
        P.net.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        H = PyHessian(P.net, crit, data=(P.x, P.y), cuda=False)
        vals = H.trace(maxIter=budget, tol=float("-inf"))  # exactly `budget` probes
        times.append(time.perf_counter() - t0)
        P.net.zero_grad(set_to_none=True)
        errs.append(abs(float(np.mean(vals)) - ref) / abs(ref))
    return median(errs), median(times)


# ---------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,32,32,10", help="MLP layer sizes (default 64,32,32,10: d = 3466)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=20, help="seeds per trace/diagonal cell (default 20)")
    ap.add_argument("--budgets", default="12,30,60,120", help="matrix-vector budgets (multiples of 6)")
    ap.add_argument("--density-probes", type=int, default=10)
    ap.add_argument("--density-iters", type=int, default=30)
    ap.add_argument("--density-seeds", type=int, default=10)
    ap.add_argument("--curvatures", default="ggn,hessian")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--sections", default="density,trace,diagonal")
    args = ap.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    budgets = [int(b) for b in args.budgets.split(",")]
    sections = args.sections.split(",")
    curvatures = args.curvatures.split(",")

    torch = bench_peers.import_peers()
    torch.set_num_threads(args.torch_threads)
    v = bench_peers.version_of
    print("# minigeo vs PyHessian and curvlinops: densities, traces, diagonals\n")
    print(f"- jax {jax.__version__}, torch {torch.__version__}, curvlinops {v('curvlinops-for-pytorch')}, "
          f"pyhessian {v('pyhessian')}, numpy {np.__version__}; torch threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY')}; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    P = bench_peers.build_mlp(torch, sizes, args.batch)
    t0 = time.perf_counter()
    truth = dense_truth(P)
    print(f"- {P.describe}; d = {truth['d']}; dense float64 Hessian and GGN in {time.perf_counter() - t0:.1f} s; "
          f"tr H = {truth['hessian']['trace']:.4g}, tr GGN = {truth['ggn']['trace']:.4g}, "
          f"rank GGN <= {args.batch * (sizes[-1] - 1)}", flush=True)
    start = time.perf_counter()
    if "density" in sections:
        print("\n## Hessian spectral density: moments against the dense spectrum\n", flush=True)
        print(density_section(torch, P, truth, args.density_probes, args.density_iters, args.density_seeds), flush=True)
    for kind in ("trace", "diagonal"):
        if kind not in sections:
            continue
        for curvature in curvatures:
            print(f"\n## {kind.capitalize()} of the {curvature.upper() if curvature == 'ggn' else 'Hessian'}: "
                  f"error against the matrix-vector budget, {args.seeds} seeds\n", flush=True)
            print(estimate_section(torch, P, truth, curvature, budgets, args.seeds, kind), flush=True)
    print(f"\n(total {time.perf_counter() - start:.0f} s after the dense truth; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
