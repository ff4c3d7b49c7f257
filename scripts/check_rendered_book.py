#!/usr/bin/env python
"""Headless-browser smoke check of the rendered book (no internet needed).

For every page in the table of contents, Debian's ``chromium`` loads the built
HTML from disk, runs its JavaScript (MathJax, the widget manager) and dumps the
resulting DOM.  The check fails unless, on every page:

* the page loads and has its title;
* every ``<script src>`` is a local file that exists (nothing from a CDN);
* MathJax rendered the math: ``mjx-container`` elements are present where the
  source has math, and no raw ``$$``, ``\\(`` or ``\\[`` delimiters remain in
  the visible text;
* every figure the notebook produced is an ``<img>`` whose file exists, and the
  number of figures matches the number of image outputs in the notebook;
* pages whose notebook has an ipywidget render it (the widget manager ran);
* no JavaScript error is raised while the page loads and runs (a probe copy of the page records
  ``error`` and ``unhandledrejection`` events);
* the intro page links the PDF of the book (``scripts/build_pdf.py``), which exists and has a
  page for every page of the table of contents;
* the execution-status page lists every notebook of the book, each executed without error;
* on pages with exercises, every solution is collapsed (sphinx-exercise dropdown, toggled by
  sphinx-togglebutton) and clicking the first one's toggle button opens it.

A screenshot of each page is written to ``_build/smoke/`` for a human to look at.

Usage: ``python scripts/check_rendered_book.py [--build _build/html]``
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import yaml
from bs4 import BeautifulSoup

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--virtual-time-budget=15000",
]
RAW_MATH = re.compile(r"\$\$|\\\(|\\\)|\\\[|\\\]")


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("check_rendered_book: chromium not found; install it with `apt-get install -y chromium`.")


def toc_pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]]
    def walk(entries: list[dict]) -> None:
        for entry in entries:
            pages.append(entry["file"])
            walk(entry.get("sections", []))  # e.g. the API reference's per-module pages

    for part in toc.get("parts", []):
        walk(part.get("chapters", []))
    return pages


def chromium(browser: str, args: list[str], profile: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def notebook_facts(page: str) -> tuple[int, bool]:
    """(number of image outputs, whether a widget is displayed) of the page's notebook."""
    nb_path = ROOT / f"{page}.ipynb"
    if not nb_path.exists():
        return 0, False
    nb = json.loads(nb_path.read_text())
    images, widget = 0, False
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        if "remove-output" in tags or "remove-cell" in tags:
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if any(k.startswith("image/") for k in data):
                images += 1
            if "application/vnd.jupyter.widget-view+json" in data:
                widget = True
    return images, widget


def source_has_math(page: str) -> bool:
    for suffix in (".ipynb", ".md"):
        path = ROOT / f"{page}{suffix}"
        if path.exists():
            text = path.read_text()
            return "$" in text or "{math}" in text
    return False


def local_target(html: Path, src: str) -> Path:
    """The file a local ``src`` attribute points to (relative path or file:// URI)."""
    src = src.split("?")[0].split("#")[0]
    if src.startswith("file://"):
        return Path(unquote(urlparse(src).path))
    return (html.parent / unquote(src)).resolve()


def visible_text(soup: BeautifulSoup) -> str:
    for tag in soup(
        ["script", "style", "pre", "code", "mjx-container", "mjx-assistive-mml", "noscript", "textarea"]
    ):
        tag.decompose()
    return soup.get_text(" ")


PROBE_HEAD = """<script>window.__probeErrors = [];
window.addEventListener("error", function (e) {
  if (e instanceof ErrorEvent) { window.__probeErrors.push(String(e.message)); }
}, true);
window.addEventListener("unhandledrejection", function (e) {
  window.__probeErrors.push("unhandled promise rejection: " + String(e.reason));
});</script>"""
PROBE_BODY = """<script>window.addEventListener("load", function () {
  setTimeout(function () {
    var sols = Array.prototype.slice.call(document.querySelectorAll("div.solution"));
    var r = {solutions: sols.length,
             collapsed: sols.filter(function (s) { return s.classList.contains("toggle-hidden"); }).length,
             opened: null};
    var button = sols.length ? sols[0].querySelector("button.toggle-button") : null;
    if (button) { button.click(); r.opened = !sols[0].classList.contains("toggle-hidden"); }
    r.errors = window.__probeErrors;
    var out = document.createElement("pre");
    out.id = "__probe__";
    out.textContent = JSON.stringify(r);
    document.body.appendChild(out);
  }, 3000);
});</script>"""


def probe_page(browser: str, html: Path, page: str, profile: str) -> list[str]:
    """Load a copy of the page with error listeners and a click on the first solution toggle."""
    text = html.read_text()
    probe = html.with_name(f"{html.stem}.__probe__.html")
    probe.write_text(
        text.replace("<head>", "<head>" + PROBE_HEAD, 1).replace("</body>", PROBE_BODY + "</body>", 1)
    )
    try:
        dom = chromium(browser, ["--dump-dom", probe.resolve().as_uri()], profile)
    finally:
        probe.unlink()
    found = BeautifulSoup(dom.stdout, "html.parser").find(id="__probe__")
    if found is None:
        return [f"{page}: the probe script did not run (page load never finished?)"]
    result = json.loads(found.get_text())
    problems = [f"{page}: JavaScript error: {e}" for e in result["errors"]]
    if solutions_in_source(page):
        if result["solutions"] == 0:
            problems.append(f"{page}: the source has solutions but the page rendered none")
        elif result["collapsed"] != result["solutions"]:
            problems.append(
                f"{page}: {result['solutions'] - result['collapsed']} solution(s) are not collapsed"
            )
        elif result["opened"] is not True:
            problems.append(f"{page}: clicking the first solution's toggle did not open it")
    return problems


