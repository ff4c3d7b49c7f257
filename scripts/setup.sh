#!/usr/bin/env bash
# Create .venv (if missing) and install the pinned requirements plus minigeo (editable).
# Used by build_book.sh and test.sh; safe to run repeatedly.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r requirements.txt
.venv/bin/python -m pip install --quiet --no-deps --editable .
echo "setup: .venv ready ($(.venv/bin/python -c 'import jax, minigeo; print("jax", jax.__version__, "minigeo", minigeo.__version__)'))"
