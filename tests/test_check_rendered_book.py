"""The browser check's test of collapsed cells (scripts/check_rendered_book.py), on synthetic pages."""

import json
import sys
from pathlib import Path

from bs4 import BeautifulSoup

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import check_rendered_book as check  # noqa: E402

PAGE = "book/01_vectors_and_covectors"
CODE = '<div class="cell_input docutils container"><pre>plt.plot(x)</pre></div>'
COLLAPSED = ('<div class="cell tag_hide-input docutils container"><details class="admonition hide above-input">'
             '<summary><p>Show code cell source</p></summary>' + CODE + '</details>'
             '<div class="cell_output"></div></div>')


def page(*cells: str) -> BeautifulSoup:
    return BeautifulSoup("<html><body>" + "".join(cells) + "</body></html>", "html.parser")


def test_the_count_is_read_from_the_notebook():
    nb = json.loads((ROOT / f"{PAGE}.ipynb").read_text())
    tagged = [c for c in nb["cells"] if "hide-input" in c.get("metadata", {}).get("tags", [])]
    assert check.hidden_input_cells(PAGE) == len(tagged) > 0


def test_collapsed_cells_pass_and_each_kind_of_failure_is_reported():
    n = check.hidden_input_cells(PAGE)
    assert check.check_hidden_inputs(page(*[COLLAPSED] * n), PAGE) == []
    opened = COLLAPSED.replace('<details class', '<details open class')
    assert "rendered open" in " ".join(check.check_hidden_inputs(page(opened, *[COLLAPSED] * (n - 1)), PAGE))
    visible = COLLAPSED.replace("</details>", "</details>" + CODE).replace(CODE + "</details>", "</details>")
    assert "does not put its code" in " ".join(check.check_hidden_inputs(page(visible, *[COLLAPSED] * (n - 1)), PAGE))
    assert "the notebook tags" in " ".join(check.check_hidden_inputs(page(*[COLLAPSED] * (n - 1)), PAGE))
