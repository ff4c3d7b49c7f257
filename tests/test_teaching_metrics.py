"""The teaching standard (book/STYLE.md): the measuring script's counting rules, and the
chapters listed as meeting the standard still meet it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "teaching_metrics", ROOT / "scripts" / "teaching_metrics.py"
)
tm = importlib.util.module_from_spec(_spec)
sys.modules["teaching_metrics"] = tm  # dataclasses look the module up
_spec.loader.exec_module(tm)


def _code(source, tags=(), outputs=()):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = list(tags)
    cell.outputs = [nbformat.from_dict(o) for o in outputs]
    return cell


def _stream(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


_IMAGE = {
    "output_type": "display_data",
    "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure size 640x480 with 1 Axes>"},
    "metadata": {},
}


def _notebook():
    md = nbformat.v4.new_markdown_cell
    cells = [
        md(
            "# 9. A chapter\n\n**Learning objectives.** After this chapter you can add.\n\n"
            "```{note}\n:class: dropdown\nOne two three.\n```"
        ),  # 1 heading + 1 number + 11 + 3 = ... counted below
        _code("x = 1\n\ny = 2\n", outputs=[_stream("x is 1\nno digits here\n")]),
        md("Formula $a + b = c$ inline, and display\n\n$$\nx = y\n$$\n\n```python\nz = 3\n```"),
        _code("plot()\n" * 30, tags=["hide-input"], outputs=[_IMAGE, _stream("7 lines\n")]),
        md("After the figure: {ref}`the first exercise <ch9-ex>` and [a link](http://x.y)."),
        _code("\n".join(["a = 0"] * 12), tags=["remove-output"], outputs=[_stream("1\n2\n")]),
        md("## Exercises\n\nMany words here that are not main text."),
        _code("q = 1\n" * 40, outputs=[_stream("1\n2\n3\n")]),
        md("## Summary\n\nDone."),
    ]
    return nbformat.v4.new_notebook(cells=cells)


def test_prose_rules():
    # inline math is one word; display math, code blocks and directive options are dropped
    assert tm.count_words("Formula $a + b = c$ inline") == 3
    assert tm.count_words("$$\nx = y + z\n$$\n\nword") == 1
    assert tm.count_words("```python\nz = 3 + 4\n```\nword") == 1
    assert tm.count_words("```{note}\n:class: dropdown\nOne two three.\n```") == 3
    assert tm.count_words("{ref}`the first exercise <ch9-ex>` and [a link](http://x.y)") == 6
    assert tm.count_words("| a | b |\n| --- | --- |\n| c | d |") == 4
    assert tm.count_words("<!-- hidden note -->shown") == 1


def test_counting_rules_on_a_synthetic_notebook():
    nb = json.loads(nbformat.writes(_notebook()))
    m = tm.measure(nb, "ch9")
    assert m.main_cells == 6  # the exercises and what follows are not main text
    # "# 9. A chapter" is 3 words ("#" is none), the objectives line 8, the note 3
    assert tm.count_words(tm.source(nb["cells"][0])) == 3 + 8 + 3
    words = [tm.count_words(tm.source(c)) for c in nb["cells"][:6] if c["cell_type"] == "markdown"]
    assert m.words == sum(words)
    # visible code: the first cell (2 non-blank lines) and the remove-output one (12 lines)
    assert m.code_lines == 2 + 12
    assert (m.largest_code_cell, m.largest_code_cell_index) == (12, 5)
    # numeric lines: "x is 1" and "7 lines" (a hide-input cell's output is shown);
    # the remove-output cell's output is not shown and the exercise's is not main text
    assert m.numeric_lines == 2
    assert m.figures == 1
    assert m.stretch_words == max(words[0] + words[1], words[2])
    assert m.stretch_numeric == 2  # "x is 1" before the figure, "7 lines" in it
    assert m.objectives_first and m.summary_last
    assert m.misses == []


def test_the_check_reports_each_target():
    nb = _notebook()
    nb.cells[0].source = "# 9. No objectives\n\n" + "word " * 800
    nb.cells[1].outputs = [nbformat.from_dict(_stream("1\n" * 31))]
    nb.cells[1].source = "a = 1\n" * 26
    nb.cells[-1].source = "## Recap"
    nb.cells.insert(2, nbformat.v4.new_markdown_cell("## Going further\n\nOptional reading."))
    m = tm.measure(json.loads(nbformat.writes(nb)), "ch9")
    text = "; ".join(m.misses)
    for phrase in ("without a figure", "printed lines", "has 26 lines", "objectives", "summary", "Going further"):
        assert phrase in text, (phrase, text)
    nb.cells[0].source = "**Learning objectives.**\n\n" + "word " * 3100
    nb.cells.insert(1, _code("plot()", outputs=[_IMAGE]))
    m = tm.measure(json.loads(nbformat.writes(nb)), "ch9")
    assert any("words of prose" in s for s in m.misses)


@pytest.mark.parametrize("prefix", tm.CHAPTERS_AT_STANDARD)
def test_chapters_at_standard_meet_the_targets(prefix):
    (path,) = sorted((ROOT / "book").glob(f"{prefix}_*.ipynb"))
    m = tm.measure(json.loads(path.read_text()), path.stem)
    assert m.misses == [], f"{path.name} misses the teaching standard: {m.misses}"


def test_the_script_runs_on_every_chapter(capsys):
    status = tm.main([])
    out = capsys.readouterr().out
    assert "| words of prose |" in out and "ch1" in out
    assert status == 0  # no --check: the table only
    assert tm.main(["--check"]) == 0, capsys.readouterr().out


def test_reading_time_line(tmp_path):
    nb = json.loads(nbformat.writes(_notebook()))
    m = tm.measure(nb, "ch9")
    assert tm.reading_time_misses(m)[0].startswith("no reading-time line")
    nb["metadata"][tm.RECORD_KEY] = {"execution_seconds": 64.2}
    path = tmp_path / "09_a_chapter.ipynb"
    path.write_text(json.dumps(nb))
    line = tm.write_reading_time(path)
    assert f"for the {m.words:,} words" in line and "about 60 s" in line
    written = json.loads(path.read_text())
    first = tm.source(written["cells"][0])
    assert first.startswith("# 9. A chapter\n\n*Reading time:") and "**Learning objectives.**" in first
    m2 = tm.measure(written, "09_a_chapter")
    assert m2.words == m.words  # the line itself is not prose
    assert tm.reading_time_misses(m2) == []
    assert tm.write_reading_time(path) == line  # rewriting replaces, not adds
    assert tm.source(json.loads(path.read_text())["cells"][0]).count("Reading time") == 1
    # a run recorded later, far from the stated one, or changed prose, is reported
    written["metadata"][tm.RECORD_KEY]["execution_seconds"] = 200.0
    assert "recorded run took 200 s" in tm.reading_time_misses(tm.measure(written, "x"))[0]
    written["cells"][2]["source"] = "More words than before, many more."
    assert "words" in tm.reading_time_misses(tm.measure(written, "x"))[0]


def test_notation_gives_every_symbol_one_meaning():
    # book/notation.md promises one meaning per symbol: no symbol (the `$...$` pieces of a row's first
    # column) names two rows, and no row gives its symbol a second meaning "with an argument" or "also"
    import re

    rows = [ln for ln in (ROOT / "book" / "notation.md").read_text().splitlines() if ln.startswith("| $")]
    seen = {}
    for row in rows:
        first, meaning = row.split(" | ")[0][2:], row.split(" | ")[1]
        for symbol in re.findall(r"\$([^$]+)\$", first):
            assert symbol not in seen, f"{symbol} names two rows: {seen[symbol]!r} and {row!r}"
            seen[symbol] = row
        assert "with an argument is" not in meaning, row
    # the damping and the Dirac delta have their own symbols, apart from eigenvalues and steps
    assert {r"\epsilon", r"\lambda_i", r"\delta", r"\delta_{\mathrm D}"} <= set(seen), sorted(seen)
