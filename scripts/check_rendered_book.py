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
  sphinx-togglebutton) and clicking the first one's toggle button opens it;
* every code cell tagged ``hide-input`` is rendered collapsed: its code in a closed ``<details>``
  with a "Show code cell source" summary, nothing of it outside.

A screenshot of each page is written to ``_build/smoke/`` for a human to look at.

The layout as a reader sees it (issue 37) is measured on every page of the table of contents through
the DevTools protocol (the chapters, the cheat sheet, the notation and API pages among them), at
1280x900 px: code cells (``pre`` in cell inputs) and outputs (``pre`` and HTML in cell outputs) that
scroll sideways, other code blocks that do, display equations wider than the column and those
clipped (not scrollable in their own box), each figure's shrink factor (natural / displayed width)
and the size its text has on screen, figures without a light background in the theme's dark mode;
and, at a 390 px phone width, how far the page scrolls sideways.  The code column's width in
characters is printed too.  A per-page table is printed and written, with screenshots of each page's
worst offenders, of two chapters at both widths and of a figure in dark mode, to
``_build/browser_check/``.  Only the categories whose limit below is not None fail the check.

Usage: ``python scripts/check_rendered_book.py [--build _build/html] [--layout-only]``
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
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

# Layout limits (issue 37), per page, measured at WIDE (and the page scroll at PHONE).
# None: measured and reported, not enforced.  Every page is reformatted (code cells at most 96
# characters, the code column's width printed in the table below; docstring examples at most 88
# characters in methods and 92 in functions, the columns of the API pages; long display equations
# broken; no figure shrunk more than 1.5x; figure text at least 9 px), and every category is
# enforced: a page over a limit fails the check.
MAX_CODE_CELLS_OVERFLOWING: int | None = 0
MAX_OUTPUTS_OVERFLOWING: int | None = 0  # printed output wraps (book/_static/layout.css)
MAX_OTHER_CODE_BLOCKS_OVERFLOWING: int | None = 0  # code blocks outside cells, API examples among them
MAX_EQUATIONS_OVERFLOWING: int | None = 0
MAX_EQUATIONS_CLIPPED: int | None = 0  # a wide equation must at least scroll inside its own box
MAX_IMAGE_SHRINK = 1.5  # natural width / displayed width above which a figure counts as shrunk
MAX_FIGURES_SHRUNK: int | None = 0
MAX_IMAGE_SHRINK_NOW = 2.0  # kept as a second, coarser line: no figure shown at less than half its size
MAX_FIGURES_SHRUNK_NOW: int | None = 0
MIN_FIGURE_FONT_PX: float | None = 9.0  # estimated size of a figure's text on screen
FIGURE_FONT_PT = 10  # matplotlib's default font size (tick labels, legends), for that estimate
MAX_DARK_FIGURES_UNREADABLE: int | None = 0
MIN_DARK_FIGURE_LUMINANCE = 0.9  # the colour behind a figure in dark mode: (near) white for black text
MAX_PHONE_PAGE_SCROLL_PX: int | None = 0
WIDE = (1280, 900)
PHONE = (390, 844)
SHOWCASE_PAGES = ("book/02_pullback_metrics", "book/06_geodesic_sharpness")  # shot whole at both widths


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


def hidden_input_cells(page: str) -> int:
    """How many code cells of the page's notebook are tagged ``hide-input``."""
    nb_path = ROOT / f"{page}.ipynb"
    if not nb_path.exists():
        return 0
    cells = json.loads(nb_path.read_text())["cells"]
    return sum("hide-input" in c.get("metadata", {}).get("tags", []) for c in cells if c["cell_type"] == "code")


