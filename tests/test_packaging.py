"""``pip install .`` into a fresh virtual environment gives a working minigeo with every public name.

The package is built from a copy of the files the build uses (pyproject.toml, README.md and the
``minigeo`` package), so the test also catches a subpackage or module missing from the wheel and
leaves no build artefacts in the repository.  Dependencies are resolved with requirements.txt as
constraints: the versions the rest of the test suite uses, served from pip's cache.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]

IMPORT_EVERYTHING = """
import importlib, inspect, pathlib, sys
import minigeo
from minigeo import assignments, models, reparam

assert "site-packages" in minigeo.__file__, minigeo.__file__
assert minigeo.__version__ == sys.argv[1], (minigeo.__version__, sys.argv[1])
names = [f"minigeo.{n}" for n in minigeo.__all__]
names += [f"minigeo.models.{n}" for n in models.__all__]
names += [f"minigeo.reparam.{n}" for n in reparam.__all__]
names += [f"minigeo.assignments.{n}" for n in assignments.__all__]
for qual in names:
    module, _, name = qual.rpartition(".")
    getattr(importlib.import_module(module), name)
import jax.numpy as jnp
print(len(names), float(minigeo.pair(jnp.ones(2), jnp.ones(2))))
"""


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_imports_every_public_name(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "minigeo", src / "minigeo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        + ["-c", str(ROOT / "requirements.txt"), str(src)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    run = subprocess.run(
        [str(python), "-c", IMPORT_EVERYTHING, version],
        cwd=tmp_path,  # not the repository: the installed copy must be the one imported
        capture_output=True,
        text=True,
        timeout=600,
        env={"JAX_PLATFORMS": "cpu", "PATH": str(venv / "bin")},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    count, value = run.stdout.split()
    assert int(count) > 90 and float(value) == 2.0
