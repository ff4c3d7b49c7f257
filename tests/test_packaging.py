"""The release check (``scripts/check_release.py``): wheel and sdist built, checked and installed.

``python -m build`` makes the sdist and, from it, the wheel, from a copy of the files the build uses
(pyproject.toml, README.md and the ``minigeo`` package), so the test also catches a subpackage or
module missing from the sdist or the wheel and leaves no build artefacts in the repository;
``twine check --strict`` checks both; the wheel is installed into a fresh virtual environment and
must import, from outside the repository, as the version of pyproject.toml with every public name.
Dependencies are resolved with requirements.txt as constraints: the versions the rest of the test
suite uses, served from pip's cache.  This is the only place the test run builds and installs
minigeo (it replaced a plain ``pip install .`` into a fresh venv, issue 50).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_release_check_builds_the_sdist_and_wheel_and_the_wheel_imports_in_a_fresh_venv(tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    dist = tmp_path / "dist"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_release.py"), "--outdir", str(dist)],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in dist.iterdir()) == [
        f"minigeo-{version}-py3-none-any.whl",
        f"minigeo-{version}.tar.gz",
    ]
    assert "twine check: " in run.stdout and " pass\n" in run.stdout, run.stdout
    assert f"the wheel imports as minigeo {version} in a fresh venv" in run.stdout, run.stdout
    assert run.stdout.rstrip().endswith(f"release check: minigeo {version} passed"), run.stdout

