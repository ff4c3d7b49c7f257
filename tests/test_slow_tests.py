"""The quick lane's list of slow tests: how it is written (scripts/slow_tests.py) and read (conftest)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tests_conftest = load(ROOT / "tests" / "conftest.py", "tests_conftest_for_slow_list")
slow_tests = load(ROOT / "scripts" / "slow_tests.py", "slow_tests_script")

LOG = """
============================= slowest durations ==============================
12.50s call     tests/test_a.py::test_big[float32]
1.20s setup    tests/test_a.py::test_small
1.10s call     tests/test_a.py::test_small
1.40s call     tests/test_b.py::TestX::test_y
0.90s teardown tests/test_b.py::TestX::test_y
(1500 durations < 1s hidden.  Use -vv to show these durations.)
12.00s call     book/01_x.ipynb::Cell 3
"""


def test_phases_of_one_test_add_up_and_only_tests_over_the_threshold_are_listed():
    assert slow_tests.slow_ids(LOG, threshold=2.0) == [
        "tests/test_a.py::test_big[float32]", "tests/test_a.py::test_small", "tests/test_b.py::TestX::test_y"]
    assert slow_tests.slow_ids(LOG, threshold=2.35) == ["tests/test_a.py::test_big[float32]"]


def test_an_entry_marks_the_test_its_cases_or_its_module():
    is_listed = tests_conftest.is_listed
    entries = {"tests/test_a.py::test_big[float32]", "tests/test_b.py", "tests/test_c.py::test_p"}
    assert is_listed("tests/test_a.py::test_big[float32]", entries)
    assert not is_listed("tests/test_a.py::test_big[float64]", entries)
    assert not is_listed("tests/test_a.py::test_bigger", entries)
    assert is_listed("tests/test_b.py::TestX::test_y", entries)
    assert is_listed("tests/test_c.py::test_p[1-2]", entries)
    assert not is_listed("tests/test_c.py::test_pq", entries)
    assert not is_listed("tests/test_bc.py::test_z", entries)


def test_every_listed_test_file_exists():
    for entry in tests_conftest.slow_entries():
        assert (ROOT / entry.split("::", 1)[0].split("[", 1)[0]).exists(), entry
