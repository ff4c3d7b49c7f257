"""The top level of minigeo (issue 53): the names the chapters teach with, and namespaces for the rest.

The GL(h) quotient geometry, the statistics, data parallelism, the exact diagonals, the special
metrics and the result types are reached through their module (``mg.quotient.gl_metric``,
``mg.curvature.Eigenpairs``); their 0.3.0 top-level names keep working with a DeprecationWarning that
names the new place, until 0.5.0.
"""

from __future__ import annotations

import inspect
import warnings

import pytest

import minigeo as mg

MOVED = sorted(mg._MOVED)


def top_level_names() -> list[str]:
    """The functions, types and constants of ``mg.__all__`` (not its namespaces, not ``__version__``)."""
    return [n for n in mg.__all__ if not n.startswith("__") and not inspect.ismodule(getattr(mg, n))]


def test_at_most_sixty_top_level_names():
    names = top_level_names()
    assert len(names) <= 60, f"{len(names)} top-level names: {names}"
    assert len(set(mg.__all__)) == len(mg.__all__), "a name is listed twice"


def test_every_namespaced_name_is_public_in_its_module_and_absent_from_the_top_level():
    for module, names in mg.IN_NAMESPACE.items():
        namespace = getattr(mg, module)
        assert module in mg.__all__, f"the namespace {module} is not in mg.__all__"
        for name in names:
            assert name in namespace.__all__, f"{module}.{name} is not in its module's __all__"
            assert name not in mg.__all__, f"{name} is both in mg.__all__ and in mg.{module}"
            assert name not in vars(mg), f"mg.{name} is bound without the deprecation warning"


def test_star_import_brings_no_moved_name():
    scope: dict = {}
    exec("from minigeo import *", scope)
    assert not set(MOVED) & set(scope), sorted(set(MOVED) & set(scope))
    assert {"ggn", "top_eigenvalues", "quotient", "stats"} <= set(scope)


@pytest.mark.parametrize("old", MOVED)
def test_old_name_warns_with_its_new_place_and_is_the_same_object(old):
    module, attr = mg._MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"minigeo\.{old} is minigeo\.{module}\.{attr}.*0\.5\.0"):
        obj = getattr(mg, old)
    assert obj is getattr(getattr(mg, module), attr)


def test_old_name_through_from_import_warns_and_resolves():
    with pytest.warns(DeprecationWarning, match="minigeo.quotient.gl_metric"):
        from minigeo import gl_metric
    assert gl_metric is mg.quotient.gl_metric
    with pytest.warns(DeprecationWarning, match="minigeo.metrics.dense"):
        from minigeo import dense_metric
    assert dense_metric is mg.metrics.dense


def test_unknown_name_is_an_attribute_error_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'gl2_metric'"):
            mg.gl2_metric  # noqa: B018
        assert not hasattr(mg, "not_a_name")
