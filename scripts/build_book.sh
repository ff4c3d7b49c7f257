#!/usr/bin/env bash
# Set up the environment and build the book, executing every notebook.
# Fails on any Sphinx warning (-W -n) and on any failing or timed-out cell.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" JAX_PLATFORMS=cpu
rm -rf _build
jupyter-book build . -W -n --keep-going
test -f _build/html/index.html || { echo "build_book: _build/html/index.html missing"; exit 1; }
echo "build_book: open _build/html/index.html"
