"""Compile the work around a user's function once per *program*, tracing it afresh at every call.

A minigeo function that takes a user's callable ``f`` (a loss, a model, a metric's product) runs
its own code around it (the jvp of a gradient, a batch of Hutchinson probes, a Lanczos loop).
Run op by op, every ``lax.scan`` / ``lax.while_loop`` inside (a transformer's block scan, Lanczos,
CG) is compiled again at each eager call: a second eager Hessian-vector product of a small ViT
took 20x the jitted call.  ``jax.jit(impl, static_argnames="f")`` fixes the speed but caches by
the *identity* of ``f``: it reads ``f``'s globals, attributes and containers once, at its first
trace, and returns stale values after the user changes them.

:func:`jit_per_callable` does neither.  At every call it

1. **traces** ``impl(f, *args)`` to a jaxpr (``jax.make_jaxpr``), so whatever ``f`` reads (a global
   three calls deep, an attribute, a dict entry, a NumPy array changed in place, ``-0.0``) is read
   now;
2. keys the compilation by the **traced program itself**: the jaxpr's equations, their parameters
   and literals (by value, bit for bit), the argument and constant shapes and dtypes.  Arrays that
   ``f`` closes over become the jaxpr's constants and are passed to the compiled program as
   **arguments**, never baked into it;
3. runs the compiled program of that key (compiling it the first time).

So a value is never stale (the program is the one traced now, the constants are today's values),
no caller's data is kept alive (an entry holds the open jaxpr, with no constant values, and the
compiled code), and ``functools.partial(loss, batch=b)``, a new lambda per batch, a bound method
or a Python float that changes every step all reuse one compilation: they trace to the same
program.  The price is one trace per call (a few milliseconds), less than running the same work
op by op.

Inside one long computation that calls the same function many times (a pass over a dataset, the
steps of Lanczos), :func:`one_trace_per_call` lets the caller trace once per argument shapes for the
duration of that computation: the user's function is read once, at the start of the public call,
as one call of a plain JAX function would read it.

Under an outer transformation (``jit``, ``vmap``, ``grad`` of the caller) the work is traced
inline instead: the outer compilation already covers it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.extend import core as jcore

from jax._src import core as _core  # eval_jaxpr (the public jax.core alias is deprecated)

__all__ = ["jit_per_callable", "one_trace_per_call"]

_CACHE_SIZE = 16  # compiled programs kept per wrapped function (least recently used dropped)

_TRACE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


# ---------------------------------------------------------------------------
# the structural key of a traced program
# ---------------------------------------------------------------------------
def _array_key(x: Any) -> tuple:
    a = np.asarray(x)
    return ("a", a.dtype.str, a.shape, a.tobytes())


# parameters of custom-derivative primitives that hold Python rules: evaluating the jaxpr (no
# differentiation: a differentiating caller passes tracers and runs inline) uses only the primal
# ``call_jaxpr``, so these never change what the program computes and are left out of the key
_RULE_PARAMS = frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk", "jvp", "fwd_jaxpr_thunk", "bwd", "out_trees", "fwd"})


def _value_key(x: Any, keep: list) -> Any:
    if isinstance(x, jcore.ClosedJaxpr):
        return ("C", _jaxpr_key(x.jaxpr, keep), tuple(_array_key(c) for c in x.consts))
    if isinstance(x, jcore.Jaxpr):
        return ("J", _jaxpr_key(x, keep))
    if isinstance(x, (bool, int, str, type(None))):
        return (type(x), x)
    if isinstance(x, (float, np.floating)):
        return ("f", type(x), float(x).hex())  # -0.0 and 0.0 differ
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_value_key(y, keep) for y in x))
    if isinstance(x, dict):
        return ("d", tuple((k, _value_key(v, keep)) for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))))
    if isinstance(x, (np.ndarray, jax.Array)):
        return _array_key(x)
    try:
        hash(x)
    except TypeError:
        keep.append(x)  # held by the entry, so its id cannot be reused while the entry lives
        return ("id", type(x), id(x))
    return ("h", type(x), x)  # the object itself: held by the key, compared by its own equality


def _params_key(eqn: Any, keep: list) -> tuple:
    custom = eqn.primitive.name.startswith("custom_")
    items = []
    for name in sorted(eqn.params):
        if custom and name in _RULE_PARAMS:
            continue
        items.append((name, _value_key(eqn.params[name], keep)))
    return tuple(items)


def _jaxpr_key(jaxpr: Any, keep: list) -> tuple:
    """A hashable value equal for two jaxprs exactly when they compute the same thing."""
    numbers: dict[int, int] = {}

    def var(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return ("lit", v.aval, _array_key(v.val))
        n = numbers.get(id(v))
        if n is None:
            n = numbers[id(v)] = len(numbers)
        return n

    head = (
        tuple((var(v), v.aval) for v in jaxpr.constvars),
        tuple((var(v), v.aval) for v in jaxpr.invars),
    )
    body = tuple(
        (
            eqn.primitive,
            tuple(var(x) for x in eqn.invars),
            tuple((var(o), o.aval) for o in eqn.outvars),
            _params_key(eqn, keep),
        )
        for eqn in jaxpr.eqns
    )
    try:
        effects = frozenset(jaxpr.effects)
    except TypeError:
        effects = tuple(map(repr, jaxpr.effects))
    return head, body, tuple(var(v) for v in jaxpr.outvars), effects


# ---------------------------------------------------------------------------
# tracing and running
# ---------------------------------------------------------------------------
def _is_tracing(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


class _Program:
    """One traced call: its open jaxpr, the constants' current values and the output structure."""

    __slots__ = ("jaxpr", "consts", "out_tree", "key", "keep")

    def __init__(self, jaxpr: Any, consts: list, out_tree: Any, key: Any, keep: list) -> None:
        self.jaxpr, self.consts, self.out_tree, self.key, self.keep = jaxpr, consts, out_tree, key, keep


