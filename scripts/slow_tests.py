"""Write tests/slow_tests.txt, the quick lane's list of slow tests, from a full run's durations.

    python scripts/slow_tests.py LOG [--threshold 2.0]

LOG is the output of ``bash scripts/test.sh`` (or of any pytest run with ``--durations=0``):
lines such as ``12.34s call     tests/test_x.py::test_y[a]``. A test goes on the list when its
setup, call and teardown together take at least ``threshold`` seconds (the log lists the phases
over ``--durations-min``, 1 s in ``scripts/test.sh``). The quick lane (``bash scripts/test.sh --quick``) then runs everything else; CI runs everything.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(tests/\S+)\s*$")


def slow_ids(log: str, threshold: float) -> list[str]:
    """The node ids whose setup, call and teardown in ``log`` add up to at least ``threshold`` s."""
    per_test: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            per_test[m.group(3)] += float(m.group(1))
    return sorted(n for n, s in per_test.items() if s >= threshold)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--threshold", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "slow_tests.txt")
    args = parser.parse_args()
    ids = slow_ids(args.log.read_text(errors="replace"), args.threshold)
    header = (f"# Tests over {args.threshold:g} s in a full run (setup + call + teardown), written by\n"
              f"# python scripts/slow_tests.py {args.log.name} --threshold {args.threshold:g}\n"
              "# The quick lane (bash scripts/test.sh --quick) leaves them out; CI runs everything.\n")
    args.out.write_text(header + "".join(f"{i}\n" for i in ids))
    print(f"slow_tests: {len(ids)} entries written to {args.out}")


if __name__ == "__main__":
    main()
