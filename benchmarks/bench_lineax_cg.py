#!/usr/bin/env python
"""minigeo's conjugate gradients (``solve_spd_cg``) against ``lineax.CG``, in one process (issue 21).

Every solve is jitted; the timed ones run side by side in interleaved rounds (median, and the
spread of the per-round ratio lineax / minigeo).  Cases (each in float32 and float64):

* ``mlp``: damped GGN of the MLP 784-256-256-10 (tanh, batch 256, cross-entropy), damping 1e-3 and 1e-1
  at ``tol=1e-6`` (minigeo's default), and in float32 also damping 1e-3 at ``tol=1e-5`` (1e-6 is at
  float32's attainable accuracy for this operator);
* ``vit``: damped GGN of minigeo's tiny ViT (8x8x1 images, patch 2 (16 tokens + cls), width 64,
  4 heads, 2 blocks, MLP 256, batch 128, ``minigeo.models.vit_apply``), damping 1e-1;
* ``vit-hard`` (opt-in): the tiny ViT's GGN with damping 1e-3, ``maxiter=500``, untimed (one call each);
* ``maxiter``: the MLP's GGN with damping 1e-6 and ``maxiter=30`` (does not converge);
* ``indefinite``: the MLP's loss *Hessian* at its random initialization (indefinite) with damping
  1e-3, and a 100 x 100 symmetric matrix with 10 negative eigenvalues; jitted and eager.

The right-hand side is the loss gradient (a natural-gradient / Newton step), except for the
matrix, where it is a fixed random vector.  Per solve: time (ms), iterations, the *true*
relative residual ``||b - A x|| / ||b||`` (evaluated in float64 from the same, exactly upcast
parameters, data and right-hand side), whether ``x`` is finite, and the status each library
reports under ``jit`` (minigeo: ``SolveInfo.status``; lineax: ``Solution.result`` with
``throw=False``).

How the lineax solve is set up (``lineax_solve`` below), as close to minigeo's semantics as
lineax allows:

* ``FunctionLinearOperator`` over the same damped product, tagged ``positive_semidefinite_tag``
  (without a tag ``lineax.CG`` refuses the operator at trace time);
* ``CG(rtol=0, atol=tol * ||b||_2, norm=two_norm, max_steps=maxiter)``: lineax stops when
  ``||r||_2 <= atol`` **and** ``||x_k - x_{k-1}||_2 <= atol`` (minigeo: the first test only,
  ``||r||_2 <= tol ||b||_2``); lineax's own default ``rtol``/``atol`` act elementwise
  (``|r_i| <= atol + rtol |b_i|`` under the max norm), which has no minigeo counterpart;
* ``stabilise_every=10`` (lineax's default: the residual is recomputed as ``b - A x``, one extra
  product, every 10 steps) and ``stabilise_every=None`` (the recurrence only, as minigeo);
* **rescaled**: lineax's CG declares a breakdown (``alpha = NaN``, then ``RESULTS.singular``)
  whenever ``p^T A p <= 100 * rcond * r^T r`` with ``rcond = 2 * eps * n``, an *absolute*
  threshold on the Rayleigh quotient (6.4 for the MLP's 269 322 float32 parameters).  The
  rows "lineax as is" show what that does to a GGN; the other lineax rows solve
  ``(c A) x = c b`` with ``c = max(1, 10 * 100 * rcond / damping)`` (the damping bounds the
  smallest eigenvalue of a damped PSD metric from below), which leaves ``x`` unchanged but also
  scales ``atol``, so that the step test ``||x_k - x_{k-1}|| <= c * tol * ||b||`` becomes looser
  by ``c`` (in float64, ``c = 1`` in every case here).

lineax is only needed by this script (``pip install -r benchmarks/requirements-peers.txt`` or
``pip install lineax``)::

    JAX_PLATFORMS=cpu OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_lineax_cg.py --rounds 5 --json lineax.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

logging.getLogger("jax._src.callback").setLevel(
    logging.CRITICAL
)  # lineax's throw=True errors: reported below, once
jax.config.update(
    "jax_enable_x64", True
)  # float64 cases and float64 residuals; every array below has an explicit dtype

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

import minigeo as mg  # noqa: E402
import minigeo.models as mm  # noqa: E402
from minigeo._linalg import solve_spd_cg  # noqa: E402

INSTALL_HINT = "pip install lineax   (or: pip install -r benchmarks/requirements-peers.txt)"
LX_RESULTS = (
    "successful",
    "max_steps_reached",
    "singular",
    "breakdown",
    "stagnation",
    "conlim",
    "nonfinite_input",
)
MG_STATUS = {0: "0 converged", 1: "1 maxiter", 2: "2 not PD", 3: "3 non-finite"}


def import_lineax():
    """Import lineax lazily, or exit with the install hint."""
    try:
        import lineax
    except ImportError as err:
        sys.exit(f"bench_lineax_cg.py needs lineax ({err}).\n  {INSTALL_HINT}")
    return lineax


def version_of(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------
# problems: params, data and model_fn(params, data) in a given dtype (data are jit arguments)
# ---------------------------------------------------------------------------
def build_mlp(dtype):
    """_harness.mlp's network, weights and data (same keys), in ``dtype``."""
    sizes, batch = (784, 256, 256, 10), 256
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) + 1)
    params = [
        {
            "W": (jax.random.normal(k, (m, n), jnp.float32) / np.sqrt(m)).astype(dtype),
            "b": jnp.zeros(n, dtype),
        }
        for k, m, n in zip(keys[:-2], sizes[:-1], sizes[1:])
    ]
    X = jax.random.normal(keys[-2], (batch, sizes[0]), jnp.float32).astype(dtype)
    y = jax.random.randint(keys[-1], (batch,), 0, sizes[-1], jnp.int32)

    def model_fn(p, data):
        h = data[0]
        for layer in p[:-1]:
            h = jnp.tanh(h @ layer["W"] + layer["b"])
        return h @ p[-1]["W"] + p[-1]["b"]

    return params, (X, y), model_fn


