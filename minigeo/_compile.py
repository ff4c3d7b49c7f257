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

**Keyed on the user's program, derived on a miss.**  Tracing the whole work (a forward-over-reverse
Hessian-vector product, a Lanczos loop around it) costs several times tracing the user's function
alone.  So when ``fn`` is made of plain callables (a function, a tuple of them, or a
:class:`Derived` rule over them, e.g. a GGN's product over the model and the loss), an eager call
traces **only the user's callables**, at the argument shapes the work called them with last time
(the *plan*), and keys the compilation on those traced programs.  On a hit the compiled program
runs with today's constants as its arguments; only on a miss is the work traced, with each user
callable replaced by an evaluation of its traced program (so the compiled work contains no value
the user's function read).  That is sound because the work is minigeo's deterministic code: given
the same user programs at the same shapes, it traces to the same program.  Arguments whose pytree
structure carries callables (e.g. a :class:`~minigeo.Metric` passed as an argument, whose product
the work could call directly) take the whole-trace path above.

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

__all__ = ["Derived", "cache_size", "compiled", "jit_per_callable", "one_trace_per_call", "run_work"]

_CACHE_SIZE = 16  # compiled programs kept per rule (least recently used dropped)

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


def _value_key(x: Any, keep: list, rules: bool = False) -> Any:
    if isinstance(x, jcore.ClosedJaxpr):
        return ("C", _jaxpr_key(x.jaxpr, keep, rules), tuple(_array_key(c) for c in x.consts))
    if isinstance(x, jcore.Jaxpr):
        return ("J", _jaxpr_key(x, keep, rules))
    if isinstance(x, (bool, int, str, type(None))):
        return (type(x), x)
    if isinstance(x, (float, np.floating)):
        return ("f", type(x), float(x).hex())  # -0.0 and 0.0 differ
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_value_key(y, keep, rules) for y in x))
    if isinstance(x, dict):
        return ("d", tuple((k, _value_key(v, keep, rules)) for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))))
    if isinstance(x, (np.ndarray, jax.Array)):
        return _array_key(x)
    try:
        hash(x)
    except TypeError:
        keep.append(x)  # held by the entry, so its id cannot be reused while the entry lives
        return ("id", type(x), id(x))
    return ("h", type(x), x)  # the object itself: held by the key, compared by its own equality


def _rule_key(rule: Any, keep: list) -> tuple:
    """The user's functions behind a custom-derivative rule (JAX wraps them in fresh objects per trace).

    Walks the rule's wrappers (closure cells, ``functools.partial``, JAX's wrapped functions) to the
    functions defined outside JAX (e.g. the ``defjvp`` rule of a model's layer norm) and keys them by
    identity (held alive by the entry): a redefined rule is a new function, hence a new program.
    """
    found: list = []
    seen: set = set()

    def walk(x: Any, depth: int) -> None:
        if depth > 8 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, functools.partial):
            walk(x.func, depth + 1)
            for a in (*x.args, *x.keywords.values()):
                walk(a, depth + 1)
            return
        inner = getattr(x, "f", None)  # jax's WrappedFun
        if inner is not None and type(x).__module__.startswith("jax"):
            walk(inner, depth + 1)
            return
        if callable(x) and hasattr(x, "__code__"):
            module = getattr(x, "__module__", "") or ""
            if not module.startswith("jax"):
                found.append(x)
                return
            for cell in x.__closure__ or ():
                try:
                    walk(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass

    walk(rule, 0)
    if not found:  # nothing recognisable: key by the object itself (a new rule object, a new program)
        found.append(rule)
    keep.extend(found)
    return ("rule", tuple(id(f) for f in found))


def _params_key(eqn: Any, keep: list, rules: bool) -> tuple:
    custom = eqn.primitive.name.startswith("custom_")
    items = []
    for name in sorted(eqn.params):
        value = eqn.params[name]
        if custom and name in _RULE_PARAMS:
            if rules:  # a program that is differentiated later: its rules by the functions they wrap
                items.append((name, _rule_key(value, keep)))
            continue
        items.append((name, _value_key(value, keep, rules)))
    return tuple(items)


def _jaxpr_key(jaxpr: Any, keep: list, rules: bool = False) -> tuple:
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
            _params_key(eqn, keep, rules),
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


def _as_function(jaxpr: Any) -> Callable[..., list]:
    """``(*consts, *args) -> outputs`` of an open jaxpr (its constants made leading arguments)."""
    opened = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
    return jcore.jaxpr_as_fun(jcore.ClosedJaxpr(opened, []))


def _make_runner(jaxpr: Any) -> Callable:
    fun = _as_function(jaxpr)

    def run(consts: list, leaves: list) -> list:
        return fun(*consts, *leaves)

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


def _signature(flat: list, in_tree: Any, static: dict) -> Any:
    avals = tuple(
        (np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "weak_type", isinstance(x, (int, float, complex))))
        for x in flat
    )
    return (in_tree, avals, tuple(sorted(static.items(), key=lambda kv: kv[0])))


