#!/usr/bin/env python
"""Build minigeo's release artefacts and check that they install: the release check (issue 50).

1. ``python -m build`` makes the sdist and, from the unpacked sdist, the wheel (so a file missing from
   the sdist breaks the wheel too), from a copy of the files the build reads (``pyproject.toml``,
   ``README.md``, ``minigeo/``): no build artefacts are left in the repository.
2. ``twine check --strict`` checks both (metadata, the README rendered as the long description).
3. The sdist must hold ``pyproject.toml``, ``README.md`` and every file of the ``minigeo`` package,
   the wheel every module; both are named with the version of ``pyproject.toml``.
4. The wheel is installed into a fresh virtual environment (its dependencies resolved with
   ``requirements.txt`` as constraints, so from pip's cache after ``scripts/setup.sh``), and, run
   from outside the repository, ``import minigeo`` must report that version and every public name
   (``__all__`` of ``minigeo``, ``minigeo.models``, ``minigeo.reparam``, ``minigeo.assignments``)
   must import.

Usage:  python scripts/check_release.py [--outdir DIR]

``--outdir`` keeps the sdist and wheel there (to upload or attach to a release); by default they are
built in a temporary folder and removed.  Needs ``build`` and ``twine`` (pinned in
``requirements.txt``).  ``tests/test_packaging.py`` runs this script in the full test run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md")

IMPORT_EVERYTHING = """
import importlib, sys
import minigeo
from minigeo import assignments, models, reparam

assert "site-packages" in minigeo.__file__, minigeo.__file__
assert minigeo.__version__ == sys.argv[1], (minigeo.__version__, sys.argv[1])
names = [f"minigeo.{n}" for n in minigeo.__all__]
names += [f"minigeo.{m}.{n}" for m, ns in minigeo.IN_NAMESPACE.items() for n in ns]
names += [f"minigeo.models.{n}" for n in models.__all__]
names += [f"minigeo.reparam.{n}" for n in reparam.__all__]
names += [f"minigeo.assignments.{n}" for n in assignments.__all__]
for qual in names:
    module, _, name = qual.rpartition(".")
    getattr(importlib.import_module(module), name)
import jax.numpy as jnp
assert float(minigeo.pair(jnp.ones(2), jnp.ones(2))) == 2.0
print(minigeo.__version__, len(names))
"""


def project_version() -> str:
    """The version in pyproject.toml's [project] table (a regex: tomllib needs Python 3.11)."""
    table = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    return re.search(r'^version\s*=\s*"([^"]+)"', table.group(1), re.M).group(1)


def package_files() -> list[str]:
    """Every file of the minigeo package, relative to the repository (no caches)."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "minigeo").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def require(condition: bool, message: str) -> None:
    if not condition:
        sys.exit(f"release check failed: {message}")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join("<snippet>" if "\n" in str(c) else str(c) for c in cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    output = done.stdout[-3000:] + done.stderr[-3000:]
    require(done.returncode == 0, f"exit status {done.returncode} of {' '.join(map(str, cmd))}\n{output}")
    return done


def build(outdir: Path, work: Path) -> tuple[Path, Path]:
    src = work / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "minigeo", src / "minigeo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run([sys.executable, "-m", "build", "--outdir", str(outdir), str(src)])
    version = project_version()
    sdist, wheels = outdir / f"minigeo-{version}.tar.gz", sorted(outdir.glob(f"minigeo-{version}-*.whl"))
    require(sdist.is_file(), f"no sdist named {sdist.name} in {sorted(p.name for p in outdir.iterdir())}")
    require(
        [w.name for w in wheels] == [f"minigeo-{version}-py3-none-any.whl"],
        f"expected one pure-Python wheel of minigeo {version}, found {[w.name for w in wheels]}",
    )
    return sdist, wheels[0]


def check_contents(sdist: Path, wheel: Path) -> None:
    version, files = project_version(), package_files()
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = [f for f in [*BUILD_INPUTS, *files] if f not in in_sdist]
    require(not missing, f"{sdist.name} lacks {missing}")
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        metadata = whl.read(f"minigeo-{version}.dist-info/METADATA").decode()
    missing = [f for f in files if f.endswith(".py") and f not in in_wheel]
    require(not missing, f"{wheel.name} lacks {missing}")
    require(f"\nVersion: {version}\n" in metadata, f"the wheel's METADATA is not version {version}")
    print(f"contents: {sdist.name} and {wheel.name} hold all {len(files)} files of the package")


def install_and_import(wheel: Path, work: Path) -> str:
    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        + ["-c", str(ROOT / "requirements.txt"), str(wheel)],
        timeout=1200,
    )
    done = run(
        [str(python), "-c", IMPORT_EVERYTHING, project_version()],
        cwd=work,  # not the repository: the installed copy must be the one imported
        timeout=600,
        env={"JAX_PLATFORMS": "cpu", "PATH": str(venv / "bin")},
    )
    version, count = done.stdout.split()
    require(int(count) > 90, f"only {count} public names")
    line = f"installed: the wheel imports as minigeo {version} in a fresh venv, {count} public names"
    print(line)
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outdir", type=Path, help="keep the sdist and the wheel in this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="minigeo-release-") as tmp:
        work = Path(tmp)
        outdir = args.outdir.resolve() if args.outdir else work / "dist"
        outdir.mkdir(parents=True, exist_ok=True)
        sdist, wheel = build(outdir, work)
        run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)])
        print(f"twine check: {sdist.name} and {wheel.name} pass")
        check_contents(sdist, wheel)
        install_and_import(wheel, work)
    print(f"release check: minigeo {project_version()} passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