def check_pdf_link(soup: BeautifulSoup, html: Path, page: str) -> list[str]:
    from pypdf import PdfReader

    links = [a["href"] for a in soup.find_all("a", href=True) if a["href"].split("#")[0].endswith(".pdf")]
    if not links:
        return [f"{page}: no link to the PDF of the book"]
    pdf = local_target(html, links[0])
    if not pdf.exists():
        return [f"{page}: the PDF link {links[0]} points at a missing file (run scripts/build_pdf.py)"]
    n_pages = len(PdfReader(pdf).pages)
    if n_pages < len(toc_pages()):
        return [f"{page}: the PDF has {n_pages} pages for {len(toc_pages())} pages of the book"]
    print(f"  PDF: {pdf.name}, {n_pages} pages")
    return []


def check_status_table(soup: BeautifulSoup, page: str) -> list[str]:
    """The nb-exec-table has one row per notebook in the TOC, each with a passing status."""
    notebooks = {p.split("/")[-1] for p in toc_pages() if (ROOT / f"{p}.ipynb").exists()}
    table = soup.find("table")
    if table is None:
        return [f"{page}: no execution-status table"]
    rows = {}
    for tr in table.find_all("tr")[1:]:
        cells = [td.get_text(" ", strip=True) for td in tr.find_all("td")]
        if cells:
            rows[cells[0].split("/")[-1]] = cells[-1]
    problems = [f"{page}: {nb} is missing from the status table" for nb in sorted(notebooks - set(rows))]
    problems += [f"{page}: {nb} did not pass ({status!r})" for nb, status in rows.items() if "✅" not in status]
    return problems


def solutions_in_source(page: str) -> bool:
    path = ROOT / f"{page}.ipynb"
    return path.exists() and "{solution-start}" in path.read_text()


def check_page(browser: str, html_dir: Path, page: str, shots: Path, profile: str) -> list[str]:
    problems: list[str] = []
    html = html_dir / f"{page}.html"
    if not html.exists():
        return [f"{page}: {html} was not built"]
    url = html.resolve().as_uri()
    dom = chromium(browser, ["--dump-dom", url], profile)
    if dom.returncode != 0 or "<html" not in dom.stdout:
        return [f"{page}: chromium could not load the page (rc={dom.returncode}): {dom.stderr[-500:]}"]
    soup = BeautifulSoup(dom.stdout, "html.parser")
    if not soup.title or not soup.title.get_text(strip=True):
        problems.append(f"{page}: page has no title")

    for script in soup.find_all("script", src=True):
        src = script["src"]
        if re.match(r"^(https?:)?//", src):
            problems.append(f"{page}: script loaded from the network: {src}")
            continue
        if not local_target(html, src).exists():
            problems.append(f"{page}: script {src} does not exist on disk")

    if source_has_math(page):
        n_math = len(soup.find_all("mjx-container"))
        if n_math == 0:
            problems.append(f"{page}: the source has math but MathJax rendered none (no mjx-container)")
    raw = RAW_MATH.findall(visible_text(BeautifulSoup(dom.stdout, "html.parser")))
    if raw:
        problems.append(f"{page}: {len(raw)} raw math delimiter(s) left in the visible text, e.g. {raw[:3]}")

    expected_images, has_widget = notebook_facts(page)
    imgs = [img for img in soup.find_all("img") if "logo" not in " ".join(img.get("class", []))]
    figures = [img for img in imgs if "_images/" in img.get("src", "")]
    for img in imgs:
        src = img.get("src", "")
        if src.startswith("data:"):
            continue
        if not local_target(html, src).exists():
            problems.append(f"{page}: image {src} does not exist on disk")
    if len(figures) < expected_images:
        problems.append(f"{page}: {len(figures)} figure(s) rendered, the notebook has {expected_images}")
    if has_widget and not soup.select(".jupyter-widgets, .widget-container, .widget-inline-hbox"):
        problems.append(f"{page}: the notebook displays an ipywidget but the page rendered none")

    problems += probe_page(browser, html, page, profile)
    if page == "book/status":
        problems += check_status_table(soup, page)
    if page == toc_pages()[0]:
        problems += check_pdf_link(soup, html, page)

    shot = shots / (page.replace("/", "__") + ".png")
    chromium(browser, [f"--screenshot={shot}", "--window-size=1280,2400", url], profile)
    if not shot.exists() or shot.stat().st_size < 10_000:
        problems.append(f"{page}: screenshot failed or is blank")
    status = "ok" if not problems else "FAIL"
    print(
        f"[{status}] {page}: {len(soup.find_all('mjx-container'))} math, {len(figures)} figures"
        + (", widget" if has_widget else "")
        + (", solutions collapsed and toggle opens" if solutions_in_source(page) and not problems else "")
    )
    return problems


def built_html_dir(description: str, who: str) -> Path | None:
    """The ``--build`` folder from the command line, or None (with a message) if it was not built."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--build", default=str(ROOT / "_build" / "html"), help="the built HTML folder")
    html_dir = Path(parser.parse_args().build)
    if not (html_dir / "index.html").exists():
        print(f"{who}: {html_dir}/index.html is missing; build the book first.")
        return None
    return html_dir


def main() -> int:
    html_dir = built_html_dir(__doc__.splitlines()[0], "check_rendered_book")
    if html_dir is None:
        return 1
    browser = find_chromium()
    shots = ROOT / "_build" / "smoke"
    shots.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as profile:
        for page in toc_pages():
            problems += check_page(browser, html_dir, page, shots, profile)
    if problems:
        print("\nRendered-book smoke check FAILED:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"Rendered-book smoke check passed ({len(toc_pages())} pages); screenshots in {shots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
