"""The assignment kit: the checks in minigeo.assignments, the student/solution notebooks, and their sync.

Each check must pass for a correct answer, fail with a helpful message for typical wrong answers
(checked against the hint it prints), report an unfinished function as "not implemented yet" and
any other exception in one line.  The solution notebooks must score full marks and the student
notebooks zero, both without a traceback, and the student notebooks must contain no solution code.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
import scipy.linalg

import minigeo as mg
from minigeo import assignments as A
from helpers import alive_processes
from wrong_submissions import WRONG_SUBMISSIONS

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "assignments"
SOLUTIONS = sorted((KIT / "solutions").glob("*.ipynb"))


def _jvp(phi, theta, v):
    return jax.jvp(phi.forward, (theta,), (v,))[1]


def _jac(phi, theta):
    return jax.jacfwd(phi.forward)(theta)


def _sylvester_projection(G, H, xi):
    P, Q = G.T @ G, H.T @ H
    B = np.asarray(P @ H.T @ xi[1] - xi[0].T @ G @ Q)
    X = jnp.asarray(scipy.linalg.solve_sylvester(np.asarray(P @ Q), np.asarray(P @ Q), B))
    return xi[0] + G @ X.T, xi[1] - H @ X


def _euclidean_projection(G, H, xi):
    # orthogonal in the Euclidean inner product: the wrong metric
    M = G.T @ G + H.T @ H
    B = H.T @ xi[1] - xi[0].T @ G
    X = jnp.asarray(scipy.linalg.solve_sylvester(np.asarray(M), np.asarray(M), np.asarray(B)))
    return xi[0] + G @ X.T, xi[1] - H @ X


def _christoffel_exponential_metric(C, theta, sign=-1.0):
    # G = diag(g), g_k = exp(2 (C theta)_k): Gamma^k_ij = d_ki C_kj + d_kj C_ki - d_ij C_ik g_i / g_k
    g, eye = jnp.exp(2.0 * (C @ theta)), jnp.eye(theta.size)
    return (
        jnp.einsum("ki,kj->kij", eye, C)
        + jnp.einsum("kj,ki->kij", eye, C)
        + sign * jnp.einsum("ij,ik,i,k->kij", eye, C, g, 1.0 / g)
    )


def _raise_type_error(*args):
    raise TypeError("unsupported operand\nsecond line of the message")


def _not_implemented(*args):
    raise NotImplementedError("fill in `f`")


CASES = {
    "check_transform_vector": (
        lambda phi, t, v: _jvp(phi, t, v),
        [(lambda phi, t, v: _jac(phi, t).T @ v, "transformed vector")],
    ),
    "check_transform_covector": (
        lambda phi, t, w: jnp.linalg.solve(_jac(phi, t).T, w),
        [(lambda phi, t, w: _jac(phi, t) @ w, "pairing omega(v)"), (lambda phi, t, w: w, "pairing")],
    ),
    "check_natural_gradient_step": (
        lambda G, g, lr: -lr * jnp.linalg.solve(G, g),
        [(lambda G, g, lr: -lr * g, "The step is -lr"), (lambda G, g, lr: -lr * G @ g, "off by")],
    ),
    "check_hessian_endomorphism": (
        lambda H, G: jnp.linalg.solve(G, H),
        [(lambda H, G: H @ jnp.linalg.inv(G), "the order matters"), (lambda H, G: H, "E is off")],
    ),
    "check_invariant_trace": (
        lambda H, G: jnp.trace(jnp.linalg.solve(G, H)),
        [(lambda H, G: jnp.trace(H), "not tr(H)")],
    ),
    "check_riemannian_hessian": (
        lambda h, g, gam: h - jnp.einsum("kij,k->ij", gam, g),
        [
            (lambda h, g, gam: h, "Riemannian Hessian"),
            (lambda h, g, gam: h - jnp.einsum("kij,i->kj", gam, g), "contract"),
        ],
    ),
    "check_vertical_vector": (
        lambda G, H, W: (-G @ W, H @ W.T),
        [(lambda G, H, W: (G @ W, H @ W.T), "G H^T is constant"), (lambda G, H, W: (-G @ W, H @ W), "G H^T")],
    ),
    "check_quotient_metric": (
        lambda G, H, e, z: mg.quotient.gl_metric((G, H), e, z),
        [(lambda G, H, e, z: jnp.vdot(e[0], z[0]) + jnp.vdot(e[1], z[1]), "metric (15)")],
    ),
    "check_horizontal_projection": (
        _sylvester_projection,
        [(_euclidean_projection, "not in the Euclidean"), (lambda G, H, xi: xi, "vertical")],
    ),
    # issue 54: plain gradient descent in a Box-Cox chart, seen in theta (not printed in chapter 1)
    "check_chart_gradient_step": (
        lambda nu, t, g, lr: -lr * g * t ** (2 - 2 * nu),
        [
            (lambda nu, t, g, lr: -lr * g, "plain gradient descent in theta"),  # the chart ignored
            (lambda nu, t, g, lr: -lr * g * t ** (1 - nu), "one factor of dtheta/dpsi is missing"),
            (lambda nu, t, g, lr: -lr * g * t ** (2 * nu - 2), "the factor is inverted"),
        ],
    ),
    # issue 54: Christoffel symbols of diag(exp(2 C theta)) by hand (chapter 4 computes them by autodiff)
    "check_christoffel_derivation": (
        _christoffel_exponential_metric,
        [
            (lambda C, t: jnp.zeros((t.size,) * 3), "not zero"),  # Gamma = 0 of a constant metric
            (lambda C, t: 2 * _christoffel_exponential_metric(C, t), "factor 2 too large"),
            (lambda C, t: _christoffel_exponential_metric(C, t, sign=+1.0), "wrong sign"),
            (
                lambda C, t: jnp.transpose(_christoffel_exponential_metric(C, t), (1, 2, 0)),
                "the index order",
            ),
        ],
    ),
    # issue 54: a derivation the chapter does not print (it uses full-rank pairs only)
    "check_vertical_dimension": (
        lambda h, r, s: h * h - (h - r) * (h - s),
        [
            (lambda h, r, s: h * h, "dimension of GL(h)"),  # transcribed from the full-rank case
            (lambda h, r, s: r * s, "rank G x rank H"),
            (lambda h, r, s: h * h - (h - r) - (h - s), "not a sum of the two kernels"),
        ],
    ),
}

# Each further assignment keeps its cases in tests/assignment_cases_<name>.py, a module with a dict
# CASES of the same form: {check name: (a correct answer, [(a wrong answer, words of its hint)])}.
# At least two wrong answers per check, each a common mistake that the hint names.
for _path in sorted(Path(__file__).parent.glob("assignment_cases_*.py")):
    _extra = importlib.import_module(_path.stem).CASES
    assert not set(_extra) & set(CASES), f"{_path.name} repeats a check"
    CASES.update(_extra)


def test_every_check_is_covered():
    assert set(CASES) == {n for n in A.__all__ if n.startswith("check_")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_passes_a_correct_answer(name, capsys):
    report = getattr(A, name)(CASES[name][0])
    assert report.passed, report.message
    assert capsys.readouterr().out.startswith("PASS ")


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_fails_wrong_answers_with_a_hint(name, capsys):
    for wrong, hint in CASES[name][1]:
        report = getattr(A, name)(wrong)
        assert not report.passed, f"{name} accepted a wrong answer"
        assert report.message.startswith("FAIL ") and hint in report.message, report.message
    assert "Traceback" not in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_reports_unfinished_and_crashing_functions_in_one_line(name, capsys):
    report = getattr(A, name)(_not_implemented)
    assert not report.passed and "not implemented yet" in report.message
    report = getattr(A, name)(_raise_type_error)
    assert not report.passed
    assert "raised TypeError: unsupported operand" in report.message and "\n" not in report.message
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and "Traceback" not in out


def test_checks_pass_in_float32_notebooks_too():
    # a notebook without jax_enable_x64: the checks switch to float64 themselves
    code = (
        "import jax, jax.numpy as jnp\n"
        "from minigeo import assignments as A\n"
        "r = A.check_invariant_trace(lambda H, G: jnp.trace(jnp.linalg.solve(G, H)))\n"
        "assert r.passed and jnp.ones(1).dtype == jnp.float32\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})


# ------------------------------------------------------------------------- notebooks


def test_every_assignment_has_a_solution_and_a_student_version():
    assert [p.name for p in SOLUTIONS] == sorted(p.name for p in KIT.glob("*.ipynb"))
    chapters = [re.match(r"assignment_(\d\d)_", p.name).group(1) for p in SOLUTIONS]
    assert chapters == [f"{k:02d}" for k in range(1, 8)]  # one per chapter, chapters 1 to 7


def test_student_notebooks_are_in_sync_with_the_solutions():
    run = subprocess.run(
        [sys.executable, str(KIT / "make_student.py"), "--check"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_student_version_leaks_no_solution(solution):
    sol = nbformat.read(solution, as_version=4)
    student = nbformat.read(KIT / solution.name, as_version=4)
    student_code = "\n".join(c.source for c in student.cells if c.cell_type == "code")
    assert "BEGIN SOLUTION" not in student_code and "END SOLUTION" not in student_code
    for cell in sol.cells:
        blocks = re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", cell.source, re.S)
        for block in blocks:
            for line in (ln for ln in block.strip().splitlines() if len(ln.strip()) >= 12):
                assert line.strip() not in student_code, (
                    f"{solution.name}: solution line {line.strip()!r} leaked"
                )
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    assert student_code.count("raise NotImplementedError") >= 3


# WRONG_SUBMISSIONS (tests/wrong_submissions.py): each solution with a typical mistake in one task.


def test_every_assignment_has_a_wrong_submission():
    assert set(WRONG_SUBMISSIONS) == {p.stem for p in SOLUTIONS}


def _wrong_submission(solution: Path) -> nbformat.NotebookNode:
    fn, right, wrong, _, _ = WRONG_SUBMISSIONS[solution.stem]
    nb = nbformat.read(solution, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and f"def {fn}(" in c.source]
    assert len(cells) == 1 and cells[0].source.count(right) == 1, f"{solution.name}: {right!r} not found"
    cells[0].source = cells[0].source.replace(right, wrong)
    return nb


def _load_grade_module():
    spec = importlib.util.spec_from_file_location("grade", KIT / "grade.py")
    grade = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("grade", grade)  # for its dataclasses
    spec.loader.exec_module(grade)
    return grade


# The one test that executes the assignment notebooks: every solution must score full marks, every
# untouched student version 0 (each task "not implemented yet", no error), every wrong submission lose
# exactly its task with the named hint, and a broken notebook be reported, not crash the grader.
# 22 notebooks, two kernels at a time: about 8 minutes on 2 busy CI cores, so this test has its own
# limit above the suite's 600 s
@pytest.mark.timeout(1800)
def test_grade_all_solutions_blank_wrong_and_broken_submissions(tmp_path):
    # one folder per "student": solution/, blank/ (the untouched student versions), wrong/, broken/
    kinds = {"solution": {}, "blank": {}, "wrong": {}}
    for sol in SOLUTIONS:
        kinds["solution"][sol.stem] = nbformat.read(sol, as_version=4)
        kinds["blank"][sol.stem] = nbformat.read(KIT / sol.name, as_version=4)
        if sol.stem in WRONG_SUBMISSIONS:
            kinds["wrong"][sol.stem] = _wrong_submission(sol)
    broken = nbformat.read(SOLUTIONS[0], as_version=4)
    broken.cells.insert(3, nbformat.v4.new_code_cell("1 / 0"))
    kinds["broken"] = {SOLUTIONS[0].stem: broken}
    paths = []
    for kind, notebooks in kinds.items():
        (tmp_path / kind).mkdir()
        for name, nb in notebooks.items():
            nbformat.write(nb, tmp_path / kind / f"{name}.ipynb")
            paths.append(tmp_path / kind / f"{name}.ipynb")
    assert set(kinds["wrong"]) == set(WRONG_SUBMISSIONS)
    run = subprocess.run(
        [
            sys.executable,
            str(KIT / "grade.py"),
            *map(str, paths),
            "--jobs",
            "2",
            "--csv",
            str(tmp_path / "g.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # the broken notebook could not be graded
    lines = dict(line.split(": ", 1) for line in run.stdout.split("\n\n")[0].splitlines())
    assert list(lines) == list(map(str, paths)), run.stdout  # one line each, in the order given
    rows = defaultdict(list)
    with open(tmp_path / "g.csv", newline="") as f:
        for row in csv.DictReader(f):
            rows[row["student"], row["assignment"]].append(row)
    for sol in SOLUTIONS:
        name = sol.stem
        full, blank = rows["solution", name], rows["blank", name]
        assert full and all(r["points"] == "1" and not r["hint"] for r in full), full
        assert re.fullmatch(
            rf"{len(full)} of {len(full)} checks passed", lines[str(tmp_path / "solution" / sol.name)]
        )
        assert [r["task"] for r in blank] == [r["task"] for r in full]
        assert all(r["points"] == "0" and "not implemented yet" in r["hint"] for r in blank), blank
        assert lines[str(tmp_path / "blank" / sol.name)] == f"0 of {len(full)} checks passed"
    for name, (_, _, _, task, hint) in WRONG_SUBMISSIONS.items():
        wrong = {r["task"]: r for r in rows["wrong", name]}
        assert wrong[task]["points"] == "0" and hint in wrong[task]["hint"], wrong[task]
        others = {t: r["hint"] for t, r in wrong.items() if t != task and r["points"] != "1"}
        assert not others, (name, others)  # only the task with the mistake loses its point
        assert (
            lines[str(tmp_path / "wrong" / f"{name}.ipynb")]
            == f"{len(wrong) - 1} of {len(wrong)} checks passed"
        )
    assert lines[str(paths[-1])].startswith("stopped by an error: ZeroDivisionError"), lines
    broken_rows = rows["broken", SOLUTIONS[0].stem]
    assert broken_rows and all(r["points"] == "0" and "ZeroDivisionError" in r["hint"] for r in broken_rows)
    # the summary: every assignment, each task with its share passed
    text = run.stdout.split("\n\n", 1)[1]
    for sol in SOLUTIONS:
        assert f"{sol.stem}: " in text, text
    assert "% passed" in text and "1 not graded" in text, text
    assert "1x stopped by an error: ZeroDivisionError" in text, text
    assert max(map(len, text.splitlines())) <= 80, text


def test_grade_identifies_the_assignment_and_the_student_without_metadata(tmp_path):
    grade = _load_grade_module()
    assignments = grade.load_assignments(KIT / "solutions")
    assert set(assignments) == {p.stem for p in SOLUTIONS}
    for sol in SOLUTIONS:
        name = sol.stem
        a = assignments[name]
        assert a.tasks and a.checks and a.chapter == name[len("assignment_") :][:2].lstrip("0"), a
        nb = nbformat.read(KIT / sol.name, as_version=4)
        assert nb.metadata["minigeo_assignment"] == name
        assert grade.identify(nb, Path("hw.ipynb"), assignments) == name
        del nb.metadata["minigeo_assignment"]  # e.g. lost in an upload: the checks it calls tell
        assert grade.identify(nb, Path("hw.ipynb"), assignments) == name
        nb.cells = nb.cells[:1]  # only the title cell is left
        assert grade.identify(nb, Path("hw.ipynb"), assignments) == name
        folder = Path("submissions/alice")
        for path in [folder / f"{name}.ipynb", Path(f"x/alice_{name}.ipynb"), Path("x/alice.ipynb")]:
            assert grade.student_name(path, name) == "alice", path
        assert grade.student_name(folder / "hw.ipynb", name, "folder") == "alice"
    # a verdict line is split after the whole task's name, even one that contains ": "
    assert grade._split_verdict("FAIL a: b: the hint", ["a: b"]) == ("a: b", False, "the hint")
    assert grade._split_verdict("PASS x: fine", []) == ("x", True, "fine")


# ------------------------------------------------------------------ no silent wrong answers


def _plus_5j(fn):
    def wrong(*args):
        out = fn(*args)
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x) + 5j, out)

    return wrong


@pytest.mark.parametrize(
    "name", ["check_invariant_trace", "check_natural_gradient_step", "check_hessian_endomorphism"]
)
def test_complex_answer_with_the_right_real_part_fails(name, capsys):
    report = getattr(A, name)(_plus_5j(CASES[name][0]))
    assert not report.passed, report.message
    assert "imaginary part" in report.message, report.message
    assert "ComplexWarning" not in capsys.readouterr().err


def test_complex_answer_with_round_off_imaginary_part_passes():
    # a trace computed from eigenvalues is complex with an imaginary part at round-off level
    report = A.check_invariant_trace(lambda H, G: jnp.sum(jnp.linalg.eigvals(jnp.linalg.solve(G, H))))
    assert report.passed, report.message


def test_answer_that_is_not_a_number_fails_in_one_line():
    report = A.check_invariant_trace(lambda H, G: "tr(G^-1 H)")
    assert not report.passed and "is not an array of numbers (got str)" in report.message


def _loop_forever(*args):
    while True:
        pass


def _loop_and_swallow_exceptions(*args):
    while True:
        try:
            while True:
                pass
        except Exception:
            pass


@pytest.mark.parametrize("student", [_loop_forever, _loop_and_swallow_exceptions])
def test_infinite_loop_fails_within_the_time_limit(student, capsys):
    import time

    start = time.monotonic()
    report = A.check_vertical_vector(student, time_limit=0.5)
    elapsed = time.monotonic() - start
    assert not report.passed and "timed out after 0.5 s" in report.message, report.message
    assert elapsed < 10, elapsed
    assert capsys.readouterr().out.startswith("FAIL vertical_vector: timed out")
    # a correct answer still passes afterwards, with the default limit
    assert A.check_vertical_vector(CASES["check_vertical_vector"][0]).passed


def test_default_time_limit_is_a_module_setting(monkeypatch):
    monkeypatch.setattr(A, "TIME_LIMIT", 0.5)
    report = A.check_invariant_trace(_loop_forever)
    assert not report.passed and "timed out after 0.5 s" in report.message


def test_time_limit_off_the_main_thread():
    # the SIGALRM timer only works on the main thread; elsewhere a watchdog thread is used
    import threading

    # off the main thread the runaway function keeps running after the watchdog gives up: loop
    # until this test says stop, so that no busy thread holds the GIL for the rest of the session
    stop = threading.Event()

    def loop_until_stopped(*args):
        while not stop.is_set():
            pass

    out = {}
    worker = threading.Thread(
        target=lambda: out.update(r=A.check_invariant_trace(loop_until_stopped, time_limit=0.5))
    )
    worker.start()
    worker.join(30)
    stop.set()
    assert not worker.is_alive()
    assert not out["r"].passed and "timed out after 0.5 s" in out["r"].message
    ok = {}
    worker = threading.Thread(
        target=lambda: ok.update(r=A.check_invariant_trace(CASES["check_invariant_trace"][0]))
    )
    worker.start()
    worker.join(60)
    assert ok["r"].passed, ok["r"].message


def test_time_limit_restores_an_outer_alarm():
    # e.g. pytest-timeout's signal method: its handler and the rest of its timer come back
    import signal

    if not hasattr(signal, "setitimer"):
        pytest.skip("no SIGALRM on this platform")
    fired = []

    def outer(*args):
        fired.append(1)

    old = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 50.0)
        A.check_invariant_trace(_loop_forever, time_limit=0.3)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 40.0 < remaining <= 50.0
        assert signal.getsignal(signal.SIGALRM) is outer and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _assignment_notebook(*sources: str, name: str = "assignment_06_horizontal_projection"):
    """A notebook of the given cells, stamped as a submission of assignment ``name``."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["minigeo_assignment"] = name
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    return nb


