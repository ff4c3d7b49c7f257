#!/usr/bin/env python
"""Grade submitted assignment notebooks: execute each one and read the score its last cell prints.

Usage:  python assignments/grade.py submissions/*.ipynb [--timeout 300]

Prints one line per notebook, ``<file>: <passed> of <total> checks passed`` (or the error that
stopped it), and exits with status 0 when every notebook ran.  The notebooks are executed in a
fresh kernel in their own folder; nothing is written back.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

SCORE = re.compile(r"(\d+) of (\d+) checks passed")


def grade(path: Path, timeout: int = 300) -> tuple[int, int] | str:
    """Return ``(passed, total)`` from the notebook's score line, or a one-line error."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    try:
        client.execute()
    except CellExecutionError as err:
        last = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()[-1]  # drop terminal colours
        return f"stopped by an error: {last}"
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