def _identity(fn: Any) -> tuple[tuple, list]:
    """``(key, parts)``: what makes two calls' ``fn`` the same function, for :func:`one_trace_per_call`.

    A :class:`Derived` is built afresh at each call of the boundary, so it is the same when its rule,
    its users and its static values are the same objects; anything else is the same object.  The
    key holds ids only; ``parts`` are the objects, compared by identity on a hit (ids can be reused).
    """
    if isinstance(fn, Derived):
        parts = [fn.rule, *fn.users, *fn.static.values()]
        return ("D", tuple(sorted(fn.static)), tuple(map(id, parts))), parts
    return ("f", id(fn)), [fn]


# ---------------------------------------------------------------------------
# the user's callables: traced alone, replayed inside the work
# ---------------------------------------------------------------------------
class Derived:
    """A callable minigeo builds from a user's callables: ``Derived(rule, users, static)(*a) = rule(*users, *a, **static)``.

    ``rule`` is minigeo's own (module-level, deterministic) code, e.g. the GGN product
    :math:`J^\\top H_z J v` of a model and a loss; ``users`` are the user's callables (or nested
    ``Derived``); ``static`` are hashable keyword arguments.  The compile layer traces only the
    users at each eager call and keys the compiled work on their programs (module docstring).
    """

    __slots__ = ("rule", "users", "static")

    def __init__(self, rule: Callable[..., Any], users: tuple, static: dict | None = None) -> None:
        self.rule, self.users, self.static = rule, tuple(users), dict(static or {})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.rule(*self.users, *args, **kwargs, **self.static)


class _Unsupported(Exception):
    """The fast path does not apply to this call (the whole-trace path runs it)."""


def _split_parts(items: Any) -> tuple[list, Callable[[list], list], tuple]:
    """Split each of ``items``: ``(their users, rebuild(new users) -> the rebuilt items, their keys)``."""
    parts = [_split_users(u) for u in items]
    sizes = [len(p[0]) for p in parts]
    rebuilds = [p[1] for p in parts]  # the closure keeps these, never the users (a compiled entry keeps it)

    def rebuild(us: list) -> list:
        out, i = [], 0
        for reb, n in zip(rebuilds, sizes):
            out.append(reb(us[i : i + n]))
            i += n
        return out

    return [u for p in parts for u in p[0]], rebuild, tuple(p[2] for p in parts)


def _split_users(fn: Any) -> tuple[list, Callable[[list], Any], Any]:
    """``(user callables, rebuild(new callables) -> fn's structure, structure key)``."""
    if fn is None:
        return [], (lambda us: None), None
    if isinstance(fn, Derived):
        try:
            static = tuple(sorted(fn.static.items()))
            hash(static)
        except TypeError as err:
            raise _Unsupported from err
        users, rebuild, keys = _split_parts(fn.users)
        rule, options = fn.rule, fn.static  # not fn itself: the rebuilt work (kept by a compiled entry) must not hold the users
        return users, (lambda us: Derived(rule, tuple(rebuild(us)), options)), ("D", rule, static, keys)
    if isinstance(fn, tuple):
        users, rebuild, keys = _split_parts(fn)
        return users, (lambda us: tuple(rebuild(us))), ("T", keys)
    if callable(fn) and not isinstance(fn, type):
        return [fn], (lambda us: us[0]), "f"
    raise _Unsupported


def _aval_key(x: Any) -> tuple:
    aval = x.aval if isinstance(x, jax.core.Tracer) else jax.typeof(x)
    return (tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False)))


def _call_key(index: int, args: tuple, kwargs: dict) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    for x in leaves:
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, float, int, bool, complex)):
            raise _Unsupported  # a non-array argument of the user's function (a string, a callable)
    return (index, tree, tuple(_aval_key(x) for x in leaves))


_AUX_SAFE: dict = {}
_NO_PLAN = object()  # no trace of the work yet for this signature (an empty plan is a plan)


