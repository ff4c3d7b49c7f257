"""Repository-wide pytest hooks: record the notebooks that nbval executes.

``python -m pytest --nbval-lax ... book/ --nbval-record DIR`` keeps the outputs of every cell that
nbval runs and, for each notebook whose cells all ran without an error or a mismatch, writes the
executed notebook to ``DIR`` (outputs in order, execution counts 1, 2, ..., the wall time of its
cells in ``metadata["nbval_record"]["execution_seconds"]``). ``scripts/cache_executed_notebooks.py``
then puts them in the book build's jupyter-cache, so that ``jupyter-book build``
(``execute_notebooks: cache``) shows the outputs nbval has just produced instead of executing every
notebook a second time. A notebook that failed, or that nbval did not run, is not written: the build
executes it itself. ``scripts/test.sh`` uses this; ``tests/test_nbval_record.py`` tests it.

nbval 0.11 (pinned in requirements.txt) merges all of a cell's stream outputs into one before it
compares them, which moves printed text above the figures printed before it. The recorder keeps
the outputs as they arrived instead (wrapping ``nbval.plugin.coalesce_streams``) and only merges
adjacent outputs of the same stream, resolving carriage returns and backspaces (progress bars) as
nbval does.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

RECORD_KEY = "nbval_record"
_RAW: dict[int, list] = {}  # id(output list) -> its outputs in arrival order, before nbval merges them


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--nbval-record",
        metavar="DIR",
        default=None,
        help="write each notebook that nbval executed without a failure, with its outputs, to DIR",
    )


def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("--nbval-record", default=None)
    if out is None:
        return
    import nbval.plugin

    original = nbval.plugin.coalesce_streams
    if not getattr(original, "_keeps_raw_outputs", False):

        def coalesce_streams(outputs):
            _RAW[id(outputs)] = copy.deepcopy(list(outputs))
            return original(outputs)

        coalesce_streams._keeps_raw_outputs = True  # type: ignore[attr-defined]
        coalesce_streams._original = original  # type: ignore[attr-defined]
        nbval.plugin.coalesce_streams = coalesce_streams
    config.pluginmanager.register(NotebookRecorder(Path(out)), "nbval-record")


def merge_adjacent_streams(outputs: list) -> list:
    """Merge consecutive outputs of one stream; resolve ``\\r`` and ``\\b`` as nbval does."""
    import nbval.plugin

    coalesce = getattr(nbval.plugin.coalesce_streams, "_original", nbval.plugin.coalesce_streams)
    merged: list = []
    for output in outputs:
        output = copy.deepcopy(output)
        last = merged[-1] if merged else None
        if (
            output.output_type == "stream"
            and last is not None
            and last.output_type == "stream"
            and last.name == output.name
        ):
            last.text += output.text
        else:
            merged.append(output)
    return [coalesce([o])[0] if o.output_type == "stream" else o for o in merged]


class NotebookRecorder:
    """Collects nbval's cell outputs per notebook and writes each notebook that fully passed."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.runs: dict[Path, dict] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        from nbval.plugin import IPyNbCell

        if not isinstance(item, IPyNbCell):
            return
        report = outcome.get_result()
        run = self.runs.setdefault(
            item.parent.path, {"outputs": {}, "failed": False, "start": call.start, "stop": call.stop}
        )
        if report.failed or report.skipped:
            run["failed"] = True
        if call.when != "call" or run["failed"]:
            return
        raw = _RAW.get(id(item.test_outputs))
        run["outputs"][item.cell_num] = merge_adjacent_streams(raw if raw is not None else item.test_outputs)
        run["stop"] = call.stop

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        from nbval.plugin import IPyNbCell

        _RAW.clear()
        if not isinstance(item, IPyNbCell):
            return
        run = self.runs.get(item.parent.path)
        n_code = sum(c.cell_type == "code" for c in item.parent.nb.cells)
        if run is None or run["failed"] or len(run["outputs"]) != n_code or run.get("written"):
            return
        self.write(item.parent.nb, item.parent.path, run)
        run["written"] = True

    def write(self, source_nb, path: Path, run: dict) -> None:
        import nbformat

        nb = copy.deepcopy(source_nb)
        count = 0
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            outputs = copy.deepcopy(run["outputs"][count])
            count += 1
            cell.execution_count = count
            for output in outputs:
                if output.output_type == "execute_result":
                    output.execution_count = count
            cell.outputs = outputs
        nb.metadata[RECORD_KEY] = {"execution_seconds": round(run["stop"] - run["start"], 2)}
        nbformat.validate(nb)
        self.out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(self.out / path.name))
