"""Compile the work around a user's function once per function, not once per eager call.

A minigeo function that takes a user's callable ``f`` (a loss, a model, a metric's product) and
runs its own code around it (the jvp of a gradient, a batch of Hutchinson probes, a Lanczos loop)
is, called eagerly, dispatched op by op, and every ``lax.scan`` / ``lax.while_loop`` inside
(a transformer's block scan, Lanczos, CG) is traced and compiled again on every call: a second
eager Hessian-vector product of a small ViT took 20x the jitted call.  :func:`jit_per_callable`
wraps such work in ``jax.jit`` compiled once per callable and input shapes, as ``jax.jit``
itself caches by function identity.

Two guarantees beyond ``jax.jit``'s:

* **No stale values from rebinding.**  ``jax.jit`` reads a function's globals once, when it
  traces.  Here each call first takes a cheap *fingerprint* of the callable: the identity of
  every object in its closure cells, its referenced globals, a ``functools.partial``'s arguments
  and a bound method's ``__self__``, following referenced functions two levels deep.  A
  notebook that rebinds ``X = new_data`` after defining ``loss = lambda p: ... X ...`` gets a
  fresh compilation, not the old ``X``.  (Mutating an object in place, e.g. ``state["scale"] = 5``,
  cannot be seen; minigeo's functions assume pure functions, as JAX does.)
* **No data kept alive.**  A plain function is cached by its code object, with the JAX arrays it
  closes over (or takes as defaults) passed in as arguments, never stored; other callables are
  keyed weakly, and their compiled code goes when they are garbage-collected.  At most 16
  compilations are kept per code object.

Under an outer transformation (``jit``, ``vmap``, ``grad`` of the caller), the work is traced
inline instead: the outer compilation already covers it.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from typing import Any, Callable

import jax

__all__ = ["jit_per_callable"]

_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None))
_MAX_DEPTH = 2


def _stamp(obj: Any) -> Any:
    """How ``obj`` is remembered: by value if immutable, else by identity (weakly where possible)."""
    if isinstance(obj, _IMMUTABLE):
        return ("v", (type(obj), obj))
    if isinstance(obj, (types.ModuleType, type)):
        return ("s", obj)  # modules and classes live as long as the program
    try:
        return ("w", weakref.ref(obj))
    except TypeError:
        return ("s", obj)  # e.g. a tuple or dict: held, compared by identity


def _same(a: Any, b: Any) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "w":
        x = a[1]()
        return x is not None and x is b[1]()
    if a[0] == "s":
        return a[1] is b[1]
    return a[1] == b[1]


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested lambdas / comprehensions share the globals
            names |= _code_names(const)
    return names


def _fingerprint(fn: Any, top_cells: bool = True) -> list:
    """Stamps of what ``fn`` reads: closure cells, referenced globals, partial arguments, ``__self__``.

    ``top_cells=False`` leaves out ``fn``'s own closure cells (a :class:`_Template` stamps them).
    """
    stamps: list = []
    seen: set[int] = set()

    def visit(g: Any, depth: int) -> None:
        if id(g) in seen or depth < 0:
            return
        seen.add(id(g))
        if isinstance(g, functools.partial):
            for a in (*g.args, *g.keywords.values()):
                stamps.append(_stamp(a))
                if callable(a):
                    visit(a, depth - 1)
            visit(g.func, depth)
            return
        if inspect.ismethod(g):
            stamps.append(_stamp(g.__self__))
            visit(g.__func__, depth)
            return
        code = getattr(g, "__code__", None)
        if not isinstance(code, types.CodeType):
            return
        own = g is fn and not top_cells
        for cell in getattr(g, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if not own:
                stamps.append(_stamp(value))
            if callable(value) and not isinstance(value, type):
                visit(value, depth - 1)
        glob = getattr(g, "__globals__", {})
        for name in sorted(_code_names(code)):
            if name in glob:
                value = glob[name]
                stamps.append(_stamp(value))
                if callable(value) and not isinstance(value, (type, types.ModuleType)):
                    visit(value, depth - 1)

    visit(fn, _MAX_DEPTH)
    return stamps


def _unchanged(old: list, new: list) -> bool:
    return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new))


def _weak_caller(fn: Any) -> Callable[[], Any] | None:
    """A zero-argument function returning ``fn`` without holding it, or None if ``fn`` cannot be weakly held."""
    if inspect.ismethod(fn):  # a bound method is a new object at every attribute access
        try:
            self_ref, func_ref = weakref.ref(fn.__self__), weakref.ref(fn.__func__)
        except TypeError:
            return None
        return lambda: types.MethodType(func_ref(), self_ref())
    try:
        ref = weakref.ref(fn)
    except TypeError:
        return None
    return ref


def _is_tracing(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs)))


def _is_array_tree(x: Any) -> bool:
    """A JAX array, or a non-empty tuple/list/dict whose leaves are all JAX arrays (a batch, a pytree)."""
    if isinstance(x, jax.Array):
        return True
    if isinstance(x, (tuple, list, dict)) and x:
        leaves = jax.tree_util.tree_leaves(x)
        return bool(leaves) and all(isinstance(leaf, jax.Array) for leaf in leaves)
    return False


class _Template:
    """A plain function with its JAX-array closure cells and defaults hoisted out as arguments.

    ``stamps`` identify the rest (code, the other cells and defaults, globals read); ``arrays``
    are the hoisted values.  :meth:`rebuild` makes the function again from traced arrays.
    """

    def __init__(self, fn: types.FunctionType) -> None:
        self.code = fn.__code__
        self.globals = fn.__globals__
        self.name = fn.__name__
        self.kwdefaults = fn.__kwdefaults__
        slots = [("d", v) for v in (fn.__defaults__ or ())]
        for cell in fn.__closure__ or ():
            try:
                slots.append(("c", cell.cell_contents))
            except ValueError:  # an empty cell
                slots.append(("e", None))
        self.kinds = tuple(kind for kind, _ in slots)
        hoisted = [_is_array_tree(v) for _, v in slots]
        self.hoisted = tuple(hoisted)
        self.arrays = [v for (_, v), h in zip(slots, hoisted) if h]
        self.static = [_stamp(v) for (_, v), h in zip(slots, hoisted) if not h]
        treedefs = tuple(jax.tree_util.tree_structure(a) for a in self.arrays)
        self.stamps = [("v", (tuple, (self.kinds, self.hoisted, treedefs))), _stamp(self.kwdefaults)] + self.static
        self.stamps += _fingerprint(fn, top_cells=False)  # globals read, and the functions in the cells

    def rebuild(self, arrays: list) -> types.FunctionType:
        it_arrays, it_static = iter(arrays), iter(self.static)
        values = []
        for hoisted in self.hoisted:
            if hoisted:
                values.append(next(it_arrays))
            else:
                stamp = next(it_static)
                values.append(stamp[1]() if stamp[0] == "w" else (stamp[1][1] if stamp[0] == "v" else stamp[1]))
        n_defaults = self.kinds.count("d")
        defaults, cells = values[:n_defaults], values[n_defaults:]
        closure = tuple(
            types.CellType() if kind == "e" else types.CellType(v) for kind, v in zip(self.kinds[n_defaults:], cells)
        )
        fn = types.FunctionType(self.code, self.globals, self.name, tuple(defaults) or None, closure or None)
        fn.__kwdefaults__ = self.kwdefaults
        return fn


_TRACE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)
_MAX_ENTRIES_PER_CODE = 16
_GIVE_UP_AFTER_MISSES = 8


def jit_per_callable(impl: Callable[..., Any], *, static_argnames: tuple[str, ...] = ()) -> Callable[..., Any]:
    """``call(fn, *args, **kwargs) = impl(fn, *args, **kwargs)``, compiled once per ``fn`` and argument shapes.

    ``fn`` is the user's callable (static; ``None`` shares one compilation); ``args`` and
    ``kwargs`` are pytrees of arrays except the keyword arguments named in ``static_argnames``.
    Called with traced arguments, ``impl`` runs inline.

    A plain Python function is cached by its code, with the JAX arrays it closes over (or takes
    as defaults) passed as arguments: ``lambda p: loss(p, batch)`` made afresh for every batch of
    the same shape reuses one compilation.  Other callables (bound methods, ``partial`` objects,
    callable objects) are cached by identity, weakly.  A function that cannot be traced
    (Python control flow on a closed-over array) runs op by op, as does a function whose
    compilations keep missing the cache.
    """
    by_code: dict = {}  # code -> {"entries": [(template, jitted)], "hits": int, "misses": int}
    by_identity: dict = {}  # id key -> (weakref to the anchor, weakref to __func__ or None, fingerprint, jitted)

    def make(caller: Callable[[], Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            return impl(caller(), *args, **kwargs)

        return jax.jit(run, static_argnames=static_argnames)

    def make_from_template(template: _Template) -> Callable[..., Any]:
        def run(arrays: list, *args: Any, **kwargs: Any) -> Any:
            return impl(template.rebuild(arrays), *args, **kwargs)

        return jax.jit(run, static_argnames=static_argnames)

    shared = jax.jit(functools.partial(impl, None), static_argnames=static_argnames)

    def by_template(fn: types.FunctionType, args: tuple, kwargs: dict) -> Any:
        record = by_code.setdefault(fn.__code__, {"entries": [], "hits": 0, "misses": 0})
        if record["misses"] >= _GIVE_UP_AFTER_MISSES and record["hits"] == 0:
            return impl(fn, *args, **kwargs)  # a new closure every call that no compilation can serve
        template = _Template(fn)
        for i, (template_old, jitted) in enumerate(record["entries"]):
            if _unchanged(template_old.stamps, template.stamps):
                record["hits"] += 1
                record["entries"].append(record["entries"].pop(i))  # most recently used last
                template_old.static = template.static  # keep the live objects, not only their stamps
                return jitted(template.arrays, *args, **kwargs)
        record["misses"] += 1
        jitted = make_from_template(template)
        arrays, template.arrays = template.arrays, []  # the entry keeps no data alive
        record["entries"].append((template, jitted))
        del record["entries"][:-_MAX_ENTRIES_PER_CODE]
        return jitted(arrays, *args, **kwargs)

    def by_anchor(fn: Any, args: tuple, kwargs: dict) -> Any:
        caller = _weak_caller(fn)
        if caller is None:
            return impl(fn, *args, **kwargs)  # cannot be held weakly: run op by op
        method = inspect.ismethod(fn)
        anchor, func = (fn.__self__, fn.__func__) if method else (fn, None)
        key = (id(anchor), id(func))
        stamps = _fingerprint(fn)
        entry = by_identity.get(key)
        if entry is not None and not (
            entry[0]() is anchor and (func is None or entry[1]() is func) and _unchanged(entry[2], stamps)
        ):
            entry = None
        if entry is None:
            anchor_ref = weakref.ref(anchor, lambda _r, key=key: by_identity.pop(key, None))
            entry = (anchor_ref, weakref.ref(func) if method else None, stamps, make(caller))
            by_identity[key] = entry
        return entry[3](*args, **kwargs)

    @functools.wraps(impl)
    def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_tracing(args, kwargs):
            return impl(fn, *args, **kwargs)
        if fn is None:  # no user callable: one compilation per argument shapes, shared
            return shared(*args, **kwargs)
        try:
            if isinstance(fn, types.FunctionType):
                return by_template(fn, args, kwargs)
            return by_anchor(fn, args, kwargs)
        except _TRACE_ERRORS:
            if isinstance(fn, types.FunctionType):
                record = by_code[fn.__code__]
                record["misses"], record["hits"] = _GIVE_UP_AFTER_MISSES, 0  # never again for this code
            return impl(fn, *args, **kwargs)  # not traceable as a whole: op by op (raises if truly wrong)

    def cache_size() -> int:  # for tests
        return sum(len(r["entries"]) for r in by_code.values()) + len(by_identity)

    call.cache_size = cache_size  # type: ignore[attr-defined]
    return call