def _aux_holds_callables(tree: Any) -> bool:
    """Whether a pytree structure's node data hold callables (a Metric's product, say)."""
    hit = _AUX_SAFE.get(tree)
    if hit is not None:
        return hit

    def holds(x: Any) -> bool:
        if isinstance(x, (tuple, list)):
            return any(holds(y) for y in x)
        if isinstance(x, dict):
            return any(holds(y) for y in x.values())
        return callable(x) and not isinstance(x, type)

    def walk(t: Any) -> bool:
        data = t.node_data()
        if data is not None and holds(data[1]):
            return True
        return any(walk(c) for c in t.children())

    out = walk(tree)
    if not out and len(_AUX_SAFE) < 4096:  # a structure that holds callables is not kept (nor what they close over)
        _AUX_SAFE[tree] = out
    return out


class _UserProgram:
    """One user callable traced at one argument signature: its open jaxpr, constants and key."""

    __slots__ = ("jaxpr", "consts", "out_tree", "key", "keep")

    def __init__(self, call: tuple, jaxpr: Any, consts: list, out_tree: Any) -> None:
        self.jaxpr, self.consts, self.out_tree = jaxpr, consts, out_tree
        self.keep: list = []
        self.key = (call, _jaxpr_key(jaxpr, self.keep, rules=True))


def _trace_users(users: list, plan: tuple) -> list:
    """The plan's user calls traced in **one** ``make_jaxpr`` and split into one program per call.

    Tracing costs a fixed overhead per ``make_jaxpr`` (about 1.5 ms on a CPU, as much as tracing a
    small MLP), paid once per eager call however many user calls the work makes (a GGN product
    calls the model and the loss).  The calls are independent, so each one's program is the part of
    the joint program its outputs need (dead-code elimination over the equations); a joint program
    with side effects is not split (each call is traced alone).
    """
    box: list = []
    sizes = [len(c[2]) for c in plan]

    def flat_users(*leaves: Any) -> list:
        outs, at = [], 0
        for c, n in zip(plan, sizes):
            a, k = jax.tree_util.tree_unflatten(c[1], leaves[at : at + n])
            at += n
            leaves_out, out_tree = jax.tree_util.tree_flatten(users[c[0]](*a, **k))
            box.append((out_tree, len(leaves_out)))
            outs.extend(leaves_out)
        return outs

    specs = [jax.ShapeDtypeStruct(s, d, weak_type=w) for c in plan for s, d, w in c[2]]
    closed = jax.make_jaxpr(flat_users)(*specs)
    jaxpr, consts = _hoist_float_literals(closed.jaxpr, list(closed.consts))
    if len(plan) == 1:
        return [_UserProgram(plan[0], jaxpr, consts, box[0][0])]
    if jaxpr.effects:  # not split: trace each call alone
        return [p for c in plan for p in _trace_users(users, (c,))]
    programs, at_in, at_out = [], 0, 0
    for c, n, (out_tree, n_out) in zip(plan, sizes, box):
        outvars = jaxpr.outvars[at_out : at_out + n_out]
        needed = {id(v) for v in outvars if isinstance(v, jcore.Var)}
        eqns = []
        for eqn in reversed(jaxpr.eqns):
            if any(id(o) in needed for o in eqn.outvars):
                eqns.append(eqn)
                needed.update(id(x) for x in eqn.invars if isinstance(x, jcore.Var))
        used = [(v, x) for v, x in zip(jaxpr.constvars, consts) if id(v) in needed]
        info = jcore.DebugInfo("make_jaxpr", f"user call {c[0]}", None, None)
        part = jcore.Jaxpr([v for v, _ in used], jaxpr.invars[at_in : at_in + n], outvars, eqns[::-1], debug_info=info)
        programs.append(_UserProgram(c, part, [x for _, x in used], out_tree))
        at_in, at_out = at_in + n, at_out + n_out
    return programs


def _discover_plan(impl: Callable, users: list, rebuild: Callable, flat: list, in_tree: Any, static: dict) -> tuple:
    """The distinct ``(user index, argument structure, avals)`` the work calls the users with (one abstract trace)."""
    seen: dict = {}

    def recorder(i: int, user: Callable) -> Callable:
        def call(*a: Any, **k: Any) -> Any:
            seen.setdefault(_call_key(i, a, k), None)
            return user(*a, **k)

        return call

    def flat_impl(*leaves: Any) -> Any:
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        return impl(rebuild([recorder(i, u) for i, u in enumerate(users)]), *args, **kwargs, **static)

    jax.eval_shape(flat_impl, *flat)
    return tuple(seen)


