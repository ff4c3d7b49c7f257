"""Releases (issue 50): one version, in pyproject.toml, and everything that installs minigeo pins it.

A release X.Y.Z is tagged ``vX.Y.Z`` (README, "Releases").  The Colab cell of every assignment, the
README's install line and the lecturers' guide install that tag, the guide with main as the
fallback; the guide's list of dependencies is the one of pyproject.toml; the citation names the
version; CHANGELOG.md dates the version's section.  (The chapters' and the cheat sheet's Colab cells
are checked in tests/test_book.py; the sdist and wheel in tests/test_packaging.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]
URL = PROJECT["urls"]["Homepage"]
PINNED = f"minigeo @ git+{URL}@v{VERSION}"
ASSIGNMENTS = sorted((ROOT / "assignments").glob("*.ipynb")) + sorted(
    (ROOT / "assignments" / "solutions").glob("*.ipynb")
)


def test_version_is_read_from_pyproject_in_a_source_checkout():
    # minigeo.__version__ has one source, pyproject.toml: from a checkout the file itself is read, so a
    # version bump shows before the editable install's metadata is rebuilt
    import minigeo

    assert Path(minigeo.__file__).resolve().parent == ROOT / "minigeo"
    assert minigeo.__version__ == VERSION
    assert f'"{VERSION}"' not in (ROOT / "minigeo" / "__init__.py").read_text()  # not written twice


def test_changelog_dates_the_release():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(VERSION)}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M), (
        f"CHANGELOG.md needs a section '## [{VERSION}] - YYYY-MM-DD'"
    )
    assert changelog.index("## [Unreleased]") < changelog.index(f"## [{VERSION}]")


@pytest.mark.parametrize("nb", ASSIGNMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_assignment_colab_cell_installs_the_release(nb):
    cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    first = "".join(cells[0]["source"])
    assert '"google.colab" in sys.modules' in first
    assert re.findall(r'"(minigeo @ [^"]+)"', first) == [PINNED], first


def test_readme_installs_the_release_and_documents_the_tags():
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r'pip install "(minigeo @ [^"]+)"', readme)
    assert installs == [PINNED], installs
    assert set(re.findall(r"\bv(\d+\.\d+\.\d+)\b", readme)) == {VERSION}  # no other release named
    assert "## Releases" in readme and "vX.Y.Z" in readme


def test_lecturers_guide_installs_the_release_with_main_as_the_fallback():
    guide = (ROOT / "book" / "lecturers.md").read_text()
    # the install block names the repository once (REPO=...), so that its lines fit the book's column
    assert f"REPO={URL}\n" in guide
    installs = re.findall(r'"(minigeo @ [^"]+)"', guide.replace("$REPO", URL))
    assert installs == [PINNED], installs
    assert set(re.findall(r"\bv(\d+\.\d+\.\d+)\b", guide)) == {VERSION}  # no other release named
    assert "**Fallback:**" in guide and f"without `@v{VERSION}`" in guide
    assert f"blob/v{VERSION}/assignments/" in guide  # the Colab link opens the release's notebook
    assert not re.search(r"`pip install minigeo`(?! finds nothing)", guide), "minigeo is on no package index"


def test_lecturers_guide_lists_the_dependencies_of_pyproject():
    guide = (ROOT / "book" / "lecturers.md").read_text()
    paragraph = re.search(r"minigeo's dependencies, as `pyproject.toml` lists them:(.*?)\n\n", guide, re.S)
    assert paragraph, "book/lecturers.md lost the sentence that lists minigeo's dependencies"
    listed = re.findall(r"`([^`]+)`", paragraph.group(1))
    listed = [item for item in listed if re.match(r"[A-Za-z0-9_.-]+\s*[<>=!~]", item)]
    expected = ", ".join(f"`{d}`" for d in PROJECT["dependencies"])
    assert sorted(listed) == sorted(PROJECT["dependencies"]), f"the guide must list exactly {expected}"


def test_citation_names_the_version():
    assert f"executed against minigeo {VERSION}" in (ROOT / "book" / "cite.md").read_text()
