#!/usr/bin/env python
"""Grade submitted assignment notebooks: run each one in a sandbox, then check its functions here.

Usage:  python assignments/grade.py SUBMISSION... [--csv grades.csv] [--jobs 2] [--timeout 300]
                                    [--wall-time 600] [--memory 6] [--cpu-time S] [--file-size 64]
                                    [--max-output 16] [--student auto|file|folder] [--summary]
                                    [--solutions DIR] [--no-namespaces]

A SUBMISSION is a notebook or a folder (searched recursively for ``*.ipynb``).  Every submission is
read before the first one runs; ``--jobs`` of them are graded at a time; nothing is written back.
Prints one line per notebook, in the order given, ``<file>: <passed> of <total> checks passed`` (or
the reason it could not be graded), and exits with status 0 when every notebook ran.  A notebook
that cannot be graded (a cell raises, a cell runs longer than ``--timeout`` seconds, the process dies,
the file is not a notebook, its assignment cannot be identified, a limit below is exceeded) gets a
one-line reason and the grader goes on with the next one.

**How a score is made.**  Nothing the notebook prints counts.  The notebook runs in a sandbox
process (``minigeo.assignments._sandbox``): first the library functions that answer one of the
assignment's tasks in one call (``BLOCKED`` below, e.g. ``mg.quotient.horizontal_projection`` for assignment 6)
are replaced, everywhere in minigeo, by functions that raise, and every ``assignments.check_*`` by a
stub that checks nothing; then its code cells run in order.  The grader then runs each task's check
in its own process, on instances drawn from a fresh secret seed, with a stand-in for the student's
function that sends the arguments to the sandbox and gets the return value back as plain arrays
(never a pickle); references, comparisons and hints are all computed here.  The task list and the
function each check takes come from the solution's score cell (``assignments.check_X(function)``).
So a printed "3 of 3 checks passed", a patched ``check_*`` or a copied table of answers scores
nothing, and a call of a blocked function fails its task with a message saying why.  A submission
that deliberately restores a blocked function (re-importing the module, copying the library's
source) is not stopped by this: that is copying, as from a book.

**Limits and isolation.**  Each submission runs in a fresh temporary folder holding only a copy of
it, with a fresh empty ``HOME``, a copy of minigeo and a small environment that names none of the
grader's folders; all is deleted afterwards.  Where ``unshare`` can create Linux namespaces without
root (most Linux machines; tried once per run, ``--no-namespaces`` turns it off) the sandbox also
gets: no network (a network namespace with no interface up); its own process list (a PID namespace:
it cannot see the grader's command line or folder, and every process it starts, detached or not,
dies with it); the solutions folder, the grader's folder and every submission's folder hidden under
empty file systems; the course folder and your home folder read-only; and an empty ``/tmp`` holding
only its own folder (a parallel submission's folder is out of reach).  It runs as an ordinary user in
a second user namespace, so it cannot undo these mounts.  Without namespaces (macOS, Windows, some
containers) the grader says so on stderr, and the sandbox can read and write what you can and reach
the network: use the container command of ``book/lecturers.md`` ("Running the grader safely").
Resource limits hold in both cases, for the sandbox and every process it starts: ``--memory`` GB of
address space (``RLIMIT_AS``: an allocation beyond it fails with a ``MemoryError``; a JAX process
reserves about 2 GB of address space before it computes anything, and the assignments' solutions
peak at 2.0-2.5 GB on two cores), ``--cpu-time`` seconds of CPU time per process (``RLIMIT_CPU``),
files of at most ``--file-size`` MB (``RLIMIT_FSIZE``), and no core dumps.  The whole submission,
start and checks included, may run ``--wall-time`` seconds, each cell ``--timeout`` seconds (and
each check as long), and it may print ``--max-output`` MB; past any of them the sandbox is killed and
the notebook scores 0 with the limit as its reason.  At the end its process group is killed, and
without a PID namespace also every process that carries its marker in its environment.

**Which assignment.**  Any notebook in ``--solutions`` (default ``assignments/solutions/``) is an
assignment; its saved score cell lists the assignment's tasks and the function each one checks.  A
submission is matched to one by, in this order: the notebook metadata field ``minigeo_assignment``
(``make_student.py`` stamps it); the ``check_*`` functions its code calls (each belongs to one
assignment); its title cell (``# Assignment 4: ...``); its file name.

**Per task.**  A task gets 1 point when its check passes on the submission's function of the name
the assignment gives it, else 0 with the check's hint.  A function the notebook does not define
fails with a hint saying so.

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
import contextlib
import csv
import io
import json
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import cloudpickle
import nbformat
import numpy as np

HERE = Path(__file__).resolve().parent
if (HERE.parent / "minigeo" / "__init__.py").is_file() and str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # the course's own minigeo, the one its solutions were written for

from minigeo.assignments import _sandbox  # noqa: E402  (the frames and the value encoding)

CHECK_CALL_WITH_FUNCTION = re.compile(r"\bassignments\.(check_\w+)\(\s*(\w+)\s*[,)]")
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
    calls: list[tuple[str, str]] = field(default_factory=list)  # per task: (check, the function it checks)
    source: Path | None = None  # the solution notebook


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
        score_cell = next(
            (c.source for c in reversed(nb.cells) if c.cell_type == "code" and SCORE.search(_stdout(c))), ""
        )
        calls = CHECK_CALL_WITH_FUNCTION.findall(score_cell)
        if len(calls) != len(tasks):  # the score cell must name one (check, function) per task
            calls = []
        found[path.stem] = Assignment(
            path.stem,
            tasks,
            set(CHECK_CALL.findall(code)),
            chapter.group(1) if chapter else None,
            calls,
            path,
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

#: The library's answer to a task, per assignment (public names of ``minigeo``): blocked in the
#: sandbox (replaced, everywhere in minigeo, by a function that raises) from before the notebook's
#: first cell until the end, so a submission that calls one fails that task with a message saying so.
BLOCKED = {
    "assignment_01_transformation_rules": [
        "transform_vector",
        "transform_covector",
        "precondition_by_metric",
        "natural_gradient",
    ],
    "assignment_02_pullback_metrics": [
        "ggn",
        "fisher",
        "empirical_fisher",
        "operators.ggn_operator",
        "operators.fisher_operator",
        "operators.empirical_fisher_operator",
        "natural_gradient",
    ],
    "assignment_03_natural_gradient": ["natural_parameter_gradient", "span_projection"],
    "assignment_04_hessian_endomorphism": [
        "hessian_endomorphism",
        "endomorphism_trace",
        "riemannian_hessian",
        "christoffel_symbols",
    ],
    "assignment_05_laplace_evidence": [
        "transform_log_density",
        "log_density_wrt_volume",
        "laplace_log_marginal_likelihood",
        "laplace_posterior",
    ],
    "assignment_06_horizontal_projection": [
        "quotient.horizontal_projection",
        "quotient.gl_metric",
        "quotient.vertical_vector",
        "quotient.gl1_horizontal_projection",
    ],
    "assignment_07_capstone": [
        "models.vit_move_along_symmetries",
        "stats.kendall_tau",
        "stats.kendall_tau_ci",
        "stats.kendall_tau_difference_ci",
    ],
}

# The sandbox's first process.  Stage "outer" (inside ``unshare --user --map-root-user --mount --net
# --pid --fork --mount-proc``): bind the folders in "readonly" read-only and hide those in "hide"
# under empty in-memory file systems, then re-enter a second user namespace as an ordinary user (the
# mounts are then locked: the submission cannot undo them).  Stage "inner": stay as a small first
# process that waits for the sandbox and exits with its status (128 + signal when killed by one); its
# child sets the resource limits and becomes ``python -m minigeo.assignments._sandbox``.  In a PID
# namespace every process the submission starts dies with this first process.
_WRAPPER = r"""
import json, os, resource, subprocess, sys
stage, cfg_path = sys.argv[1], sys.argv[2]
with open(cfg_path) as f:
    cfg = json.load(f)
