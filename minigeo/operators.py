r"""Curvature operators over whole datasets, applied batch by batch (floor 4, chapters 2 and 4).

The curvature matrices of chapters 2 and 4 are averages over the training set,

.. math:: M(\theta) = \frac1N \sum_{n=1}^N M_n(\theta), \qquad
          M \in \{H,\ \text{GGN},\ F,\ \text{empirical } F\},

and a dataset rarely fits in one batch.  A :class:`CurvatureOperator` is built once from
a loss (or a model and a loss) and the parameters; its per-batch product is compiled
once and takes the batch as an argument, so every batch of the same shape reuses the
same program.  Over an iterable of batches of sizes :math:`n_b` (batch losses are
means) the operator is :math:`\sum_b n_b M_b / \sum_b n_b`, the dataset mean whatever
the batch sizes.  Hutchinson's trace needs **one** pass over the data (all probes are
pushed through each batch together); Lanczos needs one pass per iteration and keeps its
Krylov basis in host memory (``O(d)`` on the device).  Long passes show a progress bar
(``progress=True``; off by default).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, as_float_point, check_finite, check_same_structure
from ._linalg import check_damping, lanczos_tridiagonal_offloaded
from ._eigen import ResumableBlockLanczos, certified_top_eigenvalues, validate_k
from ._estimators import check_slq_positive, mean_and_standard_error, rademacher_like, slq_breakdown_tol, slq_quadrature
from ._tree import PyTree, ravel, tree_size
from .curvature import _CG_HINT, MetricArg, _diagnose_cg, _metric_inverse, hvp
from .metrics import Likelihood, Metric, empirical_fisher, fisher, ggn

__all__ = [
    "Batches",
    "batches_of",
    "CurvatureOperator",
    "hessian_operator",
    "ggn_operator",
    "fisher_operator",
    "empirical_fisher_operator",
]

Batch = Any
BatchSource = Union[Iterable[Batch], Callable[[], Iterable[Batch]]]


# ---------------------------------------------------------------------------
# batches and progress bars
# ---------------------------------------------------------------------------
class Batches(Sequence):
    r"""An in-memory dataset cut into consecutive batches; re-iterable, with a length.

    No formula: batch :math:`i` holds examples ``i * batch_size`` to ``(i + 1) * batch_size - 1``.

    Parameters
    ----------
    data : pytree of arrays
        A pytree of arrays with a common leading example axis, e.g. ``(inputs, labels)``.
    batch_size : int
        Examples per batch; the last batch holds the remainder unless ``drop_remainder``.
    drop_remainder : bool, optional
        Drop the last, smaller batch (one compiled program instead of two).

    Raises
    ------
    GeometryError
        If ``data`` has no arrays with a leading axis, the arrays disagree on the number of
        examples, ``batch_size`` is not a positive int, or no batch remains.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> b = mg.batches_of((jnp.zeros((10, 3)), jnp.arange(10)), 4)
    >>> len(b), [x.shape[0] for x, _ in b]
    (3, [4, 4, 2])

    References
    ----------
    No formula from the source papers: the data side of :class:`~minigeo.CurvatureOperator`.
    Taught in chapter 4, *Invariant Hessians*.
    """

    def __init__(self, data: PyTree, batch_size: int, drop_remainder: bool = False) -> None:
        leaves = jax.tree_util.tree_leaves(data)
        if not leaves or any(jnp.ndim(x) < 1 for x in leaves):
            raise GeometryError("batches_of: data must be a pytree of arrays with a leading example axis.")
        sizes = {int(jnp.shape(x)[0]) for x in leaves}
        if len(sizes) != 1:
            raise GeometryError(
                f"batches_of: the arrays of data have different numbers of examples {sorted(sizes)}; "
                "their leading axes must agree."
            )
        if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
            raise GeometryError(f"batches_of: batch_size must be a positive int, got {batch_size!r}.")
        self.data, self.batch_size = data, int(batch_size)
        self.num_examples = sizes.pop()
        full, rest = divmod(self.num_examples, self.batch_size)
        self._len = full + (1 if rest and not drop_remainder else 0)
        if self._len == 0:
            raise GeometryError(
                f"batches_of: no batch: {self.num_examples} examples, batch_size {batch_size} and "
                "drop_remainder=True."
            )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> Batch:  # type: ignore[override]
        if not -self._len <= i < self._len:
            raise IndexError(f"batch {i} of {self._len}")
        start = (i % self._len) * self.batch_size
        return jax.tree_util.tree_map(lambda x: x[start : start + self.batch_size], self.data)


def batches_of(data: PyTree, batch_size: int, *, drop_remainder: bool = False) -> Batches:
    r"""Cut an in-memory dataset into consecutive batches (see :class:`~minigeo.Batches`).

    No formula: batch :math:`i` holds examples ``i * batch_size`` to ``(i + 1) * batch_size - 1``.

    Parameters
    ----------
    data : pytree of arrays
        A pytree of arrays with a common leading example axis.
    batch_size : int
        Examples per batch.
    drop_remainder : bool, optional
        Drop the last, smaller batch.

    Returns
    -------
    :class:`~minigeo.Batches`
        A re-iterable sequence of batches (pytrees like ``data``).

    Raises
    ------
    GeometryError
        If the arrays disagree on the number of examples or ``batch_size`` is not positive.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> [int(x.sum()) for x in mg.batches_of(jnp.arange(5), 2)]
    [1, 5, 4]

    References
    ----------
    No formula from the source papers: the data side of :class:`~minigeo.CurvatureOperator`.
    Taught in chapter 4, *Invariant Hessians*.
    """
    return Batches(data, batch_size, drop_remainder)


def _progress(iterable: Iterable, progress: Any, desc: str, total: int | None = None) -> Iterable:
    """Wrap ``iterable`` in a progress bar: ``progress`` False, True (tqdm) or a tqdm-like class."""
    if progress is False or progress is None:
        return iterable
    if progress is True:
        try:
            from tqdm.std import tqdm as progress
        except ImportError as e:  # pragma: no cover - tqdm is a dependency of minigeo
            raise GeometryError("progress=True needs the tqdm package: pip install tqdm.") from e
    if not callable(progress):
        raise GeometryError(f"progress must be True, False or a tqdm-like class; got {progress!r}.")
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    return progress(iterable, desc=desc, total=total)


def _one_pass(batches: BatchSource) -> Iterable[Batch]:
    return batches() if callable(batches) else batches


def _many_passes(batches: BatchSource, who: str) -> Callable[[], Iterable[Batch]]:
    """A function giving a fresh pass over the data; refuse one-shot iterators."""
    if callable(batches):
        return batches
    if isinstance(batches, Iterator):
        raise GeometryError(
            f"{who} passes over the data several times, but got a one-shot iterator (a generator?). "
            "Pass a list, mg.batches_of(data, batch_size), or a zero-argument function that returns a "
            "fresh iterator (e.g. lambda: loader)."
        )
    return lambda: batches


def _num_examples(batch: Batch, who: str) -> int:
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves or jnp.ndim(leaves[0]) < 1:
        raise GeometryError(f"{who}: a batch must be a pytree of arrays with a leading example axis.")
    n = int(jnp.shape(leaves[0])[0])
    if n == 0:
        raise GeometryError(f"{who}: a batch is empty; every batch needs at least one example.")
    return n


# ---------------------------------------------------------------------------
# the operator
# ---------------------------------------------------------------------------
class CurvatureOperator:
    r"""A curvature matrix of a loss averaged over a dataset, applied batch by batch.

    .. math:: M v = \frac{\sum_b n_b\, M_b v}{\sum_b n_b},

    :math:`M_b` the matrix of batch :math:`b` (its loss a mean over its :math:`n_b`
    examples).  Build it with :func:`~minigeo.hessian_operator`, :func:`~minigeo.ggn_operator`,
    :func:`~minigeo.fisher_operator` or :func:`~minigeo.empirical_fisher_operator`.

    Parameters
    ----------
    batch_mv : callable
        ``batch_mv(params, v, batch)``, the product :math:`M_b v` on one batch.
    params : pytree
        The point :math:`\theta` (a pytree of floating arrays).
    name : str
        Shown in messages and progress bars.

    Raises
    ------
    GeometryError
        If ``batch_mv`` is not callable, or ``params`` is empty, integer or not finite.

    Notes
    -----
    Its per-batch products are compiled once per operator (and per batch shape), with the
    parameters and the batch as arguments, so neither a new batch nor :meth:`at` new
    parameters recompiles.  The invariant endomorphism :math:`G^{-1}M` enters through the
    ``metric`` argument of :meth:`trace_estimate` and :meth:`top_eigenvalues` (``None``, a
    positive diagonal pytree, or a :class:`~minigeo.Metric`, e.g. another operator's
    :meth:`as_metric` on a fixed batch).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> X, y = jnp.eye(4), jnp.ones(4)
    >>> H = mg.hessian_operator(lambda w, b: jnp.mean((b[0] @ w - b[1]) ** 2), jnp.zeros(4))
    >>> H.dataset_mv(jnp.ones(4), mg.batches_of((X, y), 2))   # 2 X^T X / N = I / 2
    Array([0.5, 0.5, 0.5, 0.5], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eqs. (3) and (5) (GGN/Fisher and Hessian of the dataset loss);
    Grosse (2022), CSC2541 lecture 3. Taught in chapter 4, *Invariant Hessians*.
    """

    def __init__(self, batch_mv: Callable[[PyTree, PyTree, Batch], PyTree], params: PyTree, name: str) -> None:
        if not callable(batch_mv):
            raise GeometryError(f"CurvatureOperator needs a callable batch_mv; got {type(batch_mv).__name__}.")
        params = as_float_point(params, "params")
        check_finite(params, "params")
        self.params, self.name, self.batch_mv = params, name, batch_mv
        self._mv = jax.jit(batch_mv)
        self._block_mv = jax.jit(jax.vmap(batch_mv, in_axes=(None, 0, None)))
        self._terms = jax.jit(_probe_terms(batch_mv), static_argnames="batched")

    def at(self, params: PyTree) -> "CurvatureOperator":
        r"""The same operator at other parameters (same structure), reusing the compiled programs.

        .. math:: M \mapsto M(\theta') .

        Parameters
        ----------
        params : pytree
            The new point :math:`\theta'`, structured like the operator's ``params``.

        Returns
        -------
        :class:`~minigeo.CurvatureOperator`
            A new operator; this one is unchanged.

        Raises
        ------
        GeometryError
            If ``params`` differs in structure or is not finite.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> H = mg.hessian_operator(lambda w, x: jnp.mean(jnp.sum(x * w ** 3, axis=1)), jnp.ones(2))
        >>> H.at(2 * jnp.ones(2)).dataset_mv(jnp.ones(2), [jnp.ones((1, 2))])   # 6 w
        Array([12., 12.], dtype=float32)

        References
        ----------
        No formula from the source papers. Taught in chapter 4, *Invariant Hessians*.
        """
        check_same_structure(self.params, params, "params", "the operator's params")
        new = object.__new__(CurvatureOperator)
        new.__dict__.update(self.__dict__)
        new.params = as_float_point(params, "params")
        check_finite(new.params, "params")
        return new

    def __repr__(self) -> str:
        return f"CurvatureOperator({self.name}, {tree_size(self.params)} parameters)"

    # -- products -------------------------------------------------------------
    def mv(self, v: PyTree, batch: Batch) -> PyTree:
        r"""The product with one batch's matrix, compiled once per batch shape.

        .. math:: v \mapsto M_b v.

        Parameters
        ----------
        v : pytree
            A tangent vector, structured like ``params``.
        batch : pytree
            One batch (arrays with a leading example axis).

        Returns
        -------
        pytree
            :math:`M_b v`, structured like ``params``.

        Raises
        ------
        GeometryError
            If ``v`` differs in structure from ``params`` or the batch is empty or has no example axis.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> H = mg.hessian_operator(lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3, jnp.zeros(3))
        >>> H.mv(jnp.ones(3), X)   # diag(1, 4, 9)
        Array([1., 4., 9.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), eqs. (3) and (5), on one batch. Taught in chapter 4,
        *Invariant Hessians*.
        """
        check_same_structure(self.params, v, "v", "params")
        _num_examples(batch, self.name)
        return self._mv(self.params, v, batch)

    def dataset_mv(self, v: PyTree, batches: BatchSource, *, progress: Any = False) -> PyTree:
        r"""The product with the dataset matrix, over one pass of ``batches``.

        .. math:: Mv = \frac{\sum_b n_b M_b v}{\sum_b n_b}.

        Parameters
        ----------
        v : pytree
            A tangent vector, structured like ``params``.
        batches : iterable or callable
            An iterable of batches, or a function returning one.
        progress : bool or tqdm-like class, optional
            Show a progress bar.

        Returns
        -------
        pytree
            :math:`Mv`, structured like ``params``.

        Raises
        ------
        GeometryError
            If ``v`` differs in structure, there are no batches, a batch is empty, or the product is
            not finite.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> H = mg.hessian_operator(lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3, jnp.zeros(3))
        >>> H.dataset_mv(jnp.ones(3), mg.batches_of(X, 2))   # (2 * 1.5 diag(1, 4, 0) + 1 * 3 diag(0, 0, 9)) / 3
        Array([1., 4., 9.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), eqs. (3) and (5) (the dataset loss). Taught in chapter 4,
        *Invariant Hessians*.
        """
        check_same_structure(self.params, v, "v", "params")
        total, n = None, 0
        for batch in _progress(_one_pass(batches), progress, f"{self.name} product"):
            nb = _num_examples(batch, self.name)
            out = jax.tree_util.tree_map(lambda x: nb * x, self._mv(self.params, v, batch))
            total = out if total is None else jax.tree_util.tree_map(jnp.add, total, out)
            n += nb
        if total is None:
            raise GeometryError(f"{self.name}: no batches: the dataset is empty.")
        out = jax.tree_util.tree_map(lambda x: x / n, total)
        check_finite(out, f"The {self.name} product", hint="The loss is not twice differentiable here, or overflowed.")
        return out

    def as_metric(self, batch: Batch) -> Metric:
        r"""This operator on one fixed batch, as a :class:`~minigeo.Metric` (e.g. the metric of :meth:`trace_estimate`).

        .. math:: G(\theta)\,v = M_b(\theta)\,v.

        Parameters
        ----------
        batch : pytree
            The fixed batch.

        Returns
        -------
        :class:`~minigeo.Metric`
            With ``mv(params, v)`` the product :math:`M_b v`.

        Raises
        ------
        GeometryError
            If the batch is empty or has no example axis.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> H = mg.hessian_operator(lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3, jnp.zeros(3))
        >>> G = H.as_metric(X)
        >>> G.mv(jnp.zeros(3), jnp.ones(3))
        Array([1., 4., 9.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 3.4 (curvature matrices as metrics). Taught in chapter 4,
        *Invariant Hessians*.
        """
        _num_examples(batch, self.name)
        return Metric(lambda params, v: self._mv(params, v, batch), f"{self.name} (one batch)")

    # -- estimators ------------------------------------------------------------
    def trace_estimate(
        self,
        key: jax.Array,
        batches: BatchSource,
        *,
        metric: MetricArg = None,
        num_probes: int = 10,
        batched: str = "vmap",
        tol: float = 1e-6,
        maxiter: int | None = None,
        progress: Any = False,
    ) -> tuple[jax.Array, jax.Array]:
        r"""Hutchinson estimate of :math:`\mathrm{tr}(G^{-1}M)` over the dataset, in **one** pass.

        .. math:: \mathrm{tr}(G^{-1}M) \approx \frac1P\sum_{p=1}^P u_p^\top M z_p,\qquad u_p = G^{-1}z_p.

        The probes :math:`z_p` (Rademacher, drawn with ``key``) and :math:`u_p`
        are fixed before the pass; each batch adds :math:`n_b\,u_p^\top M_b z_p` for all
        probes at once.  The probes are the ones :func:`~minigeo.trace_estimate` draws
        with the same key, so for the Hessian on one batch both agree to rounding.

        Parameters
        ----------
        key : jax.Array
            PRNG key for the probes.
        batches : iterable or callable
            An iterable of batches, or a function returning one.
        metric : pytree or :class:`~minigeo.Metric`, optional
            ``None`` (Euclidean), a positive diagonal pytree, or a :class:`~minigeo.Metric`.
        num_probes : int, optional
            Number of probes :math:`P`.
        batched : {"vmap", "map"}, optional
            Push the probes through a batch together (``vmap``) or one by one (``map``, less memory).
        tol, maxiter : optional
            Conjugate-gradient tolerance and iteration limit for a matrix-free ``metric``.
        progress : bool or tqdm-like class, optional
            Show a progress bar.

        Returns
        -------
        tuple of jax.Array
            ``(estimate, standard_error)``; the error is the probes' standard deviation over
            :math:`\sqrt P` (the data enter exactly).

        Raises
        ------
        GeometryError
            If ``num_probes`` is not a positive int, ``batched`` is unknown, there are no batches, or
            the products are not finite.

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> H = mg.hessian_operator(lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3, jnp.zeros(3))
        >>> est, se = H.trace_estimate(jax.random.PRNGKey(0), [X])   # Rademacher, diagonal: exact
        >>> float(est)
        14.0

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), App. A.2 (the Riemannian trace :math:`\mathrm{tr}(G^{-1}H)`).
        Taught in chapter 4, *Invariant Hessians*.
        """
        if not (isinstance(num_probes, int) and num_probes >= 1):
            raise GeometryError(f"trace_estimate: num_probes must be a positive int, got {num_probes!r}.")
        if batched not in ("vmap", "map"):
            raise GeometryError(f"trace_estimate: batched must be 'vmap' or 'map', got {batched!r}.")
        probes = rademacher_like(key, self.params, num_probes)
        _metric_inverse(metric, self.params, tol, maxiter)  # validates a diagonal metric eagerly
        apply_inverse = _metric_inverse(metric, self.params, tol, maxiter, strict=True)  # NaN where CG failed
        duals = jax.lax.map(apply_inverse, probes) if metric is not None else probes
        values, n = None, 0
        for batch in _progress(_one_pass(batches), progress, f"{self.name} trace"):
            nb = _num_examples(batch, self.name)
            vb = nb * self._terms(self.params, probes, duals, batch, batched=batched)
            values = vb if values is None else values + vb
            n += nb
        if values is None:
            raise GeometryError(f"{self.name}: no batches: the dataset is empty.")
        values = values / n
        _diagnose_cg(values, metric, self.params, key, tol, maxiter)  # a failed CG solve: its own error
        check_finite(values, f"The {self.name} products", hint=_CG_HINT)
        return mean_and_standard_error(values)

    def top_eigenvalues(
        self,
        key: jax.Array,
        batches: BatchSource,
        *,
        k: int = 1,
        metric: MetricArg = None,
        num_iterations: int | None = None,
        rtol: float | None = 1e-2,
        tol: float = 1e-8,
        maxiter: int | None = None,
        progress: Any = False,
        block_size: int | None = None,
    ) -> jax.Array:
        r"""The ``k`` largest eigenvalues of :math:`G^{-1}M` over the dataset, counted with multiplicity, by block Lanczos.

        .. math:: G^{-1}M\,u = \lambda u,\qquad \lambda_1 \ge \dots \ge \lambda_k.

        The algorithm, certificate and guarantees of :func:`~minigeo.top_eigenvalues` (the same
        code: block Lanczos from :math:`p` random start vectors, Rayleigh-Ritz, and Kahan's
        residual bound, which counts multiplicity), with one pass over the data per **block**
        step (each batch multiplies the whole block of :math:`p` vectors at once, ``vmap``-ed) and
        the basis in host memory: the device holds a few blocks of size :math:`p \times d`, the
        host :math:`n d` numbers (:math:`2nd` with a metric) for :math:`n` products.
        ``num_iterations`` counts products (rounded up to whole blocks), so the passes over the
        data are ``num_iterations / p``; ``None`` starts at :math:`\max(30, 4k, 30p)` and grows by
        1.5x until certified.  An uncertified value raises :class:`~minigeo.GeometryError`.

        Parameters
        ----------
        key : jax.Array
            PRNG key for the start vector.
        batches : iterable or callable
            Must allow several passes: a list, :func:`~minigeo.batches_of`, or a function returning a
            fresh iterator.
        k : int, optional
            Number of eigenvalues.
        metric : pytree or :class:`~minigeo.Metric`, optional
            ``None`` (Euclidean), a positive diagonal pytree, or a :class:`~minigeo.Metric`.
        num_iterations : int, optional
            Products with :math:`M` (the Krylov dimension, rounded up to whole blocks); ``None`` grows
            the count by 1.5x until the values are certified.
        rtol : float, optional
            Certification tolerance, relative to the largest returned magnitude, as in
            :func:`~minigeo.top_eigenvalues`.
        tol, maxiter : optional
            Conjugate-gradient tolerance and iteration limit for a matrix-free ``metric``.
        progress : bool or tqdm-like class, optional
            Show a progress bar (one step per block, i.e. per pass over the data).
        block_size : int, optional
            Start vectors :math:`p`, as in :func:`~minigeo.top_eigenvalues` (default :math:`k + 2`,
            1 for :math:`k = 1`).

        Returns
        -------
        jax.Array
            The ``k`` largest eigenvalues, in decreasing order, repeated ones repeated.

        Raises
        ------
        GeometryError
            If ``batches`` is a one-shot iterator, ``k``, ``num_iterations`` or ``block_size`` is
            invalid, a value cannot be certified to ``rtol``, or the products are not finite.

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> H = mg.hessian_operator(lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3, jnp.zeros(3))
        >>> H.top_eigenvalues(jax.random.PRNGKey(0), [X], k=2).round(4)
        Array([9., 4.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 3.1 and App. A.3 (eigenvalues of :math:`E = G^{-1}H`
        are invariant). Taught in chapter 4, *Invariant Hessians*.
        """
        fresh = _many_passes(batches, "top_eigenvalues")
        d = tree_size(self.params)
        flat0, unravel = ravel(self.params)
        p = validate_k(k, num_iterations, d, block_size)
        apply_inverse = _metric_inverse(metric, self.params, tol, maxiter)
        apply_m = lambda V: self._dataset_block_mv(V, fresh())
        apply_ginv = None if metric is None else (lambda V: jnp.stack([ravel(apply_inverse(unravel(v)))[0] for v in V]))
        Z = jax.random.normal(key, (p, d), dtype=flat0.dtype)
        run = ResumableBlockLanczos(apply_m, apply_ginv, Z, key=jax.random.fold_in(key, 1))
        steps = lambda r: _progress(r, progress, f"{self.name} Lanczos")
        return certified_top_eigenvalues(
            lambda m: run.projected(m, steps=steps), d, k, p, num_iterations, rtol, True, self.name, lambda: run.products
        )

    def _dataset_block_mv(self, V: jax.Array, batches: Iterable[Batch]) -> jax.Array:
        """``M v`` for every row ``v`` of the flat ``V`` (``(p, d)``), in one pass (the block ``vmap``-ed per batch)."""
        unravel = ravel(self.params)[1]
        Vt = jax.vmap(unravel)(V)
        total, n = None, 0
        for batch in batches:
            nb = _num_examples(batch, self.name)
            out = jax.vmap(lambda t: ravel(t)[0])(self._block_mv(self.params, Vt, batch))
            total = nb * out if total is None else total + nb * out
            n += nb
        if total is None:
            raise GeometryError(f"{self.name}: no batches: the dataset is empty.")
        out = total / n
        check_finite(out, f"The {self.name} product", hint="The loss is not twice differentiable here, or overflowed.")
        return out

    def logdet_slq(
        self,
        key: jax.Array,
        batches: BatchSource,
        *,
        damping: Any = 0.0,
        num_probes: int = 20,
        num_iterations: int = 30,
        progress: Any = False,
    ) -> tuple[jax.Array, jax.Array]:
        r"""Stochastic Lanczos quadrature of :math:`\log\det(M + \lambda I)` over the dataset.

        .. math:: \log\det(M + \lambda I) = \mathbb E_z\big[z^\top\log(M + \lambda I)\,z\big].

        The estimator of :func:`~minigeo.logdet_slq` (the same Rademacher probes and restart
        vectors for the same key, so on one batch both agree to rounding), with the
        offloaded Lanczos: ``num_probes x num_iterations`` passes over the data.

        Parameters
        ----------
        key : jax.Array
            PRNG key for the probes.
        batches : iterable or callable
            Must allow several passes (see :meth:`top_eigenvalues`).
        damping : float, optional
            :math:`\lambda \ge 0`, e.g. the prior precision of the Laplace evidence.
        num_probes : int, optional
            Number of Rademacher probes.
        num_iterations : int, optional
            Lanczos steps per probe (capped at ``d``).
        progress : bool or tqdm-like class, optional
            Show a progress bar.

        Returns
        -------
        tuple of jax.Array
            ``(estimate, standard_error)``.

        Raises
        ------
        GeometryError
            If ``num_probes`` or ``num_iterations`` is not a positive int, ``damping`` is invalid,
            ``batches`` is a one-shot iterator, or the operator is singular or indefinite.

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> H = mg.hessian_operator(lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3, jnp.zeros(3))
        >>> est, se = H.logdet_slq(jax.random.PRNGKey(0), [X], num_iterations=3)
        >>> round(float(est), 4), round(float(jnp.log(36.0)), 4)   # det diag(1, 4, 9) = 36
        (3.5835, 3.5835)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 4.2, eq. (14) (the log-determinant of the Laplace
        evidence). Taught in chapter 5, *Densities and volume forms*.
        """
        if not (isinstance(num_probes, int) and num_probes >= 1):
            raise GeometryError(f"logdet_slq: num_probes must be a positive int, got {num_probes!r}.")
        if not (isinstance(num_iterations, int) and num_iterations >= 1):
            raise GeometryError(f"logdet_slq: num_iterations must be a positive int, got {num_iterations!r}.")
        check_damping(damping, "logdet_slq: damping")
        fresh = _many_passes(batches, "logdet_slq")
        d = tree_size(self.params)
        flat0, unravel = ravel(self.params)
        m = min(num_iterations, d)
        probes = jax.random.rademacher(key, (num_probes, d), dtype=flat0.dtype)
        restart_key = jax.random.fold_in(key, 1)
        rel = slq_breakdown_tol(d, flat0.dtype)
        apply = lambda v: ravel(self.dataset_mv(unravel(v), fresh()))[0] + damping * v
        out = [
            slq_quadrature(lanczos_tridiagonal_offloaded(apply, None, z, m, key=restart_key), z, rel)
            for z in _progress(probes, progress, f"{self.name} SLQ", total=num_probes)
        ]
        values, smallest, largest = (jnp.stack(x) for x in zip(*out))
        check_slq_positive(values, smallest, largest, rel, "logdet_slq")
        return mean_and_standard_error(values)


def _probe_terms(batch_mv: Callable) -> Callable:
    """``(params, probes, duals, batch) -> (u_p^T M_b z_p)_p`` for stacked probes."""

    def terms(params, probes, duals, batch, batched="vmap"):
        def one(zu):
            z, u = zu
            mz = batch_mv(params, z, batch)
            return sum(jnp.vdot(a, b) for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(mz)))

        return jax.vmap(one)((probes, duals)) if batched == "vmap" else jax.lax.map(one, (probes, duals))

    return terms


# ---------------------------------------------------------------------------
# constructors
# ---------------------------------------------------------------------------
def _split(batch: Batch, who: str) -> tuple[Any, Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise GeometryError(f"{who}: a batch must be a pair (inputs, targets); got {type(batch).__name__}.")
    return batch[0], batch[1]


def hessian_operator(loss_fn: Callable[[PyTree, Batch], jax.Array], params: PyTree) -> CurvatureOperator:
    r"""The Hessian of a loss over a dataset, applied batch by batch.

    .. math:: H = \nabla^2_\theta \frac1N\sum_n \ell_n(\theta).

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, batch)``, the **mean** loss over the batch (any pytree batch).
    params : pytree
        The point.

    Returns
    -------
    :class:`~minigeo.CurvatureOperator`
        Products by forward-over-reverse differentiation (:func:`~minigeo.hvp`), one batch at a time.

    Raises
    ------
    GeometryError
        If ``params`` is empty, integer or not finite.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.arange(12.0).reshape(6, 2)
    >>> H = mg.hessian_operator(lambda w, x: 0.5 * jnp.mean((x @ w) ** 2), jnp.zeros(2))
    >>> H.dataset_mv(jnp.array([1.0, 0.0]), mg.batches_of(X, 4)), (X.T @ X / 6)[:, 0]
    (Array([36.666668, 41.666668], dtype=float32), Array([36.666668, 41.666668], dtype=float32))

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1, eq. (5) (the Hessian as a bilinear form). Taught in
    chapter 4, *Invariant Hessians*.
    """
    return CurvatureOperator(lambda p, v, batch: hvp(lambda q: loss_fn(q, batch), p, v), params, "Hessian")


def ggn_operator(
    model_fn: Callable[[PyTree, Any], jax.Array],
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    params: PyTree,
) -> CurvatureOperator:
    r"""The generalized Gauss-Newton matrix of a model and loss over a dataset.

    .. math:: \mathrm{GGN} = \frac1N\sum_n J_n^\top\, \nabla^2_z\ell_n\, J_n,\qquad J_n = \partial z_n/\partial\theta.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> z``, outputs with a leading example axis.
    loss_fn : callable
        ``loss_fn(z, targets)``, the **mean** loss over the batch.
    params : pytree
        The point.

    Returns
    -------
    :class:`~minigeo.CurvatureOperator`
        Batches are pairs ``(inputs, targets)``; products as :func:`~minigeo.ggn`.

    Raises
    ------
    GeometryError
        If a batch is not a pair, or ``params`` is empty, integer or not finite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X, y = jnp.eye(3), jnp.zeros(3)
    >>> G = mg.ggn_operator(lambda w, x: x @ w, lambda z, t: jnp.mean((z - t) ** 2), jnp.ones(3))
    >>> G.dataset_mv(jnp.ones(3), mg.batches_of((X, y), 2))   # 2 X^T X / N
    Array([0.6666667, 0.6666667, 0.6666667], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eq. (3) and Sec. 3.4; Grosse (2022), CSC2541 lecture 3
    (connection to the Gauss-Newton Hessian). Taught in chapter 2, *Pullback metrics*.
    """

    def mv(p, v, batch):
        x, t = _split(batch, "ggn_operator")
        return ggn(lambda q: model_fn(q, x), lambda z: loss_fn(z, t)).mv(p, v)

    return CurvatureOperator(mv, params, "GGN")


def fisher_operator(
    model_fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree,
    likelihood: Union[str, Likelihood] = "categorical",
) -> CurvatureOperator:
    r"""The Fisher information of a model's predictive distribution over a dataset.

    .. math:: F = \frac1N\sum_n J_n^\top\,\mathbb E_{t\sim p(\cdot\mid z_n)}\big[g g^\top\big]\,J_n,\qquad g = \nabla_{z}\log p(t\mid z_n).

    The exact output-space Fisher (no sampling), so it needs only the inputs; batches are
    pairs ``(inputs, targets)`` like the other operators' and the targets are ignored.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> z`` (logits for ``"categorical"``, means for ``"gaussian"``).
    params : pytree
        The point.
    likelihood : {"categorical", "gaussian"} or :class:`~minigeo.Likelihood`, optional
        The predictive distribution.

    Returns
    -------
    :class:`~minigeo.CurvatureOperator`
        Products as :func:`~minigeo.fisher`, one batch at a time.

    Raises
    ------
    GeometryError
        If a batch is not a pair, the likelihood is unknown, or ``params`` is not a valid point.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> F = mg.fisher_operator(lambda w, x: x * w, jnp.zeros(2))   # logits x * w, p = (1/2, 1/2)
    >>> F.dataset_mv(jnp.array([1.0, 0.0]), mg.batches_of((jnp.ones((3, 2)), jnp.zeros(3)), 2))
    Array([ 0.25, -0.25], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eq. (3) and Sec. 3.4; Grosse (2022), CSC2541 lecture 3 (the
    Fisher). Taught in chapter 2, *Pullback metrics*.
    """
    fisher(lambda q: q, likelihood)  # validate the likelihood eagerly

    def mv(p, v, batch):
        x, _ = _split(batch, "fisher_operator")
        return fisher(lambda q: model_fn(q, x), likelihood).mv(p, v)

    return CurvatureOperator(mv, params, "Fisher")


def empirical_fisher_operator(
    model_fn: Callable[[PyTree, Any], jax.Array],
    per_example_loss_fn: Callable[[jax.Array, Any], jax.Array],
    params: PyTree,
) -> CurvatureOperator:
    r"""The empirical Fisher of a model and per-example loss over a dataset.

    .. math:: \frac1N\sum_n J_n^\top g_n g_n^\top J_n,\qquad g_n = \nabla_{z_n}\ell_n.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> z`` with a leading example axis.
    per_example_loss_fn : callable
        ``per_example_loss_fn(z, targets) -> (n,)``, the unreduced losses.
    params : pytree
        The point.

    Returns
    -------
    :class:`~minigeo.CurvatureOperator`
        Products as :func:`~minigeo.empirical_fisher`, one batch at a time.

    Raises
    ------
    GeometryError
        If a batch is not a pair, the losses are not one per example, or ``params`` is not a valid point.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X, y = jnp.array([[1.0], [2.0], [3.0]]), jnp.ones(3)
    >>> EF = mg.empirical_fisher_operator(lambda w, x: x @ w, lambda z, t: 0.5 * (z - t) ** 2, jnp.zeros(1))
    >>> EF.dataset_mv(jnp.ones(1), mg.batches_of((X, y), 2))   # mean of (x (w x - y))^2 = 14 / 3
    Array([4.6666665], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 (empirical Fisher vs Fisher); Kristiadi, Dangel & Hennig (2023),
    Sec. 3.4; Kunstner et al. (2019). Taught in chapter 2, *Pullback metrics*.
    """

    def mv(p, v, batch):
        x, t = _split(batch, "empirical_fisher_operator")
        return empirical_fisher(lambda q: model_fn(q, x), lambda z: per_example_loss_fn(z, t)).mv(p, v)

    return CurvatureOperator(mv, params, "empirical Fisher")