VIT = mm.ViTConfig(
    image_size=8, patch_size=2, channels=1, num_classes=10, width=64, depth=2, heads=4, mlp_dim=256
)


def build_vit(dtype):
    """minigeo's tiny ViT as in bench_eager.py, in ``dtype``."""
    params = jax.tree_util.tree_map(
        lambda a: a.astype(dtype), mm.init_vit(jax.random.PRNGKey(0), VIT, jnp.float32)
    )
    images = jax.random.normal(jax.random.PRNGKey(1), (128, 8, 8, 1), jnp.float32).astype(dtype)
    labels = jax.random.randint(jax.random.PRNGKey(2), (128,), 0, 10, jnp.int32)
    return params, (images, labels), lambda p, data: mm.vit_apply(p, data[0], VIT)


def loss_of(model_fn):
    return lambda p, data: _harness.cross_entropy(data[1])(model_fn(p, data))


def ggn_op(model_fn):
    """``(params, data) -> (v -> G v)``, the undamped GGN of the mean cross-entropy."""
    return lambda p, data: mg.ggn(lambda q: model_fn(q, data), _harness.cross_entropy(data[1])).at(p)


def hessian_op(model_fn):
    """``(params, data) -> (v -> H v)``, the loss Hessian (indefinite away from a minimum)."""
    loss = loss_of(model_fn)
    return lambda p, data: lambda v: mg.hvp(lambda q: loss(q, data), p, v)


def damped(op: Callable, damping: float) -> Callable:
    return lambda v: jax.tree_util.tree_map(lambda a, b: a + damping * b, op(v), v)


def tree_norm(t) -> jax.Array:
    return jnp.sqrt(sum(jnp.vdot(a, a) for a in jax.tree_util.tree_leaves(t)))


def size_of(t) -> int:
    return sum(a.size for a in jax.tree_util.tree_leaves(t))


# ---------------------------------------------------------------------------
# the two solvers
# ---------------------------------------------------------------------------
def lineax_rcond_threshold(n: int, dtype) -> float:
    """lineax.CG's breakdown threshold on p^T A p / r^T r: 100 * rcond, rcond = 2 eps n."""
    return 100 * 2 * float(jnp.finfo(dtype).eps) * n


def rescale_factor(n: int, dtype, damping: float) -> float:
    return max(1.0, 10 * lineax_rcond_threshold(n, dtype) / damping) if damping > 0 else 1.0