def test_grading_script_survives_a_cell_timeout_and_a_dead_kernel(tmp_path):
    nbformat.write(_assignment_notebook("while True:\n    pass"), tmp_path / "loop.ipynb")
    nbformat.write(_assignment_notebook("import os\nos._exit(1)"), tmp_path / "dead.ipynb")
    (tmp_path / "garbage.ipynb").write_text("{not json")
    # a printed score counts for nothing: not an assignment, so not graded
    ok = nbformat.v4.new_notebook()
    ok.cells = [nbformat.v4.new_code_cell("print('2 of 3 checks passed')")]
    nbformat.write(ok, tmp_path / "ok.ipynb")
    names = ["loop", "dead", "garbage", "ok"]
    run = subprocess.run(
        [sys.executable, str(KIT / "grade.py")]
        + [str(tmp_path / f"{n}.ipynb") for n in names]
        + ["--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 4, run.stdout + run.stderr
    assert "loop.ipynb: timed out: a cell ran longer than 3 s" in lines[0], lines
    assert "dead.ipynb: the kernel died" in lines[1], lines
    assert "garbage.ipynb: could not be read as a notebook" in lines[2], lines
    assert lines[3].endswith("ok.ipynb: not graded: the assignment could not be identified"), lines


# Per-submission limits (issue 50): a submission made from a solution that loops forever, one that
# allocates without bound, and the untouched solution, graded together with small limits.  The
# loop is stopped by the whole-notebook limit (--wall-time 60 is below --timeout), the allocation by
# the address-space limit (--memory 3: a JAX kernel reserves about 2 GB, the solution peaks there).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grader_stops_a_submission_that_loops_forever_or_allocates_without_bound(tmp_path):
    import time

    solution = SOLUTIONS[0]
    kinds = {
        "loop": "while True:\n    pass",
        "hog": "import numpy as np\n\nhog = []\nwhile True:\n    hog.append(np.ones(2**24))  # 128 MB each",
    }
    paths = [tmp_path / "solution" / solution.name]
    paths[0].parent.mkdir()
    nbformat.write(nbformat.read(solution, as_version=4), paths[0])
    for kind, code in kinds.items():
        nb = nbformat.read(solution, as_version=4)
        nb.cells.insert(3, nbformat.v4.new_code_cell(code))
        (tmp_path / kind).mkdir()
        nbformat.write(nb, tmp_path / kind / solution.name)
        paths.append(tmp_path / kind / solution.name)
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, str(KIT / "grade.py"), *map(str, paths), "--jobs", "2"]
        + ["--csv", str(tmp_path / "g.csv"), "--timeout", "300", "--wall-time", "60", "--memory", "3"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    elapsed = time.monotonic() - start
    assert run.returncode == 1, run.stdout + run.stderr
    lines = dict(line.split(": ", 1) for line in run.stdout.split("\n\n")[0].splitlines())
    assert list(lines) == list(map(str, paths)), run.stdout
    assert re.fullmatch(r"(\d+) of \1 checks passed", lines[str(paths[0])]), lines  # the limits let it run
    assert lines[str(paths[1])] == "timed out: the notebook ran longer than 60 s (--wall-time)", lines
    assert lines[str(paths[2])].startswith("stopped: out of memory"), lines
    assert "3 GB (--memory)" in lines[str(paths[2])], lines
    assert elapsed < 200, elapsed  # the loop did not run for --timeout 300 s
    with open(tmp_path / "g.csv", newline="") as f:
        rows = defaultdict(list)
        for row in csv.DictReader(f):
            rows[row["student"]].append(row)
    for kind in kinds:  # scored 0 on every task, the reason as the hint
        reason = lines[str(tmp_path / kind / solution.name)]
        assert rows[kind] and all(r["points"] == "0" and r["hint"] == reason for r in rows[kind]), rows[kind]


# The other limits, on small notebooks stamped as assignment 6 (the sandbox imports JAX and minigeo
# first: about 3 s of CPU time), without namespaces (--no-namespaces, the fallback of machines without
# unshare): CPU time, file size and printed output are limited, and the processes a submission starts
# (here in a new session, out of the process group) are killed at the end through the marker in their
# environment.  The isolation itself is tested in tests/test_grader_adversarial.py.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grader_limits_cpu_file_size_and_output_and_ends_every_process(tmp_path):
    import time

    token = f"{time.time() % 1000:.6f}"
    folder = tmp_path / "submissions"
    folder.mkdir()
    cells = {
        "spawn": f"import subprocess\nsubprocess.Popen(['sleep', '{token}'], start_new_session=True)",
        "spin": "while True:\n    pass",
        "bigfile": "open('big.bin', 'wb').write(b'0' * 3 * 2**20)",
        "flood": "while True:\n    print('x' * 100_000)",
    }
    for name, source in cells.items():
        nbformat.write(_assignment_notebook(source), folder / f"{name}.ipynb")
    run = subprocess.run(
        [sys.executable, str(KIT / "grade.py"), *(str(folder / f"{n}.ipynb") for n in cells), "--jobs", "2"]
        + ["--timeout", "120", "--wall-time", "120", "--cpu-time", "25"]
        + ["--file-size", "1", "--max-output", "1", "--no-namespaces"],  # the limits hold without them
        capture_output=True,
        text=True,
        timeout=280,
    )
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 4, run.stdout + run.stderr
    assert lines[0].endswith("spawn.ipynb: 0 of 4 checks passed"), lines  # graded; it defines nothing
    assert lines[1].endswith("spin.ipynb: stopped: used more than 25 s of CPU time (--cpu-time)"), lines
    assert "bigfile.ipynb: stopped: wrote a file larger than 1 MB (--file-size)" in lines[2], lines
    assert lines[3].endswith("flood.ipynb: stopped: printed more than 1 MB (--max-output)"), lines
    time.sleep(1)
    survivors = alive_processes(token)
    assert not survivors, f"processes {survivors} survived the grading"


# ------------------------------------------------------------ assignment 2 (pullback metrics)


def test_pullback_metrics_checks_accept_the_closed_form_and_reject_sampled_labels(capsys):
    from assignment_cases_pullback_metrics import _fisher_closed_form, _scores

    assert A.check_categorical_fisher(_fisher_closed_form).passed

    def monte_carlo_fisher(model, params, labels):  # 200 sampled labels per example: close, not exact
        S, z = _scores(model, params), model(params)
        y = jax.random.categorical(jax.random.PRNGKey(0), z, axis=-1, shape=(200, *z.shape[:1]))
        s = jnp.take_along_axis(S[None], y[:, :, None, None], axis=2)[:, :, 0]  # (200, N, d)
        return jnp.einsum("kni,knj->ij", s, s) / (200 * z.shape[0])

    report = A.check_categorical_fisher(monte_carlo_fisher)
    assert not report.passed and "is off by" in report.message and "the labels are not used" in report.message
    # the empirical-Fisher check teaches where the two differ: it reports both ranks
    report = A.check_empirical_fisher(CASES["check_empirical_fisher"][0])
    assert report.passed and "rank F_emp = 4 (<= N = 4) against rank F = 8" in report.message, report.message


# ------------------------------------------------------------------- assignment 7 (capstone)


def test_move_heads_accepts_b_k_left_alone():
    # the network does not depend on the key bias: b_k unchanged is as right as b_k -> A b_k
    from assignment_cases_capstone import _move_bk_fixed

    report = A.check_move_heads(_move_bk_fixed)
    assert report.passed, report.message


# ---------------------------------------------- issue 54: reasoning tasks in every assignment

# Per assignment, a task that a submission cannot pass by transcribing what the chapter prints (or,
# for assignment 4, by calling the library's answer, which the grader blocks): {assignment: (check,
# the transcribed answer, words of the hint that names it)}.
TRANSCRIPTIONS = {
    "assignment_01_transformation_rules": (
        "check_chart_gradient_step",
        lambda nu, theta, g, lr: -lr * g,  # the update rule theta - alpha grad, as printed
        "plain gradient descent in theta",
    ),
    "assignment_02_pullback_metrics": (
        "check_fisher_rank",
        lambda N, D, C: min(N, C * D),  # "rank at most N", printed for the empirical Fisher
        "bound of the empirical Fisher",
    ),
    "assignment_03_natural_gradient": (
        "check_gram_rank",
        lambda m, n, k: m * n,  # rank N, task 3.1's full-row-rank case
        "full row rank",
    ),
    "assignment_04_hessian_endomorphism": (
        "check_christoffel_derivation",
        None,  # the library's mg.christoffel_symbols, blocked: shown in a sandboxed process below
        "computes this task's answer",
    ),
    "assignment_05_laplace_evidence": (
        "check_chart_map",
        lambda a, b, nu: a / b,  # the chapter's log-chart example, theta = 3 for Gamma(3, 1)
        "mode in the log chart",
    ),
    "assignment_06_horizontal_projection": (
        "check_vertical_dimension",
        lambda h, r, s: h * h,  # the full-rank case the chapter works with
        "dimension of GL(h)",
    ),
    "assignment_07_capstone": (
        "check_bootstrap_distinct",
        lambda n: n,  # "draw n models with replacement"
        "not n distinct models",
    ),
}


def test_a_transcribing_submission_fails_a_task_of_every_assignment(capsys):
    assert set(TRANSCRIPTIONS) == {p.stem for p in SOLUTIONS}
    grade = _load_grade_module()
    for name, (check, answer, hint) in TRANSCRIPTIONS.items():
        sol = nbformat.read(KIT / "solutions" / f"{name}.ipynb", as_version=4)
        score = [c.source for c in sol.cells if c.cell_type == "code" and "reports = [" in c.source]
        assert score and f"assignments.{check}(" in score[0], (name, check)  # the task is graded
        if answer is None:
            continue
        report = getattr(A, check)(answer)
        assert not report.passed and hint in report.message, (name, report.message)
    # assignment 4: the library's Christoffel symbols answer the task in one call, and the grader's
    # sandbox blocks them; the check then reports the block
    assert "christoffel_symbols" in grade.BLOCKED["assignment_04_hessian_endomorphism"]
    code = (
        "import jax.numpy as jnp\n"
        "import minigeo as mg\n"
        "from minigeo import assignments as A\n"
        "from minigeo.assignments import _sandbox\n"
        "library = lambda C, t: mg.christoffel_symbols(\n"
        "    mg.metrics.dense(lambda x: jnp.diag(jnp.exp(2 * C @ x))), t)\n"
        "assert A.check_christoffel_derivation(library).passed\n"
        "_sandbox.block(['christoffel_symbols'])\n"
        "r = A.check_christoffel_derivation(library)\n"
        "assert not r.passed\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "", "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert TRANSCRIPTIONS["assignment_04_hessian_endomorphism"][2] in run.stdout.splitlines()[-1], run.stdout


def test_grader_asks_the_solution_about_an_instance_only_when_the_answer_failed_on_it():
    """The redraw rule (an unlucky instance) applies to a failed answer, whatever the check measured,
    and never to a function that is missing, unfinished, raising or too slow: the messages are the
    checks' own."""
    grade = _load_grade_module()

    def unfinished(x, y):
        raise NotImplementedError

    def slow(x, y):
        time.sleep(1.5)

    reports = {
        "wrong number": A.check_kendall_tau(lambda x, y: 0.5),
        "wrong interval": A.check_kendall_tau_bootstrap(lambda x, y, key, n, c: (-1.0, 1.0)),
        "unfinished": A.check_kendall_tau(unfinished),
        "raised": A.check_kendall_tau(lambda x, y: 1 / 0),
        "timed out": A.check_kendall_tau(slow, time_limit=0.3),
    }
    assert not any(r.passed for r in reports.values()), reports
    blamed = {k: grade._instance_may_be_to_blame(r.message) for k, r in reports.items()}
    assert blamed == {"wrong number": True, "wrong interval": True, "unfinished": False, "raised": False,
                      "timed out": False}, {k: r.message for k, r in reports.items()}
    assert not grade._instance_may_be_to_blame("FAIL kendall_tau: not run: the notebook process ended earlier")