def check_hidden_inputs(soup: BeautifulSoup, page: str) -> list[str]:
    """Every ``hide-input`` cell is rendered collapsed: its code inside a closed ``<details>`` with a summary."""
    want = hidden_input_cells(page)
    cells = soup.select("div.cell.tag_hide-input")
    problems = []
    if len(cells) != want:
        problems.append(f"{page}: {len(cells)} cell(s) rendered with a hidden input, the notebook tags {want} hide-input")
    for i, cell in enumerate(cells):
        details = cell.find("details")
        if details is None or details.find(class_="cell_input") is None or details.find("summary") is None:
            problems.append(f"{page}: hidden cell {i + 1} of {len(cells)} does not put its code in a collapsed <details>")
        elif details.has_attr("open"):
            problems.append(f"{page}: hidden cell {i + 1} of {len(cells)} is rendered open")
        elif cell.find(class_="cell_input") is not details.find(class_="cell_input"):
            problems.append(f"{page}: hidden cell {i + 1} of {len(cells)} shows its code outside the collapsed part")
    return problems


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

    problems += check_hidden_inputs(soup, page)
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
        + (f", {hidden_input_cells(page)} hidden inputs collapsed" if hidden_input_cells(page) and not problems else "")
    )
    return problems


# ---------------------------------------------------------------------------------------------
# Layout as a reader sees it (issue 37): measured through the DevTools protocol on a pipe
# (--remote-debugging-pipe; no extra Python package), which also emulates widths below the
# 500 px minimum of a headless window.
# ---------------------------------------------------------------------------------------------


class DevTools:
    """A headless chromium driven through the DevTools protocol over --remote-debugging-pipe."""

    def __init__(self, browser: str, profile: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # chromium reads commands on fd 3 and writes replies on fd 4
        low = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome_r, from_chrome_w)]
        os.close(to_chrome_r)
        os.close(from_chrome_w)

        def wire() -> None:
            os.dup2(low[0], 3)
            os.dup2(low[1], 4)

        flags = [f for f in CHROMIUM_FLAGS if not f.startswith("--virtual-time-budget")]
        self.proc = subprocess.Popen(
            [browser, *flags, "--remote-debugging-pipe", f"--user-data-dir={profile}",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=wire, pass_fds=(3, 4),
        )
        for fd in low:
            os.close(fd)
        self._buf = b""
        self._next_id = 0
        self._events: list[dict] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: bool = False, timeout: float = 60) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method:
                    return self._events.pop(i)
            self._events.append(self._read_message(deadline))

    def viewport(self, width: int, height: int, mobile: bool = False) -> None:
        self._viewport = (width, height, mobile)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}, session=True)

    def open(self, url: str) -> None:
        """Load the page and wait for MathJax's typesetting and a moment for the widget manager."""
        self._events.clear()
        self.call("Page.navigate", {"url": url}, session=True)
        self.wait_event("Page.loadEventFired", timeout=120)
        self.evaluate(SETTLE_JS)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, session=True, timeout=120)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, clip: dict | None = None, full_page: bool = False) -> None:
        params: dict = {"format": "png", "captureBeyondViewport": full_page}
        if clip:
            params["clip"] = {**clip, "scale": 1}
        elif full_page:
            size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": min(size[1], 12000), "scale": 1}
        data = self.call("Page.captureScreenshot", params, session=True, timeout=120)["data"]
        path.write_bytes(base64.b64decode(data))
        if full_page:  # capturing beyond the viewport can leave the emulated viewport resized
            self.viewport(*self._viewport)
            self.evaluate(SETTLE_JS)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


# Waits for MathJax (if any) and then half a second for the widget manager and late layout.
SETTLE_JS = """new Promise(function (done) {
  var ready = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
  ready.then(function () { setTimeout(done, 500); }, function () { setTimeout(done, 500); });
})"""


