"""Test configuration: float64 everywhere for exactness checks, and the quick lane's `slow` marks.

``jax_enable_x64`` must be set before any array is created, hence at import
time of the conftest (pytest imports it before the test modules).
"""

from pathlib import Path

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

# The single tests (or whole modules) measured over the quick lane's threshold in a full run:
# written by ``python scripts/slow_tests.py LOG`` from the ``--durations`` list that
# ``scripts/test.sh`` prints, one pytest node id (or id prefix: a file, a test without its
# parameters) per line.
SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def slow_entries(path: Path = SLOW_LIST) -> set[str]:
    if not path.exists():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def is_listed(nodeid: str, entries: set[str]) -> bool:
    """``nodeid`` or one of its prefixes ending at a ``::`` or ``[`` boundary is in ``entries``."""
    if nodeid in entries:
        return True
    for i, ch in enumerate(nodeid):
        if (ch == "[" or nodeid.startswith("::", i)) and nodeid[:i] in entries:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    import pytest

    entries = slow_entries()
    for item in items:
        if item.path.name in _SLOW_MODULES or is_listed(item.nodeid, entries):
            item.add_marker(pytest.mark.slow)
