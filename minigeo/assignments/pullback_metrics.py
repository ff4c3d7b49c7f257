"""Assignment 2 (chapter 2): the GGN, the Fisher, the empirical Fisher and a natural-gradient step."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._compile import compiled, run_work
from ..metrics import empirical_fisher, fisher, ggn
from ..natgrad import natural_gradient
from ._kit import CheckReport, _close, _close_or_name, _Fail, _run, _rng

# ---------------------------------------------------------------------------------------- instances
# Instances are drawn with NumPy's generator (no compilation), and every reference (dense Jacobians,
# Hessians, the known mistakes) is computed by one compiled program per check and network shape,
# reused when the check runs again (the score cell): a correct answer checks in a few seconds.

_reference = functools.partial(compiled, run_work)


def _normal(rng: np.random.Generator, *shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape))


def _mlp(rng: np.random.Generator, n: int, d_in: int, hidden: int, d_out: int, scale: float = 1.0):
    """A random one-hidden-layer tanh network on random inputs: ``(model, theta)``, ``model(theta)`` of shape (n, d_out).

    The parameters are one flat vector (``W1``, ``b1``, ``W2``, ``b2``), so that dense matrices are
    plain ``d x d`` arrays.
    """
    X = _normal(rng, n, d_in)
    shapes = [(d_in, hidden), (hidden,), (hidden, d_out), (d_out,)]
    sizes = [int(np.prod(s)) for s in shapes]

    def model(theta: jax.Array) -> jax.Array:
        parts, start = [], 0
        for shape, size in zip(shapes, sizes):
            parts.append(theta[start : start + size].reshape(shape))
            start += size
        W1, b1, W2, b2 = parts
        return jnp.tanh(X @ W1 + b1) @ W2 + b2

    theta = scale * _normal(rng, sum(sizes)) / np.sqrt(max(d_in, hidden))
    return model, theta


def _affine(rng: np.random.Generator, d: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A random well-conditioned invertible ``A``, its inverse and a shift ``b`` (psi = A theta + b)."""
    A = _normal(rng, d, d) / np.sqrt(d) + 2.0 * jnp.eye(d)
    return A, jnp.asarray(np.linalg.inv(np.asarray(A))), _normal(rng, d)


def _in_psi(model: Callable, A_inv: jax.Array, b: jax.Array) -> Callable:
    """The same network written in the coordinates psi = A theta + b: ``psi -> model(A^{-1}(psi - b))``."""
    return lambda psi: model(A_inv @ (psi - b))


def _jacobian(model: Callable, theta: jax.Array) -> jax.Array:
    """The dense Jacobian of the flattened outputs, ``(N * C, d)``."""
    return jax.jacfwd(lambda t: model(t).reshape(-1))(theta)


def _dense_ggn(model: Callable, loss: Callable, theta: jax.Array) -> jax.Array:
    """``J^T H_z J`` from dense ``jax.jacfwd`` and ``jax.hessian`` (the reference of tasks 2.1 and 2.4)."""
    z = model(theta)
    J = _jacobian(model, theta)
    Hz = jax.hessian(lambda zf: loss(zf.reshape(z.shape)))(z.reshape(-1))
    return J.T @ Hz @ J


def _dense_fisher(model: Callable, theta: jax.Array) -> jax.Array:
    """``(1/N) sum_n J_n^T (diag p_n - p_n p_n^T) J_n`` for softmax logits (the closed form of task 2.2)."""
    z = model(theta)
    n, c = z.shape
    J = _jacobian(model, theta).reshape(n, c, -1)
    p = jax.nn.softmax(z, axis=-1)
    Fz = jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]
    return jnp.einsum("nai,nab,nbj->ij", J, Fz, J) / n


