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

import functools
import itertools
from typing import Any, Callable, Iterable, Iterator, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import (
    GeometryError,
    as_float_point,
    check_finite,
    check_key,
    check_same_structure,
    check_working_precision,
)
from ._batches import Batch, Batches, batches_of
from ._compile import compiled, one_trace_per_call
from ._linalg import check_damping
from ._restrict import restriction
from ._spectral import (
    EstimateInfo,
    Products,
    SpectralDensity,
    certified_ends,
    probe_terms,
    check_num_probes,
    diagonal_by_method,
    slq_density,
    slq_logdet,
    trace_by_method,
)
from ._tree import PyTree, ravel, tree_size
from .curvature import hvp
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

BatchSource = Union[Iterable[Batch], Callable[[], Iterable[Batch]]]


# ---------------------------------------------------------------------------
# batches and progress bars
# ---------------------------------------------------------------------------
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


class _FinitePass:
    """At most ``max_batches`` batches of ``iterable``; sized (for progress bars) by that bound."""

    def __init__(self, iterable: Iterable[Batch], max_batches: int) -> None:
        self.iterable, self.max_batches = iterable, max_batches

    def __len__(self) -> int:
        if hasattr(self.iterable, "__len__"):
            return min(len(self.iterable), self.max_batches)  # type: ignore[arg-type]
        return self.max_batches

    def __iter__(self) -> Iterator[Batch]:
        return itertools.islice(iter(self.iterable), self.max_batches)


def _check_max_batches(max_batches: Any, who: str) -> None:
    if max_batches is not None and (
        isinstance(max_batches, bool) or not (isinstance(max_batches, (int, np.integer)) and max_batches >= 1)
    ):
        raise GeometryError(f"{who}: max_batches must be None or a positive int, got {max_batches!r}.")


def _one_pass(batches: BatchSource, who: str, max_batches: int | None = None) -> Iterable[Batch]:
    """One finite pass over the data: a sized iterable, or at most ``max_batches`` batches of any iterable.

    An iterable without ``__len__`` (a generator, an iterator, a streaming loader) might never end,
    so it needs ``max_batches``; checked before the first batch is drawn.
    """
    _check_max_batches(max_batches, who)
    data = batches() if callable(batches) else batches
    if max_batches is not None:
        return _FinitePass(data, int(max_batches))
    if not hasattr(data, "__len__"):
        made = " returned by the batches function" if callable(batches) else ""
        raise GeometryError(
            f"{who}: the batches{made} have no length ({type(data).__name__}), so a pass over them might never "
            "end. Pass a finite sized sequence (a list, or mg.operators.batches_of(data, batch_size)), or max_batches=N "
            "to stop after N batches."
        )
    return data


def _many_passes(batches: BatchSource, who: str, max_batches: int | None = None) -> Callable[[], Iterable[Batch]]:
    """A function giving a fresh finite pass over the data; refuse one-shot iterators."""
    _check_max_batches(max_batches, who)
    if not callable(batches) and isinstance(batches, Iterator):
        raise GeometryError(
            f"{who} passes over the data several times, but got a one-shot iterator (a generator?). "
            "Pass a list, mg.operators.batches_of(data, batch_size), or a zero-argument function that returns a "
            "fresh iterator (e.g. lambda: loader)."
        )
    if not callable(batches):
        _one_pass(batches, who, max_batches)  # eagerly: a sized sequence or max_batches
    return lambda: _one_pass(batches, who, max_batches)


def _num_examples(batch: Batch, who: str, examples: Callable[[Batch], Any] | None = None) -> int:
    """The number of examples of a batch: ``examples(batch)``, or the leading axis that every leaf shares.

    Without an ``examples`` rule every leaf must have a leading axis and all must agree on its
    length (else :class:`~minigeo.GeometryError` naming the leaves and their sizes): a leaf that is not
    per-example (a shared mask, a temperature) would otherwise silently set the weight of the batch.
    """
    if examples is not None:
        n = examples(batch)
        try:
            ok = not isinstance(n, (bool, np.bool_)) and np.ndim(n) == 0 and float(n) == int(n) and int(n) >= 1
        except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
            ok = False
        if not ok:
            raise GeometryError(
                f"{who}: examples(batch) must return the number of examples of the batch, an int >= 1; got {n!r}."
            )
        return int(n)
    pairs = jax.tree_util.tree_leaves_with_path(batch)
    if not pairs:
        raise GeometryError(f"{who}: a batch must be a pytree of arrays with a leading example axis; got no arrays.")
    sizes = {}
    for path, leaf in pairs:
        name = jax.tree_util.keystr(path) or "(root)"
        if jnp.ndim(leaf) < 1:
            raise GeometryError(
                f"{who}: the batch leaf {name} is a scalar (shape ()), so it has no leading example axis. Every "
                "leaf of a batch must have one, or pass examples=lambda batch: <number of examples> to the "
                "operator's constructor (e.g. examples=lambda b: b['x'].shape[0])."
            )
        sizes[name] = int(jnp.shape(leaf)[0])
    if len(set(sizes.values())) != 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise GeometryError(
            f"{who}: the leaves of a batch disagree on their leading (example) axis ({listing}), so the number of "
            "examples of the batch is ambiguous. Give every leaf the example axis first, or pass "
            "examples=lambda batch: <number of examples> to the operator's constructor (e.g. "
            "examples=lambda b: b['x'].shape[0])."
        )
    n = next(iter(sizes.values()))
    if n == 0:
        raise GeometryError(f"{who}: a batch is empty; every batch needs at least one example.")
    return n