def _make_derived_runner(impl: Callable, rebuild: Callable, n_users: int, programs: list, in_tree: Any, static: dict):
    """The work compiled with each user call replaced by its traced program (constants as arguments)."""
    table = {p.key[0]: (i, _as_function(p.jaxpr), p.out_tree) for i, p in enumerate(programs)}
    out_box: list = []

    def run(user_consts: list, leaves: list) -> list:
        def replayer(index: int) -> Callable:
            def call(*a: Any, **k: Any) -> Any:
                hit = table.get(_call_key(index, a, k))
                if hit is None:  # not the plan's call: impossible for deterministic work
                    raise _Unsupported
                j, fun, out_tree = hit
                return jax.tree_util.tree_unflatten(out_tree, fun(*user_consts[j], *jax.tree_util.tree_leaves((a, k))))

            return call

        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = impl(rebuild([replayer(i) for i in range(n_users)]), *args, **kwargs, **static)
        leaves_out, out_tree = jax.tree_util.tree_flatten(out)
        if not out_box:
            out_box.append(out_tree)
        return leaves_out

    return jax.jit(run), out_box


# ---------------------------------------------------------------------------
# the wrapper
# ---------------------------------------------------------------------------
def jit_per_callable(impl: Callable[..., Any], *, static_argnames: tuple[str, ...] = ()) -> Callable[..., Any]:
    """``call(fn, *args, **kwargs) = impl(fn, *args, **kwargs)``, traced per call, compiled per program.

    ``fn`` is the user's callable, a tuple of them, a :class:`Derived` rule over them, or ``None``;
    ``args`` and the keyword arguments not named in ``static_argnames`` are pytrees of arrays (or
    Python scalars, traced as weakly typed values).  Every call traces the user's callables afresh,
    so nothing ``fn`` reads can be stale, and reuses the compiled work whenever their traced
    programs are the same (see the module docstring).  Called with traced arguments, or on a
    function that cannot be traced (Python control flow on values), ``impl`` runs inline / op by op.
    """
    # one least-recently-used table per rule (a Derived's rule, else the wrapped impl): program key ->
    # (jitted runner, objects the key names by id); the rules sharing the boundary do not evict each other
    caches: dict = {}
    plans: dict = {}  # call signature -> the user calls of the work's last trace (or None: whole-trace path)
    lock = threading.Lock()

    def table(fn: Any) -> OrderedDict:
        while isinstance(fn, Derived) and fn.rule is run_work and len(fn.users) == 1 and isinstance(fn.users[0], Derived):
            fn = fn.users[0]  # compiled(run_work, Derived(rule, ...)): the table of the rule inside
        group = fn.rule if isinstance(fn, Derived) else None
        found = caches.get(group)
        if found is None:
            found = caches[group] = OrderedDict()
        return found

    def compiled_runner(fn: Any, program: _Program) -> Callable:
        cache = table(fn)
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

    def whole_trace(fn: Any, args: tuple, kwargs: dict, static: dict, flat: list, in_tree: Any) -> Any:
        pinned = _PINNED.get()
        signature = None
        program = runner = None
        if pinned is not None:
            ident, parts = _identity(fn)
            signature = (impl, ident, _signature(flat, in_tree, static))
            hit = pinned.get(signature)
            if hit is not None and all(a is b for a, b in zip(hit[0], parts)):
                _, program, runner = hit
        if program is None:
            try:
                program = _trace(impl, fn, flat, in_tree, static)
            except _TRACE_ERRORS:
                return impl(fn, *args, **kwargs, **static)  # not traceable as a whole: op by op
            if _is_tracing(program.consts):  # fn closes over an outer transformation's tracers
                return impl(fn, *args, **kwargs, **static)
            runner = compiled_runner(fn, program)
            if pinned is not None:
                pinned[signature] = (parts, program, runner)
        out = runner(program.consts, flat)
        return jax.tree_util.tree_unflatten(program.out_tree, out)

    def derived(fn: Any, static: dict, flat: list, in_tree: Any) -> Any:
        """The fast path: trace the user's callables only; derive the work on a miss."""
        users, rebuild, structure = _split_users(fn)
        cache = table(fn)
        if _aux_holds_callables(in_tree):
            raise _Unsupported
        signature = (in_tree, tuple(_aval_key(x) for x in flat), tuple(sorted(static.items())), structure)
        pinned = _PINNED.get()
        if pinned is not None:
            hit = pinned.get((impl, signature, tuple(map(id, users))))
            if hit is not None and all(a is b for a, b in zip(hit[0], users)):
                _, consts, runner, out_box = hit
                return jax.tree_util.tree_unflatten(out_box[0], runner(consts, flat))
        def traced(plan: tuple) -> tuple[list, Any, Any]:
            """The user's callables traced at the plan's calls, their key, and its compiled work (or None)."""
            programs = _trace_users(users, plan)
            key = (signature, tuple(p.key for p in programs))
            with lock:
                entry = cache.get(key)
                if entry is not None:
                    cache.move_to_end(key)
            return programs, key, entry

        plan = plans.get(signature, _NO_PLAN)
        if plan is None:
            raise _Unsupported
        entry = None
        if plan is not _NO_PLAN:
            programs, key, entry = traced(plan)
        if entry is None:  # a miss: find the calls, trace the users there, derive the work
            try:
                plan = _discover_plan(impl, users, rebuild, flat, in_tree, static)
            except _Unsupported:
                plans[signature] = None
                raise
            plans[signature] = plan
            programs, key, entry = traced(plan)
            if entry is None:
                runner, out_box = _make_derived_runner(impl, rebuild, len(users), programs, in_tree, static)
                with lock:
                    entry = cache[key] = (runner, [p.keep for p in programs], out_box)
                    while len(cache) > _CACHE_SIZE:
                        cache.popitem(last=False)
        runner, _, out_box = entry
        consts = [p.consts for p in programs]
        if _is_tracing(consts):  # the user's callables close over an outer transformation's tracers
            raise _Unsupported
        out = runner(consts, flat)
        if pinned is not None:
            pinned[(impl, signature, tuple(map(id, users)))] = (list(users), consts, runner, out_box)
        return jax.tree_util.tree_unflatten(out_box[0], out)

    @functools.wraps(impl)
    def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        static = {k: kwargs.pop(k) for k in static_argnames if k in kwargs}
        if _is_tracing((args, kwargs)):
            return impl(fn, *args, **kwargs, **static)
        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        try:
            return derived(fn, static, flat, in_tree)
        except _Unsupported:
            pass
        except _TRACE_ERRORS:
            return impl(fn, *args, **kwargs, **static)  # not traceable: op by op
        return whole_trace(fn, args, kwargs, static, flat, in_tree)

    def cache_size(rule: Any = None) -> int:  # for tests: programs kept, for one rule or in all
        if rule is not None:
            return len(caches.get(rule, ()))
        return sum(map(len, caches.values()))

    call.cache_size = cache_size  # type: ignore[attr-defined]
    return call


