#!/usr/bin/env python
"""Grade submitted assignment notebooks: execute each one and read every check's PASS or FAIL line.

Usage:  python assignments/grade.py SUBMISSION... [--csv grades.csv] [--jobs 2] [--timeout 300]
                                    [--wall-time 600] [--memory 6] [--cpu-time S] [--file-size 64]
                                    [--max-output 16] [--student auto|file|folder] [--summary]
                                    [--solutions DIR]

A SUBMISSION is a notebook or a folder (searched recursively for ``*.ipynb``).  Each notebook is
executed in a fresh kernel, ``--jobs`` of them at a time; nothing is written back.  Prints one line
per notebook, in the order given, ``<file>: <passed> of <total> checks passed`` (or the reason it
could not be graded), and exits with status 0 when every notebook ran.  A notebook that cannot be
graded (a cell raises, a cell runs longer than ``--timeout`` seconds, the kernel dies, the file is
not a notebook, the score cell is gone, a limit below is exceeded) gets a one-line reason and the
grader goes on with the next one.

**Limits and isolation.**  Each submission runs in a fresh temporary folder (in the system's
temporary directory, never inside the course folder) that holds only a copy of it; the kernel starts
there, with a fresh empty ``HOME`` of its own (nothing a submission leaves in ``~``, such as an
IPython startup file, reaches a later one), and both are deleted afterwards.  The kernel is started
through a small wrapper that sets resource limits before it becomes the kernel, so they hold for the
kernel and for every process it starts: ``--memory`` GB of address space (``RLIMIT_AS``: an
allocation beyond it fails with a ``MemoryError``; a JAX kernel reserves about 2 GB of address space
before it computes anything, and the assignments' solutions peak at 2.0-2.5 GB on two cores),
``--cpu-time`` seconds of CPU time per process (``RLIMIT_CPU``), files of at most ``--file-size`` MB
(``RLIMIT_FSIZE``), and no core dumps.  The whole notebook, kernel start included, may run
``--wall-time`` seconds, each cell ``--timeout`` seconds, and it may print ``--max-output`` MB
(outputs are held in the grader's memory); past any of them the kernel's process group is killed and
the notebook scores 0 with the limit as its reason.  The process group is killed at the end of every
notebook in any case.  These limits stop runaway submissions; they are no sandbox: the kernel runs
as you, can read whatever you can (the repository and its ``solutions/``, through minigeo's install
path for one) and can reach the network.  ``book/lecturers.md`` ("Running the grader safely") gives
a container command that keeps the network and the rest of your machine out of its reach.

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
import os
import re
import shutil
import signal
import site
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
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


@dataclass(frozen=True)
class Limits:
    """What one submission may use (see "Limits and isolation" in the module docstring)."""

    wall_time: float = 600.0  # seconds for the whole notebook, kernel start included
    memory_gb: float = 6.0  # address space of the kernel and of each process it starts
    cpu_time: int | None = None  # CPU seconds per process; None: wall_time x the cores we may use
    file_size_mb: float = 64.0  # the largest file the kernel may write
    max_output_mb: float = 16.0  # the outputs the notebook may print, in all

    def cpu_seconds(self) -> int:
        if self.cpu_time is not None:
            return max(1, int(self.cpu_time))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return int(self.wall_time * cores) + 1

    def rlimits(self) -> dict[str, int]:
        """``{name: value}`` of the ``RLIMIT_<name>`` limits the kernel starts under."""
        return {
            "AS": int(self.memory_gb * 2**30),
            "CPU": self.cpu_seconds(),
            "FSIZE": int(self.file_size_mb * 2**20),
            "CORE": 0,
        }


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


# The kernel's command runs through this wrapper: it sets the resource limits (NAME=value arguments
# for RLIMIT_<NAME>), then replaces itself by the kernel (the same process: the limits, the process id
# and the process group are the kernel's).  The CPU limit's hard value is 5 s above the soft one
# (SIGXCPU, then SIGKILL).  No limit is set above the hard limit already in force.
_RLIMIT_WRAPPER = """
import os, resource, sys
args = sys.argv[1:]
split = args.index("--")
for item in args[:split]:
    name, value = item.split("=")
    limit = getattr(resource, "RLIMIT_" + name)
    _, hard_now = resource.getrlimit(limit)
    soft, hard = int(value), int(value) + (5 if name == "CPU" else 0)
    if hard_now != resource.RLIM_INFINITY:
        soft, hard = min(soft, hard_now), min(hard, hard_now)
    resource.setrlimit(limit, (soft, hard))
os.execvp(args[split + 1], args[split + 1 :])
"""


class _LimitedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel starts under the resource limits ``rlimits`` (the wrapper above)."""

    rlimits: dict[str, int] = {}

    def format_kernel_cmd(self, extra_arguments=None):
        cmd = super().format_kernel_cmd(extra_arguments)
        limits = [f"{name}={value}" for name, value in self.rlimits.items()]
        return [sys.executable, "-c", _RLIMIT_WRAPPER, *limits, "--", *cmd]


