#!/usr/bin/env python
"""Print the built HTML book to one PDF, offline.

Every page of the table of contents is loaded from disk by Debian's ``chromium`` (headless), which
runs the page's JavaScript (MathJax renders the math; the chapters' sliders are skipped in batch
execution, and the static figure beside each shows its settings) and prints it with the theme's print
style (no navigation bars). The pages are joined in table-of-contents order with ``pypdf``, with one
bookmark per page, into ``_build/html/geometry-of-parameter-spaces.pdf``, which the intro page
links to. Nothing is downloaded.

Usage: ``python scripts/build_pdf.py [--build _build/html]``
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from pypdf import PdfReader, PdfWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_rendered_book import built_html_dir, chromium, find_chromium, toc_pages  # noqa: E402

PDF_NAME = "geometry-of-parameter-spaces.pdf"


def page_title(html: Path) -> str:
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html.read_text(), "html.parser")
    h1 = soup.find("h1")
    text = h1.get_text(" ", strip=True) if h1 else html.stem
    return text.rstrip("#").strip()


def main() -> int:
    html_dir = built_html_dir(__doc__.splitlines()[0], "build_pdf")
    if html_dir is None:
        return 1
    browser = find_chromium()
    writer = PdfWriter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, page in enumerate(toc_pages()):
            html = html_dir / f"{page}.html"
            out = Path(tmp) / f"{i:03d}.pdf"
            result = chromium(
                browser, ["--no-pdf-header-footer", f"--print-to-pdf={out}", html.resolve().as_uri()],
                str(Path(tmp) / "profile"),
            )
            if not out.exists() or out.stat().st_size < 1_000:
                print(f"build_pdf: chromium could not print {page}: {result.stderr[-500:]}")
                return 1
            start = len(writer.pages)
            writer.append(PdfReader(out))
            writer.add_outline_item(page_title(html), start)
    writer.add_metadata({"/Title": "Geometry of Parameter Spaces"})
    target = html_dir / PDF_NAME
    with target.open("wb") as fh:
        writer.write(fh)
    print(f"build_pdf: {len(writer.pages)} pages from {len(toc_pages())} chapters and pages -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