# Measures the page as laid out now; marks each measured element with data-layout-id for screenshots.
MEASURE_JS = r"""(function () {
  // what a reader can open is measured open: solutions (sphinx-togglebutton) and <details>
  document.querySelectorAll("details").forEach(function (d) { d.open = true; });
  document.querySelectorAll(".toggle-hidden").forEach(function (e) { e.classList.remove("toggle-hidden"); });
  var article = document.querySelector("article.bd-article") || document.querySelector("main") || document.body;
  var nextId = 0;
  function shown(el) { var r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; }
  function all(sel) { return Array.prototype.slice.call(article.querySelectorAll(sel)).filter(shown); }
  function tag(el) { var id = String(nextId++); el.setAttribute("data-layout-id", id); return id; }
  function item(el, extra) {
    var r = el.getBoundingClientRect(), o = {id: tag(el), y: r.top + window.scrollY, height: r.height};
    for (var k in extra) { o[k] = extra[k]; }
    return o;
  }
  function excess(el) { return Math.max(0, el.scrollWidth - el.clientWidth); }
  function scrolls(el) { var o = getComputedStyle(el).overflowX; return o === "auto" || o === "scroll"; }
  var res = {viewport: document.documentElement.clientWidth, code_columns: null, code_font_px: null,
             body_font_px: parseFloat(getComputedStyle(article).fontSize)};
  var inputs = all(".cell_input pre");
  var sample = inputs[0] || all("pre")[0];
  if (sample) {
    var span = document.createElement("span");
    span.textContent = new Array(101).join("0");
    sample.appendChild(span);
    var charPx = span.getBoundingClientRect().width / 100;
    sample.removeChild(span);
    var cs = getComputedStyle(sample);
    var room = sample.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
    res.code_columns = Math.floor(room / charPx + 1e-6);
    res.code_font_px = parseFloat(cs.fontSize);
    res.char_px = charPx;
  }
  function lines(el) { return el.textContent.replace(/\n$/, "").split("\n"); }
  res.inputs = inputs.map(function (p) {
    var ls = lines(p);
    return item(p, {excess: excess(p), longest: Math.max.apply(null, ls.map(function (l) { return l.length; })),
                    long_lines: res.code_columns === null ? 0 :
                      ls.filter(function (l) { return l.length > res.code_columns; }).length});
  });
  res.outputs = all(".cell_output pre, .cell_output .output.text_html").map(function (o) {
    var long = o.tagName === "PRE" && res.code_columns !== null ?
      lines(o).filter(function (l) { return l.length > res.code_columns; }).length : 0;
    return item(o, {excess: excess(o), long_lines: long});
  });
  res.other_pre = all("pre").filter(function (p) { return !p.closest(".cell_input, .cell_output"); })
    .map(function (p) { return item(p, {excess: excess(p)}); });
  res.math = all('mjx-container[display="true"]').map(function (m) {
    var inner = m.querySelector("mjx-math") || m;
    var holder = m.parentElement;
    var room = m.clientWidth || holder.clientWidth;
    var wide = Math.max(0, inner.getBoundingClientRect().width - room);
    // reachable: the equation scrolls (or is scaled down) inside its own box
    return item(m, {excess: wide, clipped: wide > 1 && !(scrolls(m) || scrolls(holder))});
  });
  res.images = all("img").filter(function (i) { return i.naturalWidth > 0 && !/logo/i.test(i.className); })
    .map(function (i) {
      return item(i, {src: i.currentSrc || i.src, natural: i.naturalWidth,
                      shown: i.getBoundingClientRect().width});
    });
  return res;
})()"""

# In the theme's dark mode: the colour behind each figure (the first opaque background from the
# image up), as relative luminance; matplotlib's inline PNGs are transparent with black text.
DARK_JS = r"""(function () {
  document.documentElement.setAttribute("data-theme", "dark");
  document.documentElement.setAttribute("data-mode", "dark");
  function lum(c) {
    var m = c.match(/[\d.]+/g); if (!m) { return null; }
    var a = m.length > 3 ? parseFloat(m[3]) : 1;
    if (a < 0.5) { return null; }
    var ch = m.slice(0, 3).map(function (v) {
      v = parseFloat(v) / 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * ch[0] + 0.7152 * ch[1] + 0.0722 * ch[2];
  }
  return Array.prototype.slice.call(document.querySelectorAll("img[data-layout-id]")).map(function (img) {
    for (var e = img; e; e = e.parentElement) {
      var l = lum(getComputedStyle(e).backgroundColor);
      if (l !== null) { return {id: img.getAttribute("data-layout-id"), luminance: l}; }
    }
    return {id: img.getAttribute("data-layout-id"), luminance: 0};
  });
})()"""

