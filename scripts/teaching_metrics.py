"""Measure the chapters against the book's teaching standard (book/STYLE.md).

Prints one table, a column per chapter notebook (``book/0N_*.ipynb``), measured on the
executed notebooks over the **main text**: every cell before the first exercise (the first
markdown cell whose heading is ``Exercises`` or that opens an ``{exercise-start}``
directive).  The rows and their counting rules:

words of prose
    Words in markdown cells.  Removed before counting: fenced code blocks (```` ``` ````
    without a ``{directive}``), display math (``$$ ... $$`` and ``\\begin{..} ... \\end{..}``),
    directive fence lines (```` ```{note} ````, ``:::``) and their option lines
    (``:label: x``), HTML comments, table separator rows and the targets of links and roles
    (``{ref}`text <target>``` keeps ``text``).  An inline formula ``$...$`` counts as one
    word.  A word is a run of characters containing a letter or a digit; headings count.
visible code lines
    Non-blank source lines of code cells not tagged ``hide-input``, ``remove-input`` or
    ``remove-cell``.
printed lines with numbers
    Lines of ``stream`` and text-only (``text/plain`` with no image next to it) outputs that
    contain a digit, in cells whose output is shown (not ``remove-output``/``remove-cell``;
    a ``hide-input`` cell's output is shown, so it counts).
figures
    Code cells with at least one image output (``image/png``, ``image/svg+xml``,
    ``image/jpeg``) and markdown cells with a ``{figure}``/``{image}`` directive or a
    ``![..](..)`` image.
longest stretch without a figure
    The largest number of prose words (and, in brackets, of printed lines with numbers)
    between two figures, or between the start of the chapter / the exercises and a figure.
largest visible code cell
    The most non-blank lines of one visible code cell.
objectives first / summary last
    The first markdown cell has a heading or bold label "Learning objectives" (or "In this
    chapter you will"); the last ``##`` section of the notebook is "Summary".
going further after the exercises
    No ``##`` section of the main text is headed "Going further": optional reading comes after
    the exercises, in the order main sections, Exercises, Going further, Summary.

reading time
    The line ``*Reading time: ...*`` right under the chapter's title (issue 51): the words of
    prose of the main text (the count above, which leaves this line out) at ``WPM`` words a
    minute, and the wall time of the last recorded execution of the whole notebook,
    ``metadata["nbval_record"]["execution_seconds"]`` (written by ``--nbval-record``, see
    ``conftest.py``), rounded to 10 s.  ``reading_time_line`` writes it; a chapter at standard
    misses the target when its line is absent, states other words or minutes, or states a run
    time more than ``RUNTIME_TOLERANCE`` (relative, at least 10 s) away from the recorded one.

``--check`` compares the chapters in ``CHAPTERS_AT_STANDARD`` with ``TARGETS`` and exits
with status 1 when one of them misses a target (the others are only reported).
``--write-reading-time`` (re)writes the reading-time line of every chapter given (after a
notebook is re-recorded, or its prose changes).

Usage::

    python scripts/teaching_metrics.py            # the table
    python scripts/teaching_metrics.py --check    # the table, then the check
    python scripts/teaching_metrics.py --write-reading-time book/05_*.ipynb
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"

#: The targets of book/STYLE.md, per chapter (main text, before the exercises).
TARGETS = {
    "max_stretch_words": 700,
    "max_numeric_lines": 30,
    "max_code_cell_lines": 25,
    "max_words": 3000,
}

#: Chapters (notebook stems' two-digit prefixes) that meet the standard; ``--check`` fails
#: when one of them stops meeting it.  Add a chapter here when it gets there.
CHAPTERS_AT_STANDARD = ["01", "02", "03", "04", "05", "06", "07"]

#: Reading speed for the reading-time line, words of prose a minute.
WPM = 200
#: How far (relative) the stated run time may be from the recorded one before --check fails.
RUNTIME_TOLERANCE = 0.3
RECORD_KEY = "nbval_record"  # conftest.py's recorder stores the notebook's wall time here

HIDDEN_INPUT = {"hide-input", "remove-input", "remove-cell"}
HIDDEN_OUTPUT = {"remove-output", "remove-cell"}
IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")

_FENCE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})(.*)$")
_OPTION = re.compile(r"^\s*:[\w-]+:")
_DISPLAY_MATH = re.compile(r"\$\$.*?\$\$|\\begin\{(\w+\*?)\}.*?\\end\{\1\}", re.S)
_INLINE_MATH = re.compile(r"(?<!\\)\$[^$\n]+?(?<!\\)\$")
_ROLE = re.compile(r"\{[\w:-]+\}`([^`<]*?)\s*(<[^`>]*>)?`")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_WORD = re.compile(r"[^\s]*[A-Za-z0-9\u00C0-\u024F\u0370-\u03FF][^\s]*")
_DIGIT = re.compile(r"\d")
_FIGURE_MD = re.compile(r"^\s*(`{3,}|:{3,})\{(figure|image|glue:figure)\}|!\[[^\]]*\]\(", re.M)
_EXERCISES = re.compile(r"^\s*#+\s*Exercises\b|\{exercise-start\}|\{exercise\}", re.M | re.I)
_OBJECTIVES = re.compile(
    r"learning objectives|in this chapter you will|by the end of this chapter", re.I
)
_SECTION = re.compile(r"^##\s+(.*)$", re.M)
_READING = re.compile(r"^\*Reading time:.*\*\s*$", re.M)
_READING_NUMBERS = re.compile(
    r"about (\d+) minutes? for the ([\d,]+) words.*?about (\d+) s when", re.S
)


def tags(cell: dict) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def prose(markdown: str) -> str:
    """The markdown text that counts as prose (see the module docstring)."""
    text = _READING.sub(" ", _COMMENT.sub(" ", markdown))
    kept, stack = [], []  # open fences: "dir" (a directive, its body is prose) or "code"
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m:
            info = m.group(2).strip()
            if not info and stack:
                stack.pop()  # a closing fence
            elif stack and stack[-1] == "code":
                pass  # a fence-like line inside a code block
            else:
                stack.append("dir" if info.startswith("{") else "code")
            continue
        if stack and stack[-1] == "code":
            continue
        if _OPTION.match(line) or re.match(r"^\s*\|?\s*:?-{3,}", line):
            continue
        kept.append(line)
    text = "\n".join(kept)
    text = _DISPLAY_MATH.sub(" ", text)
    text = _INLINE_MATH.sub(" FORMULA ", text)
    text = _ROLE.sub(lambda m: f" {m.group(1)} ", text)
    text = _LINK.sub(lambda m: f" {m.group(1)} ", text)
    return text


def count_words(markdown: str) -> int:
    return len(_WORD.findall(prose(markdown)))


def code_lines(code: str) -> int:
    return sum(1 for line in code.splitlines() if line.strip())


def printed_numeric_lines(cell: dict) -> int:
    if tags(cell) & HIDDEN_OUTPUT:
        return 0
    n = 0
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            text = out.get("text", "")
        elif "data" in out and not any(t in out["data"] for t in IMAGE_TYPES):
            if "text/html" in out["data"] or "application/vnd.jupyter.widget-view+json" in out[
                "data"
            ]:
                text = ""
            else:
                text = out["data"].get("text/plain", "")
        else:
            continue
        text = "".join(text) if isinstance(text, list) else text
        n += sum(1 for line in text.splitlines() if _DIGIT.search(line))
    return n


def has_figure(cell: dict) -> bool:
    if cell["cell_type"] == "markdown":
        return bool(_FIGURE_MD.search(source(cell)))
    if cell["cell_type"] != "code" or tags(cell) & HIDDEN_OUTPUT:
        return False
    return any(
        any(t in out.get("data", {}) for t in IMAGE_TYPES) for out in cell.get("outputs", [])
    )


@dataclass
class Metrics:
    name: str
    words: int = 0
    code_lines: int = 0
    numeric_lines: int = 0
    figures: int = 0
    stretch_words: int = 0
    stretch_numeric: int = 0
    largest_code_cell: int = 0
    largest_code_cell_index: int = -1
    objectives_first: bool = False
    summary_last: bool = False
    going_further_after_exercises: bool = True
    main_cells: int = 0
    runtime_s: float | None = None
    reading_line: str | None = None
    misses: list[str] = field(default_factory=list)


def main_text(cells: list[dict]) -> list[dict]:
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "markdown" and _EXERCISES.search(source(cell)):
            return cells[:i]
    return cells


def measure(nb: dict, name: str = "") -> Metrics:
    """The teaching metrics of one notebook (a dict as read by ``json``/``nbformat``)."""
    cells = nb["cells"]
    main = main_text(cells)
    m = Metrics(name=name, main_cells=len(main))
    run_words = run_numeric = 0
    for i, cell in enumerate(main):
        if cell["cell_type"] == "markdown":
            w = count_words(source(cell))
            m.words += w
            run_words += w
        elif cell["cell_type"] == "code":
            if not tags(cell) & HIDDEN_INPUT:
                n = code_lines(source(cell))
                m.code_lines += n
                if n > m.largest_code_cell:
                    m.largest_code_cell, m.largest_code_cell_index = n, i
            k = printed_numeric_lines(cell)
            m.numeric_lines += k
            run_numeric += k
        if has_figure(cell):
            m.figures += 1
            m.stretch_words = max(m.stretch_words, run_words)
            m.stretch_numeric = max(m.stretch_numeric, run_numeric)
            run_words = run_numeric = 0
    m.stretch_words = max(m.stretch_words, run_words)
    m.stretch_numeric = max(m.stretch_numeric, run_numeric)
    markdown = [source(c) for c in cells if c["cell_type"] == "markdown"]
    if markdown:
        first = markdown[0]
        m.objectives_first = bool(_OBJECTIVES.search(first))
        sections = [s for md in markdown for s in _SECTION.findall(md)]
        m.summary_last = bool(sections) and sections[-1].strip().lower().startswith("summary")
    main_sections = [s for c in main if c["cell_type"] == "markdown" for s in _SECTION.findall(source(c))]
    m.going_further_after_exercises = not any(
        s.strip().lower().startswith("going further") for s in main_sections
    )
    m.runtime_s = nb.get("metadata", {}).get(RECORD_KEY, {}).get("execution_seconds")
    found = _READING.search(markdown[0]) if markdown else None
    m.reading_line = found.group(0).strip() if found else None
    m.misses = check(m)
    return m


def reading_minutes(words: int) -> int:
    return max(1, round(words / WPM))


def reading_time_line(m: Metrics) -> str:
    """The reading-time line of a measured chapter (needs its recorded run time)."""
    if m.runtime_s is None:
        raise ValueError(f"{m.name}: no recorded run time; execute it with --nbval-record")
    run = max(10, int(round(m.runtime_s / 10.0)) * 10)
    return (
        f"*Reading time: about {reading_minutes(m.words)} minutes for the {m.words:,} words of"
        f" the main text at {WPM} words a minute (formulas, code and figures take longer);"
        f" running the code took about {run} s when the notebook was last recorded.*"
    )


def reading_time_misses(m: Metrics) -> list[str]:
    if m.reading_line is None:
        return ["no reading-time line under the title (--write-reading-time writes it)"]
    numbers = _READING_NUMBERS.search(m.reading_line)
    if not numbers:
        return [f"the reading-time line is malformed: {m.reading_line}"]
    minutes, words, run = int(numbers[1]), int(numbers[2].replace(",", "")), int(numbers[3])
    misses = []
    if words != m.words or minutes != reading_minutes(m.words):
        misses.append(
            f"the reading-time line states {words} words / {minutes} min, the main text has "
            f"{m.words} words / {reading_minutes(m.words)} min (--write-reading-time)"
        )
    if m.runtime_s is None:
        misses.append("no recorded run time (metadata nbval_record; record with --nbval-record)")
    elif abs(run - m.runtime_s) > max(10.0, RUNTIME_TOLERANCE * m.runtime_s):
        misses.append(
            f"the reading-time line states a run of {run} s, the last recorded run took "
            f"{m.runtime_s:.0f} s (--write-reading-time)"
        )
    return misses


def write_reading_time(path: Path) -> str:
    """Put (or replace) the reading-time line under the title of the notebook at ``path``."""
    nb = json.loads(Path(path).read_text())
    m = measure(nb, name=Path(path).name)
    line = reading_time_line(m)
    cell = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    text = source(cell)
    if _READING.search(text):
        text = _READING.sub(line, text, count=1)
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{line}\n" + (rest if rest.startswith("\n") else "\n" + rest)
    lines = text.split("\n")
    cell["source"] = [s + "\n" for s in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    Path(path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return line


def check(m: Metrics) -> list[str]:
    misses = []
    if m.name[2:].zfill(2) in CHAPTERS_AT_STANDARD or m.name[:2] in CHAPTERS_AT_STANDARD:
        misses += reading_time_misses(m)
    if m.stretch_words > TARGETS["max_stretch_words"]:
        misses.append(f"{m.stretch_words} words without a figure (> {TARGETS['max_stretch_words']})")
    if m.numeric_lines > TARGETS["max_numeric_lines"]:
        misses.append(
            f"{m.numeric_lines} printed lines with numbers (> {TARGETS['max_numeric_lines']})"
        )
    if m.largest_code_cell > TARGETS["max_code_cell_lines"]:
        misses.append(
            f"visible code cell {m.largest_code_cell_index} has {m.largest_code_cell} lines "
            f"(> {TARGETS['max_code_cell_lines']})"
        )
    if m.words > TARGETS["max_words"]:
        misses.append(f"{m.words} words of prose (> {TARGETS['max_words']})")
    if not m.objectives_first:
        misses.append("no learning objectives in the first cell")
    if not m.summary_last:
        misses.append("the last section is not a summary")
    if not m.going_further_after_exercises:
        misses.append('a "Going further" section stands in the main text (it goes after the exercises)')
    return misses


def chapters() -> list[Path]:
    return sorted(BOOK.glob("0[0-9]_*.ipynb"))


def table(ms: list[Metrics]) -> str:
    rows = [
        ("words of prose", lambda m: f"{m.words:,}"),
        ("visible code lines", lambda m: f"{m.code_lines:,}"),
        ("printed lines with numbers", lambda m: str(m.numeric_lines)),
        ("figures", lambda m: str(m.figures)),
        (
            "longest stretch without a figure",
            lambda m: f"{m.stretch_words:,} w ({m.stretch_numeric} num)",
        ),
        ("largest visible code cell", lambda m: f"{m.largest_code_cell} (c{m.largest_code_cell_index})"),
        ("learning objectives first", lambda m: "yes" if m.objectives_first else "no"),
        ("summary last", lambda m: "yes" if m.summary_last else "no"),
        ("going further after the exercises", lambda m: "yes" if m.going_further_after_exercises else "no"),
        ("reading time (min read + s run)", lambda m: (
            f"{reading_minutes(m.words)} + {m.runtime_s:.0f} s" if m.runtime_s else "no run")),
        ("meets the targets", lambda m: "yes" if not m.misses else "no"),
    ]
    head = "| | " + " | ".join(m.name for m in ms) + " |"
    lines = [head, "|---" * (len(ms) + 1) + "|"]
    for label, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(m) for m in ms) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: book/0N_*.ipynb")
    parser.add_argument("--check", action="store_true", help="fail if a chapter at standard misses")
    parser.add_argument(
        "--write-reading-time", action="store_true", help="(re)write each chapter's reading-time line"
    )
    args = parser.parse_args(argv)
    paths = args.notebooks or chapters()
    if args.write_reading_time:
        for path in paths:
            print(f"{Path(path).name}: {write_reading_time(Path(path))}")
    ms = []
    for path in paths:
        nb = json.loads(Path(path).read_text())
        ms.append(measure(nb, name="ch" + Path(path).name[:2].lstrip("0")))
    print(table(ms))
    status = 0
    for path, m in zip(paths, ms):
        if m.misses:
            at_standard = Path(path).name[:2] in CHAPTERS_AT_STANDARD
            print(f"{Path(path).name}: " + "; ".join(m.misses)
                  + (" [AT STANDARD: FAIL]" if at_standard else ""))
            if args.check and at_standard:
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
