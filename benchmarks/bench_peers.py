"""Peer comparison: minigeo (JAX) against PyTorch eager, torch.func, torch.compile, curvlinops and PyHessian.

Everything runs in ONE process on the same weights, data and vectors, for two models:

* ``mlp``: MLP 784-256-256-10, tanh, batch 256, cross-entropy (``_harness.mlp``), and the
  identical ``torch.nn.Sequential`` with the weights copied over;
* ``vit``: a tiny timm ``VisionTransformer`` (8x8x1 images, patch 2, width 64, 4 heads, 2 blocks,
  MLP 4x, 10 classes, batch 128, exact GELU), converted with ``minigeo.models.vit_from_timm``.

Rows: gradient, HVP, GGN-vector product, 10-probe Hutchinson trace, top-5 Hessian eigenvalues.
Timings are medians over interleaved rounds (minigeo and every peer once per round), warm-up
calls excluded; torch runs with ``torch.set_num_threads(2)``.  Correctness: relative error
against a float64 reference computed in JAX (``jax.enable_x64``).

The peers are test-only extras, never needed by the book or the tests::

    pip install -r requirements-parity.txt -r benchmarks/requirements-peers.txt
    JAX_PLATFORMS=cpu python benchmarks/bench_peers.py --rounds 11 --json peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["TIMM_FUSED_ATTN"] = "0"  # timm's fused attention has no double backward

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

import minigeo as mg  # noqa: E402
import minigeo.models as mm  # noqa: E402

ALL_ROWS = ("gradient", "hvp", "ggn", "trace", "eigenvalues")
INSTALL_HINT = "pip install -r benchmarks/requirements-peers.txt"


def import_peers():
    """Import torch, timm, curvlinops and pyhessian (lazily), or exit with the install hint."""
    try:
        import torch
        import timm  # noqa: F401
        import curvlinops  # noqa: F401
        import pyhessian  # noqa: F401
    except ImportError as err:
        sys.exit(f"bench_peers.py needs the peer libraries ({err}).\n  {INSTALL_HINT}\n"
                 "(together with requirements-parity.txt, which pins torch, torchvision and timm)")
    torch.set_num_threads(2)
    return torch


def version_of(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------
# numerics helpers
# ---------------------------------------------------------------------------
def flat(tree) -> np.ndarray:
    """The leaves of a pytree, in tree order, as one float64 numpy vector (no JAX dtype truncation)."""
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree_util.tree_leaves(tree)])


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def to64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


# ---------------------------------------------------------------------------
# models: a JAX side and the identical torch side
# ---------------------------------------------------------------------------
class Problem:
    """One model in both frameworks: JAX params/loss/model_fn, torch module/params/data, and converters."""


def build_mlp(torch, sizes=(784, 256, 256, 10), batch=256):
    """The MLP ``sizes`` (tanh) of ``_harness.mlp`` in JAX and as an identical ``torch.nn.Sequential``."""
    key = jax.random.PRNGKey(0)
    params, model_fn, y = _harness.mlp(key, sizes, batch)
    # _harness.mlp closes over its inputs; regenerate them exactly as it does
    keys = jax.random.split(key, len(sizes) + 1)
    X = jax.random.normal(keys[-2], (batch, sizes[0]))
    ce = _harness.cross_entropy(y)

    layers = []
    for m, n in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(m, n), torch.nn.Tanh()]
    net = torch.nn.Sequential(*layers[:-1])
    with torch.no_grad():
        for lin, layer in zip(net[::2], params):
            lin.weight.copy_(torch.from_numpy(np.asarray(layer["W"]).T.copy()))
            lin.bias.copy_(torch.from_numpy(np.asarray(layer["b"]).copy()))

    def to_jax(tensors):
        t = [np.asarray(a.detach().cpu().numpy()) for a in tensors]
        return [{"W": jnp.asarray(t[2 * i].T), "b": jnp.asarray(t[2 * i + 1])} for i in range(len(sizes) - 1)]

    P = Problem()
    P.name, P.params, P.model_fn, P.ce = "mlp", params, model_fn, ce
    P.loss = lambda p: ce(model_fn(p))
    P.net = net
    P.x = torch.from_numpy(np.asarray(X).copy())
    P.y = torch.from_numpy(np.asarray(y).astype(np.int64))
    P.to_jax = to_jax
    P.describe = f"MLP {'-'.join(map(str, sizes))} tanh, batch {batch}, cross-entropy"
    return P


def build_vit(torch):
    import timm

    torch.manual_seed(0)
    net = timm.models.vision_transformer.VisionTransformer(
        img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4, mlp_ratio=4
    )
    net.eval()
    names = [n for n, _ in net.named_parameters()]
    sd = {k: v.detach() for k, v in net.state_dict().items()}
    assert sorted(sd) == sorted(names), "the timm ViT has buffers: the converter of vectors assumes none"
    params, config = mm.vit_from_timm(sd, heads=4)
    assert config.gelu == "exact"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (128,), generator=g)
    images = jnp.asarray(x.numpy().transpose(0, 2, 3, 1))
    labels = jnp.asarray(y.numpy().astype(np.int32))
    ce = _harness.cross_entropy(labels)

    def model_fn(p):
        return mm.vit_apply(p, images, config)

    def to_jax(tensors):
        return mm.vit_from_timm({n: t.detach() for n, t in zip(names, tensors)}, heads=4, dtype=jnp.float32)[0]

    P = Problem()
    P.name, P.params, P.model_fn, P.ce = "vit", params, model_fn, ce
    P.loss = lambda p: ce(model_fn(p))
    P.net, P.x, P.y, P.to_jax = net, x, y, to_jax
    P.config = config
    with torch.no_grad():
        diff = float(np.max(np.abs(net(x).numpy() - np.asarray(jax.jit(model_fn)(params)))))
    P.logit_diff = diff
    P.describe = (
        "timm VisionTransformer 8x8x1, patch 2 (16 tokens + cls), width 64, 4 heads, depth 2, MLP 4x, "
        f"10 classes, batch 128, exact GELU; max |logits_torch - logits_minigeo| = {diff:.2e}"
    )
    if diff > 1e-4:
        raise SystemExit(f"timm and minigeo ViT logits disagree: max abs diff {diff:.3e}")
    return P


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
def interleaved(impls: dict, rounds: int, warmup: int = 1) -> dict:
    """impls: name -> zero-arg callable returning a result (blocked).  Returns name -> dict(ms, result|error)."""
    out = {}
    live = {}
    for name, fn in impls.items():
        try:
            res = None
            for _ in range(warmup):
                res = fn()
            out[name] = {"result": res, "times": []}
            live[name] = fn
        except Exception as err:  # a peer that fails is reported, not fatal
            msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
            out[name] = {"error": msg}
            if os.environ.get("BENCH_PEERS_DEBUG"):
                traceback.print_exc()
    for _ in range(rounds):
        for name, fn in live.items():
            t0 = time.perf_counter()
            fn()
            out[name]["times"].append(time.perf_counter() - t0)
    for name in live:
        out[name]["ms"] = 1e3 * statistics.median(out[name]["times"])
    return out


def jax_blocked(fn, *args):
    return lambda: jax.block_until_ready(fn(*args))


# ---------------------------------------------------------------------------
# the rows
# ---------------------------------------------------------------------------
def torch_pieces(torch, P):
    from torch.func import functional_call

    net, x, y = P.net, P.x, P.y
    crit = torch.nn.CrossEntropyLoss()
    names = [n for n, _ in net.named_parameters()]
    tparams = [p for _, p in net.named_parameters()]
    pdict = {n: p.detach() for n, p in zip(names, tparams)}

    def f_dict(pd):
        return crit(functional_call(net, pd, (x,)), y)

    def logits_dict(pd):
        return functional_call(net, pd, (x,))

    return crit, names, tparams, pdict, f_dict, logits_dict


def compile_or_error(torch, fn):
    try:
        return torch.compile(fn)
    except Exception as err:  # pragma: no cover
        raise RuntimeError(f"torch.compile: {err}")


def row_gradient(torch, P, ref, rounds, use_compile):
    crit, names, tparams, *_ = torch_pieces(torch, P)
    gfn = jax.jit(jax.grad(P.loss))

    def eager():
        for p in tparams:
            p.grad = None
        crit(P.net(P.x), P.y).backward()
        return [p.grad.clone() for p in tparams]

    impls = {"minigeo": jax_blocked(gfn, P.params), "torch eager backward": eager}
    if use_compile:
        cnet = torch.compile(P.net)

        def compiled():
            for p in tparams:
                p.grad = None
            crit(cnet(P.x), P.y).backward()
            return [p.grad.clone() for p in tparams]

        impls["torch.compile backward"] = compiled
    res = interleaved(impls, rounds)
    for name, r in res.items():
        if "result" in r:
            val = r["result"] if name == "minigeo" else P.to_jax(r["result"])
            r["err"] = rel_err(flat(val), ref["grad"])
    return res


def row_hvp(torch, P, ref, v_t, v_j, rounds, use_compile):
    from torch.func import grad, jvp

    crit, names, tparams, pdict, f_dict, _ = torch_pieces(torch, P)
    hfn = jax.jit(lambda p, v: mg.hvp(P.loss, p, v))
    vdict = {n: t for n, t in zip(names, v_t)}

    def double_backward():
        loss = crit(P.net(P.x), P.y)
        g = torch.autograd.grad(loss, tparams, create_graph=True)
        return [h.detach() for h in torch.autograd.grad(g, tparams, grad_outputs=v_t)]

    @torch.no_grad()  # as curvlinops does: torch.func's transforms ignore an outer no_grad, eager autograd stops taping
    def func_hvp(pd, vd):
        return jvp(grad(f_dict), (pd,), (vd,))[1]

    impls = {
        "minigeo": jax_blocked(hfn, P.params, v_j),
        "torch double backward": double_backward,
        "torch.func jvp(grad)": lambda: [func_hvp(pdict, vdict)[n] for n in names],
    }
    if use_compile:
        chvp = torch.compile(func_hvp)
        impls["torch.compile(torch.func)"] = lambda: [chvp(pdict, vdict)[n] for n in names]
    res = interleaved(impls, rounds)
    for name, r in res.items():
        if "result" in r:
            val = r["result"] if name == "minigeo" else P.to_jax(r["result"])
            r["err"] = rel_err(flat(val), ref["hvp"])
    return res


def row_ggn(torch, P, ref, v_t, v_j, rounds, use_compile):
    from torch.func import jvp, vjp
    from curvlinops import GGNLinearOperator

    crit, names, tparams, pdict, f_dict, logits_dict = torch_pieces(torch, P)
    G = mg.metrics.ggn(P.model_fn, P.ce)
    gfn = jax.jit(lambda p, v: G.mv(p, v))
    vdict = {n: t for n, t in zip(names, v_t)}
    B = P.x.shape[0]

    @torch.no_grad()
    def func_ggn(pd, vd):
        z, jv = jvp(logits_dict, (pd,), (vd,))
        s = torch.softmax(z, dim=-1)
        hjv = (s * jv - s * (s * jv).sum(-1, keepdim=True)) / B  # H_z of mean softmax cross-entropy
        _, pullback = vjp(logits_dict, pd)
        return pullback(hjv)[0]

    impls = {
        "minigeo": jax_blocked(gfn, P.params, v_j),
        "torch.func jvp+vjp": lambda: [func_ggn(pdict, vdict)[n] for n in names],
    }
    try:
        op = GGNLinearOperator(P.net, crit, tparams, [(P.x, P.y)], check_deterministic=True)
        impls["curvlinops GGNLinearOperator"] = lambda: [t.detach() for t in op @ list(v_t)]
    except Exception as err:
        impls["curvlinops GGNLinearOperator"] = _raiser(err)
    if use_compile:
        cggn = torch.compile(func_ggn)
        impls["torch.compile(torch.func)"] = lambda: [cggn(pdict, vdict)[n] for n in names]
    res = interleaved(impls, rounds)
    for name, r in res.items():
        if "result" in r:
            val = r["result"] if name == "minigeo" else P.to_jax(r["result"])
            r["err"] = rel_err(flat(val), ref["ggn"])
    return res


def _raiser(err):
    def f():
        raise err

    return f


def row_trace(torch, P, ref, rounds):
    import pyhessian
    from pyhessian import hessian as PyHessian

    crit, names, tparams, *_ = torch_pieces(torch, P)
    key = jax.random.PRNGKey(42)
    tfn = jax.jit(lambda p: mg.trace_estimate(P.loss, p, key, num_probes=10))

    def pyh():
        torch.manual_seed(0)
        P.net.zero_grad(set_to_none=True)  # PyHessian reads p.grad: stale grads would be added to its graph
        H = PyHessian(P.net, crit, data=(P.x, P.y), cuda=False)
        vals = H.trace(maxIter=10, tol=float("-inf"))  # tol=-inf: never stops early, exactly 10 probes
        P.net.zero_grad(set_to_none=True)
        return vals

    res = interleaved({"minigeo": jax_blocked(tfn, P.params), "PyHessian trace(maxIter=10)": pyh}, rounds)
    m = res["minigeo"]
    if "result" in m:
        est, se = (float(a) for a in m["result"])
        m["value"], m["se"] = est, se
        m["err"] = abs(est - ref["trace"][0]) / abs(ref["trace"][0])
    p = res["PyHessian trace(maxIter=10)"]
    if "result" in p:
        vals = np.asarray(p["result"], np.float64)
        p["value"], p["probes"] = float(vals.mean()), len(vals)
        p["se"] = float(vals.std(ddof=1) / np.sqrt(len(vals)))
        # what PyHessian does with its defaults (maxIter=100, tol=1e-3): how many probes it stops after
        torch.manual_seed(0)
        P.net.zero_grad(set_to_none=True)
        H = PyHessian(P.net, crit, data=(P.x, P.y), cuda=False)
        d = H.trace()
        P.net.zero_grad(set_to_none=True)
        p["default_probes"], p["default_value"] = len(d), float(np.mean(d))
    return res


def row_eigenvalues(torch, P, ref, rounds):
    import scipy.sparse.linalg as sla
    import pyhessian  # noqa: F401

    pyh_mod = sys.modules["pyhessian.hessian"]  # the module (pyhessian.hessian is shadowed by the class)
    from curvlinops import HessianLinearOperator

    crit, names, tparams, *_ = torch_pieces(torch, P)
    key = jax.random.PRNGKey(7)
    counts = {"curvlinops": 0, "curvlinops_1e3": 0, "pyhessian": 0}

    def minigeo_eigs():
        return jax.block_until_ready(mg.top_eigenvalues(P.loss, P.params, key, k=5))

    def minigeo_eigs_1e3():
        return jax.block_until_ready(mg.top_eigenvalues(P.loss, P.params, key, k=5, rtol=1e-3))

    # equal accuracy (issue 49): minigeo's certificate at rtol 1e-3 beside eigsh at tol 1e-3 (eigsh's
    # default tol=0 iterates to machine precision); the defaults (rtol 1e-2 and tol 0) stay as rows
    impls = {"minigeo": minigeo_eigs, "minigeo (rtol 1e-3)": minigeo_eigs_1e3}
    try:
        Hop = HessianLinearOperator(P.net, crit, tparams, [(P.x, P.y)]).to_scipy()

        def counted(v):
            counts["curvlinops"] += 1
            return Hop.matvec(v)

        Hc = sla.LinearOperator(Hop.shape, matvec=counted, dtype=np.float32)
        v0 = np.random.default_rng(0).standard_normal(Hop.shape[0]).astype(np.float32)
        impls["curvlinops + scipy eigsh"] = lambda: np.sort(sla.eigsh(Hc, k=5, which="LA", v0=v0, return_eigenvectors=False))[::-1]
        def counted_1e3(v):
            counts["curvlinops_1e3"] += 1
            return Hop.matvec(v)

        Hc3 = sla.LinearOperator(Hop.shape, matvec=counted_1e3, dtype=np.float32)
        impls["curvlinops + scipy eigsh (tol 1e-3)"] = lambda: np.sort(
            sla.eigsh(Hc3, k=5, which="LA", v0=v0, tol=1e-3, return_eigenvectors=False))[::-1]
    except Exception as err:
        impls["curvlinops + scipy eigsh"] = _raiser(err)

    orig_hvp = pyh_mod.hessian_vector_product

    def counting_hvp(*a, **kw):
        counts["pyhessian"] += 1
        return orig_hvp(*a, **kw)

    def pyh():
        torch.manual_seed(0)
        P.net.zero_grad(set_to_none=True)
        pyh_mod.hessian_vector_product = counting_hvp
        try:
            H = pyh_mod.hessian(P.net, crit, data=(P.x, P.y), cuda=False)
            vals, _ = H.eigenvalues(top_n=5)
        finally:
            pyh_mod.hessian_vector_product = orig_hvp
            P.net.zero_grad(set_to_none=True)
        return np.asarray(vals)

    impls["PyHessian eigenvalues(top_n=5)"] = pyh
    counts_before = dict(counts)
    res = interleaved(impls, rounds)
    calls = rounds + 1
    for name, r in res.items():
        if "result" in r:
            vals = np.asarray(r["result"], np.float64)
            r["value"] = vals.tolist()
            r["errs"] = (np.abs(vals - ref["eigs"]) / np.abs(ref["eigs"])).tolist()
            r["err"] = max(r["errs"])
    if "result" in res.get("curvlinops + scipy eigsh", {}):
        res["curvlinops + scipy eigsh"]["matvecs_per_call"] = (counts["curvlinops"] - counts_before["curvlinops"]) / calls
    if "result" in res.get("curvlinops + scipy eigsh (tol 1e-3)", {}):
        res["curvlinops + scipy eigsh (tol 1e-3)"]["matvecs_per_call"] = (
            counts["curvlinops_1e3"] - counts_before["curvlinops_1e3"]) / calls
    if "result" in res.get("PyHessian eigenvalues(top_n=5)", {}):
        res["PyHessian eigenvalues(top_n=5)"]["hvps_per_call"] = (counts["pyhessian"] - counts_before["pyhessian"]) / calls
    return res


# ---------------------------------------------------------------------------
# float64 references (JAX)
# ---------------------------------------------------------------------------
def references(P, v_j, rows):
    ref = {}
    with jax.enable_x64(True):
        p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), P.params)
        v64 = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), v_j)
        if "gradient" in rows:
            ref["grad"] = flat(jax.jit(jax.grad(P.loss))(p64))
        if "hvp" in rows:
            ref["hvp"] = flat(jax.jit(lambda p, v: mg.hvp(P.loss, p, v))(p64, v64))
        if "ggn" in rows:
            G = mg.metrics.ggn(P.model_fn, P.ce)
            ref["ggn"] = flat(jax.jit(G.mv)(p64, v64))
        if "trace" in rows:
            est, se = jax.jit(lambda p: mg.trace_estimate(P.loss, p, jax.random.PRNGKey(42), num_probes=10))(p64)
            ref["trace"] = (float(est), float(se))
        if "eigenvalues" in rows:
            ev = mg.top_eigenvalues(P.loss, p64, jax.random.PRNGKey(3), k=5, num_iterations=200, rtol=None)
            ref["eigs"] = np.asarray(ev, np.float64)
    return ref


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------
def fmt_err(r) -> str:
    if "error" in r:
        return "-"
    return f"{r['err']:.1e}" if "err" in r else "-"


def table(results, refs) -> str:
    lines = [
        "| quantity | model | minigeo ms | minigeo rel. err | peer | peer ms | ratio minigeo/peer | peer rel. err |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for (model, row), res in results.items():
        m = res["minigeo"]
        m_ms = f"{m['ms']:.2f}" if "ms" in m else f"failed: {m.get('error')}"
        if len(res) == 1:
            lines.append(f"| {row} | {model} | {m_ms} | {fmt_err(m)} | - | - | - | - |")
        for name, r in res.items():
            if name == "minigeo":
                continue
            extra = ""
            if row == "trace" and "value" in r:
                extra = f" (value {r['value']:.4g} ± {r['se']:.2g}; minigeo f32 {m.get('value', float('nan')):.4g}, f64 same probes {refs[model]['trace'][0]:.4g} ± {refs[model]['trace'][1]:.2g})"
            if row == "eigenvalues" and "errs" in r:
                extra = " (per value " + ", ".join(f"{e:.0e}" for e in r["errs"]) + ")"
            if "ms" in r:
                ratio = f"{m['ms'] / r['ms']:.2f}" if "ms" in m else "-"
                lines.append(
                    f"| {row} | {model} | {m_ms} | {fmt_err(m)} | {name} | {r['ms']:.2f} | {ratio} | {fmt_err(r)}{extra} |"
                )
            else:
                lines.append(f"| {row} | {model} | {m_ms} | {fmt_err(m)} | {name} | failed: {r['error']} | - | - |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=11, help="interleaved timing rounds (default 11)")
    ap.add_argument("--eig-rounds", type=int, default=None, help="rounds for the eigenvalue row (default min(rounds, 3))")
    ap.add_argument("--models", default="mlp,vit")
    ap.add_argument("--rows", default=",".join(ALL_ROWS), help=f"subset of {','.join(ALL_ROWS)}")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    ap.add_argument("--json", default=None, help="write the results to this path")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in rows:
        if r not in ALL_ROWS:
            ap.error(f"unknown row {r!r}; choose from {ALL_ROWS}")
    for m in models:
        if m not in ("mlp", "vit"):
            ap.error(f"unknown model {m!r}; choose from mlp, vit")
    eig_rounds = args.eig_rounds if args.eig_rounds is not None else min(args.rounds, 3)

    torch = import_peers()
    header = {
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": version_of("jaxlib"),
        "torch": torch.__version__,
        "curvlinops": version_of("curvlinops-for-pytorch"),
        "pyhessian": version_of("pyhessian"),
        "timm": version_of("timm"),
        "scipy": version_of("scipy"),
        "torch threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "not set (libgomp default: active spin-wait)"),
        "jax matmul precision": str(jax.config.jax_default_matmul_precision or "default (float32 on CPU)"),
        "torch float32 matmul precision": torch.get_float32_matmul_precision(),
        "dtype": "float32 (references float64 in JAX)",
        "rounds": args.rounds,
        "eigenvalue rounds": eig_rounds,
    }
    print("# minigeo vs peers")
    for k, v in header.items():
        print(f"- {k}: {v}")
    sys.stdout.flush()

    results, refs, notes = {}, {}, {}
    for model in models:
        P = build_mlp(torch) if model == "mlp" else build_vit(torch)
        print(f"\n## {model}: {P.describe}; {mg_n(P.params)} parameters", flush=True)
        g = torch.Generator().manual_seed(123)
        v_t = [torch.randn(p.shape, generator=g) for p in P.net.parameters()]
        v_j = P.to_jax(v_t)
        t0 = time.perf_counter()
        refs[model] = references(P, v_j, rows)
        print(f"float64 references: {time.perf_counter() - t0:.1f} s", flush=True)
        if "eigenvalues" in rows:
            print(f"float64 top-5 (Lanczos 200): {np.array2string(refs[model]['eigs'], precision=6)}", flush=True)
        for row in rows:
            t0 = time.perf_counter()
            try:
                if row == "gradient":
                    res = row_gradient(torch, P, refs[model], args.rounds, not args.no_compile)
                elif row == "hvp":
                    res = row_hvp(torch, P, refs[model], v_t, v_j, args.rounds, not args.no_compile)
                elif row == "ggn":
                    res = row_ggn(torch, P, refs[model], v_t, v_j, args.rounds, not args.no_compile)
                elif row == "trace":
                    res = row_trace(torch, P, refs[model], args.rounds)
                else:
                    res = row_eigenvalues(torch, P, refs[model], eig_rounds)
            except Exception as err:  # a broken row is reported, the others still run
                traceback.print_exc()
                res = {"minigeo": {"error": f"row failed: {type(err).__name__}: {err}"[:200]}}
            results[(model, row)] = res
            print(f"  {row}: {time.perf_counter() - t0:.1f} s", flush=True)
            print("\n".join(table({(model, row): res}, refs).splitlines()[2:]), flush=True)
            for name, r in res.items():
                if "error" in r:
                    print(f"    {name} failed: {r['error']}", flush=True)
                for key in ("probes", "default_probes", "default_value", "matvecs_per_call", "hvps_per_call", "value"):
                    if key in r:
                        notes.setdefault(f"{model}/{row}/{name}", {})[key] = r[key]

    print("\n" + table(results, refs))
    print("\nnotes:")
    for k, v in notes.items():
        print(f"- {k}: {v}")
    if args.json:
        out = {
            "header": header,
            "references": {m: {k: (v.tolist() if isinstance(v, np.ndarray) and v.size < 10 else v)
                               for k, v in r.items() if k in ("trace", "eigs")} for m, r in refs.items()},
            "results": [
                {"model": m, "quantity": row, "impl": name,
                 **{k: v for k, v in r.items() if k not in ("result",)}}
                for (m, row), res in results.items() for name, r in res.items()
            ],
        }
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
        print(f"\nwrote {args.json}")


def mg_n(params) -> int:
    return _harness.n_params(params)


if __name__ == "__main__":
    main()