# At a phone's width: how far the page scrolls sideways, and the outermost elements that stick out
# of the viewport outside a box that scrolls (code blocks, equations and tables may scroll inside).
PHONE_JS = r"""(function () {
  var doc = document.documentElement, W = doc.clientWidth;
  var res = {viewport: W, scroll: Math.max(doc.scrollWidth, document.body.scrollWidth) - W, offenders: []};
  function contained(el) {
    for (var e = el.parentElement; e && e !== document.body; e = e.parentElement) {
      var s = getComputedStyle(e);
      if (s.overflowX !== "visible" || s.position === "fixed") { return true; }
    }
    return false;
  }
  var els = document.body.querySelectorAll("*");
  for (var i = 0; i < els.length && res.offenders.length < 5; i++) {
    var el = els[i], r = el.getBoundingClientRect();
    if (r.width === 0 || r.right + window.scrollX <= W + 1) { continue; }
    var s = getComputedStyle(el);
    if (s.position === "fixed" || s.visibility === "hidden" || contained(el)) { continue; }
    var p = el.parentElement.getBoundingClientRect();
    if (p.right + window.scrollX > W + 1 && el.parentElement !== document.body) { continue; }
    res.offenders.push(el.tagName.toLowerCase() + (el.className && el.className.baseVal === undefined ?
      "." + String(el.className).trim().split(/\s+/).join(".") : "") + " (right edge " + Math.round(r.right) + " px)");
  }
  return res;
})()"""


def png_dpi(path: Path) -> float:
    """The resolution a figure was saved at (matplotlib writes it in the PNG's pHYs chunk)."""
    try:
        from PIL import Image

        with Image.open(path) as image:
            dpi = image.info.get("dpi")
        if dpi and dpi[0] > 1:
            return float(dpi[0])
    except Exception:  # noqa: BLE001 - no Pillow, not a PNG: fall back to matplotlib's default
        pass
    return 100.0


def worst(items: list[dict], key: str = "excess") -> dict | None:
    over = [i for i in items if i[key] > 1]
    return max(over, key=lambda i: i[key]) if over else None


def shoot_element(tools: DevTools, item: dict, path: Path, viewport_width: int) -> None:
    """A screenshot of the column around one measured element, outlined in red."""
    where = tools.evaluate(
        f'(function () {{ var e = document.querySelector(\'[data-layout-id="{item["id"]}"]\');'
        ' if (!e) { return null; } e.style.outline = "3px solid red"; e.style.outlineOffset = "-3px";'
        ' e.scrollIntoView({block: "center"}); var r = e.getBoundingClientRect();'
        ' return [r.top + window.scrollY, r.height]; })()'
    ) or [item["y"], item["height"]]
    tools.screenshot(path, clip={"x": 0, "y": max(0.0, where[0] - 80), "width": viewport_width,
                                 "height": min(where[1] + 160, 1600)})


