"""Test configuration: float64 everywhere for exactness checks, and the quick lane's `slow` marks.

``jax_enable_x64`` must be set before any array is created, hence at import
time of the conftest (pytest imports it before the test modules).
"""

import os
from pathlib import Path

import jax
import pytest

import minigeo  # noqa: F401  (before the backend starts: its XLA flag against jaxlib 0.10.2's CPU miscompilation)

jax.config.update("jax_enable_x64", True)

# On a GPU, float32 matrix products default to TF32 (about three digits); the float32 tolerances
# here are scaled by float32's eps, so the tests check the algorithms at "highest" precision there
# unless JAX_DEFAULT_MATMUL_PRECISION says otherwise. On an H200 (jax 0.11.2) the spectral and
# Krylov modules passed 99 of 99 at "highest" and failed 12 float32 cases in TF32
# (benchmarks/gpu_spectral/README.md). CPUs are unaffected.
if "JAX_DEFAULT_MATMUL_PRECISION" not in os.environ and jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """After each test module, drop every compiled XLA program (``jax.clear_caches``).

    The unit tests and the notebooks run in one pytest process (two xdist workers, whole files
    per worker; ``scripts/test.sh``), so one worker runs dozens of modules. Without this, a worker
    keeps every executable the modules before compiled; a long process once ended in a segmentation
    fault inside XLA's CPU compiler, and the unit tests ran in two processes for it. A module's own
    tests still share their compilations (the compile tests count within one test).
    """
    yield
    jax.clear_caches()


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
