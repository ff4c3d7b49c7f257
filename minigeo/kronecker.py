r"""Kronecker-factored curvature: KFAC and EKFAC metrics of dense layers (floor 3, chapter 2).

For a dense layer :math:`y = x^\top W + b` (minigeo's layout: ``y = x @ W + b``, ``W`` of shape
``(in, out)``), one example's contribution to the GGN / Fisher block of :math:`(W, b)` is the
Kronecker product :math:`\bar x \bar x^\top \otimes \sum_r g_r g_r^\top`, where :math:`\bar x = (x, 1)`
(the 1 for the bias) and :math:`g_r = J_y^\top S e_r` are the columns of a square root
:math:`S S^\top` of the output-space Fisher (= the loss Hessian for the categorical and Gaussian
likelihoods), backpropagated to the layer's output.  KFAC replaces the mean of the products by the
product of the means,

.. math:: G_{(W,b)} \approx A \otimes B,\qquad A = \frac1N\sum_n \bar x_n \bar x_n^\top,\qquad
    B = c\sum_n\sum_r g_{n,r} g_{n,r}^\top,\quad c = 1/N \text{ ("mean") or } 1 \text{ ("sum")},

block-diagonal across layers (Martens & Grosse 2015).  The flattening is minigeo's row-major one
(``ravel_pytree``: index ``i * out + j`` of ``W[i, j]``), in which :math:`\mathrm{vec}(\bar x g^\top)
= \bar x \otimes g`, so a product is :math:`(A\otimes B)\,\mathrm{vec}(V) = \mathrm{vec}(A V B)` with
``V = [v_W; v_b]`` of shape ``(in + 1, out)``.  Solves use the eigendecompositions
:math:`A = Q_A \Lambda_A Q_A^\top`, :math:`B = Q_B \Lambda_B Q_B^\top`:

.. math:: (A\otimes B + \epsilon I)^{-1}\mathrm{vec}(V) = \mathrm{vec}\Big(Q_A\big[(Q_A^\top V Q_B)
    \oslash (\lambda_A \lambda_B^\top + \epsilon)\big] Q_B^\top\Big),

never a :math:`d\times d` matrix.  EKFAC (George et al. 2018) keeps the eigenbasis
:math:`Q_A \otimes Q_B` and replaces the eigenvalues :math:`\lambda_{A,i}\lambda_{B,j}` by the exact
second moments of the per-example gradients in that basis, the diagonal of the exact block there:

.. math:: s_{ij} = c\sum_n (q_{A,i}^\top \bar x_n)^2 \sum_r (q_{B,j}^\top g_{n,r})^2
    = \big[(Q_A\otimes Q_B)^\top G_{(W,b)} (Q_A\otimes Q_B)\big]_{(ij),(ij)}.

It is the Frobenius-nearest matrix to the exact block among those with that eigenbasis, so never
farther from the exact GGN than KFAC.  For a layer shared by tokens the per-example gradient is
:math:`\sum_t \bar x_{nt} g_{nt,r}^\top`, and :math:`s` is still the diagonal of the exact block,
products of different tokens included (as curvlinops' ``EKFACLinearOperator``); only the eigenbasis
depends on ``weight_sharing``.

**Which parameters.**  Dense layers are found in the model's program (``jax.make_jaxpr``, with
nested ``jax.jit`` calls inlined and every ``lax.scan`` unrolled, so a block run by a scan gives one
layer per block, on its slice ``W[l]`` of the stacked leaf): a matrix product (``dot_general``
without batch axes) of inputs ``x`` of shape ``(N, *T, ...)`` (``N`` the batch of the outputs) and a
parameter ``W`` (a leaf, or one block's slice of it) used only there, contracting some of ``W``'s
axes (``in``, in ``W``'s axis order) with the trailing axes of ``x``.  ``W``'s other axes are
``out``; the layer's matrix is ``W`` with its ``in`` axes first, reshaped to ``(in, out)``
(``x @ W`` with ``W`` of shape ``(in, out)``; a per-head projection ``einsum("btd,hde->bhte", x,
W_q)`` is the ``(d, h*e)`` matrix, the output projection ``einsum("bhte,hde->btd", o, W_o)`` the
``(h*e, d)`` one).  Its bias is a parameter of ``W``'s ``out`` shape (or a block's slice) used
only to be added to that product, after transposes and broadcasts, or to a sum that the product is
the only use of (a residual ``x + x @ W + b``).  A layer applied to every token, inputs
``(N, *T, in)`` (a transformer's projections and MLP, a patch embedding), has its weight shared by
the tokens; ``weight_sharing="expand"`` or ``"reduce"`` says how the tokens enter the factors
(Eschenhagen et al. 2023, *Kronecker-Factored Approximate Curvature for Modern Neural Network
Architectures*, NeurIPS).  Every other parameter (a LayerNorm scale, a position embedding, a
convolution kernel, a weight used twice) raises :class:`~minigeo.GeometryError` naming it: KFAC has
no Kronecker factors for it, and minigeo does not silently give it an identity or diagonal block.
Hold such parameters fixed, as curvlinops does with the parameters it is not given: pass only the
dense ones and let the model close over the rest (``lambda dense, x: model(merge(dense, rest), x)``).
The examples must not interact (no batch
statistics): the backpropagated factors of all examples are taken from one backward pass per
column of :math:`S`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ._checks import GeometryError, as_float_point, check_finite, check_key, split_batch
from ._compile import Derived, compiled, run_work
from ._likelihood import Likelihood, as_likelihood, fisher_factor, is_categorical
from ._status import Status
from ._tree import PyTree
from .metrics import Metric

__all__ = ["KroneckerFactor", "KroneckerEigenbasis", "kfac", "ekfac", "kfac_factors", "kronecker_eigenbasis"]


class KroneckerFactor(NamedTuple):
    r"""The Kronecker factors of one dense layer: :math:`G_{(W,b)} \approx A \otimes B`.

    Attributes
    ----------
    weight : str
        The path of the weight leaf ``W`` (shape ``(in, out)``) in the parameters (``jax.tree_util.keystr``).
    bias : str or None
        The path of its bias leaf (shape ``(out,)``), or ``None`` for a layer without bias.
    A : jax.Array
        :math:`\frac1N\sum_n \bar x_n \bar x_n^\top`, shape ``(in + 1, in + 1)`` with a bias (the
        last row and column belong to it), ``(in, in)`` without.
    B : jax.Array
        :math:`c\sum_{n,r} g_{n,r} g_{n,r}^\top`, shape ``(out, out)``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.array([[1.0, 2.0]])
    >>> linear, params = lambda p, x: x @ p["W"], {"W": jnp.ones((2, 1))}
    >>> (f,) = mg.kronecker.kfac_factors(linear, "gaussian", params, batch=(X, None))
    >>> f.weight, f.bias, f.A.tolist(), f.B.tolist()
    ("['W']", None, [[1.0, 2.0], [2.0, 4.0]], [[1.0]])

    References
    ----------
    Martens & Grosse (2015), "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature" (ICML), the factors of one layer. Chapter 2.
    """

    weight: str
    bias: str | None
    A: jax.Array
    B: jax.Array


class KroneckerEigenbasis(NamedTuple):
    r"""One layer's block of a KFAC or EKFAC metric in its eigenbasis: :math:`(Q_A\otimes Q_B)\,\mathrm{diag}(s)\,(Q_A\otimes Q_B)^\top`.

    Attributes
    ----------
    weight : str
        The path of the weight leaf (``jax.tree_util.keystr``).
    bias : str or None
        The path of its bias leaf, or ``None``.
    QA : jax.Array
        Eigenvectors of :math:`A`, ``(in + 1, in + 1)`` with a bias, ``(in, in)`` without.
    QB : jax.Array
        Eigenvectors of :math:`B`, ``(out, out)``.
    eigenvalues : jax.Array
        :math:`s`, shape ``(in (+1), out)``: ``s[i, j]`` belongs to the eigenvector
        :math:`q_{A,i}\otimes q_{B,j}`; :math:`\lambda_{A,i}\lambda_{B,j}` for KFAC, the projected
        second moments for EKFAC.  The damping of the metric is not included.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X, linear = jnp.array([[1.0, 0.0], [0.0, 2.0]]), lambda p, x: x @ p["W"]
    >>> K = mg.kfac(linear, "gaussian", {"W": jnp.zeros((2, 1))}, batch=(X, None))
    >>> (e,) = mg.kronecker.kronecker_eigenbasis(K)
    >>> e.eigenvalues.ravel().tolist()  # eigenvalues of A = diag(1, 4) / 2, times B = 1
    [0.5, 2.0]

    References
    ----------
    Martens & Grosse (2015), "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature" (ICML); George et al. (2018), "Fast Approximate Natural Gradient Descent in a
    Kronecker-factored Eigenbasis" (NeurIPS). Chapters 2 and 5.
    """

    weight: str
    bias: str | None
    QA: jax.Array
    QB: jax.Array
    eigenvalues: jax.Array


class _Layer(NamedTuple):
    """A dense layer found in the (flattened) model program: the product's equation, its leaves, layout.

    The weight is the leaf ``weight`` (or its slice ``index`` along the first axis, a block of a
    stack run by ``lax.scan``); its matrix view is ``W.transpose(w_perm).reshape(n_in, n_out)``:
    the contracted axes first (``in``), then the others (``out``).  ``x_perm`` puts the inputs in the
    order ``(N, *tokens, *contracted)``, ``g_perm`` the product's axes in the order
    ``(N, *tokens, *out)``."""

    eqn: int
    x_pos: int  # the operand of the product that is the layer's input
    weight: int
    index: int | None
    bias: int | None
    bias_index: int | None
    n_in: int
    n_out: int
    out_shape: tuple  # the product's shape (its cotangents have it)
    w_perm: tuple
    x_perm: tuple
    g_perm: tuple


# ---------------------------------------------------------------------------
# the model's program, flattened: nested jit calls inlined, scans unrolled
# ---------------------------------------------------------------------------
_CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat")


def _inlined_call(eqn: Any) -> bool:
    """Whether ``eqn`` is a nested call whose program :func:`_evaluate` inlines."""
    return eqn.primitive.name in _CALLS and ("jaxpr" in eqn.params or "call_jaxpr" in eqn.params)


def _evaluate(jaxpr: Any, consts: list, args: list, hook: Callable | None = None) -> list:
    """Evaluate ``jaxpr``, inlining nested calls and unrolling ``lax.scan`` (slices ``x[i]`` of its inputs),
    so that a dense layer of a block run by a scan appears once per block, on that block's slice.

    ``hook(i, invals, out)``, when given, replaces the output of the program's own ``i``-th equation
    (not those of the calls and scan bodies it evaluates): :func:`_run` adds the probes there."""
    env: dict = {}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        if _inlined_call(eqn):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            closed = inner if hasattr(inner, "consts") else None
            outs = _evaluate(closed.jaxpr if closed else inner, list(closed.consts) if closed else [], invals)
        elif eqn.primitive.name == "scan":
            p = eqn.params
            nc, nk, body = p["num_consts"], p["num_carry"], p["jaxpr"]
            consts_, carry, xs = invals[:nc], invals[nc: nc + nk], invals[nc + nk:]
            steps = range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"])
            ys = []
            for step in steps:
                out = _evaluate(body.jaxpr, list(body.consts),
                                [*consts_, *carry, *(jax.lax.index_in_dim(x, step, keepdims=False) for x in xs)])
                carry, y = out[:nk], out[nk:]
                ys.append(y)
            if p["reverse"]:
                ys.reverse()
            n_y = len(body.jaxpr.outvars) - nk
            outs = [*carry, *(jnp.stack([y[j] for y in ys]) if ys else jnp.zeros((0,) + tuple(a.shape), a.dtype)
                              for j, a in zip(range(n_y), body.out_avals[nk:]))]
        else:
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if hook is not None:
                out = hook(i, invals, out)
            outs = out if eqn.primitive.multiple_results else [out]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _flat_program(f: Callable, leaves: list) -> Any:
    """The closed jaxpr of ``f(leaves)`` with nested calls inlined and scans unrolled."""
    closed = jax.make_jaxpr(f)(leaves)
    if not any(e.primitive.name == "scan" or _inlined_call(e) for e in closed.jaxpr.eqns):
        return closed  # already flat: no second trace
    return jax.make_jaxpr(lambda ls: _evaluate(closed.jaxpr, list(closed.consts), ls))(leaves)


# ---------------------------------------------------------------------------
# finding the dense layers in the model's program
# ---------------------------------------------------------------------------
def _is_var(v: Any) -> bool:
    return not isinstance(v, Literal)


def _find_layers(jaxpr: Any, leaf_shapes: list[tuple], batch: int) -> tuple[list[_Layer], list[int]]:
    """``(layers, others)``: the dense layers of the program and the leaves (indices) not wholly in them."""
    invars = jaxpr.invars[: len(leaf_shapes)]
    index = {v: k for k, v in enumerate(invars)}
    uses: dict[Any, list[tuple[int, int]]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for pos, v in enumerate(eqn.invars):
            if _is_var(v):
                uses.setdefault(v, []).append((i, pos))
    for v in jaxpr.outvars:
        if _is_var(v):
            uses.setdefault(v, []).append((-1, 0))
    eqns = jaxpr.eqns
    producer = {v: e for e in eqns for v in e.outvars}

    def single_use(v: Any) -> tuple[int, int] | None:
        u = uses.get(v, [])
        return u[0] if len(u) == 1 else None

    def source(v: Any) -> tuple[int, int | None] | None:
        """``(k, None)`` if ``v`` is leaf ``k`` used once, ``(k, i)`` if it is ``leaf_k[i]`` (a scan's slice)."""
        if not (_is_var(v) and single_use(v)):
            return None
        if v in index:
            return index[v], None
        e = producer.get(v)
        if e is None or e.primitive.name != "squeeze" or tuple(e.params["dimensions"]) != (0,):
            return None
        u = e.invars[0]
        s = producer.get(u)
        if not (_is_var(u) and single_use(u) and s is not None and s.primitive.name == "slice"):
            return None
        leaf = s.invars[0]
        if not (_is_var(leaf) and leaf in index):
            return None
        shape = leaf_shapes[index[leaf]]
        start, limit, strides = s.params["start_indices"], s.params["limit_indices"], s.params["strides"]
        i = start[0]
        if tuple(start[1:]) != (0,) * (len(shape) - 1) or tuple(limit) != (i + 1, *shape[1:]) or (
            strides is not None and any(st != 1 for st in strides)
        ):
            return None
        return index[leaf], int(i)

    def bias_source(other: Any, out_shape: tuple, positions: list[int]) -> tuple | None:
        """The bias ``(k, i)`` that ``other`` is a broadcast of (single-use ``broadcast_in_dim`` steps),
        its axes landing on the product's output axes ``positions`` of the sum."""
        chain = []
        while _is_var(other) and single_use(other) and source(other) is None:
            e = producer.get(other)
            if e is None or e.primitive.name != "broadcast_in_dim":
                return None
            chain.append(e)
            other = e.invars[0]
        src = source(other)
        if src is None:
            return None
        shape = leaf_shapes[src[0]][1:] if src[1] is not None else leaf_shapes[src[0]]
        if tuple(shape) != tuple(out_shape):
            return None
        axes = list(range(len(shape)))  # where each of the bias's axes lands
        for e in reversed(chain):
            axes = [e.params["broadcast_dimensions"][a] for a in axes]
        return src if axes == positions else None  # (an add's operands have equal ranks: no promotion)

    def bias_of(y: Any, out_shape: tuple, positions: list[int]) -> tuple | None:
        """The bias of the product ``y``: added to it (after transposes), or to a sum that it is the only use
        of (``x + y @ W + b`` adds ``b`` to the residual sum, whose gradient is ``y``'s); each step used once."""
        cur = y
        while single_use(cur) is not None:
            i, pos = single_use(cur)
            if i < 0:
                return None
            e = eqns[i]
            if e.primitive.name == "transpose":
                perm = tuple(e.params["permutation"])
                positions = [perm.index(p) for p in positions]
                cur = e.outvars[0]
                continue
            if e.primitive.name != "add":
                return None
            b = bias_source(e.invars[1 - pos], out_shape, positions)
            if b is not None:
                return b
            out = e.outvars[0]
            if tuple(out.aval.shape) != tuple(cur.aval.shape):
                return None
            cur = out
        return None

    layers = []
    claimed: dict[int, list] = {}  # leaf -> the slices (or None) the layers take of it
    for i, eqn in enumerate(eqns):
        if eqn.primitive.name != "dot_general":
            continue
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if lb or rb:
            continue
        for w_pos in (1, 0):
            src = source(eqn.invars[w_pos])
            if src is not None:
                break
        else:
            continue
        x_pos = 1 - w_pos
        x, w = eqn.invars[x_pos], eqn.invars[w_pos]
        xc, wc = (lc, rc) if x_pos == 0 else (rc, lc)
        pairs = sorted(zip(wc, xc))  # W's contracted axes in W's own order (not the order einsum chose)
        wc, xc = [w for w, _ in pairs], [x for _, x in pairs]
        x_shape, w_shape = tuple(x.aval.shape), tuple(w.aval.shape)
        xf = [a for a in range(len(x_shape)) if a not in xc]
        wf = [a for a in range(len(w_shape)) if a not in wc]
        if not xf or xf[0] != 0 or x_shape[0] != batch or not wf:
            continue
        y = eqn.outvars[0]
        # the product's axes: the lhs's free axes, then the rhs's
        out_axes = [("x", a) for a in xf] + [("w", a) for a in wf]
        if w_pos == 0:
            out_axes = [("w", a) for a in wf] + [("x", a) for a in xf]
        g_perm = tuple(out_axes.index(("x", a)) for a in xf) + tuple(out_axes.index(("w", a)) for a in wf)
        positions = [out_axes.index(("w", a)) for a in wf]
        out_shape = tuple(w_shape[a] for a in wf)
        b = bias_of(y, out_shape, positions)
        n_in = int(np.prod([w_shape[a] for a in wc]))
        n_out = int(np.prod(out_shape))
        layers.append(_Layer(
            i, x_pos, src[0], src[1], None if b is None else b[0], None if b is None else b[1], n_in, n_out,
            tuple(y.aval.shape), tuple(wc) + tuple(wf), tuple(xf) + tuple(xc), g_perm,
        ))
        claimed.setdefault(src[0], []).append(src[1])
        if b is not None:
            claimed.setdefault(b[0], []).append(b[1])
    taken = set()
    for k, got in claimed.items():
        n_uses = len(uses.get(invars[k], []))
        if got == [None] or (None not in got and sorted(got) == list(range(leaf_shapes[k][0])) and n_uses == len(got)):
            taken.add(k)
    layers = [la for la in layers if la.weight in taken and (la.bias is None or la.bias in taken)]
    taken = {la.weight for la in layers} | {la.bias for la in layers if la.bias is not None}
    return layers, [k for k in range(len(leaf_shapes)) if k not in taken]


def _run(closed: Any, leaves: list, probes: list, layers: list[_Layer]) -> tuple[list, list]:
    """Evaluate the (flat) program with a probe added to each dense layer's product; also return the layer inputs."""
    at = {layer.eqn: n for n, layer in enumerate(layers)}
    xs = [None] * len(layers)

    def probe(i: int, invals: list, out: Any) -> Any:
        if i not in at:
            return out
        xs[at[i]] = invals[layers[at[i]].x_pos]
        return out + probes[at[i]]

    return _evaluate(closed.jaxpr, list(closed.consts), leaves, probe), xs


# ---------------------------------------------------------------------------
# the statistics: layer inputs and backpropagated output-side factors
# ---------------------------------------------------------------------------
def _units(v: jax.Array, weight_sharing: str, pool: Callable) -> jax.Array:
    r"""``(N, T, k)`` to the ``(M, k)`` rows ``u`` of a factor, :math:`A = \frac1M\sum_u \bar x_u\bar x_u^\top`,
    :math:`B = c\sum_{u,r} g_{u,r}g_{u,r}^\top`: ``"expand"``, every (example, token), :math:`M = NT`;
    ``"reduce"``, every example, the token axis pooled (``jnp.mean`` for the inputs, ``jnp.sum`` for the
    backpropagated columns: :math:`\sum_t \bar x_t g_t^\top \approx \bar x\,(\sum_t g_t)^\top`), :math:`M = N`.
    For a layer applied once per example (``T = 1``) both are the same."""
    return v.reshape(-1, v.shape[-1]) if weight_sharing == "expand" else pool(v, axis=1)


def _model_layers(f: Callable, leaves: list, who: str, paths: tuple) -> tuple[Any, list[_Layer]]:
    """The model's flat program and its dense layers; a :class:`GeometryError` when the model's output is
    not one ``(N, C)`` array, the batch is empty, or a parameter is outside the dense layers."""
    closed = _flat_program(f, leaves)
    if len(closed.out_avals) != 1 or len(closed.out_avals[0].shape) != 2:
        shapes = [tuple(a.shape) for a in closed.out_avals]
        raise GeometryError(
            f"{who}: model_fn must return one array of outputs of shape (N, C) (a batch of logits or means); "
            f"got {shapes if len(shapes) != 1 else shapes[0]}."
        )
    n = closed.out_avals[0].shape[0]
    if n == 0:
        raise GeometryError(f"{who}: the batch is empty; the metric of an empty batch is undefined.")
    layers, others = _find_layers(closed.jaxpr, [tuple(np.shape(x)) for x in leaves], n)
    if others:
        listed = ", ".join(f"{paths[k]} {tuple(np.shape(leaves[k]))}" for k in others)
        raise GeometryError(
            f"{who}: {len(others)} parameter(s) are not in a dense layer, so KFAC has no Kronecker factors for "
            f"them: {listed}. A dense layer here is `x @ W (+ b)` (or an einsum contracting some axes of W): W "
            f"(or its block of a lax.scan's stack) used only there, on inputs x of shape (N, *tokens, in) with "
            f"N = {n} the batch of the outputs, b of W's output shape used only to be added to that product. "
            "Hold the other parameters fixed (pass only the dense ones and let model_fn close over the rest; "
            "for minigeo's ViT, minigeo.models.vit_dense_params splits them), or use mg.ggn / mg.fisher (exact, "
            "matrix-free)."
        )
    return closed, layers


def _statistics(closed: Any, layers: list[_Layer], lik: Likelihood, reduction: str, mc_samples: int | None,
                key: Any, leaves: list, categorical: bool):
    """``(xs, backward, columns, c)``: per layer the inputs ``(N, T, in)`` (a 1 appended for a bias); the
    output-side columns ``(R, N, C)`` (a factor of the output Fisher, or scaled Monte-Carlo scores); and
    ``backward(w)``, per layer the column ``w`` backpropagated to the layer's outputs, ``(N, T, out)``,
    ``T`` the layer's tokens (1 for a layer applied once per example)."""
    z_aval = closed.out_avals[0]
    probes = [jnp.zeros(layer.out_shape, z_aval.dtype) for layer in layers]
    (z,), vjp, xs = jax.vjp(lambda pr: _run(closed, leaves, pr, layers), probes, has_aux=True)
    n = z.shape[0]
    z0 = jax.lax.stop_gradient(z)
    if mc_samples is None:
        columns = jnp.moveaxis(fisher_factor(lik.fisher_mv, z0, categorical), -1, 0)  # (R, N, C)
    else:
        targets = jax.vmap(lambda k: lik.sample(k, z0))(jax.random.split(key, mc_samples))
        scores = jax.vmap(lambda t: jax.grad(lambda zz: jnp.sum(lik.nll(zz, t)))(z0))(targets)  # (S, N, C)
        columns = scores / jnp.sqrt(jnp.asarray(mc_samples, z0.dtype))

    def backward(w: jax.Array) -> list:
        return [jnp.transpose(g, layer.g_perm).reshape(n, -1, layer.n_out) for g, layer in zip(vjp([w])[0], layers)]

    c = 1.0 / n if reduction == "mean" else 1.0
    xs = [jnp.transpose(x, layer.x_perm).reshape(n, -1, layer.n_in) for x, layer in zip(xs, layers)]
    xs = [
        jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1) if layer.bias is not None else x
        for x, layer in zip(xs, layers)
    ]
    return xs, backward, columns, c