def measure_page(tools: DevTools, html_dir: Path, page: str, shots: Path) -> dict | None:
    html = html_dir / f"{page}.html"
    if not html.exists():
        return None
    url = html.resolve().as_uri()
    name = page.replace("/", "__")
    showcase = page in SHOWCASE_PAGES

    tools.viewport(*WIDE)
    tools.open(url)
    if showcase:
        tools.screenshot(shots / f"{name}__{WIDE[0]}px.png", full_page=True)
    m = tools.evaluate(MEASURE_JS)
    for image in m["images"]:
        image["shrink"] = image["natural"] / max(image["shown"], 1.0)
        src = image["src"]
        dpi = png_dpi(Path(unquote(urlparse(src).path))) if src.startswith("file:") else 100.0
        image["font_px"] = FIGURE_FONT_PT * dpi / 72 / image["shrink"]
    dark = {d["id"]: d["luminance"] for d in tools.evaluate(DARK_JS)}
    for image in m["images"]:
        image["dark_luminance"] = dark.get(image["id"], 1.0)
    if showcase and m["images"]:
        shoot_element(tools, m["images"][0], shots / f"{name}__dark_figure.png", WIDE[0])
    tools.evaluate('document.documentElement.setAttribute("data-theme", "light");'
                   'document.documentElement.setAttribute("data-mode", "light")')

    r = {
        "page": page,
        "code_columns": m["code_columns"],
        "code_font_px": m["code_font_px"],
        "body_font_px": m["body_font_px"],
        "inputs": (sum(i["excess"] > 1 for i in m["inputs"]), len(m["inputs"])),
        "long_lines": sum(i["long_lines"] for i in m["inputs"]),
        "longest_line": max((i["longest"] for i in m["inputs"]), default=0),
        "outputs": (sum(o["excess"] > 1 for o in m["outputs"]), len(m["outputs"])),
        "long_output_lines": sum(o["long_lines"] for o in m["outputs"]),
        "other_pre": (sum(o["excess"] > 1 for o in m["other_pre"]), len(m["other_pre"])),
        "math": (sum(e["excess"] > 1 for e in m["math"]), len(m["math"])),
        "math_clipped": sum(e["clipped"] for e in m["math"]),
        "images": len(m["images"]),
        "max_shrink": max((i["shrink"] for i in m["images"]), default=0.0),
        "shrunk": sum(i["shrink"] > MAX_IMAGE_SHRINK for i in m["images"]),
        "shrunk_now": sum(i["shrink"] > MAX_IMAGE_SHRINK_NOW for i in m["images"]),
        "min_font_px": min((i["font_px"] for i in m["images"]), default=None),
        "dark_unreadable": sum(i["dark_luminance"] < MIN_DARK_FIGURE_LUMINANCE for i in m["images"]),
        "shots": [],
    }
    # the worst offender of each kind on this page, for a human to look at
    offenders = {
        "code": worst(m["inputs"]),
        "output": worst(m["outputs"]),
        "codeblock": worst(m["other_pre"]),
        "equation": worst(m["math"]),
        "figure": worst([{**i, "excess": i["shrink"]} for i in m["images"] if i["shrink"] > MAX_IMAGE_SHRINK]),
    }
    for kind, item in offenders.items():
        if item is not None:
            shot = shots / f"{name}__worst_{kind}.png"
            shoot_element(tools, item, shot, WIDE[0])
            r["shots"].append(shot.name)

    tools.viewport(*PHONE, mobile=True)
    tools.open(url)
    phone = tools.evaluate(PHONE_JS)
    r["phone_scroll"] = phone["scroll"]
    r["phone_offenders"] = phone["offenders"]
    if showcase:
        tools.screenshot(shots / f"{name}__{PHONE[0]}px.png", full_page=True)
    return r


def fraction(pair: tuple[int, int]) -> str:
    return f"{pair[0]}/{pair[1]}" if pair[1] else "-"


def layout_table(results: list[dict]) -> str:
    head = ("| page | code cells overflowing | outputs overflowing | other code blocks overflowing "
            "| equations wider than column (clipped) | figures: max shrink, > "
            f"{MAX_IMAGE_SHRINK}x, min font px | dark-mode figures without white paper | page scroll at {PHONE[0]} px "
            "| code column (chars @ font px) | code lines longer than the column (longest) "
            "| printed lines longer than the column |")
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        fig = (f"{r['max_shrink']:.2f}, {r['shrunk']}/{r['images']}, {r['min_font_px']:.1f}"
               if r["images"] else "-")
        cols = f"{r['code_columns']} @ {r['code_font_px']:.1f}" if r["code_columns"] else "-"
        rows.append(
            f"| {r['page']} | {fraction(r['inputs'])} | {fraction(r['outputs'])} | {fraction(r['other_pre'])} "
            f"| {fraction(r['math'])} ({r['math_clipped']}) | {fig} | {r['dark_unreadable']} "
            f"| {r['phone_scroll']} px | {cols} | {r['long_lines']} ({r['longest_line']}) "
            f"| {r['long_output_lines']} |"
        )
    return "\n".join(rows)


