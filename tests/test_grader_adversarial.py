"""The grader against submissions that try to fool it (issue 55), made here from assignment 6's
solution and student notebooks so that they never go stale.

Each cheat must score 0 on the tasks it cheats on, or be stopped, while the honest solution graded in
the same run keeps full marks:

- forged print: the untouched student notebook plus a cell that prints PASS lines and a full score;
- patched checker: the student notebook with every ``assignments.check_*`` replaced by a stand-in
  that prints PASS and returns a passing report;
- library call: the solution with one task answered by the library's own function (blocked);
- snoop: the student notebook plus a cell that looks for the solutions (by absolute path, through
  the grader's command line and folder in ``/proc``, next to minigeo) and runs them if found;
- sabotage: a cell that overwrites another submission of the same run;
- runaway: detached processes (a new session, a double fork) that would outlive the grader;
- slow cells: cells each under the per-cell limit, together over the whole-notebook limit.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import nbformat
from helpers import alive_processes
import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "assignments"
NAME = "assignment_06_horizontal_projection"
SOLUTION = KIT / "solutions" / f"{NAME}.ipynb"
STUDENT = KIT / f"{NAME}.ipynb"
TASKS = ["vertical_vector", "quotient metric (15)", "horizontal_projection", "vertical_dimension"]
N = len(TASKS)


def _with_cells(base: Path, *sources: str, at: int | None = None) -> nbformat.NotebookNode:
    nb = nbformat.read(base, as_version=4)
    cells = [nbformat.v4.new_code_cell(src) for src in sources]
    if at is None:
        nb.cells += cells
    else:
        nb.cells[at:at] = cells
    return nb


def _namespaces() -> bool:
    sys.path.insert(0, str(KIT))
    try:
        import grade
    finally:
        sys.path.remove(str(KIT))
    return grade.namespaces_available()


FORGED_PRINT = (
    "print('PASS vertical_vector: (-G Omega, H Omega^T) is correct')\n"
    "print('PASS quotient metric (15): metric (15) is correct and GL(h)-invariant.')\n"
    "print('PASS horizontal_projection: matches minigeo')\n"
    "print('3 of 3 checks passed')"
)

PATCHED_CHECKER = (
    "from minigeo import assignments\n"
    "from minigeo.assignments import CheckReport\n"
    "\n"
    "def _always_pass(task):\n"
    "    def check(fn, **kwargs):\n"
    "        print(f'PASS {task}: ok')\n"
    "        return CheckReport(task, True, f'PASS {task}: ok')\n"
    "    return check\n"
    "\n"
    "for _name, _task in [('check_vertical_vector', 'vertical_vector'),\n"
    "                     ('check_quotient_metric', 'quotient metric (15)'),\n"
    "                     ('check_horizontal_projection', 'horizontal_projection')]:\n"
    "    setattr(assignments, _name, _always_pass(_task))\n"
    "import minigeo.assignments._kit as _kit\n"
    "_kit._close = lambda *args, **kwargs: None  # every comparison passes, in this process"
)

# the library's answer, called directly and through a name imported before the grader could block it
LIBRARY_CALL = (
    "from minigeo.quotient import horizontal_projection as _hp\n"
    "\n"
    "def horizontal_projection(G, H, xi):\n"
    "    return _hp((G, H), xi)"
)


def _snoop(solutions: Path) -> str:
    return (
        "import json, os, pathlib\n"
        "import minigeo\n"
        f"places = [pathlib.Path({str(solutions)!r})]\n"
        "for pid in ['self', str(os.getppid())] + [p.name for p in pathlib.Path('/proc').glob('[0-9]*')]:\n"
        "    try:\n"
        "        args = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
        "        places.append(pathlib.Path(os.readlink(f'/proc/{pid}/cwd')) / 'assignments' / 'solutions')\n"
        "    except OSError:\n"
        "        continue\n"
        "    for arg in args:\n"
        "        if arg.endswith(b'grade.py'):\n"
        "            places.append(pathlib.Path(arg.decode()).parent / 'solutions')\n"
        "places.append(pathlib.Path(minigeo.__file__).parents[1] / 'assignments' / 'solutions')\n"
        "for place in places:\n"
        f"    try:\n"
        f"        nb = json.loads((place / '{NAME}.ipynb').read_text())\n"
        "    except (OSError, ValueError):\n"
        "        continue\n"
        "    for cell in nb['cells']:\n"
        "        src = ''.join(cell['source'])\n"
        "        if cell['cell_type'] == 'code' and src.lstrip().startswith(('def ', 'import scipy')):\n"
        "            exec(src, globals())\n"
        "    print('found the solutions in', place)\n"
        "    break"
    )


def _sabotage(victim: Path, root: Path, isolated: bool) -> str:
    # with namespaces, also every notebook in /tmp (a parallel sandbox's copy, were it visible)
    tmp = "*pathlib.Path('/tmp').glob('*/*/*.ipynb')" if isolated else ""
    return (
        "import pathlib\n"
        f"victim = pathlib.Path({str(victim)!r})\n"
        "try:\n"
        "    victim.write_text('{\"cells\": [], \"raise\": 1}')\n"
        "except OSError as err:\n"
        "    print('could not write:', err)\n"
        f"for nb in [*pathlib.Path({str(root)!r}).glob('**/*.ipynb'), {tmp}]:\n"
        "    if nb.parent != pathlib.Path.cwd():\n"
        "        try:\n"
        "            nb.write_text('sabotaged')\n"
        "        except OSError:\n"
        "            pass"
    )


def _runaway(token: str) -> str:
    return (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{token}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{token}'])\n"
        "    os._exit(0)"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the isolation uses Linux namespaces")
def test_cheating_submissions_score_zero_and_honest_ones_full_marks(tmp_path):
    # without namespaces the sandbox can read the solutions and write into other folders: the snoop
    # then succeeds and the victim's file is overwritten (it is still graded as it was submitted)
    isolated = _namespaces()
    token = f"{time.time() % 1000:.6f}"  # a unique argument to find the runaway processes by
    kinds = {
        "honest": nbformat.read(SOLUTION, as_version=4),
        "forged_print": _with_cells(STUDENT, FORGED_PRINT),
        "patched_checker": _with_cells(STUDENT, PATCHED_CHECKER, at=3),
        "library_call": _with_cells(SOLUTION, LIBRARY_CALL, at=len(nbformat.read(SOLUTION, 4).cells) - 2),
        "snoop": _with_cells(STUDENT, _snoop(KIT / "solutions")) if isolated else None,
        "sabotage": None,  # below: it names the victim's path
        "runaway": _with_cells(SOLUTION, _runaway(token)),
        "slow_cells": _with_cells(SOLUTION, *["import time\ntime.sleep(15)"] * 5),
    }
    paths = {kind: tmp_path / kind / f"{NAME}.ipynb" for kind in kinds}
    victim = tmp_path / "victim" / f"{NAME}.ipynb"
    kinds["sabotage"] = _with_cells(SOLUTION, _sabotage(victim, tmp_path, isolated), at=3)
    kinds = {kind: nb for kind, nb in kinds.items() if nb is not None}
    order = ["sabotage", *[k for k in kinds if k != "sabotage"]]
    paths["victim"] = victim
    kinds["victim"] = nbformat.read(SOLUTION, as_version=4)
    order.append("victim")
    for kind in order:
        paths[kind].parent.mkdir()
        nbformat.write(kinds[kind], paths[kind])
    victim_bytes = victim.read_bytes()
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, str(KIT / "grade.py"), *(str(paths[k]) for k in order), "--jobs", "2"]
        + ["--csv", str(tmp_path / "g.csv"), "--timeout", "20", "--wall-time", "60"],
        capture_output=True,
        text=True,
        timeout=880,
    )
    elapsed = time.monotonic() - start
    lines = dict(line.split(": ", 1) for line in run.stdout.split("\n\n")[0].splitlines())
    assert list(lines) == [str(paths[k]) for k in order], run.stdout + run.stderr
    rows = defaultdict(dict)
    with open(tmp_path / "g.csv", newline="") as f:
        for row in csv.DictReader(f):
            rows[row["student"]][row["task"]] = (int(row["points"]), row["hint"])
    line = {kind: lines[str(paths[kind])] for kind in order}
    report = json.dumps({"elapsed_s": round(elapsed, 1), "lines": line, "rows": rows}, indent=1)
    print(report)
    full = f"{N} of {N} checks passed"
    for kind in ["honest", "victim", "runaway", "sabotage"]:
        assert line[kind] == full, report  # the victim is graded as submitted
    if isolated:
        assert victim.read_bytes() == victim_bytes, "a submission wrote into another one's file"
    for kind in ["forged_print", "patched_checker", "snoop"][: 3 if isolated else 2]:
        assert line[kind] == f"0 of {N} checks passed", report
        assert all("not implemented yet" in hint for _, hint in rows[kind].values()), report
    assert line["library_call"] == f"{N - 1} of {N} checks passed", report
    points, hint = rows["library_call"]["horizontal_projection"]
    assert points == 0 and "mg.quotient.horizontal_projection computes this task's answer" in hint, report
    assert line["slow_cells"] == "timed out: the notebook ran longer than 60 s (--wall-time)", report
    time.sleep(1)
    assert not alive_processes(token), f"runaway processes survived the grading: {alive_processes(token)}"


# What the sandbox sees, reported through the score: the probe cell replaces vertical_vector by a
# function that raises with the list of problems found, so the CSV hint names them.
PROBE = (
    "import json, os, pathlib, socket\n"
    "problems = []\n"
    "try:\n"
    "    socket.create_connection(('1.1.1.1', 53), timeout=3).close()\n"
    "    problems.append('the network is reachable')\n"
    "except OSError:\n"
    "    pass\n"
    "for p in pathlib.Path('/proc').glob('[0-9]*'):\n"
    "    try:\n"
    "        cmd = open(p / 'cmdline', 'rb').read().decode(errors='replace')\n"
    "    except OSError:\n"
    "        continue\n"
    "    if 'grade.py' in cmd or 'pytest' in cmd:\n"
    "        problems.append('sees the grader: ' + cmd[:80])\n"
    "if sorted(os.listdir('.')) != [NAME + '.ipynb']:\n"
    "    problems.append(f'its folder holds {os.listdir(\".\")}')\n"
    "env = json.dumps(dict(os.environ))\n"
    "for secret in SECRETS:\n"
    "    if secret in env:\n"
    "        problems.append('its environment names ' + secret)\n"
    "    if pathlib.Path(secret).exists() and any(pathlib.Path(secret).iterdir()):\n"
    "        problems.append('it can list ' + secret)\n"
    "# the course folder and this Python stay visible (read-only) where they live under /tmp\n"
    "kept = [str(pathlib.Path.cwd()), *KEPT]\n"
    "others = [p for p in pathlib.Path('/tmp').iterdir() if not any(k.startswith(str(p) + '/') for k in kept)]\n"
    "if others:\n"
    "    problems.append(f'/tmp holds {others[:3]}')\n"
    "if problems:\n"
    "    def vertical_vector(*args):\n"
    "        raise RuntimeError('isolation: ' + '; '.join(problems))"
)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the isolation uses Linux namespaces")
def test_sandbox_has_no_network_no_grader_processes_and_a_small_environment(tmp_path):
    if not _namespaces():
        pytest.skip("unshare cannot create namespaces on this machine")
    path = tmp_path / "sub" / f"{NAME}.ipynb"
    path.parent.mkdir()
    secrets = [str(KIT / "solutions"), str(KIT), str(path.parent)]
    kept = [str(KIT.parent.resolve()), str(Path(sys.prefix).resolve())]  # a checkout or venv under /tmp
    setup = f"NAME = {NAME!r}\nSECRETS = {secrets!r}\nKEPT = {kept!r}"
    nbformat.write(_with_cells(SOLUTION, setup, PROBE), path)
    run = subprocess.run(
        [sys.executable, str(KIT / "grade.py"), str(path), "--csv", str(tmp_path / "g.csv")],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.stdout.startswith(f"{path}: {N} of {N} checks passed"), run.stdout + run.stderr


# Issue 54: per assignment, a submission that answers a task with the library's own function fails
# that task.  The grader blocks those functions in the sandbox (``BLOCKED`` in grade.py; the whole
# path through the grader is shown for assignment 6 above).  Here, per assignment: the library call
# is a correct answer when nothing is blocked (so the block is what fails it), and once the sandbox
# has blocked the assignment's functions the same call raises the message the student sees.
LIBRARY_ANSWERS = {
    "assignment_01_transformation_rules": (
        "check_transform_vector",
        "lambda phi, theta, v: mg.transform_vector(phi, theta, v)",
    ),
    "assignment_02_pullback_metrics": (
        None,  # mg.ggn(...).mv would answer ggn_vector_product; the check is slow, so only the block is shown
        "lambda model, loss, params, v: mg.ggn(lambda p, b=None: model(p), lambda z, b=None: loss(z))",
    ),
    "assignment_03_natural_gradient": (
        "check_span_projection",
        "lambda J, g: jax.vmap(lambda e: mg.span_projection(J, g, e), out_axes=1)(jnp.eye(J.shape[0]))",
    ),
    "assignment_04_hessian_endomorphism": (
        "check_invariant_trace",
        "lambda H, G: mg.endomorphism_trace(H, G)",
    ),
    "assignment_05_laplace_evidence": (
        None,  # the change-of-variables check takes about a minute
        "lambda log_q, phi, psi: mg.transform_log_density(log_q, phi)(psi)",
    ),
    "assignment_06_horizontal_projection": (
        None,  # graded end to end above (library_call)
        "lambda G, H, xi: mg.quotient.horizontal_projection((G, H), xi)",
    ),
    "assignment_07_capstone": ("check_kendall_tau", "lambda x, y: mg.stats.kendall_tau(x, y)"),
}


def _grade_module():
    sys.path.insert(0, str(KIT))
    try:
        import grade
    finally:
        sys.path.remove(str(KIT))
    return grade


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_library_call_answers_a_task_of_every_assignment_and_the_grader_blocks_it():
    import jax  # noqa: F401  (used by the answers' source)
    import jax.numpy as jnp  # noqa: F401

    import minigeo as mg  # noqa: F401
    from minigeo import assignments as A

    grade = _grade_module()
    assert set(LIBRARY_ANSWERS) == {p.stem for p in (KIT / "solutions").glob("*.ipynb")}
    for name, (check, source) in LIBRARY_ANSWERS.items():
        called = source.split("mg.", 1)[1].split("(", 1)[0]
        assert called in grade.BLOCKED[name], (name, called)
        if check is not None:  # nothing blocked here: the one call is a full answer
            report = getattr(A, check)(eval(source, {"mg": mg, "jax": jax, "jnp": jnp}), time_limit=300)
            assert report.passed, (name, report.message)
    # in a fresh process, as in the sandbox: block, then call each answer on placeholder arguments
    code = (
        "import jax, jax.numpy as jnp, json, sys\n"
        "import minigeo as mg\n"
        "from minigeo.assignments import _sandbox\n"
        "answers, blocked = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
        "out = {}\n"
        "for name, (_, source) in answers.items():\n"
        "    _sandbox.block(blocked[name])\n"
        "    fn = eval(source)\n"
        "    n = fn.__code__.co_argcount\n"
        "    try:\n"
        "        fn(*[jnp.eye(2)] * n)\n"
        "        out[name] = 'no error'\n"
        "    except Exception as err:\n"
        "        out[name] = f'{type(err).__name__}: {err}'\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(LIBRARY_ANSWERS), json.dumps(grade.BLOCKED)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    for name, message in seen.items():
        assert message.startswith("RuntimeError: mg."), (name, message)
        assert "computes this task's answer" in message, (name, message)
