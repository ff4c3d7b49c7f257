#!/usr/bin/env bash
# Set up the environment and build the book, executing every notebook.
# Fails on any Sphinx warning (-W -n) and on any failing or timed-out cell. Then prints the
# whole book to _build/html/geometry-of-parameter-spaces.pdf (offline, headless chromium).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# MINIGEO_BOOK_BATCH=1: the chapters' slider cells print a note instead of starting ipywidgets'
# interact, which can deadlock a non-interactive notebook client (jupyter/nbclient#312)
export PATH="$PWD/.venv/bin:$PATH" JAX_PLATFORMS=cpu MINIGEO_BOOK_BATCH=1
rm -rf _build
jupyter-book build . -W -n --keep-going
test -f _build/html/index.html || { echo "build_book: _build/html/index.html missing"; exit 1; }
bash scripts/install_chromium.sh
python scripts/build_pdf.py
echo "build_book: open _build/html/index.html"