@jax.tree_util.register_pytree_node_class
class _Found:
    """The dense layers found in the model's program, carried out of the compiled rule as static pytree
    data: a call that reuses the compiled rule (the same programs) gets them back without a trace."""

    def __init__(self, layers: tuple) -> None:
        self.layers = tuple(layers)

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return (), self.layers

    @classmethod
    def tree_unflatten(cls, layers: tuple, _: tuple) -> "_Found":
        return cls(layers)


def _factor_rule(f: Callable, fisher_mv: Callable, sample: Callable, nll: Callable, leaves: list, key: Any, *,
                 name: str, categorical: bool, reduction: str, mc_samples: int | None, weight_sharing: str,
                 kind: str, who: str, paths: tuple) -> tuple[_Found, list[tuple]]:
    """The dense layers and every layer's block from the model ``f`` over the leaves and the likelihood's
    functions: ``kind="pairs"`` ``(A, B)``, ``"kfac"`` ``(A, B, lamA, QA, lamB, QB)``, ``"ekfac"``
    ``(S, QA, QB)``.

    A :class:`~minigeo._compile.Derived` rule: an eager call traces only ``f`` and the likelihood's
    functions and reuses the compiled statistics, factors and eigendecompositions when their programs
    are the ones compiled before (the statistics never leave the compiled program, and the layers come
    back as the output's static structure)."""
    lik = Likelihood(name, fisher_mv, sample, nll)
    closed, layers = _model_layers(f, leaves, who, paths)
    return _Found(layers), _blocks(closed, layers, lik, leaves, key, categorical, reduction, mc_samples,
                                   weight_sharing, kind)