def minigeo_solve(op: Callable, b, *, damping: float, tol: float, maxiter: int):
    x, info = solve_spd_cg(op, b, damping=damping, tol=tol, maxiter=maxiter, return_info=True)
    return x, info.status, info.iterations


def lineax_solve(
    lx, op: Callable, b, *, damping: float, tol: float, maxiter: int, scale: float, stabilise, throw=False
):
    mv = damped(op, damping)
    cmv = (lambda v: jax.tree_util.tree_map(lambda a: scale * a, mv(v))) if scale != 1.0 else mv
    cb = jax.tree_util.tree_map(lambda a: scale * a, b) if scale != 1.0 else b
    operator = lx.FunctionLinearOperator(cmv, jax.eval_shape(lambda: cb), lx.positive_semidefinite_tag)
    solver = lx.CG(
        rtol=0.0,
        atol=tol * tree_norm(cb),
        norm=lx.internal.two_norm,
        stabilise_every=stabilise,
        max_steps=maxiter,
    )
    sol = lx.linear_solve(operator, cb, solver, throw=throw)
    return sol.value, sol.result, sol.stats["num_steps"]


def lx_name(lx, result) -> str:
    for name in LX_RESULTS:
        if bool(result == getattr(lx.RESULTS, name)):
            return name
    return "?"


LX_PHRASES = ("maximum number of solver steps", "returned non-finite", "received non-finite", "breakdown")


