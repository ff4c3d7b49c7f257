#!/usr/bin/env python
"""Grade submitted assignment notebooks: execute each one and read the score its last cell prints.

Usage:  python assignments/grade.py submissions/*.ipynb [--timeout 300]

Prints one line per notebook, ``<file>: <passed> of <total> checks passed`` (or the error that
stopped it), and exits with status 0 when every notebook ran.  The notebooks are executed in a
fresh kernel in their own folder; nothing is written back.  A notebook that cannot be graded (a
cell raises, a cell runs longer than ``--timeout`` seconds, the kernel dies, the file is not a
notebook) gets a one-line reason and the grader goes on with the next one.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

SCORE = re.compile(r"(\d+) of (\d+) checks passed")


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


def grade(path: Path, timeout: int = 300) -> tuple[int, int] | str:
    """Return ``(passed, total)`` from the notebook's score line, or a one-line error."""
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # missing file, not JSON, not a notebook
        return f"could not be read as a notebook: {type(err).__name__}: {_first_line(err)}"
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
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
    text = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "stream"
    )
    scores = SCORE.findall(text)
    if not scores:
        return "no score line found (was the last cell deleted?)"
    passed, total = scores[-1]
    return int(passed), int(total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=300)
    args = parser.parse_args()
    status = 0
    for path in args.notebooks:
        result = grade(path, args.timeout)
        if isinstance(result, str):
            status = 1
            print(f"{path}: {result}")
        else:
            print(f"{path}: {result[0]} of {result[1]} checks passed")
    return status


if __name__ == "__main__":
    sys.exit(main())