def _trace(impl: Callable, fn: Any, flat: list, in_tree: Any, static: dict) -> _Program:
    out_tree_box: list = []

    def flat_impl(*leaves: Any) -> list:
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = impl(fn, *args, **kwargs, **static)
        leaves_out, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return leaves_out

    closed = jax.make_jaxpr(flat_impl)(*flat)
    jaxpr, consts = _hoist_float_literals(closed.jaxpr, list(closed.consts))
    keep: list = []
    # the key is the program alone: the runner takes flat leaves, so the pytree structures (whose
    # auxiliary data may hold the user's functions, e.g. a Metric's product) need not be in it
    key = _jaxpr_key(jaxpr, keep)
    return _Program(jaxpr, consts, out_tree_box[0], key, keep)


def _hoist_float_literals(jaxpr: Any, consts: list) -> tuple[Any, list]:
    """Turn the top level's floating-point scalar literals into constants (arguments of the program).

    A Python float the user's function reads (a learning rate, a temperature, a per-step
    schedule) is traced as a literal; hoisted, it is an argument, so a new value reuses the
    compilation instead of making a new program.
    """
    constvars = list(jaxpr.constvars)
    hoisted: dict = {}

    def sub(x: Any) -> Any:
        if not isinstance(x, jcore.Literal):
            return x
        val = np.asarray(x.val)
        if val.shape != () or not np.issubdtype(val.dtype, np.floating):
            return x
        var = jcore.Var(x.aval)
        constvars.append(var)
        consts.append(np.asarray(val, dtype=x.aval.dtype))
        hoisted[id(var)] = var
        return var

    eqns = [eqn.replace(invars=[sub(x) for x in eqn.invars]) for eqn in jaxpr.eqns]
    if not hoisted:
        return jaxpr, consts
    outvars = [sub(x) for x in jaxpr.outvars]
    return jaxpr.replace(constvars=constvars, eqns=eqns, outvars=outvars), consts


def _make_runner(jaxpr: Any) -> Callable:
    def run(consts: list, leaves: list) -> list:
        return _core.eval_jaxpr(jaxpr, consts, *leaves)

    return jax.jit(run)


