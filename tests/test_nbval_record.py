"""The notebooks run once in CI: nbval executes them, the book build renders those outputs.

Tested end to end on small notebooks in a temporary folder, with the repository's ``conftest.py``
(the recorder), ``scripts/cache_executed_notebooks.py`` and a real ``jupyter-book build``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from cache_executed_notebooks import cache_executed  # noqa: E402

pytestmark = pytest.mark.slow

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}

# printed text, then a figure-like display, then text again, a progress bar on stderr, and a value
CELLS = [
    "import uuid\nprint('first line')\nfrom IPython.display import display, Markdown\n"
    "display(Markdown('**shown between**'))\nprint('after the display')",
    "import sys\nfor i in range(3):\n    sys.stderr.write(f'\\rprogress {i}/3')\n_ = sys.stderr.write('\\rprogress 3/3\\n')",
    "print('run', uuid.uuid4().hex)",
    "6 * 7",
]


def make_notebook(folder: Path, name: str = "nb.ipynb", checked_output: str | None = None) -> Path:
    nb = new_notebook(cells=[new_markdown_cell("# A small notebook")] + [new_code_cell(s) for s in CELLS])
    nb.metadata["kernelspec"] = KERNELSPEC
    if checked_output is not None:  # a checked cell whose saved output is checked_output
        cell = new_code_cell("print(2 + 2)", metadata={"tags": ["nbval-check-output"]})
        cell.execution_count = 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=checked_output)]
        nb.cells.append(cell)
    path = folder / name
    nbformat.write(nb, str(path))
    return path


def run_nbval(folder: Path, record: Path, *notebooks: Path) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "conftest.py", folder / "conftest.py")
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
           "-q", "--rootdir", str(folder), "--nbval-record", str(record), *map(str, notebooks)]
    return subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("book")
    good = make_notebook(folder, "good.ipynb", checked_output="4\n")
    bad = make_notebook(folder, "bad.ipynb", checked_output="5\n")
    record = folder / "recorded"
    result = run_nbval(folder, record, good, bad)
    return folder, record, result


def test_a_passing_notebook_is_written_with_its_outputs_in_order(recorded):
    folder, record, result = recorded
    assert "1 failed" in result.stdout, result.stdout[-2000:]  # bad.ipynb's checked cell
    nb = nbformat.read(str(record / "good.ipynb"), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, 2, 3, 4, 5]
    kinds = [(o.output_type, o.get("name")) for o in code[0].outputs]
    assert kinds == [("stream", "stdout"), ("display_data", None), ("stream", "stdout")]
    assert code[0].outputs[0].text == "first line\n"
    assert code[0].outputs[1].data["text/markdown"] == "**shown between**"
    assert code[1].outputs == [nbformat.v4.new_output("stream", name="stderr", text="progress 3/3\n")]
    assert re.fullmatch(r"run [0-9a-f]{32}\n", code[2].outputs[0].text)
    assert code[3].outputs[0].output_type == "execute_result"
    assert code[3].outputs[0].execution_count == 4 and code[3].outputs[0].data["text/plain"] == "42"
    assert nb.metadata["nbval_record"]["execution_seconds"] > 0
    # the markdown cells and the cell metadata are the source's
    assert nb.cells[0].source == "# A small notebook"
    assert code[4].metadata["tags"] == ["nbval-check-output"]


def test_a_failing_notebook_is_not_written(recorded):
    _, record, _ = recorded
    assert not (record / "bad.ipynb").exists()


def test_a_notebook_edited_after_the_run_is_not_cached(recorded, tmp_path):
    folder, record, _ = recorded
    book = tmp_path / "book"
    book.mkdir()
    edited = nbformat.read(str(folder / "good.ipynb"), as_version=4)
    edited.cells[2].source += "\nprint('edited')"
    nbformat.write(edited, str(book / "good.ipynb"))
    assert cache_executed(record, tmp_path / "cache", book=book) == []
    shutil.copy(folder / "good.ipynb", book / "good.ipynb")
    assert cache_executed(record, tmp_path / "cache", book=book) == ["good.ipynb"]


def test_the_book_build_renders_the_recorded_outputs_without_executing(recorded, tmp_path):
    folder, record, _ = recorded
    book = tmp_path / "minibook"
    book.mkdir()
    shutil.copy(folder / "good.ipynb", book / "good.ipynb")
    (book / "_config.yml").write_text(
        "title: t\nonly_build_toc_files: true\nexecute:\n  execute_notebooks: cache\n  allow_errors: false\n"
    )
    (book / "_toc.yml").write_text("format: jb-book\nroot: good\n")
    assert cache_executed(record, book / "_build" / ".jupyter_cache", book=book) == ["good.ipynb"]
    build = subprocess.run([str(Path(sys.executable).parent / "jupyter-book"), "build", str(book), "-W", "-n"],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    html = (book / "_build" / "html" / "good.html").read_text()
    recorded_run = nbformat.read(str(record / "good.ipynb"), as_version=4).cells[3].outputs[0].text.strip()
    assert recorded_run in html  # a fresh execution would have printed another uuid
    assert html.index("first line") < html.index("shown between") < html.index("after the display")