def _peak_address_space(pid: int) -> int:
    """The kernel's largest address space so far (``VmPeak``, Linux), in bytes; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmPeak:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _LimitedClient(NotebookClient):
    """nbclient's client under ``Limits``: a kernel started by ``_LimitedKernelManager``, a watchdog
    thread that kills the kernel's process group at the whole notebook's deadline and records the
    kernel's peak address space, a cap on the printed output, and a kill of the process group at
    the end (``close``)."""

    def __init__(self, nb, limits: Limits, deadline: float, **kw):
        super().__init__(nb, **kw)
        self.limits, self.deadline = limits, deadline
        self.stopped: str | None = None  # why we killed the kernel, if we did
        self.kernel_pgid: int | None = None
        self.kernel_process = None
        self.output_bytes = 0
        self.peak_bytes = 0  # the kernel's peak address space, as the watchdog saw it
        self.done = threading.Event()
        self.watchdog: threading.Thread | None = None

    def create_kernel_manager(self):
        manager = type("LimitedKernelManager", (_LimitedKernelManager,), {"rlimits": self.limits.rlimits()})
        self.km = manager(kernel_name=self.kernel_name, config=self.config)
        return self.km

    async def async_start_new_kernel(self, **kwargs):
        try:
            await super().async_start_new_kernel(**kwargs)
        finally:  # also when the start failed: a kernel that was launched is killed by ``close``
            provisioner = getattr(self.km, "provisioner", None)
            self.kernel_process = getattr(provisioner, "process", None)
            # the kernel leads a new session (jupyter_client starts it so): its process group is its pid
            self.kernel_pgid = getattr(provisioner, "pgid", None) or getattr(provisioner, "pid", None)
        self.watchdog = threading.Thread(target=self.watch, daemon=True)
        self.watchdog.start()

    def watch(self) -> None:
        """Until ``close``: the kernel's peak address space, four times a second, and the deadline."""
        process = self.kernel_process
        while not self.done.wait(min(0.25, max(0.0, self.deadline - time.monotonic()))):
            if process is not None and process.returncode is None:  # not reaped: the pid is the kernel's
                self.peak_bytes = max(self.peak_bytes, _peak_address_space(process.pid))
            if time.monotonic() >= self.deadline:
                wall = self.limits.wall_time
                self.kill(f"timed out: the notebook ran longer than {wall:g} s (--wall-time)")
                return

    def out_of_memory(self) -> bool:
        """Whether the kernel's address space came within 5 % of the limit (a failure then is the limit's)."""
        return self.peak_bytes >= 0.95 * self.limits.rlimits()["AS"]

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        self.output_bytes += len(str(content.get("text", ""))) + len(str(content.get("data", "")))
        if self.output_bytes > self.limits.max_output_mb * 2**20:
            self.kill(f"stopped: printed more than {self.limits.max_output_mb:g} MB (--max-output)")
            return None
        return super().output(outs, msg, display_id, cell_index)

    def kill(self, reason: str | None = None) -> None:
        """SIGKILL to the kernel's process group: the kernel and what it started in its group."""
        if reason and self.stopped is None:
            self.stopped = reason
        if self.kernel_pgid:
            try:
                os.killpg(self.kernel_pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        self.done.set()
        self.kill()

    def death_reason(self) -> str | None:
        """Why the kernel died, when its exit signal names a limit."""
        code = self.kernel_process.poll() if self.kernel_process is not None else None
        if code is None or code >= 0:
            return None
        if -code == signal.SIGXCPU:
            return f"stopped: used more than {self.limits.cpu_seconds()} s of CPU time (--cpu-time)"
        if -code == signal.SIGXFSZ:
            return f"stopped: wrote a file larger than {self.limits.file_size_mb:g} MB (--file-size)"
        if -code == signal.SIGKILL:
            return "the kernel was killed (SIGKILL: the hard CPU-time limit, or the machine is out of memory)"
        try:
            return f"the kernel died ({signal.Signals(-code).name})"
        except ValueError:
            return None


def _error_reason(err: CellExecutionError, limits: Limits) -> str:
    """The one-line reason for a cell that raised; a limit's name when the error comes from one."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()  # drop terminal colours
    last = lines[-1] if lines else type(err).__name__
    ename, evalue = getattr(err, "ename", "") or "", getattr(err, "evalue", "") or ""
    if "MemoryError" in ename or "RESOURCE_EXHAUSTED" in evalue:
        return f"stopped: out of memory, over the limit of {limits.memory_gb:g} GB (--memory): {last}"
    if ename == "OSError" and "[Errno 27]" in evalue:  # EFBIG: Python ignores SIGXFSZ
        return f"stopped: wrote a file larger than {limits.file_size_mb:g} MB (--file-size): {last}"
    return f"stopped by an error: {last}"


def _kernel_environment(home: Path) -> dict[str, str]:
    """The grader's environment with ``HOME`` a fresh folder: what a submission leaves in ``~``
    (IPython startup files, a user ``site-packages``) never reaches a later one.  Packages you
    installed with ``pip install --user`` stay importable (``PYTHONUSERBASE``)."""
    env = dict(os.environ, HOME=str(home))
    if "PYTHONUSERBASE" not in env and os.path.isdir(site.getusersitepackages()):
        env["PYTHONUSERBASE"] = site.getuserbase()
    return env


def _execute(nb, path: Path, timeout: int, limits: Limits | None = None) -> str | None:
    """Run the notebook in a fresh kernel, in a fresh temporary folder holding only a copy of it, under
    ``limits``; the reason it could not be run, or None.  The outputs go into ``nb``."""
    limits = Limits() if limits is None else limits
    deadline = time.monotonic() + limits.wall_time
    scratch = Path(tempfile.mkdtemp(prefix="minigeo-grade-"))  # work/: the kernel's folder; home/: HOME
    workdir, home = scratch / "work", scratch / "home"
    client = None
    try:
        workdir.mkdir()
        home.mkdir()
        shutil.copyfile(path, workdir / path.name)
        client = _LimitedClient(
            nb,
            limits,
            deadline,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(workdir)}},
            extra_arguments=["--IPKernelApp.log_level=ERROR"],  # not a warning per kernel on stderr
            shutdown_kernel="immediate",  # SIGKILL to the process group: there is nothing to save
        )
        try:
            client.execute(env=_kernel_environment(home))
            reason = client.stopped
        except CellExecutionError as err:
            reason = client.stopped or _error_reason(err, limits)
        except CellTimeoutError:
            reason = client.stopped or f"timed out: a cell ran longer than {timeout} s (an infinite loop?)"
        except DeadKernelError as err:
            reason = client.stopped or client.death_reason() or f"the kernel died: {_first_line(err)}"
        except Exception as err:  # anything else that stops this notebook must not stop the grading
            reason = client.stopped or f"could not be run: {type(err).__name__}: {_first_line(err)}"
        if reason and client.out_of_memory() and "out of memory" not in reason:
            # a kernel out of memory often cannot even report its MemoryError: it hangs, or dies
            memory = limits.memory_gb
            reason = f"stopped: out of memory, at the limit of {memory:g} GB (--memory); then {reason}"
        return reason
    finally:
        if client is not None:
            client.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _ungradable(result: Result, reason: str, tasks: list[str]) -> Result:
    result.line = reason
    result.rows = [(task, 0, reason) for task in tasks or [""]]
    return result


def grade(
    path: Path,
    timeout: int = 300,
    assignments: dict[str, Assignment] | None = None,
    limits: Limits | None = None,
) -> Result:
    """Execute one submission under ``limits`` and grade each task of its assignment from the score
    cell."""
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
    reason = _execute(nb, path, timeout, limits)
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
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Each notebook runs in a fresh temporary folder holding only a copy of it, its kernel "
        "under the limits above; a notebook past a limit scores 0 with the limit as its reason. "
        "The limits stop runaway submissions, they are no sandbox: see 'Running the grader safely' "
        "in book/lecturers.md for a container without network.",
    )
    parser.add_argument("notebooks", nargs="+", type=Path, help="notebooks, or folders of notebooks")
    parser.add_argument(
        "--timeout", type=int, default=300, metavar="SECONDS", help="seconds a cell may run (default 300)"
    )
    parser.add_argument(
        "--wall-time",
        type=float,
        default=600,
        metavar="SECONDS",
        help="seconds the whole notebook may run, kernel start included (default 600)",
    )
    parser.add_argument(
        "--memory",
        type=float,
        default=6,
        metavar="GB",
        help="address space of the kernel and of each process it starts, RLIMIT_AS (default 6; "
        "a JAX kernel reserves about 2 GB before it computes anything, more with more cores)",
    )
    parser.add_argument(
        "--cpu-time",
        type=int,
        default=None,
        metavar="SECONDS",
        help="CPU seconds of the kernel and of each process it starts, RLIMIT_CPU (default: "
        "--wall-time x the CPU cores the grader may use, so that it only stops processes the "
        "wall-time limit cannot reach)",
    )
    parser.add_argument(
        "--file-size",
        type=float,
        default=64,
        metavar="MB",
        help="the largest file the kernel may write, RLIMIT_FSIZE (default 64)",
    )
    parser.add_argument(
        "--max-output",
        type=float,
        default=16,
        metavar="MB",
        help="output a notebook may print in all; it is held in the grader's memory (default 16)",
    )
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
    limits = Limits(args.wall_time, args.memory, args.cpu_time, args.file_size, args.max_output)
    paths = _notebooks(args.notebooks)
    results = []
    n = len(paths)
    if args.jobs > 1 and n > 1:
        # one worker process per running kernel; results come back, and are printed, in input order
        pool = ProcessPoolExecutor(max_workers=min(args.jobs, n))
        graded = pool.map(grade, paths, [args.timeout] * n, [assignments] * n, [limits] * n)
    else:
        pool, graded = None, (grade(p, args.timeout, assignments, limits) for p in paths)
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