# ---------------------------------------------------------------------------
# one trace per public call
# ---------------------------------------------------------------------------
_PINNED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("minigeo_pinned_traces", default=None)


@contextlib.contextmanager
def one_trace_per_call() -> Iterator[None]:
    """Within this block, each compiled function traces once per (function, argument shapes).

    For the loops inside one public call (a dataset pass, Lanczos or CG steps driven from Python):
    the user's function is read once, when the block's first call traces it, and its constants
    are the values read then.  Nested blocks share the outermost one; leaving it forgets all.
    """
    if _PINNED.get() is not None:
        yield
        return
    token = _PINNED.set({})
    try:
        yield
    finally:
        _PINNED.reset(token)


def _signature(fn: Any, flat: list, in_tree: Any, static: dict) -> Any:
    avals = tuple(
        (np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "weak_type", isinstance(x, (int, float, complex))))
        for x in flat
    )
    return (id(fn), in_tree, avals, tuple(sorted(static.items(), key=lambda kv: kv[0])))


# ---------------------------------------------------------------------------
# the wrapper
# ---------------------------------------------------------------------------
def jit_per_callable(impl: Callable[..., Any], *, static_argnames: tuple[str, ...] = ()) -> Callable[..., Any]:
    """``call(fn, *args, **kwargs) = impl(fn, *args, **kwargs)``, traced per call, compiled per program.

    ``fn`` is the user's callable (or ``None``); ``args`` and the keyword arguments not named in
    ``static_argnames`` are pytrees of arrays (or Python scalars, traced as weakly typed values).
    Every call traces ``impl`` afresh, so nothing ``fn`` reads can be stale, and reuses the
    compiled program whenever the traced program is the same (see the module docstring).  Called
    with traced arguments, or on a function that cannot be traced (Python control flow on values),
    ``impl`` runs inline / op by op.
    """
    cache: OrderedDict = OrderedDict()  # program key -> (jitted runner, objects the key names by id)
    lock = threading.Lock()

    def compiled_runner(program: _Program) -> Callable:
        with lock:
            entry = cache.get(program.key)
            if entry is not None:
                cache.move_to_end(program.key)
                return entry[0]
            runner = _make_runner(program.jaxpr)
            cache[program.key] = (runner, program.keep)
            while len(cache) > _CACHE_SIZE:
                cache.popitem(last=False)
            return runner

    @functools.wraps(impl)
    def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        static = {k: kwargs.pop(k) for k in static_argnames if k in kwargs}
        if _is_tracing((args, kwargs)):
            return impl(fn, *args, **kwargs, **static)
        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        pinned = _PINNED.get()
        signature = None
        program = runner = None
        if pinned is not None:
            signature = (impl, _signature(fn, flat, in_tree, static))
            hit = pinned.get(signature)
            if hit is not None and hit[0] is fn:
                _, program, runner = hit
        if program is None:
            try:
                program = _trace(impl, fn, flat, in_tree, static)
            except _TRACE_ERRORS:
                return impl(fn, *args, **kwargs, **static)  # not traceable as a whole: op by op
            if _is_tracing(program.consts):  # fn closes over an outer transformation's tracers
                return impl(fn, *args, **kwargs, **static)
            runner = compiled_runner(program)
            if pinned is not None:
                pinned[signature] = (fn, program, runner)
        out = runner(program.consts, flat)
        return jax.tree_util.tree_unflatten(program.out_tree, out)

    def cache_size() -> int:  # for tests
        return len(cache)

    call.cache_size = cache_size  # type: ignore[attr-defined]
    return call


def bind_batch(fn: Callable[..., Any], batch: Any) -> Callable[..., Any]:
    """The one calling convention for data: ``fn(params, batch)``; ``batch=None`` means ``fn(params)`` (a closure).

    The bound function closes over the batch, which the compile layer passes as an argument of the
    compiled program (never a constant of it): a new batch of the same shapes does not recompile, and
    the batch is not kept after the call.
    """
    if batch is None:
        return fn
    return lambda params: fn(params, batch)