def _blocks(closed: Any, layers: list[_Layer], lik: Likelihood, leaves: list, key: Any, categorical: bool,
            reduction: str, mc_samples: int | None, weight_sharing: str, kind: str) -> list[tuple]:
    """The blocks of :func:`_factor_rule` from the model's flat program and its layers."""
    xs, backward, columns, c = _statistics(closed, layers, lik, reduction, mc_samples, key, leaves, categorical)

    # B = c sum_r g_r^T g_r, accumulated one column at a time: no (R, N, T, out) array is formed
    def column(Bs: list, w: jax.Array) -> tuple[list, None]:
        units = [_units(g, weight_sharing, jnp.sum) for g in backward(w)]
        return [B + u.T @ u for B, u in zip(Bs, units)], None

    zeros = [jnp.zeros((g.shape[-1],) * 2, columns.dtype) for g in jax.eval_shape(backward, columns[0])]
    Bs = jax.lax.scan(column, zeros, columns)[0]
    pairs = []
    for x, B in zip(xs, Bs):
        u = _units(x, weight_sharing, jnp.mean)
        pairs.append((u.T @ u / u.shape[0], c * B))
    if kind == "pairs":
        return pairs
    eig = [(*_eigh(A), *_eigh(B)) for A, B in pairs]
    if kind == "kfac":
        return [(A, B, *e) for (A, B), e in zip(pairs, eig)]

    # EKFAC: a second pass over the columns, projecting each one's g onto the factors' eigenbases
    steps = [_projected_second_moments(x @ QA, QB.shape[0]) for x, (_, QA, _, QB) in zip(xs, eig)]

    def projected(accs: list, w: jax.Array) -> tuple[list, None]:
        return [upd(acc, g @ QB) for acc, g, (_, upd, _), (_, _, _, QB) in zip(accs, backward(w), steps, eig)], None

    accs = jax.lax.scan(projected, [init() for init, _, _ in steps], columns)[0]
    return [(finish(acc, c), QA, QB) for acc, (_, _, finish), (_, QA, _, QB) in zip(accs, steps, eig)]


