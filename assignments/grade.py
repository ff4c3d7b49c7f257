#!/usr/bin/env python
"""Grade submitted assignment notebooks: execute each one and read every check's PASS or FAIL line.

Usage:  python assignments/grade.py SUBMISSION... [--csv grades.csv] [--jobs 2] [--timeout 300]
                                    [--student auto|file|folder] [--summary] [--solutions DIR]

A SUBMISSION is a notebook or a folder (searched recursively for ``*.ipynb``).  Each notebook is
executed in a fresh kernel in its own folder, ``--jobs`` of them at a time; nothing is written back.
Prints one line per notebook, in the order given, ``<file>: <passed> of <total> checks passed`` (or
the reason it could not be graded), and exits with status 0 when every notebook ran.  A notebook
that cannot be graded (a cell raises, a cell runs longer than ``--timeout`` seconds, the kernel
dies, the file is not a notebook, the score cell is gone) gets a one-line reason and the grader goes
on with the next one.

**Which assignment.**  Any notebook in ``--solutions`` (default ``assignments/solutions/``) is an
assignment; its saved score cell lists the assignment's tasks.  A submission is matched to one by,
in this order: the notebook metadata field ``minigeo_assignment`` (``make_student.py`` stamps it);
the ``check_*`` functions its code calls (each belongs to one assignment); its title cell
(``# Assignment 4: ...``); its file name.

**Per task.**  The score is read from the score cell (the last cell that prints ``k of n checks
passed``): each of its lines ``PASS <task>: ...`` or ``FAIL <task>: <hint>`` gives that task 1 or 0
points.  A task of the assignment without a line there gets 0 points; the notebook's score line is
then ignored and the one-line result counts the tasks.

**The CSV** (``--csv``) has one row per submission and task: ``student, assignment, task, points,
hint`` (the FAIL message without the task's name; empty for a PASS).  An ungradable notebook gets a
row per task with 0 points and the reason as its hint.  The student is, with ``--student auto``
(default), the file name without ``.ipynb`` and without the assignment's name where it contains it
(``alice.ipynb``, ``alice_assignment_04_hessian_endomorphism.ipynb``), or the folder's name when
nothing is left (``alice/assignment_04_hessian_endomorphism.ipynb``); ``--student file`` always
takes the file name, ``--student folder`` always the folder's.  With ``--csv`` or ``--summary`` a
summary for the lecturer follows the one-line results: per assignment and task the number of
submissions, the share that passed, and the most common hints (numbers replaced by ``…``).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
import textwrap
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

HERE = Path(__file__).resolve().parent
SCORE = re.compile(r"(\d+) of (\d+) checks passed")
VERDICT = re.compile(r"^(PASS|FAIL) (.*)$")
CHECK_CALL = re.compile(r"\b(check_\w+)\s*\(")
TITLE = re.compile(r"^#\s*Assignment\s+(\d+)\b", re.I | re.M)
METADATA_KEY = "minigeo_assignment"
UNKNOWN = "unknown"
NUMBER = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)|[-+]?\d+\.\d+")  # floats, not 15 or (3, 3)


@dataclass
class Assignment:
    """One assignment, read from its solution notebook."""

    name: str  # the solution's file name without .ipynb
    tasks: list[str]  # in the order of its score cell
    checks: set[str]  # the check_* functions it calls
    chapter: str | None  # "4" from "# Assignment 4: ..."


@dataclass
class Result:
    """The grade of one submission: its assignment, the rows of the CSV, and the one-line result."""

    path: Path
    assignment: str
    rows: list[tuple[str, int, str]] = field(default_factory=list)  # (task, points, hint)
    line: str = ""  # "<passed> of <total> checks passed" or the reason it could not be graded
    graded: bool = False


# ----------------------------------------------------------------- reading notebooks


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _score_cell_lines(nb) -> tuple[list[str], tuple[int, int]] | None:
    """The printed lines and the (passed, total) of the last code cell that prints a score line."""
    for cell in reversed([c for c in nb.cells if c.cell_type == "code"]):
        text = _stdout(cell)
        scores = SCORE.findall(text)
        if scores:
            return text.splitlines(), (int(scores[-1][0]), int(scores[-1][1]))
    return None


def _split_verdict(line: str, tasks: list[str]) -> tuple[str, bool, str] | None:
    """``(task, passed, rest)`` of a ``PASS <task>: ...`` / ``FAIL <task>: ...`` line, else None.

    A task of ``tasks`` is matched as a whole (so a task's name may contain ``": "``); any other
    line is split at its first ``": "``.
    """
    m = VERDICT.match(line.rstrip())
    if not m:
        return None
    verdict, body = m.groups()
    for task in sorted(tasks, key=len, reverse=True):
        if body.startswith(task + ": ") or body == task:
            return task, verdict == "PASS", body[len(task) + 2 :]
    if ": " not in body:
        return None
    task, rest = body.split(": ", 1)
    return task, verdict == "PASS", rest


def load_assignments(solutions: Path) -> dict[str, Assignment]:
    """Every assignment in the solutions folder, with its tasks read from the saved score cell."""
    found = {}
    for path in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        score = _score_cell_lines(nb)
        tasks = []
        for line in score[0] if score else []:
            verdict = _split_verdict(line, [])
            if verdict and verdict[0] not in tasks:
                tasks.append(verdict[0])
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        title = "\n".join(c.source for c in nb.cells[:3] if c.cell_type == "markdown")
        chapter = TITLE.search(title)
        found[path.stem] = Assignment(
            path.stem, tasks, set(CHECK_CALL.findall(code)), chapter.group(1) if chapter else None
        )
    return found


def identify(nb, path: Path, assignments: dict[str, Assignment]) -> str:
    """The name of the submission's assignment (see the module docstring), or ``"unknown"``."""
    stamped = nb.metadata.get(METADATA_KEY)
    if stamped in assignments:
        return stamped
    called = set(CHECK_CALL.findall("\n".join(c.source for c in nb.cells if c.cell_type == "code")))
    overlap = {name: len(called & a.checks) for name, a in assignments.items()}
    best = max(overlap.values(), default=0)
    if best > 0 and list(overlap.values()).count(best) == 1:
        return max(overlap, key=overlap.get)
    title = TITLE.search("\n".join(c.source for c in nb.cells[:3] if c.cell_type == "markdown"))
    if title:
        same = [
            name for name, a in assignments.items() if a.chapter and int(a.chapter) == int(title.group(1))
        ]
        if len(same) == 1:
            return same[0]
    named = [name for name in assignments if name in path.name]
    return named[0] if len(named) == 1 else UNKNOWN


# --------------------------------------------------------------------------- grading


def _execute(nb, path: Path, timeout: int) -> str | None:
    """Run the notebook in a fresh kernel; the reason it could not be run, or None."""
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        extra_arguments=["--IPKernelApp.log_level=ERROR"],  # not a warning per kernel on stderr
    )
    try:
        client.execute()
    except CellExecutionError as err:
        lines = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()  # drop terminal colours
        return f"stopped by an error: {lines[-1] if lines else type(err).__name__}"
    except CellTimeoutError:
        return f"timed out: a cell ran longer than {timeout} s (an infinite loop?)"
    except DeadKernelError as err:
        return f"the kernel died: {_first_line(err)}"
    except Exception as err:  # anything else that stops this notebook must not stop the grading
        return f"could not be run: {type(err).__name__}: {_first_line(err)}"
    return None


