"""Structural checks of the book: every chapter is in the TOC, executed, tagged, and installs on Colab."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
# numbered chapters carry the full chapter contract (size knob, exercises, >= 3 checked cells);
# reference pages such as the cheat sheet are notebooks too, with at least one checked cell
CHAPTERS = [nb for nb in NOTEBOOKS if re.match(r"\d\d_", nb.name)]


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc["parts"]:
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


def repository_url() -> str:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return meta["project"]["urls"]["Homepage"]


def code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_there_are_chapters():
    assert NOTEBOOKS, "book/ has no chapter notebooks"


def test_every_toc_entry_exists_and_every_notebook_is_listed():
    listed = toc_files()
    for entry in listed:
        assert any((ROOT / f"{entry}{ext}").exists() for ext in (".md", ".ipynb")), (
            f"{entry} is in _toc.yml but missing"
        )
    for nb in NOTEBOOKS:
        assert f"book/{nb.stem}" in listed, f"{nb.name} is not in _toc.yml"


def test_config_points_at_the_same_repository():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["repository"]["url"] == repository_url()
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_installs_minigeo_on_colab_only(nb):
    # the release this book was tested with: the tag of pyproject.toml's version (README, "Releases")
    first = "".join(code_cells(nb)[0]["source"])
    assert '"google.colab" in sys.modules' in first
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    urls = re.findall(r"git\+(\S+?)\"", first)
    pinned = f"{repository_url()}@v{version}"
    assert urls == [pinned], f"{nb.name}: Colab install must use {pinned}, found {urls}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_executed_tagged_and_clean(nb):
    cells = code_cells(nb)
    unexecuted = [
        i for i, c in enumerate(cells) if "".join(c["source"]).strip() and c.get("execution_count") is None
    ]
    assert not unexecuted, (
        f"{nb.name}: code cells {unexecuted} have no saved outputs; run `jupyter execute --inplace`"
    )
    errors = [o for c in cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{nb.name}: saved outputs contain errors"
    checked = [c for c in cells if "nbval-check-output" in c.get("metadata", {}).get("tags", [])]
    needed = 3 if nb in CHAPTERS else 1
    assert len(checked) >= needed, f"{nb.name}: tag the cells printing key numbers with nbval-check-output"
    for c in checked:
        # printed text, or a displayed Markdown table (nbval compares its text/markdown source)
        assert any(
            o["output_type"] == "stream" or "text/markdown" in o.get("data", {}) for o in c["outputs"]
        ), f"{nb.name}: a checked cell prints nothing"
    stderr = [o for c in checked for o in c["outputs"] if o.get("name") == "stderr"]
    assert not stderr, f"{nb.name}: checked cells write to stderr (warnings make nbval flaky)"


def test_chapters_are_numbered_and_include_the_cheat_sheet():
    assert len(CHAPTERS) >= 7
    assert ROOT / "book" / "cheatsheet.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.name)
def test_notebook_has_size_knob_and_exercises(nb):
    text = nb.read_text()
    assert 'SIZE = \\"cpu\\"' in text, f'{nb.name}: needs the SIZE = "cpu" knob next to the setup cell'
    assert "## Exercises" in text


EXERCISE = re.compile(r"```\{exercise-start\}[^\n]*\n:label: (\S+)")
SOLUTION = re.compile(r"```\{solution-start\} (\S+)\n((?::\w+:[^\n]*\n)*)```")


def markdown_sources(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.name)
def test_exercises_use_sphinx_exercise_with_collapsed_solutions(nb):
    """Every chapter has >= 2 labelled exercises (sphinx-exercise), each with a solution that is a
    collapsed dropdown and contains at least one code cell; no solution relies on hide-input (which
    would still show the printed answer)."""
    cells = json.loads(nb.read_text())["cells"]
    markdown = "\n".join(markdown_sources(nb))
    exercises = EXERCISE.findall(markdown)
    assert len(exercises) >= 2, f"{nb.name}: needs at least two sphinx-exercise exercises"
    assert all(label.startswith(f"ch{int(nb.name[:2])}-ex-") for label in exercises), exercises
    solutions = {label: options for label, options in SOLUTION.findall(markdown)}
    for label in exercises:
        assert label in solutions, f"{nb.name}: exercise {label} has no solution"
        assert ":class: dropdown" in solutions[label], f"{nb.name}: solution to {label} is not collapsed"
    # gated directives balance, and every solution holds a code cell that runs on minigeo
    depth, code_in_solution, n_solutions = 0, 0, 0
    for c in cells:
        src = "".join(c["source"])
        if c["cell_type"] == "markdown":
            opens, closes = src.count("{solution-start}"), src.count("{solution-end}")
            if closes:
                assert depth == 1, f"{nb.name}: unbalanced solution-start/solution-end"
                assert code_in_solution, f"{nb.name}: a solution has no code cell"
                depth -= closes
            if opens:
                assert depth == 0, f"{nb.name}: nested solution-start"
                depth, code_in_solution, n_solutions = depth + opens, 0, n_solutions + 1
        elif depth:
            code_in_solution += 1
            assert "hide-input" not in c.get("metadata", {}).get("tags", []), (
                f"{nb.name}: solution cells are collapsed by the dropdown; drop hide-input"
            )
    assert depth == 0, f"{nb.name}: a solution-start is never closed"
    assert n_solutions == len(solutions), f"{nb.name}: duplicate solution labels"


def test_exercise_labels_are_unique_book_wide():
    labels = [lab for nb in CHAPTERS for lab in EXERCISE.findall("\n".join(markdown_sources(nb)))]
    assert len(labels) == len(set(labels)), "duplicate exercise labels across chapters"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_uses_only_public_minigeo_names(nb):
    import minigeo

    public = set(minigeo.__all__)
    source = "\n".join("".join(c["source"]) for c in code_cells(nb))
    used = set(re.findall(r"\bmg\.([A-Za-z_]\w*)", source))
    assert used <= public, f"{nb.name}: uses non-public names {sorted(used - public)}"
    # a namespace's names: its module's public names (mg.quotient.gl_metric, mg.curvature.Eigenpairs)
    for module, name in re.findall(r"\bmg\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)", source):
        namespace = getattr(minigeo, module)
        if inspect.ismodule(namespace) and module not in ("models", "assignments", "reparam"):
            assert name in namespace.__all__, f"{nb.name}: mg.{module}.{name} is not public"
    assert not re.search(r"minigeo\._", source), f"{nb.name}: imports a private minigeo module"


def test_cite_page_names_every_chapter_and_status_page_is_listed():
    cite = (ROOT / "book" / "cite.md").read_text()
    for nb in CHAPTERS:
        heading = json.loads(nb.read_text())["cells"][0]["source"][0].lstrip("# ").strip()
        title = re.sub(r"^\d+\.\s*", "", heading).lower()
        assert re.search(rf"\| {int(nb.name[:2])} \| {re.escape(title)} \|", cite.lower()), (
            f"cite.md has no BibTeX title row for {nb.name} ({title!r})"
        )
    assert "book/status" in toc_files() and "{nb-exec-table}" in (ROOT / "book" / "status.md").read_text()


INTERACTIVE_CHAPTERS = [nb for nb in CHAPTERS if int(nb.name[:2]) <= 5]


@pytest.mark.parametrize("nb", INTERACTIVE_CHAPTERS, ids=lambda p: p.name)
def test_chapter_has_a_guarded_interactive_figure(nb):
    """Chapters 1-5 each have a slider figure (ipywidgets.interact, recomputing with minigeo) that
    batch execution skips: MINIGEO_BOOK_BATCH=1 (set by the build and CI) prints a note instead,
    because interact can deadlock a non-interactive notebook client (jupyter/nbclient#312)."""
    cells = [c for c in code_cells(nb) if "widgets.interact(" in "".join(c["source"])]
    assert cells, f"{nb.name}: no interactive figure"
    for c in cells:
        src = "".join(c["source"])
        assert 'os.environ.get("MINIGEO_BOOK_BATCH")' in src, f"{nb.name}: interact is not guarded"
        assert "mg." in src or "def " in src, f"{nb.name}: the callback should recompute"
        assert "nbval-ignore-output" in c.get("metadata", {}).get("tags", [])


def test_build_and_tests_run_notebooks_in_batch_mode():
    for script in ("build_book.sh", "test.sh"):
        assert "MINIGEO_BOOK_BATCH=1" in (ROOT / "scripts" / script).read_text()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_cell_ids_are_unique(nb):
    ids = [c.get("id") for c in json.loads(nb.read_text())["cells"]]
    assert len(ids) == len(set(ids)), f"{nb.name}: duplicate cell ids (nbformat renames them on read)"


# The rendered column of a code cell (scripts/check_rendered_book.py measures it in a browser):
# 96 characters of the theme's code font in the main text, fewer inside an exercise or solution
# box and in a collapsed (hide-input) cell, which the check opens (their borders and padding):
# in a box a line of 89 characters scrolled sideways and one of 87 did not; in a collapsed cell
# 95 scrolled and 93 did not (fresh-clone rehearsals of 2026-11-29).
CODE_COLUMNS = {"main text": 96, "collapsed cell": 93, "exercise or solution box": 87}


def code_lines_by_place(path: Path) -> dict[str, list[str]]:
    """Every code cell's lines, by where the cell renders: an exercise/solution box, a collapsed cell, or the main text."""
    place, out = "main text", {k: [] for k in CODE_COLUMNS}
    for cell in json.loads(path.read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            for m in re.finditer(r"\{(exercise|solution)-(start|end)\}", src):
                place = "exercise or solution box" if m.group(2) == "start" else "main text"
        elif place == "main text" and "hide-input" in cell.get("metadata", {}).get("tags", []):
            out["collapsed cell"] += src.split("\n")
        else:
            out[place] += src.split("\n")
    return out


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_code_lines_fit_the_rendered_column(nb):
    too_long = [
        f"{place} ({len(line)} > {CODE_COLUMNS[place]}): {line.strip()[:60]}"
        for place, lines in code_lines_by_place(nb).items()
        for line in lines
        if len(line) > CODE_COLUMNS[place]
    ]
    assert not too_long, too_long
