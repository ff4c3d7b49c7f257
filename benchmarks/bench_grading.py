"""Grading at course scale: the time ``assignments/grade.py`` takes for a class of submissions.

Builds a class of ``--n`` submissions of one assignment from its solution notebook, as a lecturer
would receive them: a third solved (the solution), a third untouched (the student version), the
rest with the typical mistake of ``tests/wrong_submissions.py``'s ``WRONG_SUBMISSIONS`` (one task
wrong) but one, which has a cell that raises.  Then runs
``grade.py`` on the folder with ``--jobs`` kernels at a time and prints the wall time, the CPU time
of the grader and its kernels, and the grader's summary.

    python benchmarks/bench_grading.py --assignment 07 --n 30 --jobs 2
    taskset -c 0,1 python benchmarks/bench_grading.py ...   # hold it to two cores

Issue 35's target: 30 submissions of one assignment graded in under 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "assignments"


def _wrong_submissions() -> dict:
    """The typical mistakes of the grade-all test (``tests/wrong_submissions.py``)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from wrong_submissions import WRONG_SUBMISSIONS

    return WRONG_SUBMISSIONS


def make_class(assignment: str, n: int, folder: Path) -> list[Path]:
    """``n`` submissions of ``assignment`` ("07" or its full name) written to ``folder``."""
    (solution,) = [p for p in (KIT / "solutions").glob("*.ipynb") if p.stem.split("_")[1] == assignment[-2:]]
    fn, right, wrong, _, _ = _wrong_submissions()[solution.stem]
    solved = nbformat.read(solution, as_version=4)
    blank = nbformat.read(KIT / solution.name, as_version=4)
    mistaken = nbformat.read(solution, as_version=4)
    (cell,) = [c for c in mistaken.cells if c.cell_type == "code" and f"def {fn}(" in c.source]
    cell.source = cell.source.replace(right, wrong)
    broken = nbformat.read(solution, as_version=4)
    broken.cells.insert(3, nbformat.v4.new_code_cell("1 / 0"))
    kinds = [solved] * (n // 3) + [blank] * (n // 3) + [mistaken] * (n - 2 * (n // 3) - 1) + [broken]
    paths = []
    for i, nb in enumerate(kinds[:n], 1):
        path = folder / f"student_{i:02d}.ipynb"
        nbformat.write(nb, path)
        paths.append(path)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assignment", default="07", help="assignment number, e.g. 07")
    ap.add_argument("--n", type=int, default=30, help="submissions in the class (default 30)")
    ap.add_argument("--jobs", type=int, default=2, help="grade.py's --jobs (default 2)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "submissions"
        folder.mkdir()
        make_class(args.assignment, args.n, folder)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        run = subprocess.run(
            [sys.executable, str(KIT / "grade.py"), str(folder), "--jobs", str(args.jobs), "--summary"],
            capture_output=True,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")),
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(run.stdout)
    print(run.stderr[-2000:], file=sys.stderr)
    print(
        f"bench_grading: assignment {args.assignment}, {args.n} submissions, --jobs {args.jobs}, "
        f"{os.cpu_count()} CPUs visible, affinity {len(os.sched_getaffinity(0))} cores: "
        f"wall {wall:.1f} s ({wall / 60:.2f} min), CPU {cpu:.1f} s, grade.py exit {run.returncode}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