def _ungradable(result: Result, reason: str, tasks: list[str]) -> Result:
    result.line = reason
    result.rows = [(task, 0, reason) for task in tasks or [""]]
    return result


def grade(path: Path, timeout: int = 300, assignments: dict[str, Assignment] | None = None) -> Result:
    """Execute one submission and grade each task of its assignment from the score cell."""
    assignments = load_assignments(HERE / "solutions") if assignments is None else assignments
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # missing file, not JSON, not a notebook
        name = next((n for n in assignments if n in path.name), UNKNOWN)
        tasks = assignments[name].tasks if name in assignments else []
        reason = f"could not be read as a notebook: {type(err).__name__}: {_first_line(err)}"
        return _ungradable(Result(path, name), reason, tasks)
    name = identify(nb, path, assignments)
    tasks = assignments[name].tasks if name in assignments else []
    result = Result(path, name)
    for cell in nb.cells:  # saved outputs must not count: a cell nbclient skips (no code) keeps them
        if cell.cell_type == "code":
            cell.outputs = []
    reason = _execute(nb, path, timeout)
    if reason:
        return _ungradable(result, reason, tasks)
    score = _score_cell_lines(nb)
    if score is None:
        return _ungradable(result, "no score line found (was the last cell deleted?)", tasks)
    lines, (passed, total) = score
    verdicts = {}
    for line in lines:
        verdict = _split_verdict(line, tasks)
        if verdict:
            verdicts[verdict[0]] = verdict[1:]
    for task in tasks or list(verdicts):
        if task in verdicts:
            ok, rest = verdicts[task]
            result.rows.append((task, int(ok), "" if ok else rest))
        else:
            result.rows.append((task, 0, "no PASS or FAIL line for this task in the score cell"))
    if tasks:  # the tasks of the assignment, whatever the score line says
        passed, total = sum(points for _, points, _ in result.rows), len(tasks)
    elif not result.rows:
        result.rows = [("", 0, f"assignment not identified; its score line says {passed} of {total}")]
    result.line = f"{passed} of {total} checks passed"
    result.graded = True
    return result