def layout_problems(results: list[dict]) -> list[str]:
    """The measured categories that are enforced (limit not None) and over their limit."""
    problems = []
    for r in results:
        counts = {
            "code cells that scroll sideways": (r["inputs"][0], MAX_CODE_CELLS_OVERFLOWING),
            "outputs that scroll sideways": (r["outputs"][0], MAX_OUTPUTS_OVERFLOWING),
            "other code blocks that scroll sideways": (r["other_pre"][0], MAX_OTHER_CODE_BLOCKS_OVERFLOWING),
            "display equations wider than the column": (r["math"][0], MAX_EQUATIONS_OVERFLOWING),
            "display equations clipped (not scrollable in their own box)": (r["math_clipped"], MAX_EQUATIONS_CLIPPED),
            f"figures shrunk more than {MAX_IMAGE_SHRINK}x": (r["shrunk"], MAX_FIGURES_SHRUNK),
            f"figures shrunk more than {MAX_IMAGE_SHRINK_NOW}x": (r["shrunk_now"], MAX_FIGURES_SHRUNK_NOW),
            "figures without white paper in dark mode": (r["dark_unreadable"], MAX_DARK_FIGURES_UNREADABLE),
            f"px of horizontal page scroll at {PHONE[0]} px": (r["phone_scroll"], MAX_PHONE_PAGE_SCROLL_PX),
        }
        for what, (count, limit) in counts.items():
            if limit is not None and count > limit:
                extra = f": {', '.join(r['phone_offenders'])}" if "page scroll" in what and r["phone_offenders"] else ""
                problems.append(f"{r['page']}: {count} {what} (limit {limit}){extra}")
        if (MIN_FIGURE_FONT_PX is not None and r["min_font_px"] is not None
                and r["min_font_px"] < MIN_FIGURE_FONT_PX):
            problems.append(f"{r['page']}: a figure's text is about {r['min_font_px']:.1f} px on screen "
                            f"(limit {MIN_FIGURE_FONT_PX} px)")
    return problems


def check_layout(browser: str, html_dir: Path, shots: Path) -> list[str]:
    shots.mkdir(parents=True, exist_ok=True)
    for old in shots.glob("*.png"):
        old.unlink()
    results = []
    with tempfile.TemporaryDirectory() as profile:
        tools = DevTools(browser, profile)
        try:
            for page in toc_pages():
                r = measure_page(tools, html_dir, page, shots)
                if r is not None:
                    results.append(r)
        finally:
            tools.close()
    table = layout_table(results)
    (shots / "layout.md").write_text(table + "\n")
    (shots / "layout.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nLayout at {WIDE[0]}x{WIDE[1]} px (and page scroll at {PHONE[0]} px); "
          f"screenshots and layout.md in {shots}:")
    print(table)
    worst_shots = [s for r in results for s in r["shots"]]
    if worst_shots:
        print(f"  worst offenders (screenshots): {', '.join(worst_shots[:12])}"
              + (f" and {len(worst_shots) - 12} more" if len(worst_shots) > 12 else ""))
    return layout_problems(results)


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=str(ROOT / "_build" / "html"), help="the built HTML folder")
    parser.add_argument("--layout-only", action="store_true",
                        help="only the layout measurements (for iterating on the theme's CSS)")
    args = parser.parse_args()
    html_dir = Path(args.build)
    if not (html_dir / "index.html").exists():
        print(f"check_rendered_book: {html_dir}/index.html is missing; build the book first.")
        return 1
    browser = find_chromium()
    shots = ROOT / "_build" / "smoke"
    shots.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    if not args.layout_only:
        with tempfile.TemporaryDirectory() as profile:
            for page in toc_pages():
                problems += check_page(browser, html_dir, page, shots, profile)
    layout_shots = ROOT / "_build" / "browser_check"
    problems += check_layout(browser, html_dir, layout_shots)
    if problems:
        print("\nRendered-book smoke check FAILED:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"Rendered-book smoke check passed ({len(toc_pages())} pages); screenshots in {shots} "
          f"and {layout_shots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
