"""Test configuration: float64 everywhere for exactness checks.

``jax_enable_x64`` must be set before any array is created, hence at import
time of the conftest (pytest imports it before the test modules).
"""

import jax

jax.config.update("jax_enable_x64", True)


# Modules whose tests execute notebooks, install packages, load torch or build ViT-B/32-sized
# models: the quick lane (``bash scripts/test.sh --quick``) leaves them out; CI runs everything.
_SLOW_MODULES = {
    "test_book.py",
    "test_assignments.py",
    "test_packaging.py",
    "test_vit_timm_parity.py",
    "test_vit_open_clip_parity.py",
    "test_vit.py",
    "test_api_docs.py",
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.name in _SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
