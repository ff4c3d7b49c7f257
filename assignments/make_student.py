#!/usr/bin/env python
"""Make the student versions of the assignments from the solution notebooks.

Every code cell of ``assignments/solutions/*.ipynb`` may contain blocks

    ### BEGIN SOLUTION
    ...the answer...
    ### END SOLUTION

Each block is replaced by ``raise NotImplementedError("...")`` at the block's indentation (the
message names the exercise, taken from the enclosing ``def``), and all outputs are cleared, so the
student notebooks in ``assignments/`` carry no part of the answers.  Both versions get the notebook
metadata field ``minigeo_assignment`` = the solution's file name without ``.ipynb`` (written into the
solution too when it lacks it), by which ``grade.py`` tells the assignments apart.  Run it after
editing or adding a solution; the test suite fails when a student notebook is out of date.

Usage:  python assignments/make_student.py [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
METADATA_KEY = "minigeo_assignment"  # read by grade.py


def strip_solutions(source: str) -> str:
    """Replace every solution block of a cell's source by a NotImplementedError line."""
    out, skipping, current_def = [], False, "this function"
    for line in source.splitlines():
        m = re.match(r"\s*def (\w+)\(", line)
        if m:
            current_def = f"`{m.group(1)}`"
        stripped = line.strip()
        if stripped == BEGIN:
            if skipping:
                raise ValueError(f"nested {BEGIN!r}")
            skipping = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# TODO: your code here (delete the next line)")
            out.append(f'{indent}raise NotImplementedError("fill in {current_def}")')
            continue
        if stripped == END:
            if not skipping:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            skipping = False
            continue
        if not skipping:
            out.append(line)
    if skipping:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "\n".join(out)


def student_version(solution: nbformat.NotebookNode, name: str | None = None) -> nbformat.NotebookNode:
    """The student version of a solution notebook; ``name`` (the assignment's) is stamped into it."""
    nb = nbformat.from_dict(solution)
    if name is not None:
        nb.metadata[METADATA_KEY] = name
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check that the student notebooks are up to date",
    )
    args = parser.parse_args()
    stale = []
    for path in sorted((HERE / "solutions").glob("*.ipynb")):
        solution = nbformat.read(path, as_version=4)
        if solution.metadata.get(METADATA_KEY) != path.stem:  # stamp the solution with its name
            if args.check:
                stale.append(f"{path.name} (solution without metadata {METADATA_KEY!r})")
            else:
                solution.metadata[METADATA_KEY] = path.stem
                path.write_text(nbformat.writes(solution) + "\n")
                print(f"stamped {path.relative_to(HERE.parent)}")
        nb = student_version(solution, path.stem)
        target = HERE / path.name
        text = nbformat.writes(nb) + "\n"
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(HERE.parent)}")
    if stale:
        print("out of date (run python assignments/make_student.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