def run_work(work: Any, *args: Any) -> Any:
    """``work(*args)``: the rule of a call whose work is already a :class:`Derived` (``compiled(run_work, work, ...)``)."""
    return work(*args)


# the one compile boundary of minigeo: every module reaches the compiler through :func:`compiled`
_BOUNDARY = jit_per_callable(run_work)


def compiled(rule: Callable[..., Any], fn: Any, *args: Any, **static: Any) -> Any:
    """``rule(fn, *args, **static)``, traced per call and compiled once per program: minigeo's one compile boundary.

    ``rule`` is minigeo's own module-level code (a Hessian-vector product, a CG solve, a Lanczos
    run); ``fn`` is the user's callable, a tuple of them, a :class:`Derived` rule over them or
    ``None``; ``args`` are pytrees of arrays; ``static`` are hashable options (sizes, tolerances,
    names) that select the program.  The call is ``Derived(rule, (fn,), static)`` through
    :func:`jit_per_callable`: an eager call traces only the user's callables and reuses the
    compiled work when their programs are the ones compiled before (module docstring); under an
    outer transformation the rule runs inline.  Each rule keeps its own compiled programs.
    """
    return _BOUNDARY(Derived(rule, (fn,), static), *args)


def cache_size(rule: Callable[..., Any] | None = None) -> int:
    """The number of compiled programs the boundary keeps for ``rule`` (all rules: ``None``); for tests."""
    return _BOUNDARY.cache_size(rule)


def bind_batch(fn: Callable[..., Any], batch: Any) -> Callable[..., Any]:
    """The one calling convention for data: ``fn(params, batch)``; ``batch=None`` means ``fn(params)`` (a closure).

    The bound function closes over the batch, which the compile layer passes as an argument of the
    compiled program (never a constant of it): a new batch of the same shapes does not recompile, and
    the batch is not kept after the call.
    """
    if batch is None:
        return fn
    return lambda params: fn(params, batch)