_compiled = functools.partial(compiled, run_work)


def _prepare(model_fn: Callable, likelihood: Any, params: PyTree, batch: Any, reduction: str,
             mc_samples: Any, key: Any, who: str):
    """Checked arguments and the model on its data over the flat leaves (its program is traced, and its
    layers found, by :func:`_factor_rule`)."""
    lik = as_likelihood(likelihood, who)
    if reduction not in ("mean", "sum"):
        raise GeometryError(f"{who}: reduction must be 'mean' or 'sum', got {reduction!r}.")
    if mc_samples is not None:
        if key is None or isinstance(mc_samples, bool) or not (isinstance(mc_samples, int) and mc_samples >= 1):
            raise GeometryError(f"{who}: the Monte-Carlo Fisher needs mc_samples >= 1 (an int) and a PRNG key.")
        check_key(key)
    params = as_float_point(params, "params")
    check_finite(params, "params")
    leaves, treedef = jax.tree_util.tree_flatten(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if batch is None:
        f = lambda ls: model_fn(jax.tree_util.tree_unflatten(treedef, ls))
    else:
        inputs, _ = split_batch(batch, who)
        f = lambda ls: model_fn(jax.tree_util.tree_unflatten(treedef, ls), inputs)
    return lik, params, leaves, treedef, paths, f


def _eigh(M: jax.Array) -> tuple[jax.Array, jax.Array]:
    lam, Q = jnp.linalg.eigh(0.5 * (M + M.T))
    return jnp.maximum(lam, 0.0), Q  # PSD by construction: clip round-off below zero


# ---------------------------------------------------------------------------
# the metrics
# ---------------------------------------------------------------------------
def _layer_names(paths: list, layer: _Layer) -> tuple[str, str | None]:
    """The layer's weight and bias as paths, ``path[l]`` for a block's slice of a stacked leaf."""
    name = lambda k, i: paths[k] if i is None else f"{paths[k]}[{i}]"
    return name(layer.weight, layer.index), None if layer.bias is None else name(layer.bias, layer.bias_index)


def _stack(leaves: list, layer: _Layer) -> jax.Array:
    """The layer's ``(in [+ 1], out)`` matrix: the weight's matrix view with the bias as its last row."""
    W = leaves[layer.weight] if layer.index is None else leaves[layer.weight][layer.index]
    W = jnp.transpose(W, layer.w_perm).reshape(layer.n_in, layer.n_out)
    if layer.bias is None:
        return W
    b = leaves[layer.bias] if layer.bias_index is None else leaves[layer.bias][layer.bias_index]
    return jnp.concatenate([W, b.reshape(1, layer.n_out)], axis=0)


def _map_layers(leaves: list, layers: list[_Layer], fn: Callable[[int, jax.Array], jax.Array]) -> list:
    """The leaves with every layer's matrix ``V`` replaced by ``fn(n, V)`` (``n`` the layer's position);
    the slices of a leaf stacked over a scan's blocks put back together."""
    out, pieces = list(leaves), {}

    def put(k: int, i: int | None, value: jax.Array) -> None:
        if i is None:
            out[k] = value
        else:
            pieces.setdefault(k, {})[i] = value

    for n, layer in enumerate(layers):
        R = fn(n, _stack(leaves, layer))
        shape = np.shape(leaves[layer.weight])[0 if layer.index is None else 1:]
        W = R[: layer.n_in].reshape([shape[a] for a in layer.w_perm])
        put(layer.weight, layer.index, jnp.transpose(W, np.argsort(layer.w_perm)))
        if layer.bias is not None:
            bshape = np.shape(leaves[layer.bias])[0 if layer.bias_index is None else 1:]
            put(layer.bias, layer.bias_index, R[layer.n_in].reshape(bshape))
    for k, parts in pieces.items():
        out[k] = jnp.stack([parts[i] for i in range(len(parts))])
    return out


def _check_point(params: PyTree, treedef: Any, shapes: list, who: str) -> list:
    leaves, td = jax.tree_util.tree_flatten(params)
    if td != treedef or [tuple(np.shape(x)) for x in leaves] != shapes:
        raise GeometryError(
            f"{who}: this metric was built for parameters of structure {treedef} with leaf shapes {shapes}; "
            f"got {td} with {[tuple(np.shape(x)) for x in leaves]}. Build it again at these parameters."
        )
    return leaves


class _FactoredProduct:
    r"""The product function of a Kronecker-factored metric, holding its eigenbasis (read by
    :func:`kronecker_eigenbasis`), its symmetric square root ``square_root(params, v, damping)``,
    :math:`(G + \epsilon I)^{1/2} v` (read by the spectral density's probes, which need a factor of
    the metric and cannot import this module) and its diagonal ``diagonal(params)``, a pytree like
    ``params`` (read by the diagonal Laplace posterior)."""

    def __init__(self, mv: Callable, eigenbasis: Callable[[], list], square_root: Callable,
                 diagonal: Callable) -> None:
        self._mv, self.eigenbasis, self.square_root, self.diagonal = mv, eigenbasis, square_root, diagonal

    def __call__(self, params: PyTree, v: PyTree) -> PyTree:
        return self._mv(params, v)


def _metric(name: str, treedef: Any, shapes: list, layers: list[_Layer], blocks: list, kind: str,
            paths: list) -> Metric:
    """The block-diagonal metric of the factored blocks: ``kind="kfac"`` blocks ``(A, B, lamA, QA, lamB, QB)``,
    ``kind="ekfac"`` blocks ``(S, QA, QB)``."""

    def mv(params: PyTree, v: PyTree) -> PyTree:
        _check_point(params, treedef, shapes, name)

        def product(n: int, V: jax.Array) -> jax.Array:
            if kind == "kfac":
                A, B = blocks[n][0].astype(V.dtype), blocks[n][1].astype(V.dtype)
                return A @ V @ B
            S, QA, QB = (b.astype(V.dtype) for b in blocks[n])
            return QA @ ((QA.T @ V @ QB) * S) @ QB.T

        return jax.tree_util.tree_unflatten(treedef, _map_layers(jax.tree_util.tree_leaves(v), layers, product))

    def in_eigenbasis(v: PyTree, scale: Callable[[jax.Array], jax.Array]) -> list:
        """The leaves of ``Q diag(scale(S)) Q^T v``, layer by layer."""

        def apply(n: int, V: jax.Array) -> jax.Array:
            S, QA, QB = (b.astype(V.dtype) for b in _eigen_block(blocks[n], kind))
            return QA @ ((QA.T @ V @ QB) * scale(S)) @ QB.T

        return _map_layers(jax.tree_util.tree_leaves(v), layers, apply)

    def solve(params: PyTree, rhs: PyTree, damping: Any) -> tuple[PyTree, jax.Array]:
        _check_point(params, treedef, shapes, name)
        ok, finite = jnp.asarray(True), jnp.asarray(True)
        for block in blocks:
            D = _eigen_block(block, kind)[0] + damping
            eps = jnp.finfo(D.dtype).eps
            ok = ok & (jnp.min(D) > max(D.shape) * eps * jnp.max(jnp.abs(D)))
            finite = finite & jnp.all(jnp.isfinite(D))
        finite = finite & jnp.all(jnp.asarray([jnp.all(jnp.isfinite(r)) for r in jax.tree_util.tree_leaves(rhs)]))
        status = jnp.where(
            ~finite, Status.NON_FINITE, jnp.where(ok, Status.OK, Status.NOT_POSITIVE_DEFINITE)
        ).astype(jnp.int32)
        out = [jnp.where(status == Status.OK, x, jnp.nan) for x in in_eigenbasis(rhs, lambda S: 1.0 / (S + damping))]
        return jax.tree_util.tree_unflatten(treedef, out), status

    def square_root(params: PyTree, v: PyTree, damping: Any) -> PyTree:
        _check_point(params, treedef, shapes, name)
        return jax.tree_util.tree_unflatten(treedef, in_eigenbasis(v, lambda S: jnp.sqrt(S + damping)))

    def diagonal(params: PyTree) -> PyTree:
        leaves = _check_point(params, treedef, shapes, name)

        def diag(n: int, V: jax.Array) -> jax.Array:
            S, QA, QB = (b.astype(V.dtype) for b in _eigen_block(blocks[n], kind))
            return (QA * QA) @ S @ (QB * QB).T

        return jax.tree_util.tree_unflatten(treedef, _map_layers(leaves, layers, diag))

    def eigenbasis() -> list[KroneckerEigenbasis]:
        out = []
        for layer, block in zip(layers, blocks):
            S, QA, QB = _eigen_block(block, kind)
            out.append(KroneckerEigenbasis(*_layer_names(paths, layer), QA, QB, S))
        return out

    return Metric(_FactoredProduct(mv, eigenbasis, square_root, diagonal), name, solve_fn=solve)


def _projected_second_moments(xt: jax.Array, n_out: int) -> tuple[Callable, Callable, Callable]:
    r"""EKFAC's :math:`s_{ij} = c\sum_{n,r}\big(\sum_t \tilde x_{nt,i}\,\tilde g_{nt,r,j}\big)^2` as ``(init, update,
    finish)``, summed one column ``r`` at a time: the squared projections of the per-example gradients
    :math:`\sum_t \bar x_{nt} g_{nt,r}^\top` onto :math:`q_{A,i}\otimes q_{B,j}` (``xt = x Q_A``, ``(N, T, in)``;
    ``update(acc, gt_r)`` with ``gt_r = g_r Q_B``, ``(N, T, out)``; ``finish(acc, c)`` the ``(in, out)`` moments).

    One token: :math:`c\,(\tilde x^{\odot 2})^\top \sum_r \tilde g_r^{\odot 2}`.  Several: through the token
    Gram matrices :math:`\sum_r \tilde g_{nt,r}\tilde g_{ns,r}` (memory :math:`N T^2 out`) or, when that is
    larger, the per-example gradients of one column at a time (memory :math:`N\cdot in\cdot out`), as
    curvlinops chooses."""
    n, T, n_in = xt.shape
    dtype = xt.dtype
    if T == 1:
        return (lambda: jnp.zeros((n, n_out), dtype), lambda acc, gt: acc + gt[:, 0] ** 2,
                lambda acc, c: c * (xt[:, 0] ** 2).T @ acc)
    if T * T * (n_in + n_out) <= n_in * n_out:
        return (lambda: jnp.zeros((n, T, T, n_out), dtype),
                lambda acc, gt: acc + jnp.einsum("ntj,nsj->ntsj", gt, gt),
                lambda acc, c: c * jnp.einsum("nti,nsi,ntsj->ij", xt, xt, acc))
    return (lambda: jnp.zeros((n_in, n_out), dtype),
            lambda acc, gt: acc + jnp.sum(jnp.einsum("nti,ntj->nij", xt, gt) ** 2, axis=0),
            lambda acc, c: c * acc)


def _eigen_block(block: tuple, kind: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""``(S, Q_A, Q_B)`` of one layer's block, :math:`G_\ell = (Q_A\otimes Q_B)\,\mathrm{diag}(S)\,(Q_A\otimes Q_B)^\top`."""
    if kind == "kfac":
        lamA, QA, lamB, QB = block[2:]
        return lamA[:, None] * lamB[None, :], QA, QB
    return block


def kronecker_eigenbasis(metric: Metric) -> list[KroneckerEigenbasis]:
    r"""The eigenbasis and eigenvalues of every layer's block of a :func:`~minigeo.kfac` or :func:`~minigeo.ekfac` metric.

    .. math:: G_\ell = (Q_{A,\ell}\otimes Q_{B,\ell})\,\mathrm{diag}(s_\ell)\,(Q_{A,\ell}\otimes Q_{B,\ell})^\top,

    what log-determinants, samples and marginal variances of a Kronecker-factored Laplace posterior
    are computed from (:func:`~minigeo.laplace_posterior` with ``structure="kfac"``).

    Parameters
    ----------
    metric : :class:`~minigeo.Metric`
        A metric made by :func:`~minigeo.kfac` or :func:`~minigeo.ekfac` (its damping is not included).

    Returns
    -------
    list of :class:`~minigeo.kronecker.KroneckerEigenbasis`
        One per dense layer, in the order of the model's program.

    Raises
    ------
    GeometryError
        For any other metric.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X, linear = jnp.array([[1.0, 2.0]]), lambda p, x: x @ p["W"]
    >>> K = mg.kfac(linear, "gaussian", {"W": jnp.zeros((2, 1))}, batch=(X, None))
    >>> [e.eigenvalues.shape for e in mg.kronecker.kronecker_eigenbasis(K)]
    [(2, 1)]

    References
    ----------
    Martens & Grosse (2015), "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature" (ICML). Chapters 2 and 5.
    """
    fn = getattr(metric, "mv_fn", None)
    if not isinstance(fn, _FactoredProduct):
        raise GeometryError(
            f"kronecker_eigenbasis: needs a metric made by mg.kfac or mg.ekfac; got "
            f"{getattr(metric, 'name', type(metric).__name__)!r}."
        )
    return fn.eigenbasis()


def _factors(model_fn, likelihood, params, batch, reduction, mc_samples, key, weight_sharing, who, kind):
    """``(likelihood, treedef, leaf shapes, paths, layers, blocks)``, the blocks of :func:`_factor_rule` for ``kind``."""
    if weight_sharing not in ("expand", "reduce"):
        raise GeometryError(f"{who}: weight_sharing must be 'expand' or 'reduce', got {weight_sharing!r}.")
    lik, params, leaves, treedef, paths, f = _prepare(
        model_fn, likelihood, params, batch, reduction, mc_samples, key, who
    )
    static = dict(name=lik.name, categorical=is_categorical(lik), reduction=reduction,
                  mc_samples=mc_samples, weight_sharing=weight_sharing, kind=kind, who=who, paths=tuple(paths))
    work = Derived(_factor_rule, (f, lik.fisher_mv, lik.sample, lik.nll), static)
    found, blocks = _compiled(work, leaves, key if mc_samples is not None else None)
    return lik, treedef, [tuple(np.shape(x)) for x in leaves], paths, list(found.layers), blocks


def kfac_factors(
    model_fn: Callable[..., jax.Array],
    likelihood: Union[str, Likelihood],
    params: PyTree,
    *,
    batch: Any = None,
    reduction: str = "mean",
    mc_samples: int | None = None,
    key: jax.Array | None = None,
    weight_sharing: str = "expand",
) -> list[KroneckerFactor]:
    r"""The Kronecker factors :math:`A, B` of every dense layer, in the order of the model's program.

    .. math:: A = \frac1N\sum_n \bar x_n \bar x_n^\top,\qquad B = c\sum_n\sum_r g_{n,r} g_{n,r}^\top,

    the factors of :func:`~minigeo.kfac` (same arguments), for inspection and for building on them.

    Parameters
    ----------
    model_fn, likelihood, params, batch, reduction, mc_samples, key, weight_sharing
        As in :func:`~minigeo.kfac`.

    Returns
    -------
    list of :class:`~minigeo.kronecker.KroneckerFactor`
        One per dense layer.

    Raises
    ------
    GeometryError
        As :func:`~minigeo.kfac`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.array([[1.0], [3.0]])
    >>> params = {"W": jnp.ones((1, 1)), "b": jnp.zeros(1)}
    >>> affine = lambda p, x: x @ p["W"] + p["b"]
    >>> (f,) = mg.kronecker.kfac_factors(affine, "gaussian", params, batch=(X, None))
    >>> f.A.tolist(), f.B.tolist()  # mean of (x, 1)(x, 1)^T; B = (1/N) sum_n 1
    ([[5.0, 2.0], [2.0, 1.0]], [[1.0]])

    References
    ----------
    Martens & Grosse (2015), "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature" (ICML). Chapter 2.
    """
    _, _, _, paths, layers, blocks = _factors(
        model_fn, likelihood, params, batch, reduction, mc_samples, key, weight_sharing, "kfac_factors", "pairs"
    )
    return [KroneckerFactor(*_layer_names(paths, layer), A, B) for layer, (A, B) in zip(layers, blocks)]


def kfac(
    model_fn: Callable[..., jax.Array],
    likelihood: Union[str, Likelihood],
    params: PyTree,
    *,
    batch: Any = None,
    reduction: str = "mean",
    mc_samples: int | None = None,
    key: jax.Array | None = None,
    weight_sharing: str = "expand",
) -> Metric:
    r"""The KFAC approximation of the GGN / Fisher: one Kronecker product per dense layer, block-diagonal.

    .. math:: G(\theta) &\approx \mathrm{blockdiag}_\ell\,(A_\ell \otimes B_\ell),\\
        A_\ell &= \frac1N\sum_n \bar x_n \bar x_n^\top,\quad B_\ell = c\sum_n\sum_r g_{n,r} g_{n,r}^\top,

    :math:`\bar x_n` the layer's input (with a 1 appended for a bias), :math:`g_{n,r} = J_{y_n}^\top
    S_n e_r` the columns of a square root :math:`S_n S_n^\top = F_{z_n}` of the output-space Fisher
    backpropagated to the layer's output :math:`y_n` ("type-2", the exact expectation; the GGN for
    the categorical and Gaussian likelihoods), or, with ``mc_samples``, the gradients
    :math:`\nabla_{y_n}\log p(t\mid z_n)/\sqrt{S}` at sampled targets (the MC Fisher).  The factors are
    computed once, at ``params``: the metric is the constant field of that point, and its
    :meth:`~minigeo.Metric.solve` is exact through the eigendecompositions of the factors (default
    ``method="factored"``), never forming a :math:`d\times d` matrix.  Exact (equal to the block of
    the GGN) for one example, ``N = 1``, and more generally whenever
    :math:`\bar x_n \bar x_n^\top` or :math:`\sum_r g_{n,r}g_{n,r}^\top` is the same for every example.
    Which parameters count as dense layers, and what happens to the others: see ``minigeo.kronecker``.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> z`` with ``batch``, ``params -> z`` without: outputs of shape
        ``(N, C)`` (logits for ``"categorical"``, means for ``"gaussian"``).
    likelihood : {"categorical", "gaussian"} or :class:`~minigeo.Likelihood`
        As in :func:`~minigeo.fisher`.
    params : pytree
        The point :math:`\theta` at which the factors are computed.
    batch : tuple, optional
        ``(inputs, targets)`` (the targets are not used: the Fisher takes its targets from the
        model), as in :func:`~minigeo.ggn` and :func:`~minigeo.fisher`.
    reduction : {"mean", "sum"}, optional
        ``"mean"`` (:math:`c = 1/N`, a mean loss) or ``"sum"`` (:math:`c = 1`).
    mc_samples : int, optional
        With ``key``: the Monte-Carlo Fisher's factors, ``mc_samples`` sampled targets per example.
    key : jax.Array, optional
        PRNG key of the sampled targets.
    weight_sharing : {"expand", "reduce"}, optional
        For a layer applied to every token, inputs ``(N, *T, in)``: ``"expand"`` (the default, as
        curvlinops') treats every (example, token) as an example, :math:`A = \frac{1}{N|T|}\sum_{n,t}
        \bar x_{nt}\bar x_{nt}^\top`, :math:`B = c\sum_{n,t,r} g_{nt,r} g_{nt,r}^\top` (it drops the
        products of different tokens); ``"reduce"`` takes per example the mean input and the summed
        column, :math:`\bar x_n = \frac1{|T|}\sum_t \bar x_{nt}`, :math:`g_{n,r} = \sum_t g_{nt,r}`
        (exact for a linear layer whose outputs are averaged over the tokens, with a Gaussian
        likelihood).  No effect on layers applied once per example.

    Returns
    -------
    :class:`~minigeo.Metric`
        Named ``"KFAC (<likelihood>)"``; its damping is added as for every metric
        (``.with_damping(eps)``: :math:`A\otimes B + \epsilon I`, not the factored damping of the paper).

    Raises
    ------
    GeometryError
        For parameters that are not in a dense layer (named), outputs not of shape ``(N, C)``, an
        unknown likelihood or ``reduction``, ``mc_samples`` without a key, non-finite parameters;
        from the metric: vectors or parameters of another structure or shape, negative damping, and
        (eagerly) a solve with a singular damped factor product.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.array([[1.0, 2.0]])  # one example: KFAC is the exact GGN
    >>> params = {"W": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    >>> model = lambda p, x: x @ p["W"] + p["b"]
    >>> K = mg.kfac(model, "categorical", params, batch=(X, None))
    >>> G = mg.fisher(model, "categorical", batch=(X, None))
    >>> bool(jnp.allclose(K.dense(params), G.dense(params)))
    True
    >>> v = {"W": jnp.ones((2, 2)), "b": jnp.ones(2)}
    >>> x = K.with_damping(0.1).solve(params, v)  # through the eigenvectors of A and B
    >>> bool(jnp.allclose(K.with_damping(0.1).mv(params, x)["W"], v["W"], atol=1e-5))
    True

    References
    ----------
    Martens & Grosse (2015), "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature" (ICML); the "type-2" factor :math:`B` as in curvlinops' ``KFACLinearOperator``.
    Chapter 2.
    """
    lik, treedef, shapes, paths, layers, blocks = _factors(
        model_fn, likelihood, params, batch, reduction, mc_samples, key, weight_sharing, "kfac", "kfac"
    )
    name = f"{'MC ' if mc_samples is not None else ''}KFAC ({lik.name})"
    return _metric(name, treedef, shapes, layers, blocks, "kfac", paths)


def ekfac(
    model_fn: Callable[..., jax.Array],
    likelihood: Union[str, Likelihood],
    params: PyTree,
    *,
    batch: Any = None,
    reduction: str = "mean",
    mc_samples: int | None = None,
    key: jax.Array | None = None,
    weight_sharing: str = "expand",
) -> Metric:
    r"""EKFAC: KFAC's Kronecker eigenbasis with the exact second moments of the gradients as eigenvalues.

    .. math:: G(\theta) &\approx \mathrm{blockdiag}_\ell\,(Q_A\otimes Q_B)\,\mathrm{diag}(s)\,(Q_A\otimes Q_B)^\top,\\
        s_{ij} &= c\sum_n (q_{A,i}^\top \bar x_n)^2 \sum_r (q_{B,j}^\top g_{n,r})^2,

    :math:`Q_A, Q_B` the eigenvectors of :func:`~minigeo.kfac`'s factors of each layer, :math:`\bar x_n` and
    :math:`g_{n,r}` as there.  :math:`s` is the diagonal of the exact GGN / Fisher block in that
    basis, so EKFAC is the nearest matrix to the exact block (Frobenius norm) with KFAC's
    eigenvectors, never farther from it than KFAC.  For a layer shared by tokens,
    :math:`s_{ij} = c\sum_{n,r}\big(q_{A,i}^\top \big(\sum_t \bar x_{nt} g_{nt,r}^\top\big) q_{B,j}\big)^2`,
    still that diagonal (``weight_sharing`` chooses KFAC's eigenbasis only).  A function of its own, as :func:`~minigeo.ggn`,
    :func:`~minigeo.fisher` and :func:`~minigeo.empirical_fisher` are (one name per matrix computed),
    with :func:`~minigeo.kfac`'s arguments; products and solves cost the same as KFAC's solves.

    Parameters
    ----------
    model_fn, likelihood, params, batch, reduction, mc_samples, key, weight_sharing
        As in :func:`~minigeo.kfac`.

    Returns
    -------
    :class:`~minigeo.Metric`
        Named ``"EKFAC (<likelihood>)"``; exact factored solves, as :func:`~minigeo.kfac`'s.

    Raises
    ------
    GeometryError
        As :func:`~minigeo.kfac`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.array([[1.0, 0.0], [0.0, 2.0]])
    >>> params = {"W": jnp.zeros((2, 1))}
    >>> model = lambda p, x: x @ p["W"]
    >>> E = mg.ekfac(model, "gaussian", params, batch=(X, None))
    >>> E.dense(params)  # the exact GGN X^T X / N, diagonal in A's eigenbasis
    Array([[0.5, 0. ],
           [0. , 2. ]], dtype=float32)

    References
    ----------
    George, Laurent, Bouthillier, Ballas & Vincent (2018), "Fast Approximate Natural Gradient
    Descent in a Kronecker-factored Eigenbasis" (NeurIPS); Martens & Grosse (2015). Chapter 2.
    """
    lik, treedef, shapes, paths, layers, blocks = _factors(
        model_fn, likelihood, params, batch, reduction, mc_samples, key, weight_sharing, "ekfac", "ekfac"
    )
    name = f"{'MC ' if mc_samples is not None else ''}EKFAC ({lik.name})"
    return _metric(name, treedef, shapes, layers, blocks, "ekfac", paths)
