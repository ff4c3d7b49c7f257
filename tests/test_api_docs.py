"""The API reference covers every public name, and every public docstring has what the book promises.

Promise (book/api/index.md): each public name documents its formula, the paper/equation it
implements (or says it implements none), the chapter that teaches it, and a short executed example.
The examples themselves run in the doctest step of the test command.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import tomllib

import minigeo as mg
import minigeo.assignments as assignments
import minigeo.models as mm
import minigeo.reparam as reparam

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "book" / "api"
SOURCES = (
    "Kristiadi",
    "van Oostrum",
    "Grosse",
    "da Silva",
    "Andriushchenko",
    "No formula from the source papers",
)


def public_objects() -> dict[str, object]:
    objs = {}
    for name in mg.__all__:
        obj = getattr(mg, name)
        if inspect.ismodule(obj) or name == "__version__":
            continue
        objs[f"minigeo.{name}"] = obj
    for module, names in mg.IN_NAMESPACE.items():  # reached as mg.<module>.<name> only (issue 53)
        for name in names:
            objs[f"minigeo.{module}.{name}"] = getattr(getattr(mg, module), name)
    for mod in (mm, reparam, assignments):
        for name in mod.__all__:
            objs[f"{mod.__name__}.{name}"] = getattr(mod, name)
    return objs


def documented_names() -> set[str]:
    names = set()
    for page in API.glob("*.md"):
        module = "minigeo"
        for line in page.read_text().splitlines():
            m = re.match(r"\.\. currentmodule:: (\S+)", line)
            if m:
                module = m.group(1)
            m = re.match(r"\.\. (?:auto(?:function|class|exception|data)|py:data):: (\S+)", line)
            if m:
                target = m.group(1)
                names.add(target if target.startswith("minigeo.") else f"{module}.{target}")
    return names


def test_every_public_name_is_in_the_api_reference():
    documented = documented_names()
    missing = [qual for qual in public_objects() if qual not in documented]
    assert not missing, f"add these to book/api/*.md: {missing}"


def test_every_api_page_is_in_the_toc():
    toc = (ROOT / "_toc.yml").read_text()
    for page in API.glob("*.md"):
        assert f"book/api/{page.stem}" in toc, f"{page.name} is not in _toc.yml"


@pytest.mark.parametrize("qual", sorted(q for q, o in public_objects().items() if q not in ()))
def test_docstring_has_source_chapter_and_example(qual):
    doc = inspect.getdoc(public_objects()[qual]) or ""
    assert doc.strip(), f"{qual} has no docstring"
    sections = re.split(r"\n(\w[\w ]*)\n-{3,}\n", "\n" + doc)
    named = dict(zip(sections[1::2], sections[2::2]))
    refs = named.get("References", "")
    assert any(s in refs for s in SOURCES), f"{qual}: References must name the source (or say there is none)"
    assert re.search(r"[Cc]hapters?\s+\d|every\s+chapter", refs), f"{qual}: References must name the chapter"
    assert ">>>" in named.get("Examples", ""), f"{qual}: needs an Examples section with a doctest"


def test_version_is_consistent():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert mg.__version__ == meta["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]?", changelog, re.M)
    assert released and released[0] == mg.__version__, (
        "CHANGELOG.md's newest release must be minigeo.__version__"
    )
