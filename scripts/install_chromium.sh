#!/usr/bin/env bash
# Install Debian's chromium if it is missing: the headless browser that prints the book to PDF
# (scripts/build_pdf.py) and checks the rendered pages (scripts/check_rendered_book.py).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  echo "install_chromium: installing Debian's chromium"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
