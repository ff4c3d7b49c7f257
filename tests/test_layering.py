"""minigeo's layering, as documented in book/api/architecture.md and README.md, checked on the source.

(a) No module imports a private name (leading underscore) from a public module of minigeo: internals
    shared by several modules live in private ``_``-modules.
(b) Every module imports only from floors below its own (``FLOORS``); inside a subpackage, only from
    the submodules listed before it (``PACKAGE_ORDER``).

Both read the imports with ``ast`` (module-level and inside functions), nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "minigeo"

#: The floor of every top-level module (a subpackage counts as one module).  Floor 1 holds the internals
#: and the two self-contained public modules, in steps 1.0 to 1.5 (a step imports only from earlier steps).
FLOORS: dict[str, float] = {
    "_toolchain": 0.5,  # the guard against jaxlib 0.10.2's CPU miscompilation, imported first by __init__
    "_checks": 1.0,
    "_compile": 1.0,
    "_status": 1.05,  # the one status enumeration (issue 30, item 6)
    "_tree": 1.1,
    "_likelihood": 1.1,  # the Likelihood type and the one lookup by name, for metrics and kronecker (issue 53)
    "_batches": 1.15,  # the one batches type, below the operators and the sharpness functions (issue 53)
    "_pairs": 1.1,
    "_eigen": 1.1,  # block Lanczos and its certificate (on main since the merge of wip/eig)
    "stats": 1.1,
    "parallel": 1.1,
    "_linalg": 1.2,
    "_estimators": 1.2,
    "_restrict": 1.2,  # the operator on a sub-block of leaves or sub-arrays (issue 36)
    "_metric": 1.3,
    "_inverse": 1.4,
    "_spectral": 1.5,  # the estimators, written once (issue 30, item 7)
    "coords": 2,
    "metrics": 2,
    "quotient": 2,
    "reparam": 3,
    "kronecker": 3,  # Kronecker-factored metrics of dense layers, on minigeo.metrics (issue 52)
    "natgrad": 3,
    "curvature": 3,
    "sharpness": 3,
    "operators": 4,
    "densities": 4,
    "assignments": 4.5,  # the checks use floor-4 libraries as references (densities, models)
    "models": 4,
    "__init__": 5,
}

#: Inside a subpackage: the reading order of its submodules (a submodule imports only from earlier ones).
PACKAGE_ORDER: dict[str, dict[str, int]] = {
    "sharpness": {"_spec": 0, "_blocks": 1, "_ascent": 2, "_drivers": 3, "__init__": 4},
    "models": {"vit": 0, "training": 0, "checkpoints": 1, "__init__": 2},
    # one module per assignment, each on the shared machinery in _kit
    "assignments": {
        "_kit": 0,
        "transformation_rules": 1,
        "pullback_metrics": 1,
        "natural_gradient": 1,
        "hessian_endomorphism": 1,
        "laplace_evidence": 1,
        "horizontal_projection": 1,
        "capstone": 1,
        "__init__": 2,
        "_sandbox": 3,  # the grader's sandbox process: above the package it stubs (see PROCESS_MAIN_MODULES)
    },
}

#: Modules that are the main module of their own process (``python -m ...``), not a layer of the library:
#: they may import the package root, at run time.  ``assignments._sandbox`` runs one submission for the
#: grader and imports all of minigeo to block the answer functions before the student's cells run.
PROCESS_MAIN_MODULES = {"minigeo.assignments._sandbox"}

#: Known exceptions to (a), each with its way out.  ``operators`` shares ``top_eigenvalues``'s certified
#: Lanczos with ``curvature`` on branches that predate the block-Lanczos rewrite of issue 31 item 1, which
#: moves it to the private ``_eigen`` module; once merged, nothing uses this entry: delete it.
ALLOWED_PRIVATE_IMPORTS: set = set()


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of minigeo (a package's ``__init__`` as ``pkg.__init__``)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = ("minigeo",) + path.relative_to(PKG).with_suffix("").parts
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """``(absolute module, imported names, line)`` of every ``from minigeo... import`` in a module."""
    package = name.rsplit(".", 1)[0]  # the package a relative import starts from (also for __init__)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "minigeo":
                target = node.module
            else:
                continue
            names = [a.name for a in node.names]
            if node.module is None:  # ``from . import a, b``: the names are modules
                out += [(f"{target}.{n}", [], node.lineno) for n in names]
            else:
                out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "minigeo"]
    return out


def _is_private(module: str) -> bool:
    """A module is private if any part of its dotted name after ``minigeo`` starts with ``_`` (not ``__init__``)."""
    return any(p.startswith("_") and p != "__init__" for p in module.split(".")[1:])


def _resolve(module: str, modules: dict[str, Path]) -> str:
    """The file-level name of an imported module (``minigeo.sharpness`` -> ``minigeo.sharpness.__init__``)."""
    return module if module in modules else f"{module}.__init__"


def _place(module: str) -> tuple[str, str | None]:
    """(top-level unit, submodule inside a subpackage or None)."""
    parts = module.split(".")[1:]
    if parts[0] in PACKAGE_ORDER:
        return parts[0], parts[1] if len(parts) > 1 else "__init__"
    return parts[0], None


def test_every_module_has_a_floor():
    """A new module must be placed in FLOORS (or its package's order) and in the documentation."""
    missing = []
    for name in _modules():
        unit, sub = _place(name)
        if unit not in FLOORS or (sub is not None and sub not in PACKAGE_ORDER[unit]):
            missing.append(name)
    assert not missing, f"place these modules in FLOORS / PACKAGE_ORDER and in book/api/architecture.md: {missing}"


def test_no_private_name_is_imported_from_a_public_module():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for target, names, line in _imports(name, path):
            if _is_private(target):
                continue
            for n in names:
                if n.startswith("_"):
                    if (name, target, n) not in ALLOWED_PRIVATE_IMPORTS:
                        bad.append(f"{path.relative_to(PKG.parent)}:{line}: {n} from public {target}")
    assert not bad, "move these shared internals into a private _-module:\n" + "\n".join(bad)


def test_modules_import_only_from_floors_below():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        unit, sub = _place(name)
        for target, _, line in _imports(name, path):
            t_unit, t_sub = _place(_resolve(target, modules))
            if name in PROCESS_MAIN_MODULES and t_unit == "__init__":
                continue
            if t_unit == unit and sub is not None:  # inside a subpackage: its reading order
                ok = PACKAGE_ORDER[unit][t_sub] < PACKAGE_ORDER[unit][sub]
            else:
                ok = FLOORS[t_unit] < FLOORS[unit]
            if not ok:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {name} imports {target}")
    assert not bad, "imports that do not go down a floor:\n" + "\n".join(bad)


def test_the_checks_are_not_vacuous():
    """The parser resolves relative imports (also from a package's __init__) and tells private modules apart."""
    found = _imports("minigeo.quotient", PKG / "quotient.py")
    assert any(t == "minigeo._pairs" and "_factor_pair" in names for t, names, _ in found)
    found = _imports("minigeo.sharpness.__init__", PKG / "sharpness" / "__init__.py")
    assert any(t == "minigeo.stats" and names == ["kendall_tau"] for t, names, _ in found)
    assert any(t == "minigeo.sharpness._drivers" for t, _, _ in found)
    assert _is_private("minigeo._pairs") and _is_private("minigeo.sharpness._blocks")
    assert not _is_private("minigeo.sharpness") and not _is_private("minigeo.models.vit")


def _calls_to(name: str, first_arg: str | None = None) -> list[str]:
    """Every call ``name(...)`` or ``x.name(...)`` in minigeo's source (whose first argument is the
    name ``first_arg``, if given), as ``path:line``."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if first_arg is not None:
                    args = node.args
                    if not (args and isinstance(args[0], ast.Name) and args[0].id == first_arg):
                        continue
                if called == name:
                    found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    return found


def test_one_compile_boundary_and_no_private_jax():
    """Every module reaches the compiler through ``_compile.compiled`` (issue 53): ``jit_per_callable``
    is applied at exactly one site, in ``_compile.py``, and nothing imports JAX's private ``jax._src``."""
    sites = _calls_to("jit_per_callable")
    assert len(sites) == 1 and sites[0].startswith("minigeo/_compile.py"), sites
    private = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
                private.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not private, private
    # not vacuous: the scan finds the boundary's users, the partials of `compiled` in every module that compiles
    users = {site.split(":")[0] for site in _calls_to("partial", first_arg="compiled")}
    assert {"minigeo/curvature.py", "minigeo/_metric.py", "minigeo/_spectral.py", "minigeo/operators.py"} <= users