def first_line(err: BaseException) -> str:
    """The error's class and the line that says what went wrong (lineax's message, not the traceback)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    msg = next((line for line in lines if any(p in line for p in LX_PHRASES)), lines[0] if lines else "")
    if "EquinoxRuntimeError: " in msg:
        msg = msg.split("EquinoxRuntimeError: ", 1)[1]
    return f"{type(err).__name__}: {msg}"[:160]


# ---------------------------------------------------------------------------
# one case
# ---------------------------------------------------------------------------
def run_case(lx, spec: dict, rounds: int, timed: bool, eager: bool) -> dict:
    """spec: label, build, op (ggn/hessian builder or 'matrix'), damping, tol, maxiter, dtype."""
    dtype = spec["dtype"]
    params, data, op_at, b, op64 = make_problem(spec, dtype)
    n = size_of(b)
    scale = rescale_factor(n, dtype, spec["damping"])
    kw = dict(damping=spec["damping"], tol=spec["tol"], maxiter=spec["maxiter"])
    solvers = {
        "minigeo": jax.jit(lambda p, d, r: minigeo_solve(op_at(p, d), r, **kw)),
        "lineax, stabilise_every=10": jax.jit(
            lambda p, d, r: lineax_solve(lx, op_at(p, d), r, scale=scale, stabilise=10, **kw)
        ),
        "lineax, stabilise_every=None": jax.jit(
            lambda p, d, r: lineax_solve(lx, op_at(p, d), r, scale=scale, stabilise=None, **kw)
        ),
    }
    if scale != 1.0:
        solvers["lineax as is (no rescale)"] = jax.jit(
            lambda p, d, r: lineax_solve(lx, op_at(p, d), r, scale=1.0, stabilise=10, **kw)
        )

    b64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), b)
    nb64 = float(tree_norm(b64))

    def true_residual(x) -> float:
        x64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), x)
        if not all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree_util.tree_leaves(x64)):
            return float("nan")
        r = jax.tree_util.tree_map(lambda u, w: u - w, b64, op64(x64))
        return float(tree_norm(r)) / nb64

    rows = {}
    for name, fn in solvers.items():
        t0 = time.perf_counter()
        x, status, its = jax.block_until_ready(fn(params, data, b))
        first = time.perf_counter() - t0
        rows[name] = {
            "status": MG_STATUS.get(int(status), str(int(status)))
            if name == "minigeo"
            else lx_name(lx, status),
            "iterations": int(its),
            "true_residual": true_residual(x),
            "finite": all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree_util.tree_leaves(x)),
            "first_call_s": first,
            "times": [],
        }
    if timed:
        live = {k: v for k, v in solvers.items() if not k.startswith("lineax as is")}
        for _ in range(rounds):
            for name, fn in live.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(params, data, b))
                rows[name]["times"].append(time.perf_counter() - t0)
        base = rows["minigeo"]["times"]
        for name in live:
            t = rows[name]["times"]
            rows[name]["ms"] = 1e3 * statistics.median(t)
            rows[name]["ms_per_it"] = rows[name]["ms"] / max(rows[name]["iterations"], 1)
            ratios = [a / c for a, c in zip(t, base)]
            rows[name]["ratio"] = statistics.median(ratios)
            rows[name]["ratio_range"] = [min(ratios), max(ratios)]
    extra = {}
    # lineax with throw=True under jit: does a failure stop the program?
    thrower = jax.jit(
        lambda p, d, r: lineax_solve(lx, op_at(p, d), r, scale=scale, stabilise=10, throw=True, **kw)
    )
    try:
        jax.block_until_ready(thrower(params, data, b))
        extra["lineax throw=True, jit"] = "no error"
    except Exception as err:  # noqa: BLE001 (what lineax raises is what we report)
        extra["lineax throw=True, jit"] = first_line(err)
    if eager:
        op = op_at(params, data)
        try:
            x, info = solve_spd_cg(op, b, return_info=True, **kw)
            extra["minigeo eager"] = f"no error, status {int(info.status)}"
        except mg.GeometryError as err:
            extra["minigeo eager"] = first_line(err)
        for throw in (False, True):
            try:
                x, res, its = lineax_solve(lx, op, b, scale=scale, stabilise=10, throw=throw, **kw)
                extra[f"lineax eager throw={throw}"] = (
                    f"no error, result {lx_name(lx, res)}, {int(its)} steps, "
                    + (
                        "finite x"
                        if all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree_util.tree_leaves(x))
                        else "NaN x"
                    )
                )
            except Exception as err:  # noqa: BLE001
                extra[f"lineax eager throw={throw}"] = first_line(err)
    return {
        "case": spec["label"],
        "dtype": jnp.dtype(dtype).name,
        "n": n,
        "damping": spec["damping"],
        "tol": spec["tol"],
        "maxiter": spec["maxiter"],
        "scale": scale,
        "lineax_threshold": lineax_rcond_threshold(n, dtype),
        "rows": {k: {kk: vv for kk, vv in v.items() if kk != "times"} for k, v in rows.items()},
        "extra": extra,
    }


def make_problem(spec: dict, dtype):
    """(params, data, op_at(params, data), rhs, float64 damped operator) for a case."""
    if spec["op"] == "matrix":
        rng = np.random.default_rng(0)
        d = 100
        eig = np.concatenate([-np.linspace(0.1, 1.0, 10), np.linspace(0.1, 10.0, d - 10)])
        Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
        A64 = (Q * eig) @ Q.T
        A64 = 0.5 * (A64 + A64.T)
        b = jnp.asarray(rng.standard_normal(d), dtype)
        A = jnp.asarray(A64, dtype)
        op64 = damped(lambda v: jnp.asarray(A64) @ v, spec["damping"])
        return A, None, (lambda M, _: lambda v: M @ v), b, op64
    params, data, model_fn = spec["build"](dtype)
    op_builder = spec["op"](model_fn)
    b = jax.jit(jax.grad(loss_of(model_fn)))(params, data)
    assert all(a.dtype == jnp.dtype(dtype) for a in jax.tree_util.tree_leaves(b)), (
        "dtype leaked (x64 promotion)"
    )
    if jnp.dtype(dtype) == jnp.float64:
        p64, d64 = params, data
    else:
        p64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)
        d64 = (data[0].astype(jnp.float64), data[1])
    mv64 = jax.jit(
        lambda p, d, v: damped(op_builder(p, d), spec["damping"])(v)
    )  # data as arguments: no constant folding
    return params, data, op_builder, b, lambda v: mv64(p64, d64, v)


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------
def print_case(res: dict) -> None:
    print(
        f"\n{res['case']}, {res['dtype']}: n = {res['n']:,}, damping {res['damping']:g}, tol {res['tol']:g}, "
        f"maxiter {res['maxiter']}; lineax threshold 100*rcond = {res['lineax_threshold']:.3g}, rescale c = "
        f"{res['scale']:.3g}"
    )
    print(
        f"  {'solver':30s} {'ms':>9s} {'ms/it':>7s} {'ratio [min, max]':>20s} {'its':>5s} {'true res':>9s}  status"
    )
    for name, r in res["rows"].items():
        ms = f"{r['ms']:9.1f} {r['ms_per_it']:7.2f}" if "ms" in r else f"{'-':>9s} {'-':>7s}"
        ratio = (
            f"{r['ratio']:.2f} [{r['ratio_range'][0]:.2f}, {r['ratio_range'][1]:.2f}]"
            if "ratio" in r
            else "-"
        )
        fin = "" if r["finite"] else ", x NaN"
        print(
            f"  {name:30s} {ms} {ratio:>20s} {r['iterations']:5d} {r['true_residual']:9.2e}  {r['status']}{fin}"
        )
    for k, v in res["extra"].items():
        print(f"  {k}: {v}")


def cases(selected: set[str]) -> list[tuple[dict, bool, bool]]:
    """(spec, timed, eager) for the selected groups."""
    out = []
    for dtype in (jnp.float32, jnp.float64):
        if "mlp" in selected:
            tols = [(1e-3, 1e-6), (1e-1, 1e-6)] + ([(1e-3, 1e-5)] if dtype == jnp.float32 else [])
            for damping, tol in tols:  # tol 1e-6 is at float32's attainable accuracy here; 1e-5 is not
                spec = dict(
                    label="(a) MLP GGN", build=build_mlp, op=ggn_op, damping=damping, tol=tol, maxiter=1000
                )
                out.append((spec | {"dtype": dtype}, True, False))
        if "vit" in selected:
            spec = dict(
                label="(b) tiny ViT GGN", build=build_vit, op=ggn_op, damping=1e-1, tol=1e-6, maxiter=1000
            )
            out.append((spec | {"dtype": dtype}, True, False))
        if "vit-hard" in selected:  # opt-in (about 2 min): float32 recurrence drift over hundreds of steps
            spec = dict(
                label="(b') tiny ViT GGN, small damping",
                build=build_vit,
                op=ggn_op,
                damping=1e-3,
                tol=1e-6,
                maxiter=500,
            )
            out.append((spec | {"dtype": dtype}, False, False))
        if "maxiter" in selected:
            spec = dict(
                label="(c) MLP GGN, maxiter", build=build_mlp, op=ggn_op, damping=1e-6, tol=1e-6, maxiter=30
            )
            out.append((spec | {"dtype": dtype}, False, True))
        if "indefinite" in selected:
            spec = dict(
                label="(d) MLP Hessian (indefinite)",
                build=build_mlp,
                op=hessian_op,
                damping=1e-3,
                tol=1e-6,
                maxiter=200,
            )
            out.append((spec | {"dtype": dtype}, False, True))
            spec = dict(
                label="(d) 100x100 matrix, 10 negative eigenvalues",
                build=None,
                op="matrix",
                damping=0.0,
                tol=1e-6,
                maxiter=1000,
            )
            out.append((spec | {"dtype": dtype}, False, True))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (MLP)")
    parser.add_argument("--vit-rounds", type=int, default=3, help="interleaved timing rounds (tiny ViT)")
    parser.add_argument(
        "--cases", default="mlp,vit,maxiter,indefinite", help="also: vit-hard (opt-in, ~2 min)"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    lx = import_lineax()
    print(_harness.describe_machine())
    print(
        f"lineax {version_of('lineax')}, equinox {version_of('equinox')}, jaxtyping {version_of('jaxtyping')}, "
        f"numpy {np.__version__}"
    )
    results = []
    t_start = time.perf_counter()
    for spec, timed, eager in cases(set(args.cases.split(","))):
        rounds = args.vit_rounds if spec["build"] is build_vit else args.rounds
        res = run_case(lx, spec, rounds, timed, eager)
        print_case(res)
        sys.stdout.flush()
        results.append(res)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": _harness.describe_machine(),
                    "lineax": version_of("lineax"),
                    "equinox": version_of("equinox"),
                    "jaxtyping": version_of("jaxtyping"),
                    "results": results,
                },
                f,
                indent=1,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