def _check_key_first(key: Any, batches: Any, who: str) -> None:
    """Raise unless ``key`` is a PRNG key, naming swapped ``(batches, key)`` arguments when ``batches`` is one.

    Runs before any batch is read (a raw ``TypeError`` from deep in the solver otherwise)."""
    try:
        check_key(key, f"{who}: key")
    except GeometryError:
        try:
            check_key(batches)
        except GeometryError:
            raise GeometryError(
                f"{who}: key must be a JAX PRNG key, e.g. jax.random.PRNGKey(0) or jax.random.key(0); got "
                f"{type(key).__name__}. The signature is {who.split('.')[-1]}(key, batches, ...)."
            ) from None
        raise GeometryError(
            f"{who}: the arguments are swapped: the first is {type(key).__name__} (the batches?) and the second a "
            f"PRNG key. Call {who.split('.')[-1]}(key, batches, ...)."
        ) from None


# ---------------------------------------------------------------------------
# the operator
# ---------------------------------------------------------------------------
class CurvatureOperator:
    r"""A curvature matrix of a loss averaged over a dataset, applied batch by batch.

    .. math:: M v = \frac{\sum_b n_b\, M_b v}{\sum_b n_b},

    :math:`M_b` the matrix of batch :math:`b` (its loss a mean over its :math:`n_b`
    examples).  Nothing is traced once and kept: each method call traces the loss afresh (once
    per batch shape within the call) and reuses compiled code only for an identical trace, so a
    changed global or attribute is seen at the next call and one call never mixes two states.  Build it with :func:`~minigeo.operators.hessian_operator`, :func:`~minigeo.operators.ggn_operator`,
    :func:`~minigeo.operators.fisher_operator` or :func:`~minigeo.operators.empirical_fisher_operator`.

    Parameters
    ----------
    batch_mv : callable
        ``batch_mv(params, v, batch)``, the product :math:`M_b v` on one batch.
    params : pytree
        The point :math:`\theta` (a pytree of floating arrays).
    name : str
        Shown in messages and progress bars.
    examples : callable, optional
        ``examples(batch) -> int``, the number of examples :math:`n_b` of a batch (its weight in the
        dataset mean).  By default :math:`n_b` is the length of the leading axis, which **every leaf**
        of the batch must then have and agree on; pass ``examples`` when a batch holds leaves that are
        not per-example (a shared mask, a temperature, a vocabulary table), e.g.
        ``examples=lambda b: b["x"].shape[0]``.

    Raises
    ------
    GeometryError
        If ``batch_mv`` or ``examples`` is not callable, or ``params`` is empty, integer, complex or not
        finite.

    Notes
    -----
    **Batches.**  A batch is any pytree the per-batch product accepts.  Its number of examples
    :math:`n_b` comes from one explicit rule: ``examples(batch)`` if given, else the common
    length of the leading axes of all its leaves; leaves that disagree raise
    :class:`~minigeo.GeometryError` naming each leaf and its size (the count is never read off one leaf).
    **Passes.**  Every pass over the data (:meth:`dataset_mv`, :meth:`trace_estimate`,
    :meth:`top_eigenvalues`, :meth:`logdet_slq`) takes a finite sized sequence (a list,
    :func:`~minigeo.operators.batches_of`, or a function returning one), or any iterable with
    ``max_batches=N`` (at most ``N`` batches per pass); an iterable without a length and without
    ``max_batches`` (a generator, a streaming loader) raises before the first batch, since the pass
    might never end.  ``progress=True`` shows a bar with the pass's length.

    Every method reads the loss afresh: a call traces the per-batch product (once per batch shape
    during a pass over a dataset, so one call never mixes old and new state) and runs the
    program compiled for that trace, with the parameters and the batch as arguments.  Neither a
    new batch, nor :meth:`at` new parameters, nor a new operator for the same loss recompiles;
    a change to what the loss reads (a global, an attribute) is seen at the next call.

    The invariant endomorphism :math:`G^{-1}M` enters through the
    ``metric`` argument of :meth:`trace_estimate` and :meth:`top_eigenvalues` (``None``, a
    :class:`~minigeo.Metric` such as ``mg.metrics.diagonal(w)`` or another operator's
    :meth:`as_metric` on a fixed batch).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> X, y = jnp.eye(4), jnp.ones(4)
    >>> loss = lambda w, b: jnp.mean((b[0] @ w - b[1]) ** 2)
    >>> H = mg.operators.hessian_operator(loss, jnp.zeros(4))
    >>> H.dataset_mv(jnp.ones(4), mg.operators.batches_of((X, y), 2))  # 2 X^T X / N = I / 2
    Array([0.5, 0.5, 0.5, 0.5], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eqs. (3) and (5) (GGN/Fisher and Hessian of the dataset loss);
    Grosse (2022), CSC2541 lecture 3. Taught in chapter 4, *Invariant Hessians*.
    """

    def __init__(
        self,
        batch_mv: Callable[[PyTree, PyTree, Batch], PyTree],
        params: PyTree,
        name: str,
        *,
        examples: Callable[[Batch], int] | None = None,
    ) -> None:
        if not callable(batch_mv):
            raise GeometryError(f"CurvatureOperator needs a callable batch_mv; got {type(batch_mv).__name__}.")
        if examples is not None and not callable(examples):
            raise GeometryError(
                f"CurvatureOperator: examples must be None or a function batch -> number of examples; got {examples!r}."
            )
        self.examples = examples
        params = as_float_point(params, "params")
        check_finite(params, "params")
        self.params, self.name, self.batch_mv = params, name, batch_mv
        self._mv = functools.partial(_batch_product, batch_mv)
        self._terms = functools.partial(_batch_terms, batch_mv)
        self._block_mv = functools.partial(_batch_block_product, batch_mv)

    def at(self, params: PyTree) -> "CurvatureOperator":
        r"""The same operator at other parameters (same structure), reusing the compiled programs.

        .. math:: M \mapsto M(\theta') .

        Parameters
        ----------
        params : pytree
            The new point :math:`\theta'`, structured like the operator's ``params``.

        Returns
        -------
        :class:`~minigeo.operators.CurvatureOperator`
            A new operator; this one is unchanged.

        Raises
        ------
        GeometryError
            If ``params`` differs in structure or is not finite.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> loss = lambda w, x: jnp.mean(jnp.sum(x * w ** 3, axis=1))
        >>> H = mg.operators.hessian_operator(loss, jnp.ones(2))
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
        r"""The product with one batch's matrix, compiled once per traced program (batch shape).

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
        >>> loss = lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3
        >>> H = mg.operators.hessian_operator(loss, jnp.zeros(3))
        >>> H.mv(jnp.ones(3), X)   # diag(1, 4, 9)
        Array([1., 4., 9.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), eqs. (3) and (5), on one batch. Taught in chapter 4,
        *Invariant Hessians*.
        """
        check_same_structure(self.params, v, "v", "params")
        _num_examples(batch, self.name, self.examples)
        return self._mv(self.params, v, batch)

    @one_trace_per_call()
    def dataset_mv(
        self, v: PyTree, batches: BatchSource, *, progress: Any = False, max_batches: int | None = None
    ) -> PyTree:
        r"""The product with the dataset matrix, over one pass of ``batches``.

        .. math:: Mv = \frac{\sum_b n_b M_b v}{\sum_b n_b}.

        Parameters
        ----------
        v : pytree
            A tangent vector, structured like ``params``.
        batches : sequence or callable
            A finite sized sequence of batches (a list, :func:`~minigeo.operators.batches_of`), or a function
            returning one; any other iterable needs ``max_batches``.
        progress : bool or tqdm-like class, optional
            Show a progress bar.
        max_batches : int, optional
            Use at most this many batches (required for an iterable without a length).

        Returns
        -------
        pytree
            :math:`Mv`, structured like ``params``.

        Raises
        ------
        GeometryError
            If ``v`` differs in structure or dtype, ``batches`` has no length and no ``max_batches`` is
            given, there are no batches, a batch is empty or its leaves disagree on the number of
            examples (see the class notes), or the product is not finite.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> loss = lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3
        >>> H = mg.operators.hessian_operator(loss, jnp.zeros(3))
        >>> # (2 * 1.5 diag(1, 4, 0) + 1 * 3 diag(0, 0, 9)) / 3
        >>> H.dataset_mv(jnp.ones(3), mg.operators.batches_of(X, 2))
        Array([1., 4., 9.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), eqs. (3) and (5) (the dataset loss). Taught in chapter 4,
        *Invariant Hessians*.
        """
        check_same_structure(self.params, v, "v", "params")
        total, n = None, 0
        for batch in _progress(_one_pass(batches, self.name, max_batches), progress, f"{self.name} product"):
            nb = _num_examples(batch, self.name, self.examples)
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
        >>> loss = lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3
        >>> H = mg.operators.hessian_operator(loss, jnp.zeros(3))
        >>> G = H.as_metric(X)
        >>> G.mv(jnp.zeros(3), jnp.ones(3))
        Array([1., 4., 9.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 3.4 (curvature matrices as metrics). Taught in chapter 4,
        *Invariant Hessians*.
        """
        _num_examples(batch, self.name, self.examples)
        return Metric(lambda params, v: self._mv(params, v, batch), f"{self.name} (one batch)")

    # -- estimators ------------------------------------------------------------
    @one_trace_per_call()
    def trace_estimate(
        self,
        key: jax.Array,
        batches: BatchSource,
        *,
        metric: Metric | None = None,
        num_probes: int = 10,
        batched: str = "vmap",
        tol: float = 1e-6,
        maxiter: int | None = None,
        progress: Any = False,
        max_batches: int | None = None,
        method: str = "hutchinson",
        return_info: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        r"""Hutchinson (one pass), Hutch++ (three) or XTrace (two) estimate of :math:`\mathrm{tr}(G^{-1}M)` over the dataset.

        .. math:: \mathrm{tr}(G^{-1}M) \approx \frac1P\sum_{p=1}^P u_p^\top M z_p,\qquad u_p = G^{-1}z_p.

        The probes :math:`z_p` (Rademacher, drawn with ``key``) and :math:`u_p`
        are fixed before the pass; each batch adds :math:`n_b\,u_p^\top M_b z_p` for all
        probes at once.  The probes are the ones :func:`~minigeo.trace_estimate` draws
        with the same key, so for the Hessian on one batch both agree to rounding.

        Parameters
        ----------
        key : jax.Array
            PRNG key for the probes.
        batches : sequence or callable
            A finite sized sequence of batches, or a function returning one (see :meth:`dataset_mv`).
        metric : pytree or :class:`~minigeo.Metric`, optional
            ``None`` (Euclidean) or a :class:`~minigeo.Metric` (a diagonal one, ``mg.metrics.diagonal(w)``,
            is inverted elementwise; others by conjugate gradients).
        num_probes : int, optional
            Number of probes :math:`P`.
        batched : {"vmap", "map"}, optional
            Push the probes through a batch together (``vmap``) or one by one (``map``, less memory).
        tol, maxiter : optional
            Conjugate-gradient tolerance, in ``(0, 1)``, and iteration limit (a positive int) for a
            matrix-free ``metric``.
        progress : bool or tqdm-like class, optional
            Show a progress bar.
        max_batches : int, optional
            Use at most this many batches (required for an iterable without a length).
        method : {"hutchinson", "hutch++", "xtrace"}, optional
            As in :func:`~minigeo.trace_estimate`; ``num_probes`` is the budget of products, and
            Hutch++ passes over the data three times, XTrace twice (``batches`` must allow it).  Their
            standard errors rest on the few samples named there (Hutch++'s deflated probes, XTrace's
            leave-one-out estimates) and are widened by the Student-t factor for that count, so that
            ``est +- 2 se`` is a 95 % interval at small budgets too.
        return_info : bool, optional
            Also return an :class:`~minigeo.curvature.EstimateInfo` (a :class:`~minigeo.Status` and the products used).

        Returns
        -------
        tuple of jax.Array
            ``(estimate, standard_error)``; the error is the probes' standard deviation over
            :math:`\sqrt P` (the data enter exactly).

        Raises
        ------
        GeometryError
            If ``num_probes`` is not a positive int, ``batched`` is unknown, ``tol`` or ``maxiter`` is
            invalid, ``key`` is not a PRNG key (also when ``key`` and ``batches`` are swapped), the
            operator's params are float16/bfloat16, ``batches`` has no length and no ``max_batches`` is
            given, there are no batches, or the products are not finite.

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> loss = lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3
        >>> H = mg.operators.hessian_operator(loss, jnp.zeros(3))
        >>> key = jax.random.PRNGKey(0)
        >>> est, se = H.trace_estimate(key, [X])   # Rademacher, diagonal: exact
        >>> float(est)
        14.0

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), App. A.2 (the Riemannian trace :math:`\mathrm{tr}(G^{-1}H)`).
        Taught in chapter 4, *Invariant Hessians*.
        """
        _check_key_first(key, batches, f"{self.name}.trace_estimate")
        check_working_precision(self.params, f"{self.name}.trace_estimate")
        if method in ("hutch++", "xtrace"):
            fresh = _many_passes(batches, f"{self.name}.trace_estimate ({method})", max_batches)
        else:
            data = _one_pass(batches, self.name, max_batches)  # before the probes' solves: a finite pass
            fresh = lambda: data

        def terms(probes: PyTree, duals: PyTree, batched: str) -> jax.Array:
            values, n = None, 0
            for batch in _progress(fresh(), progress, f"{self.name} trace"):
                nb = _num_examples(batch, self.name, self.examples)
                vb = nb * self._terms(self.params, probes, duals, batch, batched=batched)
                values = vb if values is None else values + vb
                n += nb
            if values is None:
                raise GeometryError(f"{self.name}: no batches: the dataset is empty.")
            return values / n

        source = Products(self.params, self.name, terms, lambda V: self._dataset_block_mv(V, fresh()))
        return trace_by_method(
            source, key, metric, method=method, num_probes=num_probes, batched=batched, tol=tol, maxiter=maxiter,
            who=f"{self.name}.trace_estimate", return_info=return_info,
        )

    @one_trace_per_call()
    def diagonal_estimate(
        self,
        key: jax.Array,
        batches: BatchSource,
        *,
        num_probes: int = 10,
        max_batches: int | None = None,
        method: str = "hutchinson",
        return_info: bool = False,
    ) -> tuple[PyTree, PyTree]:
        r"""Hutchinson (one pass) or XDiag (two passes) estimate of :math:`\mathrm{diag}(M)` over the dataset, with standard errors.

        .. math:: \mathrm{diag}(M) = \mathbb E_z[z \odot Mz].

        The estimators of :func:`~minigeo.diagonal_estimate`: all probes are multiplied in one pass
        (``vmap``-ed per batch); XDiag passes twice (the sketch, then its basis).

        Parameters
        ----------
        key : jax.Array
            PRNG key of the probes.
        batches : sequence or callable
            A finite sized sequence of batches, or a function returning one.
        num_probes : int, optional
            The budget of products: probes :math:`P` for Hutchinson, at least 4 for XDiag.
        max_batches : int, optional
            Use at most this many batches (required for an iterable without a length).
        method : {"hutchinson", "xdiag"}, optional
            As in :func:`~minigeo.diagonal_estimate`.
        return_info : bool, optional
            Also return an :class:`~minigeo.curvature.EstimateInfo`.

        Returns
        -------
        tuple of two pytrees
            ``(diagonal, standard_error)``, each structured like ``params``.

        Raises
        ------
        GeometryError
            If ``num_probes`` is not a positive int, ``key`` is not a PRNG key, the dataset is empty, or
            the products are not finite.

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> loss = lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3
        >>> H = mg.operators.hessian_operator(loss, jnp.zeros(3))
        >>> key = jax.random.PRNGKey(0)
        >>> H.diagonal_estimate(key, [X], num_probes=2)[0]   # diagonal: exact
        Array([1., 4., 9.], dtype=float32)

        References
        ----------
        No formula from the source papers: Bekas, Kokiopoulou & Saad (2007); XDiag: Epperly, Tropp &
        Webber (2024). Chapter 4.
        """
        _check_key_first(key, batches, f"{self.name}.diagonal_estimate")
        check_working_precision(self.params, f"{self.name}.diagonal_estimate")
        if method == "xdiag":
            fresh = _many_passes(batches, f"{self.name}.diagonal_estimate (xdiag)", max_batches)
        else:
            data = _one_pass(batches, self.name, max_batches)
            fresh = lambda: data
        source = Products(self.params, self.name, None, lambda V: self._dataset_block_mv(V, fresh()))
        return diagonal_by_method(
            source, key, method=method, num_probes=num_probes, who=f"{self.name}.diagonal_estimate",
            return_info=return_info,
        )

    def restrict(self, paths: Any) -> "CurvatureOperator":
        r"""The operator on a subset of the parameter leaves: the principal sub-block :math:`M_{SS}`.

        .. math:: M_{SS}\,v_S = \big(M\,\iota(v_S)\big)_S,

        with :math:`\iota` the embedding that pads :math:`v_S` with zeros on the other leaves; the other
        leaves stay at the operator's parameters.  Every method (products, traces, eigenvalues,
        densities) then works per layer or per block in one call.

        Parameters
        ----------
        paths : sequence
            What to keep, a list of selectors: a *path* (a tuple of keys as in
            ``jax.tree_util.tree_leaves_with_path``, ``("layer1", "w")``, ``("blocks", 0, "wq")``; a
            single key is a path of length one) keeps a whole leaf; a pair ``(path, index)``, ``index``
            a tuple of non-negative ints, keeps the sub-array ``leaf[index]`` (its leading axes fixed):
            ``(("blocks", "attn", "W_q"), (0, 2))`` is layer 0, head 2 of a leaf stacked as
            ``(layers, heads, ...)``.  A single path may be passed bare; a single pair goes in a list.

        Returns
        -------
        :class:`~minigeo.operators.CurvatureOperator`
            Its ``params`` is the dict ``{key: sub-array}`` of the kept entries (a pytree), ``key`` the
            path, or ``path + (index,)`` for a sub-array.

        Raises
        ------
        GeometryError
            If a path names no leaf, an index is out of range for its leaf, two selections overlap
            or ``paths`` is empty (the message lists the leaves and their shapes).

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> loss = lambda p, x: jnp.mean(jnp.sum(x * p["a"], 1) ** 2 + jnp.sum(p["b"] ** 4))
        >>> H = mg.operators.hessian_operator(loss, {"a": jnp.ones(2), "b": jnp.ones(1)})
        >>> Hb = H.restrict([("b",)])
        >>> Hb.dataset_mv(Hb.params, [jnp.eye(2)])          # 12 b^2 on the b block only
        {('b',): Array([12.], dtype=float32)}
        >>> W = {"w": jnp.arange(1.0, 7.0).reshape(2, 3)}    # e.g. (heads, features)
        >>> Hw = mg.operators.hessian_operator(lambda p, x: jnp.mean(jnp.sum(p["w"] ** 3)), W)
        >>> Hw1 = Hw.restrict([("w", (1,))])                 # row 1 only: 6 w on the diagonal
        >>> Hw1.dataset_mv({("w", (1,)): jnp.ones(3)}, [jnp.ones(1)])
        {('w', (1,)): Array([24., 30., 36.], dtype=float32)}

        References
        ----------
        No formula from the source papers (a principal sub-block). Chapters 4 and 7.
        """
        r = restriction(self.params, paths, f"{self.name}.restrict")
        full_leaves = jax.tree_util.tree_leaves(self.params)
        batch_mv = self.batch_mv

        def sub_mv(sub_params: dict, v: dict, batch: Batch) -> dict:
            point = r.embed(sub_params, full_leaves)
            return r.extract(batch_mv(point, r.embed(v, [jnp.zeros_like(x) for x in full_leaves]), batch))

        return CurvatureOperator(sub_mv, r.sub, f"{self.name}[{r.name}]", examples=self.examples)

    @one_trace_per_call()
    def top_eigenvalues(
        self,
        key: jax.Array,
        batches: BatchSource,
        *,
        k: int = 1,
        metric: Metric | None = None,
        num_iterations: int | None = None,
        rtol: float | None = 1e-2,
        tol: float = 1e-8,
        maxiter: int | None = None,
        progress: Any = False,
        max_batches: int | None = None,
        block_size: int | None = None,
        which: str = "largest",
        return_info: bool = False,
        return_vectors: bool = False,
    ) -> Any:
        r"""The ``k`` largest (or smallest) eigenvalues of :math:`G^{-1}M` over the dataset, counted with multiplicity.

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
            Must allow several passes: a list, :func:`~minigeo.operators.batches_of`, or a function returning a
            fresh iterator.
        k : int, optional
            Number of eigenvalues.
        metric : pytree or :class:`~minigeo.Metric`, optional
            ``None`` (Euclidean) or a :class:`~minigeo.Metric` (a diagonal one, ``mg.metrics.diagonal(w)``,
            is inverted elementwise; others by conjugate gradients).
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
        max_batches : int, optional
            Use at most this many batches per pass (required for batches without a length).
        block_size : int, optional
            Start vectors :math:`p`, as in :func:`~minigeo.top_eigenvalues` (default :math:`k`).
        which : {"largest", "smallest", "both"}, optional
            As in :func:`~minigeo.top_eigenvalues`: ``"smallest"`` in increasing order, ``"both"`` a
            pair ``(largest, smallest)`` from two runs.
        return_info : bool, optional
            Also return an :class:`~minigeo.curvature.EstimateInfo` (a :class:`~minigeo.Status` and the products used).
        return_vectors : bool, optional
            Return :class:`~minigeo.curvature.Eigenpairs` ``(values, vectors)``: the eigenvectors as pytrees like
            ``params`` stacked on a leading axis ``k``, :math:`G`-orthonormal, certified with the values
            (as in :func:`~minigeo.top_eigenvalues`).

        Returns
        -------
        jax.Array or Eigenpairs
            The ``k`` largest eigenvalues, in decreasing order, repeated ones repeated (see ``which``);
            with ``return_vectors``, :class:`~minigeo.curvature.Eigenpairs` (a pair of them for ``"both"``).

        Raises
        ------
        GeometryError
            If ``key`` is not a PRNG key (the message names swapped ``(batches, key)`` arguments), the
            operator's params are float16/bfloat16, ``batches`` is a one-shot iterator or has no length
            (and no ``max_batches``), ``k``, ``num_iterations`` or ``block_size`` is invalid, a value
            cannot be certified to ``rtol``, or the products are not finite.

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> loss = lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3
        >>> H = mg.operators.hessian_operator(loss, jnp.zeros(3))
        >>> H.top_eigenvalues(jax.random.PRNGKey(0), [X], k=2).round(4)
        Array([9., 4.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 3.1 and App. A.3 (eigenvalues of :math:`E = G^{-1}H`
        are invariant). Taught in chapter 4, *Invariant Hessians*.
        """
        _check_key_first(key, batches, f"{self.name}.top_eigenvalues")
        check_working_precision(self.params, f"{self.name}.top_eigenvalues")
        fresh = _many_passes(batches, "top_eigenvalues", max_batches)
        steps = lambda r: _progress(r, progress, f"{self.name} Lanczos")
        source = Products(self.params, self.name, None, lambda V: self._dataset_block_mv(V, fresh()), steps=steps)
        return certified_ends(
            source, key, metric, which=which, k=k, num_iterations=num_iterations, rtol=rtol, tol=tol, maxiter=maxiter,
            block_size=block_size, who=f"{self.name}.top_eigenvalues", return_info=return_info,
            return_vectors=return_vectors,
        )

    @one_trace_per_call()
    def spectral_density(
        self,
        key: jax.Array,
        batches: BatchSource,
        *,
        metric: Metric | None = None,
        num_probes: int = 10,
        num_iterations: int = 30,
        probes: Any = None,
        tol: float = 1e-8,
        maxiter: int | None = None,
        progress: Any = False,
        max_batches: int | None = None,
        return_info: bool = False,
    ) -> SpectralDensity | tuple[SpectralDensity, EstimateInfo]:
        r"""The spectral density of :math:`G^{-1}M` over the dataset by stochastic Lanczos quadrature.

        .. math:: \phi(\lambda) = \frac1d\sum_j \delta(\lambda - \lambda_j(G^{-1}M)).

        The estimator of :func:`~minigeo.spectral_density` (the same probes, Lanczos in the
        :math:`G`-inner product and Gauss rules), with one pass over the data per product and each
        probe's basis in host memory: ``num_probes * num_iterations`` passes.

        Parameters
        ----------
        key : jax.Array
            PRNG key of the probes.
        batches : iterable or callable
            Must allow several passes (a list, :func:`~minigeo.operators.batches_of`, or a function returning a
            fresh iterator).
        metric : :class:`~minigeo.Metric` or None, optional
            ``None``, a diagonal, dense, KFAC or EKFAC Metric (or any Metric with ``probes=``).
        num_probes, num_iterations : int, optional
            Probes and Lanczos steps per probe.
        probes : array or pytree, optional
            Covector probes with covariance :math:`G` instead of drawn ones.
        tol, maxiter : optional
            Conjugate-gradient tolerance and iteration limit for a non-diagonal ``metric``.
        progress : bool or tqdm-like class, optional
            Show a progress bar (one step per pass over the data).
        max_batches : int, optional
            Use at most this many batches per pass (required for batches without a length).
        return_info : bool, optional
            Also return an :class:`~minigeo.curvature.EstimateInfo`.

        Returns
        -------
        SpectralDensity
            Nodes and weights per probe, ``.density(grid, sigma)``, ``.moments(k)``.

        Raises
        ------
        GeometryError
            As :func:`~minigeo.spectral_density`, and if ``batches`` allows only one pass.

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> loss = lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3
        >>> H = mg.operators.hessian_operator(loss, jnp.zeros(3))
        >>> key = jax.random.PRNGKey(0)
        >>> dens = H.spectral_density(key, [X], num_probes=2, num_iterations=3)
        >>> round(float(dens.moments(1)[0]), 4)   # tr(H) / d = (1 + 4 + 9) / 3
        4.6667

        References
        ----------
        Lin, Saad & Yang (2016), Sec. 3.2; Kristiadi, Dangel & Hennig (2023), Sec. 3.1 (the invariant
        :math:`E`). Chapter 4.
        """
        _check_key_first(key, batches, f"{self.name}.spectral_density")
        check_working_precision(self.params, f"{self.name}.spectral_density")
        fresh = _many_passes(batches, "spectral_density", max_batches)
        steps = lambda r: _progress(r, progress, f"{self.name} SLQ")
        source = Products(self.params, self.name, None, lambda V: self._dataset_block_mv(V, fresh()), steps=steps)
        return slq_density(
            source, key, metric, num_probes=num_probes, num_iterations=num_iterations, probes=probes, tol=tol,
            maxiter=maxiter, who=f"{self.name}.spectral_density", return_info=return_info,
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

    @one_trace_per_call()
    def logdet_slq(
        self,
        key: jax.Array,
        batches: BatchSource,
        *,
        damping: Any = 0.0,
        num_probes: int = 20,
        num_iterations: int = 30,
        progress: Any = False,
        max_batches: int | None = None,
        return_info: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        r"""Stochastic Lanczos quadrature of :math:`\log\det(M + \epsilon I)` over the dataset.

        .. math:: \log\det(M + \epsilon I) = \mathbb E_z\big[z^\top\log(M + \epsilon I)\,z\big].

        The estimator of :func:`~minigeo.densities.logdet_slq` (the same Rademacher probes and restart
        vectors for the same key, so on one batch both agree to rounding), with the
        offloaded Lanczos: ``num_probes x num_iterations`` passes over the data.

        Parameters
        ----------
        key : jax.Array
            PRNG key for the probes.
        batches : iterable or callable
            Must allow several passes (see :meth:`top_eigenvalues`).
        damping : float, optional
            :math:`\epsilon \ge 0`, e.g. the prior precision of the Laplace evidence.
        num_probes : int, optional
            Number of Rademacher probes.
        num_iterations : int, optional
            Lanczos steps per probe (capped at ``d``).
        progress : bool or tqdm-like class, optional
            Show a progress bar.
        max_batches : int, optional
            Use at most this many batches per pass (required for batches without a length).
        return_info : bool, optional
            Also return an :class:`~minigeo.curvature.EstimateInfo` (a :class:`~minigeo.Status` and the products used).

        Returns
        -------
        tuple of jax.Array
            ``(estimate, standard_error)``.

        Raises
        ------
        GeometryError
            If ``num_probes`` or ``num_iterations`` is not a positive int, ``damping`` is invalid,
            ``batches`` is a one-shot iterator or has no length (and no ``max_batches``), or the operator
            is singular or indefinite.

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> X = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
        >>> loss = lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2) * 3
        >>> H = mg.operators.hessian_operator(loss, jnp.zeros(3))
        >>> est, se = H.logdet_slq(jax.random.PRNGKey(0), [X], num_iterations=3)
        >>> round(float(est), 4), round(float(jnp.log(36.0)), 4)   # det diag(1, 4, 9) = 36
        (3.5835, 3.5835)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 4.2, eq. (14) (the log-determinant of the Laplace
        evidence). Taught in chapter 5, *Densities and volume forms*.
        """
        _check_key_first(key, batches, f"{self.name}.logdet_slq")
        check_working_precision(self.params, f"{self.name}.logdet_slq")
        check_damping(damping, "logdet_slq: damping")
        check_num_probes(num_probes, "logdet_slq")
        fresh = _many_passes(batches, "logdet_slq", max_batches)
        flat0, unravel = ravel(self.params)
        apply = lambda v: ravel(self.dataset_mv(unravel(v), fresh()))[0] + damping * v
        return slq_logdet(
            apply, flat0.size, key, num_probes=num_probes, num_iterations=num_iterations, dtype=flat0.dtype,
            on_host=True, steps=lambda probes: _progress(probes, progress, f"{self.name} SLQ", total=num_probes),
            return_info=return_info,
        )


# ---------------------------------------------------------------------------
# constructors
# ---------------------------------------------------------------------------
def _terms_impl(batch_mv: Callable, params, probes, duals, batch, *, batched: Any = "vmap"):
    """``(u_p^T M_b z_p)_p`` of one batch ``b`` for stacked probes (the estimators' one definition)."""
    return probe_terms(lambda z: batch_mv(params, z, batch), probes, duals, batched)


# traced at every call (once per batch shape inside one method call), compiled once per program
def _product_impl(batch_mv: Callable, params, v, batch):
    return batch_mv(params, v, batch)


def _block_product_impl(batch_mv: Callable, params, V, batch):
    return jax.vmap(batch_mv, in_axes=(None, 0, None))(params, V, batch)


_batch_product = functools.partial(compiled, _product_impl)
_batch_terms = functools.partial(compiled, _terms_impl)
_batch_block_product = functools.partial(compiled, _block_product_impl)


def hessian_operator(
    loss_fn: Callable[[PyTree, Batch], jax.Array], params: PyTree, *, examples: Callable[[Batch], int] | None = None
) -> CurvatureOperator:
    r"""The Hessian of a loss over a dataset, applied batch by batch.

    .. math:: H = \nabla^2_\theta \frac1N\sum_n \ell_n(\theta).

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, batch)``, the **mean** loss over the batch (any pytree batch).
    params : pytree
        The point.
    examples : callable, optional
        ``examples(batch) -> int``, the number of examples of a batch (see
        :class:`~minigeo.operators.CurvatureOperator`); by default the leading axis that every leaf shares.

    Returns
    -------
    :class:`~minigeo.operators.CurvatureOperator`
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
    >>> loss = lambda w, x: 0.5 * jnp.mean((x @ w) ** 2)
    >>> H, e1 = mg.operators.hessian_operator(loss, jnp.zeros(2)), jnp.array([1.0, 0.0])
    >>> H.dataset_mv(e1, mg.operators.batches_of(X, 4)), (X.T @ X / 6)[:, 0]
    (Array([36.666668, 41.666668], dtype=float32), Array([36.666668, 41.666668], dtype=float32))

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1, eq. (5) (the Hessian as a bilinear form). Taught in
    chapter 4, *Invariant Hessians*.
    """
    return CurvatureOperator(lambda p, v, batch: hvp(loss_fn, p, v, batch=batch), params, "Hessian", examples=examples)


def ggn_operator(
    model_fn: Callable[[PyTree, Any], jax.Array],
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    params: PyTree,
    *,
    examples: Callable[[Batch], int] | None = None,
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
    examples : callable, optional
        ``examples(batch) -> int``, the number of examples of a batch (see
        :class:`~minigeo.operators.CurvatureOperator`); by default the leading axis that every leaf shares.

    Returns
    -------
    :class:`~minigeo.operators.CurvatureOperator`
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
    >>> loss = lambda z, t: jnp.mean((z - t) ** 2)
    >>> G = mg.operators.ggn_operator(lambda w, x: x @ w, loss, jnp.ones(3))
    >>> G.dataset_mv(jnp.ones(3), mg.operators.batches_of((X, y), 2))   # 2 X^T X / N
    Array([0.6666667, 0.6666667, 0.6666667], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eq. (3) and Sec. 3.4; Grosse (2022), CSC2541 lecture 3
    (connection to the Gauss-Newton Hessian). Taught in chapter 2, *Pullback metrics*.
    """

    def mv(p, v, batch):
        return ggn(model_fn, loss_fn, batch=batch).mv(p, v)

    return CurvatureOperator(mv, params, "GGN", examples=examples)


def fisher_operator(
    model_fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree,
    likelihood: Union[str, Likelihood] = "categorical",
    *,
    examples: Callable[[Batch], int] | None = None,
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
    examples : callable, optional
        ``examples(batch) -> int``, the number of examples of a batch (see
        :class:`~minigeo.operators.CurvatureOperator`); by default the leading axis that every leaf shares.

    Returns
    -------
    :class:`~minigeo.operators.CurvatureOperator`
        Products as :func:`~minigeo.fisher`, one batch at a time.

    Raises
    ------
    GeometryError
        If a batch is not a pair, the likelihood is unknown, or ``params`` is not a valid point.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> F = mg.operators.fisher_operator(lambda w, x: x * w, jnp.zeros(2))  # p = (1/2, 1/2)
    >>> data = mg.operators.batches_of((jnp.ones((3, 2)), jnp.zeros(3)), 2)
    >>> F.dataset_mv(jnp.array([1.0, 0.0]), data)
    Array([ 0.25, -0.25], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eq. (3) and Sec. 3.4; Grosse (2022), CSC2541 lecture 3 (the
    Fisher). Taught in chapter 2, *Pullback metrics*.
    """
    fisher(lambda q: q, likelihood)  # validate the likelihood eagerly

    def mv(p, v, batch):
        return fisher(model_fn, likelihood, batch=batch).mv(p, v)

    return CurvatureOperator(mv, params, "Fisher", examples=examples)


def empirical_fisher_operator(
    model_fn: Callable[[PyTree, Any], jax.Array],
    per_example_loss_fn: Callable[[jax.Array, Any], jax.Array],
    params: PyTree,
    *,
    examples: Callable[[Batch], int] | None = None,
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
    examples : callable, optional
        ``examples(batch) -> int``, the number of examples of a batch (see
        :class:`~minigeo.operators.CurvatureOperator`); by default the leading axis that every leaf shares.

    Returns
    -------
    :class:`~minigeo.operators.CurvatureOperator`
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
    >>> loss = lambda z, t: 0.5 * (z - t) ** 2
    >>> EF = mg.operators.empirical_fisher_operator(lambda w, x: x @ w, loss, jnp.zeros(1))
    >>> # the mean of (x (w x - y))^2 = 14 / 3
    >>> EF.dataset_mv(jnp.ones(1), mg.operators.batches_of((X, y), 2))
    Array([4.6666665], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 (empirical Fisher vs Fisher); Kristiadi, Dangel & Hennig (2023),
    Sec. 3.4; Kunstner et al. (2019). Taught in chapter 2, *Pullback metrics*.
    """

    def mv(p, v, batch):
        return empirical_fisher(model_fn, per_example_loss_fn, batch=batch).mv(p, v)

    return CurvatureOperator(mv, params, "empirical Fisher", examples=examples)