if stage == "outer":
    if cfg["private_tmp"]:  # an empty temporary folder, with only this sandbox's scratch folder in it
        # and the folders the sandbox needs that live under it (a checkout or a venv in /tmp); the
        # read-only and hidden mounts below then apply to what is visible
        tmp = cfg["private_tmp"]
        fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECTORY) for path in [cfg["scratch"], *cfg["keep_in_tmp"]]}
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", tmp], check=True)
        for path, fd in fds.items():
            os.makedirs(path, exist_ok=True)
            bind = ["mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", path]
            subprocess.run(bind, check=True, pass_fds=(fd,))
            os.close(fd)
    for path in cfg["readonly"]:
        if os.path.isdir(path):
            subprocess.run(["mount", "--bind", path, path], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", path], check=True)
    for path in cfg["hide"]:
        if os.path.isdir(path):
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=555", "tmpfs", path], check=True)
    uid, gid = cfg["uid"], cfg["gid"]
    os.execvp("unshare", ["unshare", "--user", "--mount", f"--map-user={uid}", f"--map-group={gid}",
                          sys.executable, "-c", cfg["wrapper"], "inner", cfg_path])
pid = os.fork()
if pid == 0:
    for name, value in cfg["rlimits"].items():
        limit = getattr(resource, "RLIMIT_" + name)
        _, hard_now = resource.getrlimit(limit)
        soft, hard = int(value), int(value) + (5 if name == "CPU" else 0)
        if hard_now != resource.RLIM_INFINITY:
            soft, hard = min(soft, hard_now), min(hard, hard_now)
        resource.setrlimit(limit, (soft, hard))
    os.execv(sys.executable, [sys.executable, "-m", "minigeo.assignments._sandbox", cfg["sandbox_config"]])
while True:
    try:
        _, status = os.waitpid(pid, 0)
        break
    except ChildProcessError:
        status = 0
        break
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""

_NAMESPACES: bool | None = None


def namespaces_available() -> bool:
    """Whether ``unshare`` can make the sandbox's namespaces here without root (tried once)."""
    global _NAMESPACES
    if _NAMESPACES is None:
        import subprocess

        cmd = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--mount-proc"]
        inner = ["unshare", "--user", "--mount", f"--map-user={_inner_uid()}", f"--map-group={_inner_gid()}"]
        inner.append("true")
        try:
            run = subprocess.run(
                [*cmd, "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', tempfile.gettempdir(), *inner],
                capture_output=True,
                timeout=30,
            )
            _NAMESPACES = run.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _NAMESPACES = False
    return _NAMESPACES


def _inner_uid() -> int:
    return os.getuid() or 1000  # never root inside: an ordinary user, who cannot undo the mounts


def _inner_gid() -> int:
    return os.getgid() or 1000


def _error_reason(ename: str, evalue: str, limits: Limits) -> str:
    """The one-line reason for a cell that raised; a limit's name when the error comes from one."""
    last = f"{ename}: {evalue}" if evalue else ename
    if "MemoryError" in ename or "RESOURCE_EXHAUSTED" in evalue:
        return f"stopped: out of memory, over the limit of {limits.memory_gb:g} GB (--memory): {last}"
    if ename == "OSError" and "[Errno 27]" in evalue:  # EFBIG: Python ignores SIGXFSZ
        return f"stopped: wrote a file larger than {limits.file_size_mb:g} MB (--file-size): {last}"
    return f"stopped by an error: {last}"


def _sandbox_environment(scratch: Path) -> dict[str, str]:
    """A small environment that names none of the grader's folders: ``HOME`` and ``TMPDIR`` in the
    scratch folder, minigeo from the copy there, ``PATH`` with this Python's folder first, and the
    variables that tune JAX, XLA and the BLAS threads."""
    env = {
        "HOME": str(scratch / "home"),
        "TMPDIR": str(scratch / "tmp"),
        "PYTHONPATH": str(scratch / "lib"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "MPLBACKEND": "Agg",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
    }
    for name, value in os.environ.items():
        if name.startswith(("JAX_", "XLA_", "OMP_", "MKL_", "OPENBLAS_", "TF_CPP_")):
            env[name] = value
    return env


def _folders_to_hide(paths: list[Path], solutions: Path) -> list[Path]:
    """The solutions, the grader's own folder and every submission's folder."""
    folders = {solutions.resolve(), HERE, *(p.resolve().parent for p in paths)}
    folders = sorted(folders, key=lambda p: len(p.parts))
    return [p for i, p in enumerate(folders) if not any(q in p.parents for q in folders[:i])]


@dataclass
class Isolation:
    """What the sandbox hides and protects (see "Isolation" in the module docstring)."""

    hide: list[Path] = field(default_factory=list)  # under an empty file system
    readonly: list[Path] = field(default_factory=list)  # bound read-only
    namespaces: bool = True  # use unshare when it works here


def _usable(paths: list[Path], scratch: Path) -> list[str]:
    """The folders that exist and hold neither the scratch folder nor this Python (hiding those would
    stop the sandbox)."""
    keep = []
    vital = [scratch.resolve(), Path(sys.executable).resolve(), Path(sys.prefix).resolve()]
    vital += [Path(sys.base_prefix).resolve(), Path(np_dir()).resolve()]
    for p in paths:
        p = Path(p).resolve()
        if p.is_dir() and not any(v == p or p in v.parents for v in vital):
            keep.append(str(p))
    return keep


def _kept_in_tmp(readonly: list[Path], scratch: Path) -> list[str]:
    """The folders under the temporary folder that must stay visible in the sandbox's private one:
    this Python's installation and the read-only folders (a course checked out, or a venv made,
    under /tmp), outermost only; the scratch folder is bound back on its own."""
    tmp = Path(tempfile.gettempdir()).resolve()
    wanted = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent, Path(np_dir()), *readonly]
    under = {p.resolve() for p in wanted if p.exists() and tmp in p.resolve().parents}
    under = {p for p in under if p != scratch.resolve() and scratch.resolve() not in p.parents}
    return sorted(str(p) for p in under if not any(q in p.parents for q in under))


def np_dir() -> str:
    import numpy

    return str(Path(numpy.__file__).parent)


class _Sandbox:
    """One submission's sandbox process (``minigeo.assignments._sandbox``) and the pipes to it."""

    def __init__(self, source: bytes, filename: str, blocked: list[str], limits: Limits, timeout: int,
                 isolation: Isolation):
        import subprocess

        import minigeo

        self.limits, self.timeout = limits, timeout
        self.deadline = time.monotonic() + limits.wall_time
        self.stopped: str | None = None  # why we killed it, if we did
        self.output = bytearray()  # the last 64 kB it printed
        self.output_bytes = 0
        self.next_id = 0
        self.token = secrets.token_hex(16)
        self.scratch = Path(tempfile.mkdtemp(prefix="minigeo-grade-"))
        work, lib = self.scratch / "work", self.scratch / "lib"
        for folder in (work, lib, self.scratch / "home", self.scratch / "tmp"):
            folder.mkdir()
        (work / filename).write_bytes(source)
        shutil.copytree(
            Path(minigeo.__file__).parent, lib / "minigeo", ignore=shutil.ignore_patterns("__pycache__")
        )
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        out_r, out_w = os.pipe()
        sandbox_config = self.scratch / "sandbox.json"
        sandbox_config.write_text(
            json.dumps(
                {"fd_in": req_r, "fd_out": resp_w, "notebook": str(work / filename), "blocked": blocked}
            )
        )
        self.namespaced = isolation.namespaces and namespaces_available()
        config = {
            "rlimits": limits.rlimits(),
            "sandbox_config": str(sandbox_config),
            "readonly": _usable(isolation.readonly, self.scratch) if self.namespaced else [],
            "hide": _usable(isolation.hide, self.scratch) if self.namespaced else [],
            "private_tmp": str(Path(tempfile.gettempdir()).resolve()) if self.namespaced else "",
            "keep_in_tmp": _kept_in_tmp(isolation.readonly, self.scratch) if self.namespaced else [],
            "scratch": str(self.scratch.resolve()),
            "uid": _inner_uid(),
            "gid": _inner_gid(),
            "wrapper": _WRAPPER,
        }
        wrapper_config = self.scratch / "wrapper.json"
        wrapper_config.write_text(json.dumps(config))
        cmd = [sys.executable, "-c", _WRAPPER, "outer" if self.namespaced else "inner", str(wrapper_config)]
        if self.namespaced:
            cmd = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork"]
            cmd += ["--mount-proc", sys.executable, "-c", _WRAPPER, "outer", str(wrapper_config)]
        env = _sandbox_environment(self.scratch)
        env["MINIGEO_SANDBOX"] = self.token  # to find its processes afterwards when there is no PID namespace
        try:
            self.process = subprocess.Popen(
                cmd,
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=out_w,
                pass_fds=(req_r, resp_w),
                start_new_session=True,
            )
        finally:
            for fd in (req_r, resp_w, out_w):
                os.close(fd)
        self.reader = _sandbox.FrameReader(self.resp_r, max_bytes=1 << 30)
        self.drain = threading.Thread(target=self._read_output, args=(out_r,), daemon=True)
        self.drain.start()

    # ----------------------------------------------------------- output, limits, the end

    def _read_output(self, fd: int) -> None:
        cap = self.limits.max_output_mb * 2**20
        with os.fdopen(fd, "rb", buffering=0) as f:
            while True:
                chunk = f.read(1 << 16)
                if not chunk:
                    return
                self.output_bytes += len(chunk)
                self.output += chunk
                del self.output[: max(0, len(self.output) - 65536)]
                if self.output_bytes > cap:
                    self.kill(f"stopped: printed more than {self.limits.max_output_mb:g} MB (--max-output)")

    def kill(self, reason: str | None = None) -> None:
        if reason and self.stopped is None:
            self.stopped = reason
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        try:
            write_frame = _sandbox.write_frame
            write_frame(self.req_w, {"exit": True})
        except OSError:
            pass
        self.kill()
        try:
            self.process.wait(timeout=10)
        except Exception:
            pass
        _kill_marked(self.token)
        for fd in (self.req_w, self.resp_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self.drain.join(timeout=5)
        if os.environ.get("MINIGEO_GRADE_DEBUG"):  # what the notebook's process printed, for the lecturer
            sys.stderr.write(self.output.decode(errors="replace"))
        shutil.rmtree(self.scratch, ignore_errors=True)

    def death_reason(self) -> str:
        """Why the sandbox ended without being asked to."""
        if self.stopped:
            return self.stopped
        try:
            code = self.process.wait(timeout=5)
        except Exception:
            code = None
        tail = self.output.decode(errors="replace")
        if "MemoryError" in tail or "RESOURCE_EXHAUSTED" in tail or "bad_alloc" in tail:
            return f"stopped: out of memory, over the limit of {self.limits.memory_gb:g} GB (--memory)"
        sig = None
        if code is not None and code > 128:  # the first process's exit code: 128 + the sandbox's signal
            sig = code - 128
        elif code is not None and code < 0:
            sig = -code
        if sig == signal.SIGXCPU:
            return f"stopped: used more than {self.limits.cpu_seconds()} s of CPU time (--cpu-time)"
        if sig == signal.SIGXFSZ:
            return f"stopped: wrote a file larger than {self.limits.file_size_mb:g} MB (--file-size)"
        if sig == signal.SIGKILL:
            return "the kernel was killed (SIGKILL: the hard CPU-time limit, or the machine is out of memory)"
        if sig:
            try:
                return f"the kernel died ({signal.Signals(sig).name})"
            except ValueError:
                pass
        return f"the kernel died: it exited with code {code}"

    def _receive(self, cell_timeout: float | None = None):
        """The next message; None when the sandbox ended or was stopped (``self.stopped`` says why)."""
        last = time.monotonic()
        while True:
            if self.stopped:
                return None
            now = time.monotonic()
            if now >= self.deadline:
                wall = self.limits.wall_time
                self.kill(f"timed out: the notebook ran longer than {wall:g} s (--wall-time)")
                return None
            if cell_timeout is not None and now - last >= cell_timeout:
                self.kill(f"timed out: a cell ran longer than {self.timeout} s (an infinite loop?)")
                return None
            try:
                frame = self.reader.read(timeout=0.25)
            except (ValueError, OSError) as err:
                self.kill(f"could not be graded: a garbled message from the notebook's process ({err})")
                return None
            if frame is not None:
                return frame
            if self.reader.eof:
                return None

    # ---------------------------------------------------------------------- the notebook

    def run_notebook(self) -> str | None:
        """Run the notebook's cells; None when all ran, else the reason (an error, a limit)."""
        started = False  # the per-cell limit starts with the first cell, after the imports
        while True:
            frame = self._receive(cell_timeout=self.timeout if started else None)
            if frame is None:
                return self.death_reason()
            head, _ = frame
            started = started or "cell" in head
            if "error" in head:
                err = head["error"] if isinstance(head["error"], dict) else {}
                return _error_reason(str(err.get("ename", "")), str(err.get("evalue", "")), self.limits)
            if head.get("ready"):
                return None

    # ------------------------------------------------------------------- remote functions

    def function(self, name: str):
        """A stand-in for the submission's function ``name``: its arguments are pickled to the
        sandbox, its result comes back as plain arrays."""
        from minigeo.assignments import _kit

        def call(*args, **kwargs):
            if self.stopped or self.reader.eof:
                raise _kit._Fail(f"not run: {self.stopped or 'the notebook process ended earlier'}")
            rid, self.next_id = self.next_id, self.next_id + 1
            with _kit._float64():  # cloudpickle: the checks pass functions (models, losses, charts)
                payload = cloudpickle.dumps((args, kwargs))
            limit = _kit._time_limit() if _CALL_LIMIT[0] is None else _CALL_LIMIT[0]
            _sandbox.write_frame(self.req_w, {"id": rid, "call": name, "limit": limit}, payload)
            while True:
                frame = self._receive()
                if frame is None:
                    raise _kit._Fail(f"not run: {self.death_reason()}")
                head, data = frame
                if head.get("id") == rid:
                    break  # an older answer (a call the check's time limit gave up on) is dropped
            if head.get("missing"):
                raise _kit._Fail(
                    f"the notebook defines no function `{name}` (keep the name the assignment gives it)"
                )
            if head.get("timed_out"):
                raise _kit._TimedOut()
            if "raised" in head:
                err = head["raised"] if isinstance(head["raised"], dict) else {}
                ename = re.sub(r"\W", "", str(err.get("ename", "Exception")))[:60] or "Exception"
                if ename == "NotImplementedError":
                    raise NotImplementedError(str(err.get("evalue", "")))
                raise type(ename, (Exception,), {})(str(err.get("evalue", "")))
            try:
                return _sandbox.unpack_value(head.get("value"), data)
            except Exception as err:
                raise _kit._Fail(f"its return value could not be read ({type(err).__name__})") from None

        call.__name__ = name
        return call


_CALL_LIMIT: list[float | None] = [None]


def _kill_marked(token: str) -> None:
    """SIGKILL to every process whose environment carries the sandbox's token (Linux): the processes
    a submission started in a new session, when there is no PID namespace to end them."""
    marker = f"MINIGEO_SANDBOX={token}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


_SOLUTIONS: dict[Path, dict] = {}


def _solution_function(assignment: Assignment, name: str):
    """The solution notebook's function ``name``, run here (the solutions are the course's own code):
    its code cells but the Colab install and the checks, once per process."""
    if assignment.source is None:
        return None
    if assignment.source not in _SOLUTIONS:
        namespace: dict = {"__name__": "solution"}
        try:
            nb = nbformat.read(assignment.source, as_version=4)
            for cell in nb.cells:
                if cell.cell_type == "code" and "assignments.check_" not in cell.source:
                    if "google.colab" not in cell.source:
                        exec(compile(cell.source, str(assignment.source), "exec"), namespace)
        except Exception:
            namespace = {}
        _SOLUTIONS[assignment.source] = namespace
    fn = _SOLUTIONS[assignment.source].get(name)
    return fn if callable(fn) else None


# FAIL messages that no random instance causes: the function is missing, unfinished, raised (a blocked
# library function raises too), ran too long, or returned something unreadable, or the sandbox is gone
_NOT_THE_INSTANCE = (
    "not run:",
    "not implemented yet",
    "your function raised",
    "defines no function",
    "timed out",
    "could not be read",
)


def _instance_may_be_to_blame(message: str) -> bool:
    """Whether a FAIL may be the random instance's doing (a wrong or non-finite number, a statistical
    property such as an interval's width on an unlucky sample), so that the solution is asked about the
    same instance; not a missing, unfinished, crashing, blocked or slow function."""
    return message.startswith("FAIL") and not any(s in message for s in _NOT_THE_INSTANCE)


def _ungradable(result: Result, reason: str, tasks: list[str]) -> Result:
    result.line = reason
    result.rows = [(task, 0, reason) for task in tasks or [""]]
    return result


def grade(
    path: Path,
    timeout: int = 300,
    assignments: dict[str, Assignment] | None = None,
    limits: Limits | None = None,
    source: bytes | None = None,
    isolation: Isolation | None = None,
) -> Result:
    """Grade one submission: run it in a sandbox under ``limits``, then run each task's check here, on
    a fresh secret seed, calling the submission's function in the sandbox.  ``source`` is the
    notebook's bytes (read from ``path`` when not given)."""
    from minigeo import assignments as checks
    from minigeo.assignments import _kit

    assignments = load_assignments(HERE / "solutions") if assignments is None else assignments
    limits = Limits() if limits is None else limits
    if isolation is None:
        isolation = Isolation(_folders_to_hide([path], HERE / "solutions"), [HERE.parent, Path.home()])
    try:
        source = Path(path).read_bytes() if source is None else source
        nb = nbformat.reads(source.decode("utf-8"), as_version=4)
    except Exception as err:  # missing file, not JSON, not a notebook
        name = next((n for n in assignments if n in path.name), UNKNOWN)
        tasks = assignments[name].tasks if name in assignments else []
        reason = f"could not be read as a notebook: {type(err).__name__}: {_first_line(err)}"
        return _ungradable(Result(path, name), reason, tasks)
    name = identify(nb, path, assignments)
    result = Result(path, name)
    if name not in assignments or not assignments[name].calls:
        return _ungradable(result, "not graded: the assignment could not be identified", [])
    assignment = assignments[name]
    tasks = assignment.tasks
    box = _Sandbox(source, path.name, BLOCKED.get(name, []), limits, timeout, isolation)
    try:
        reason = box.run_notebook()
        if reason:
            return _ungradable(result, reason, tasks)
        # MINIGEO_GRADE_SEED reproduces a run (the instances are then no longer secret)
        seed = int(os.environ.get("MINIGEO_GRADE_SEED", secrets.randbelow(2**31)))
        _CALL_LIMIT[0] = float(timeout)
        with contextlib.redirect_stdout(io.StringIO()):
            for task, (check, fn) in zip(tasks, assignment.calls):
                for _ in range(3):
                    with _kit.grading_seed(seed):
                        report = getattr(checks, check)(box.function(fn), time_limit=timeout)
                    if report.passed or not _instance_may_be_to_blame(report.message):
                        break
                    # a wrong answer: does the solution itself pass this random instance?  If not, the
                    # instance is to blame (an unlucky draw), and the task is checked on a new one
                    reference = _solution_function(assignment, fn)
                    if reference is None:
                        break
                    with _kit.grading_seed(seed):
                        if getattr(checks, check)(reference, time_limit=timeout).passed:
                            break
                    seed = secrets.randbelow(2**31)
                hint = report.message.split(": ", 1)[1] if ": " in report.message else report.message
                if report.message.startswith(f"FAIL {task}: "):
                    hint = report.message[len(f"FAIL {task}: ") :]
                result.rows.append((task, int(report.passed), "" if report.passed else hint))
                if box.stopped and box.stopped.startswith("timed out: the notebook"):
                    return _ungradable(result, box.stopped, tasks)
    finally:
        _CALL_LIMIT[0] = None
        box.close()
    result.line = f"{sum(points for _, points, _ in result.rows)} of {len(tasks)} checks passed"
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


def _grade_path(path, timeout, assignments, limits, source, isolation) -> Result:
    if source is None:  # could not be read at the start
        source = b""
    return grade(path, timeout, assignments, limits, source, isolation)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Each notebook runs in a sandbox (a fresh folder; with Linux namespaces no network, its own "
        "processes, the solutions and other submissions hidden) under the limits above; the checks run "
        "in the grader's own process; a notebook past a limit scores 0 with the limit as its reason. "
        "See 'Running the grader safely' in book/lecturers.md.",
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
    parser.add_argument(
        "--no-namespaces",
        action="store_true",
        help="do not use Linux namespaces (unshare) even where they work: limits only, no isolation",
    )
    args = parser.parse_args()
    assignments = load_assignments(args.solutions)
    limits = Limits(args.wall_time, args.memory, args.cpu_time, args.file_size, args.max_output)
    paths = _notebooks(args.notebooks)
    # every submission is read before the first one runs: what a submission writes into another
    # one's file (the sandbox hides their folders anyway) cannot change what is graded
    sources = []
    for path in paths:
        try:
            sources.append(path.read_bytes())
        except OSError:
            sources.append(None)
    isolation = Isolation(
        _folders_to_hide(paths, args.solutions), [HERE.parent, Path.home()], not args.no_namespaces
    )
    if not args.no_namespaces and not namespaces_available():
        print(
            "grade.py: unshare cannot create namespaces here: each submission runs under the limits, in "
            "its own folder and session, but it can reach the network and read your files (see "
            "book/lecturers.md, 'Running the grader safely')",
            file=sys.stderr,
        )
    results = []
    n = len(paths)
    common = ([args.timeout] * n, [assignments] * n, [limits] * n, sources, [isolation] * n)
    if args.jobs > 1 and n > 1:
        # one worker process per running sandbox (started fresh, not forked from this process, which
        # has JAX's threads); results come back, and are printed, in input order
        context = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(max_workers=min(args.jobs, n), mp_context=context)
        graded = pool.map(_grade_path, paths, *common)
    else:
        pool, graded = None, map(_grade_path, paths, *common)
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