def _logits_nll(z: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example negative log-likelihoods ``(N,)`` of softmax logits ``z`` at integer ``labels``."""
    return -jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), labels[:, None], axis=-1)[:, 0]


def _per_example_gradients(model: Callable, theta: jax.Array, labels: jax.Array) -> jax.Array:
    """``(N, d)``: row n is the gradient of example n's negative log-likelihood."""
    return jax.jacrev(lambda t: _logits_nll(model(t), labels))(theta)


# -------------------------------------------------------------------------------------- task 2.1


def _ggn_cases(rng: np.random.Generator) -> list[tuple[str, Callable, Callable, jax.Array]]:
    """(name, model, loss, theta): two random networks of one shape, with output losses whose Hessian is not ``I``."""
    out = []
    model, theta = _mlp(rng, 5, 3, 4, 3)
    labels = jnp.asarray(rng.integers(0, 3, 5))
    out.append(("mean cross-entropy", model, lambda z: jnp.mean(_logits_nll(z, labels)), theta))
    model, theta = _mlp(rng, 5, 3, 4, 3, scale=1.5)
    out.append(
        ("a loss coupling the examples", model, lambda z: jax.nn.logsumexp(z) + 0.1 * jnp.sum(z**4), theta)
    )
    return out


def _ggn_references(model: Callable, loss: Callable, theta: jax.Array, v: jax.Array) -> dict:
    """G v from the dense GGN, and what the common mistakes give instead."""
    z = model(theta)
    J = _jacobian(model, theta)
    Jv = (J @ v).reshape(z.shape)
    pull = lambda w: J.T @ w.reshape(-1)  # noqa: E731
    return {
        "Gv": _dense_ggn(model, loss, theta) @ v,
        "JtJv": J.T @ (J @ v),
        "Hv": jax.jvp(jax.grad(lambda t: loss(model(t))), (theta,), (v,))[1],
        "grad": pull(jax.grad(loss)(z)),
        "swapped": pull(jax.jvp(jax.grad(loss), (Jv,), (Jv,))[1]),
        "mg.ggn": ggn(model, loss).mv(theta, v),
    }


def check_ggn_vector_product(
    fn: Callable[[Callable, Callable, jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(model, loss, params, v)`` = :math:`\mathbf{G}v = \mathbf{J}^\top\mathbf{H}_z\mathbf{J}v`, the GGN-vector product.

    .. math:: \mathbf{G}v = \mathbf{J}^\top\bigl(\mathbf{H}_z(\mathbf{J}v)\bigr),\qquad
        \mathbf{H}_z = \nabla_z^2\,\mathcal L(z)\big|_{z = f(\theta)}.

    ``model`` maps a flat parameter vector to outputs ``z`` of shape ``(N, C)``, ``loss`` maps ``z`` to
    a scalar (targets closed over).  Compared with the dense GGN built from ``jax.jacfwd`` and
    ``jax.hessian`` and with :func:`minigeo.ggn` on two random networks (mean cross-entropy, a loss
    that couples the examples), and checked to transform as a pullback metric
    (chapter 2, Sec. 2.6): in coordinates :math:`\psi = A\theta + b` the product with :math:`Av` is
    :math:`A^{-\top}\mathbf{G}v`, so :math:`\langle v, v\rangle_{\mathbf{G}}` does not change.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(model, loss, params, v)``; it returns :math:`\mathbf{G}v`, shaped like ``params``.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint naming the
        mistake: the output Hessian left out, the full Hessian of the loss, the gradient instead of
        a Hessian product, the output Hessian at the wrong point); an exception raised by ``fn`` is
        reported there instead of propagating.

    Examples
    --------
    >>> import jax
    >>> from minigeo import assignments
    >>> def ggn_vector_product(model, loss, params, v):
    ...     z, Jv = jax.jvp(model, (params,), (v,))
    ...     HJv = jax.jvp(jax.grad(loss), (z,), (Jv,))[1]
    ...     return jax.vjp(model, params)[1](HJv)[0]
    >>> assignments.check_ggn_vector_product(ggn_vector_product).passed
    PASS ggn_vector_product: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.1, eq. (3), and Sec. 3.4, eq. (12); Grosse (2022), CSC2541
    lecture 3 *Metrics* (``gnhvp``). Assignment of chapter 2.
    """

    def body() -> str:
        hint = (
            "G v = J^T (H_z (J v)): push v forward with jax.jvp(model, ...), multiply by the Hessian of the "
            "loss at z = model(params) (jax.jvp of jax.grad(loss)), pull back with jax.vjp(model, ...)."
        )
        rng = _rng(21)
        for name, model, loss, theta in _ggn_cases(rng):
            v = _normal(rng, theta.size)
            ref = _reference(lambda x: _ggn_references(model, loss, x, v), theta)
            mistakes = [
                (ref["JtJv"], "it equals J^T J v. The output Hessian H_z is missing: G v = J^T H_z J v."),
                (
                    ref["Hv"],
                    "it equals H v, the full Hessian of loss(model(params)). The GGN drops its residual term "
                    "sum_a dL/dz_a Hess f_a: multiply J v by the Hessian of the loss in the outputs only.",
                ),
                (
                    ref["grad"],
                    "it equals J^T grad L, the gradient. Multiply by the output Hessian H_z instead: the "
                    "tangent of jax.grad(loss) in the direction J v.",
                ),
                (
                    ref["swapped"],
                    "the output Hessian was taken at z = J v. Evaluate it at z = model(params): "
                    "jax.jvp(jax.grad(loss), (z,), (Jv,)), primals first, then tangents.",
                ),
            ]
            got = fn(model, loss, theta, v)
            _close_or_name(got, ref["Gv"], f"G v ({name})", hint, mistakes)
            _close(got, ref["mg.ggn"], f"G v ({name}) against mg.ggn", hint)
            A, A_inv, b = _affine(rng, theta.size)
            _close(
                fn(_in_psi(model, A_inv, b), loss, A @ theta + b, A @ v),
                A_inv.T @ ref["Gv"],
                f"G v in the coordinates psi = A theta + b ({name})",
                "A pullback metric transforms by autodiff alone: computed on psi -> model(A^{-1}(psi - b)) at "
                "A theta + b, the product with A v is A^{-T} G v.",
            )
        return (
            "J^T H_z J v matches the dense GGN and mg.ggn for 2 losses, and <v, v>_G is the same in "
            "reparametrized coordinates."
        )

    return _run("ggn_vector_product", body, time_limit)


# -------------------------------------------------------------------------------------- task 2.2


def _classifier_cases(rng: np.random.Generator) -> list[tuple[Callable, jax.Array, jax.Array]]:
    """(model, theta, labels): two random softmax classifiers of one shape (3 classes) with random labels."""
    out = []
    for _ in range(2):
        model, theta = _mlp(rng, 5, 3, 4, 3, scale=1.5)
        out.append((model, theta, jnp.asarray(rng.integers(0, 3, 5))))
    return out


def _fisher_references(model: Callable, theta: jax.Array, labels: jax.Array) -> dict:
    """The closed-form Fisher, and what the common mistakes give instead."""
    z = model(theta)
    n, c = z.shape
    p = jax.nn.softmax(z, axis=-1)
    S = jax.jacrev(lambda t: jax.nn.log_softmax(model(t), axis=-1))(theta)  # (N, C, d) scores
    Jz = _jacobian(model, theta).reshape(n, c, -1)  # gradients of the logits
    Jp = jax.jacrev(lambda t: jax.nn.softmax(model(t), axis=-1))(theta)  # gradients of p
    U = _per_example_gradients(model, theta, labels)
    F = _dense_fisher(model, theta)
    return {
        "F": F,
        "empirical": U.T @ U / n,
        "no ppT": jnp.einsum("nc,nci,ncj->ij", p, Jz, Jz) / n,
        "unweighted": jnp.einsum("nci,ncj->ij", S, S) / (n * c),
        "grad p": jnp.einsum("nc,nci,ncj->ij", p, Jp, Jp) / n,
        "sum": n * F,
        "mg.fisher": fisher(model).dense(theta),
    }


def check_categorical_fisher(
    fn: Callable[[Callable, jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(model, params, labels)`` = the Fisher of a softmax classifier, as the covariance of the score.

    .. math::
        \begin{aligned}
        \mathbf{F} &= \frac1N\sum_{n=1}^N \mathbb{E}_{y\sim p(\cdot\mid x_n)}\bigl[s_{n,y}s_{n,y}^\top\bigr]
        = \frac1N\sum_n\sum_{c} p_{nc}\,s_{nc}s_{nc}^\top \\
        &= \frac1N\sum_n \mathbf{J}_n^\top\bigl(\mathrm{diag}(p_n) - p_np_n^\top\bigr)\mathbf{J}_n ,
        \end{aligned}

    with :math:`s_{nc} = \nabla_\theta\log p(c\mid x_n)`, :math:`p_n = \mathrm{softmax}(z_n)`.  ``model`` maps
    a flat parameter vector to logits of shape ``(N, C)``; ``labels`` (the training labels, shape
    ``(N,)``) are passed so that the signature matches the empirical Fisher's, and a correct answer
    does not use them.  Compared with the closed form (dense ``jax.jacfwd``) and :func:`minigeo.fisher`
    on two random classifiers, and checked to transform as a pullback metric,
    :math:`\hat{\mathbf{F}} = A^{-\top}\mathbf{F}A^{-1}` under :math:`\psi = A\theta + b`.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(model, params, labels)``; it returns the ``d x d`` Fisher.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint naming the
        mistake: the training labels instead of the model's, the :math:`-pp^\top` term missing,
        unweighted classes, the gradient of :math:`p` instead of :math:`\log p`, a sum instead of a
        mean); an exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from minigeo import assignments
    >>> def categorical_fisher(model, params, labels):
    ...     S = jax.jacrev(lambda t: jax.nn.log_softmax(model(t), axis=-1))(params)
    ...     p = jax.nn.softmax(model(params), axis=-1)
    ...     return jnp.einsum("nc,nci,ncj->ij", p, S, S) / p.shape[0]
    >>> assignments.check_categorical_fisher(categorical_fisher).passed
    PASS categorical_fisher: ...
    True

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (the Fisher as the covariance of the score and the
    Hessian of the KL); Kristiadi, Dangel & Hennig (2023), Sec. 3.4, eq. (12). Assignment of chapter 2.
    """

    def body() -> str:
        hint = (
            "F = (1/N) sum_n sum_c p_nc s_nc s_nc^T with the score s_nc = grad_params log softmax(model(params))[n, c] "
            "(jax.jacrev of the log-softmax gives all of them); the labels are not used."
        )
        rng = _rng(22)
        for model, theta, labels in _classifier_cases(rng):
            ref = _reference(lambda x: _fisher_references(model, x, labels), theta)
            mistakes = [
                (
                    ref["empirical"],
                    "it equals the empirical Fisher (the scores at the training labels). The Fisher takes its "
                    "labels from the model: average over y ~ p(y | x_n), i.e. sum over all classes weighted by p.",
                ),
                (
                    ref["no ppT"],
                    "it equals J^T diag(p) J / N: the -p p^T term is missing. The score is the gradient of "
                    "log softmax(z)_y = z_y - logsumexp(z), not of the logit z_y: the normalizer depends on the "
                    "parameters too.",
                ),
                (
                    ref["unweighted"],
                    "it weights the classes equally. The expectation is over y ~ p(y | x_n): weight class c by p_c.",
                ),
                (
                    ref["grad p"],
                    "it uses the gradient of p(y), not of log p(y). The score is grad log p = grad p / p.",
                ),
                (
                    ref["sum"],
                    "it is N times too large. The chapter's Fisher is a mean over the examples: divide by N.",
                ),
            ]
            got = fn(model, theta, labels)
            _close_or_name(got, ref["F"], "the Fisher", hint, mistakes)
            _close(got, ref["mg.fisher"], "the Fisher against mg.fisher", hint)
            A, A_inv, b = _affine(rng, theta.size)
            _close(
                fn(_in_psi(model, A_inv, b), A @ theta + b, labels),
                A_inv.T @ ref["F"] @ A_inv,
                "the Fisher in the coordinates psi = A theta + b",
                "The Fisher is a pullback metric: recomputed by autodiff in new coordinates it is A^{-T} F A^{-1}.",
            )
        return (
            "the covariance of the score equals J^T (diag p - p p^T) J / N and mg.fisher, and transforms as "
            "A^-T F A^-1."
        )

    return _run("categorical_fisher", body, time_limit)


# -------------------------------------------------------------------------------------- task 2.3


def _empirical_fisher_references(model: Callable, theta: jax.Array, labels: jax.Array) -> dict:
    """The empirical Fisher from per-example gradients, the Fisher, and what the common mistakes give."""
    n = labels.shape[0]
    U = _per_example_gradients(model, theta, labels)
    g_bar = U.mean(0)
    return {
        "F_emp": U.T @ U / n,
        "F": _dense_fisher(model, theta),
        "sum": U.T @ U,
        "mean outer": jnp.outer(g_bar, g_bar),
        "sum outer": n * jnp.outer(g_bar, g_bar),
        "mg.empirical_fisher": empirical_fisher(model, lambda z: _logits_nll(z, labels)).dense(theta),
    }


def check_empirical_fisher(
    fn: Callable[[Callable, jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(model, params, labels)`` = the empirical Fisher of a softmax classifier, and where it is not the Fisher.

    .. math:: \mathbf{F}_\mathrm{emp} = \frac1N\sum_{n=1}^N g_ng_n^\top = \frac1N\mathbf{U}^\top\mathbf{U},
        \qquad g_n = \nabla_\theta\ell_n = -\nabla_\theta\log p(y_n\mid x_n),

    where the rows of :math:`\mathbf{U}` (``N x d``) are the per-example gradients: one rank-one term per
    example, so :math:`\mathrm{rank}\,\mathbf{F}_\mathrm{emp}\le N`.  Compared with per-example gradients
    from ``jax.jacrev`` and with :func:`minigeo.empirical_fisher` at random labels and at labels far from
    the model's predictions (each example labelled with its least likely class), where it is far from the
    Fisher and has rank :math:`N` against the Fisher's :math:`N(C-1)`.  Then the bridge between the two:
    with labels drawn from the model, :math:`\mathbb{E}_{y_n\sim p(\cdot\mid x_n)}[\mathbf{F}_\mathrm{emp}] = \mathbf{F}`
    (computed exactly from ``fn`` on each example and each class, weighted by :math:`p_{nc}`).

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(model, params, labels)``; it returns the ``d x d`` empirical Fisher.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint naming the
        mistake: the Fisher instead, a sum instead of the chapter's mean, the outer product of the mean
        gradient); an exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from minigeo import assignments
    >>> def empirical_fisher(model, params, labels):
    ...     nll = lambda t: -jnp.take_along_axis(
    ...         jax.nn.log_softmax(model(t), axis=-1), labels[:, None], axis=-1)[:, 0]
    ...     U = jax.jacrev(nll)(params)
    ...     return U.T @ U / U.shape[0]
    >>> assignments.check_empirical_fisher(empirical_fisher).passed
    PASS empirical_fisher: ...
    True

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (empirical Fisher vs Fisher); Kunstner, Balles & Hennig
    (2019), Sec. 3. Assignment of chapter 2.
    """

    def body() -> str:
        hint = (
            "F_emp = (1/N) sum_n g_n g_n^T with g_n the gradient of example n's negative log-likelihood at its "
            "training label (the rows of jax.jacrev of the per-example losses)."
        )
        rng = _rng(23)
        n, c = 4, 3
        model, theta = _mlp(rng, n, 3, 4, c, scale=2.0)
        p = np.asarray(jax.nn.softmax(model(theta), axis=-1))
        cases = [
            (jnp.asarray(rng.integers(0, c, n)), "random labels"),
            (
                jnp.asarray(np.argmin(p, axis=-1)),
                "labels far from the predictions",
            ),  # each its least likely class
        ]
        for labels, where in cases:
            ref = _reference(lambda x, labels=labels: _empirical_fisher_references(model, x, labels), theta)
            mistakes = [
                (
                    ref["F"],
                    "it equals the Fisher (labels drawn from the model). The empirical Fisher plugs in the "
                    "training labels: g_n is the gradient of -log p(labels[n] | x_n).",
                ),
                (
                    ref["sum"],
                    "it is N times too large. The chapter's empirical Fisher is a mean: (1/N) sum_n g_n g_n^T.",
                ),
                (
                    ref["mean outer"],
                    "it equals the outer product of the mean gradient, a rank-one matrix that vanishes at a "
                    "minimum. Average the outer products instead: (1/N) sum_n g_n g_n^T.",
                ),
                (
                    ref["sum outer"],
                    "it equals N g_bar g_bar^T, the outer product of the summed gradient (rank one). Average "
                    "the per-example outer products instead: (1/N) sum_n g_n g_n^T.",
                ),
            ]
            got = fn(model, theta, labels)
            _close_or_name(got, ref["F_emp"], f"the empirical Fisher ({where})", hint, mistakes)
            _close(
                got,
                ref["mg.empirical_fisher"],
                f"the empirical Fisher against mg.empirical_fisher ({where})",
                hint,
            )
        F, F_emp = np.asarray(ref["F"]), np.asarray(got, dtype=float)
        tol = 1e-10 * float(np.max(np.abs(F)))
        rank_emp, rank_F = int(np.linalg.matrix_rank(F_emp, tol=tol)), int(np.linalg.matrix_rank(F, tol=tol))
        gap = float(np.linalg.norm(F_emp - F) / np.linalg.norm(F))
        # the bridge: with labels drawn from the model, the empirical Fisher is the Fisher on average
        # (exactly: each example alone, each class, weighted by its probability)
        expected = sum(
            p[i, k] * np.asarray(fn(lambda t, i=i: model(t)[i : i + 1], theta, jnp.array([k])), dtype=float)
            for i in range(n)
            for k in range(c)
        )
        _close(
            expected / n,
            F,
            "the average of your empirical Fisher over labels drawn from the model (one example at a time)",
            "E_{y_n ~ p(. | x_n)}[F_emp] must be the Fisher. " + hint,
        )
        return (
            f"(1/N) sum g_n g_n^T matches mg.empirical_fisher; at labels far from the predictions "
            f"||F_emp - F|| / ||F|| = {gap:.3g} and rank F_emp = {rank_emp} (<= N = {n}) against rank F = {rank_F}; "
            "averaged over labels drawn from the model it is the Fisher."
        )

    return _run("empirical_fisher", body, time_limit)


# -------------------------------------------------------------------------------------- task 2.4


def _natural_gradient_references(model: Callable, loss: Callable, theta: jax.Array, lr, lam) -> dict:
    """The step from the dense GGN and from the Fisher, and what the common mistakes give instead."""
    d = theta.size
    eye = jnp.eye(d)
    g = jax.grad(lambda t: loss(model(t)))(theta)
    G = _dense_ggn(model, loss, theta)
    J = _jacobian(model, theta)
    H = jax.hessian(lambda t: loss(model(t)))(theta)
    step = lambda M: theta - lr * jnp.linalg.solve(M, g)  # noqa: E731
    return {
        "step": step(G + lam * eye),
        "undamped": step(G),
        "gradient": theta - lr * g,
        "newton": step(H + lam * eye),
        "ascent": theta + lr * jnp.linalg.solve(G + lam * eye, g),
        "JtJ": step(J.T @ J + lam * eye),
        "2G": step(2 * G + lam * eye),
        "fisher": step(fisher(model, "gaussian").dense(theta) + lam * eye),
        "mg.natural_gradient": theta
        - lr * natural_gradient(ggn(model, loss), theta, g, damping=lam, solver="dense"),
    }


def check_natural_gradient_regression(
    fn: Callable[[Callable, Callable, jax.Array, float, float], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(model, loss, params, lr, damping)`` = one damped natural-gradient (GGN) step on a small regression.

    .. math::
        \begin{aligned}
        \theta^+ &= \theta - \alpha\,(\mathbf{G} + \epsilon\mathbf{I})^{-1}\nabla\mathcal{J}(\theta), \\
        \mathbf{G} &= \mathbf{J}^\top\mathbf{H}_z\mathbf{J},\quad \mathcal{J}(\theta) = \mathcal{L}(f(\theta)),
        \end{aligned}

    for a tanh network with one output and the loss :math:`\mathcal{L}(z) = \frac1{2N}\sum_n (z_n - y_n)^2`,
    so :math:`\mathbf{H}_z = \mathbf{I}/N` and the GGN is the Fisher of a unit-variance Gaussian
    (:func:`minigeo.fisher` with ``"gaussian"``).  Compared with a dense solve, with that Fisher and with
    :func:`minigeo.natural_gradient` at random points, step sizes and damping; then, without damping,
    with the invariance of the step under :math:`\psi = A\theta + b` (chapter 2, Sec. 2.6): the step
    computed in :math:`\psi` lands at :math:`A\theta^+ + b`, so the network computes the same function.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(model, loss, params, lr, damping)``; it returns the new parameters.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint naming the
        mistake: a plain gradient step, the Hessian instead of the GGN, the damping left out, a
        sign, :math:`\mathbf{J}^\top\mathbf{J}` without the loss's :math:`1/N`); an exception raised by
        ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from minigeo import assignments
    >>> def natural_gradient_step(model, loss, params, lr, damping):
    ...     z = model(params)
    ...     J = jax.jacfwd(lambda t: model(t).reshape(-1))(params)
    ...     Hz = jax.hessian(lambda zf: loss(zf.reshape(z.shape)))(z.reshape(-1))
    ...     G = J.T @ Hz @ J + damping * jnp.eye(params.size)
    ...     grad = jax.grad(lambda t: loss(model(t)))(params)
    ...     return params - lr * jnp.linalg.solve(G, grad)
    >>> assignments.check_natural_gradient_regression(natural_gradient_step).passed
    PASS natural_gradient_regression: ...
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.2 and Sec. 3.4; Grosse (2022), CSC2541 lecture 3 *Metrics*
    (squared error: Gauss-Newton = Fisher). Assignment of chapter 2.
    """

    def body() -> str:
        hint = (
            "theta - lr (G + damping I)^{-1} grad, with G = J^T H_z J the GGN of this loss (H_z = I/N for "
            "L = (1/2N) sum (z_n - y_n)^2) and grad the gradient of loss(model(params)); use a linear solve."
        )
        rng = _rng(24)
        n = 20  # more outputs than the 13 parameters: the GGN is invertible without damping
        for _ in range(3):
            model, theta = _mlp(rng, n, 2, 3, 1, scale=1.5)
            y = _normal(rng, n)
            loss = lambda z, y=y: 0.5 * jnp.mean((z[:, 0] - y) ** 2)  # noqa: E731
            lr, lam = float(rng.uniform(0.2, 1.0)), float(rng.uniform(1e-2, 1e-1))
            ref = _reference(lambda x: _natural_gradient_references(model, loss, x, lr, lam), theta)
            mistakes = [
                (
                    ref["gradient"],
                    "it is a plain gradient step. Precondition the gradient: (G + damping I)^{-1} grad.",
                ),
                (
                    ref["newton"],
                    "it is a damped Newton step with the full Hessian. Use the GGN J^T H_z J, which drops the "
                    "residual term (the Hessian is not positive definite in general).",
                ),
                (ref["undamped"], "the damping is missing: solve with G + damping I."),
                (
                    ref["ascent"],
                    "wrong sign: step against the gradient, theta - lr (G + damping I)^{-1} grad.",
                ),
                (
                    ref["JtJ"],
                    "it uses G = J^T J. The GGN of L = (1/2N) sum (z_n - y_n)^2 has H_z = I/N: G = J^T J / N.",
                ),
                (
                    ref["2G"],
                    "it uses G = 2 J^T J / N, the GGN of a loss without the 1/2. Use the Hessian of the loss "
                    "you are given: H_z = I/N.",
                ),
            ]
            got = fn(model, loss, theta, lr, lam)
            _close_or_name(got, ref["step"], "the new parameters", hint, mistakes)
            _close(
                got,
                ref["fisher"],
                "the new parameters against the Fisher step (for squared error GGN = Fisher)",
                hint,
            )
            _close(
                got,
                ref["mg.natural_gradient"],
                "the new parameters against mg.natural_gradient",
                hint,
            )
        # invariance: without damping the step is the same step in any affine coordinates.  Undamped, the
        # step's round-off grows with the GGN's condition number; a saturated net (about 1 draw in 6) has
        # cond(J^T J) beyond 1e10, where a correct solve differs from the reference by more than the
        # tolerance: such an instance is drawn again (up to 20 times) instead of failing a right answer
        for _ in range(20):
            J = np.asarray(jax.jacfwd(lambda t: model(t).reshape(-1))(theta))
            if np.linalg.cond(J.T @ J) < 1e8:
                break
            model, theta = _mlp(rng, n, 2, 3, 1, scale=1.5)
            y = _normal(rng, n)
            loss = lambda z, y=y: 0.5 * jnp.mean((z[:, 0] - y) ** 2)  # noqa: E731
            ref = _reference(lambda x: _natural_gradient_references(model, loss, x, lr, lam), theta)
            got = fn(model, loss, theta, lr, lam)
        A, A_inv, b = _affine(rng, theta.size)
        model_psi = _in_psi(model, A_inv, b)
        theta_plus = fn(model, loss, theta, lr, 0.0)
        _close(theta_plus, ref["undamped"], "the undamped step (damping = 0)", hint)
        _close(
            fn(model_psi, loss, A @ theta + b, lr, 0.0),
            A @ ref["undamped"] + b,
            "the undamped step computed in the coordinates psi = A theta + b",
            "G and the gradient transform as A^{-T} G A^{-1} and A^{-T} grad, so G^{-1} grad transforms as a "
            "vector, with A: the step in psi must land at A theta^+ + b.",
        )
        damped_gap = float(
            jnp.max(jnp.abs(model_psi(fn(model_psi, loss, A @ theta + b, lr, lam)) - model(got)))
        )
        return (
            "matches the dense GGN (= Fisher) solve and mg.natural_gradient; undamped, the step is the same "
            f"function in any affine coordinates (with damping {lam:.2g} I it is not: outputs differ by {damped_gap:.1e})."
        )

    return _run("natural_gradient_regression", body, time_limit)


def _linear_softmax_fisher(W: np.ndarray, X: np.ndarray) -> np.ndarray:
    """The Fisher of z_n = W x_n with softmax outputs, from its definition (1/N) sum_n sum_c p_nc s_nc s_nc^T,
    s_nc = grad_W log softmax(W x_n)_c = (e_c - p_n) x_n^T (flattened row-major like W)."""
    C, D = W.shape
    N = X.shape[0]
    F = np.zeros((C * D, C * D))
    for x in X:
        z = W @ x
        p = np.exp(z - z.max())
        p /= p.sum()
        for c in range(C):
            s = np.outer(np.eye(C)[c] - p, x).ravel()
            F += p[c] * np.outer(s, s)
    return F / N


def check_fisher_rank(
    fn: Callable[[int, int, int], int],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(N, D, C)`` = the rank of the Fisher of a linear softmax classifier, predicted before computing it.

    The model is :math:`z_n = W x_n` with :math:`W\in\mathbb R^{C\times D}` (no bias) on :math:`N` inputs
    :math:`x_n\in\mathbb R^D` in general position, with softmax probabilities.  A count the chapter does
    not print: the check computes the Fisher from its definition, :math:`\frac1N\sum_n\sum_c p_{nc}s_{nc}s_{nc}^\top`
    with the exact score, at random :math:`W` and inputs, and compares ``fn``'s number with its
    numerical rank.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(N, D, C)`` with integers; it returns the rank, a number.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> from minigeo import assignments
    >>> assignments.check_fisher_rank(lambda N, D, C: min(N, D) * C).passed
    FAIL fisher_rank: ...
    False

    References
    ----------
    No formula from the source papers (a count derived from chapter 2's Fisher of a softmax
    classifier); Kunstner, Balles & Hennig (2019) compare the Fisher with the empirical Fisher.
    Assignment of chapter 2.
    """

    def body() -> str:
        rng = _rng(24)
        cases = [(2, 5, 3), (6, 3, 4), (5, 4, 2), (1, 3, 5), (3, 2, 3)]
        for _ in range(3):
            cases.append((int(rng.integers(1, 7)), int(rng.integers(1, 6)), int(rng.integers(2, 5))))
        for N, D, C in cases:
            W = rng.normal(size=(C, D))
            X = rng.normal(size=(N, D))
            truth = int(np.linalg.matrix_rank(_linear_softmax_fisher(W, X), tol=1e-9))
            got = fn(N, D, C)
            mistakes = [
                (
                    min(N, D) * C,
                    "the softmax loses one direction per example: adding the same number to every logit "
                    "changes no probability, so the output Fisher diag(p) - p p^T has rank C - 1, not C.",
                ),
                (
                    min(N, C * D),
                    "rank <= N is the bound of the empirical Fisher (one label per example); the Fisher "
                    "sums over all C labels of each example.",
                ),
                (C * D, "F is singular here: the number of parameters C D is only an upper bound."),
                (
                    (C - 1) * N,
                    "more examples than inputs add nothing: the rows x_n span at most D dimensions.",
                ),
            ]
            _close_or_name(
                got,
                truth,
                f"the rank of the Fisher for N = {N}, D = {D}, C = {C}",
                "F = (1/N) sum_n (x_n x_n^T) kron (diag p_n - p_n p_n^T): what is the rank of each factor?",
                mistakes,
            )
        return "the rank of the softmax Fisher is right for every shape."

    return _run("fisher_rank", body, time_limit)