# ----------------------------------------------------------------------- reporting


def student_name(path: Path, assignment: str, convention: str = "auto") -> str:
    """The student a submission belongs to (see ``--student`` in the module docstring)."""
    if convention == "folder":
        return path.resolve().parent.name
    if convention == "file" or assignment == UNKNOWN:
        return path.stem
    rest = path.stem.replace(assignment, "").strip(" _-.")
    return rest or path.resolve().parent.name


def write_csv(results: list[Result], target: Path, convention: str = "auto") -> None:
    with open(target, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "assignment", "task", "points", "hint"])
        for r in results:
            student = student_name(r.path, r.assignment, convention)
            for task, points, hint in r.rows:
                writer.writerow([student, r.assignment, task, points, hint])


def _hint_lines(count: int, hint: str, width: int = 80) -> list[str]:
    """``   5x <hint>``, numbers masked, wrapped to ``width`` columns under the hint's start."""
    hint = NUMBER.sub("…", hint)
    return textwrap.wrap(hint, width, initial_indent=f"    {count:3d}x ", subsequent_indent=" " * 9)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def summary(results: list[Result], most_common: int = 3) -> str:
    """Per assignment and task: submissions, share passed, the most common hints.

    A notebook that could not be graded counts as failing every task; its reason is listed once,
    under the assignment, instead of under every task.  Lines are at most 80 characters wide.
    """
    by_assignment: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_assignment[r.assignment].append(r)
    out = ["Per task: submissions, share passed, most common hints (numbers shown as …)"]
    for name in sorted(by_assignment):
        group = by_assignment[name]
        graded = [r for r in group if r.graded]
        full = sum(1 for r in graded if all(points for _, points, _ in r.rows))
        out += ["", f"{name}: {_plural(len(group), 'submission')}"]
        out.append(f"  {full} with full marks, {len(group) - len(graded)} not graded")
        for reason, count in Counter(r.line for r in group if not r.graded).most_common():
            out += _hint_lines(count, reason)
        tasks: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for r in group:
            for task, points, hint in r.rows:
                tasks[task].append((points, hint if r.graded else ""))
        width = max(len(task or "(notebook)") for task in tasks)
        for task, rows in tasks.items():
            passed = sum(points for points, _ in rows)
            share = 100 * passed / len(rows)
            out.append(f"  {task or '(notebook)':<{width}}  {len(rows):3d}  {share:3.0f}% passed")
            hints = Counter(NUMBER.sub("…", hint) for points, hint in rows if not points and hint)
            for hint, count in hints.most_common(most_common):
                out += _hint_lines(count, hint)
    return "\n".join(out)


def _notebooks(paths: list[Path]) -> list[Path]:
    out = []
    for path in paths:
        if path.is_dir():
            out += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        else:
            out.append(path)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path, help="notebooks, or folders of notebooks")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a cell may run (default 300)")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks executed at once (default 2)")
    parser.add_argument("--csv", type=Path, help="write one row per submission and task to this file")
    parser.add_argument(
        "--summary", action="store_true", help="print the per-task summary (implied by --csv)"
    )
    parser.add_argument("--student", choices=["auto", "file", "folder"], default="auto")
    parser.add_argument(
        "--solutions", type=Path, default=HERE / "solutions", help="the assignments' solutions"
    )
    args = parser.parse_args()
    assignments = load_assignments(args.solutions)
    paths = _notebooks(args.notebooks)
    results = []
    n = len(paths)
    if args.jobs > 1 and n > 1:
        # one worker process per running kernel; results come back, and are printed, in input order
        pool = ProcessPoolExecutor(max_workers=min(args.jobs, n))
        graded = pool.map(grade, paths, [args.timeout] * n, [assignments] * n)
    else:
        pool, graded = None, (grade(p, args.timeout, assignments) for p in paths)
    try:
        for result in graded:
            results.append(result)
            print(f"{result.path}: {result.line}", flush=True)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    if args.csv:
        write_csv(results, args.csv, args.student)
    if args.csv or args.summary:
        print()
        print(summary(results))
    return 0 if all(r.graded for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
