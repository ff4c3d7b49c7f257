#!/usr/bin/env bash
# The newest-JAX lane (issue 50): what a Colab user gets, ahead of CI's pins.
#
#   bash scripts/test_newest_jax.sh
#
# Creates .venv-newest with Python 3.12 (PYTHON=... to choose another interpreter), installs
# requirements.txt's pins except jax and jaxlib, then the newest jax and jaxlib on the package
# index, and minigeo; runs the quick lane (unit tests not marked slow, docstring examples but the
# assignment checkers') and executes chapter 1 under nbval. CI (.ci/run) runs the pinned lane only;
# the README records this lane's last result.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${PYTHON:-}" ]; then  # python3.12 on PATH, else pyenv's newest 3.12
  if python3.12 --version > /dev/null 2>&1; then
    PYTHON=python3.12
  elif command -v pyenv > /dev/null && V=$(pyenv latest 3.12 2> /dev/null); then
    PYTHON="$(pyenv prefix "$V")/bin/python3.12"
  else
    echo "newest-jax: no Python 3.12 found; set PYTHON=/path/to/python3.12" >&2
    exit 2
  fi
fi
VENV=.venv-newest
if [ ! -x "$VENV/bin/python" ]; then
  echo "newest-jax: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
REQ=$(mktemp)
trap 'rm -f "$REQ"' EXIT
grep -v -E '^(jax|jaxlib)==' requirements.txt > "$REQ"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -r "$REQ"
"$VENV/bin/python" -m pip install --quiet --upgrade jax jaxlib
"$VENV/bin/python" -m pip install --quiet --no-deps --editable .
export PATH="$PWD/$VENV/bin:$PATH" JAX_PLATFORMS=cpu MINIGEO_BOOK_BATCH=1
python -c 'import sys, jax, minigeo; print("newest-jax: python", sys.version.split()[0], "jax", jax.__version__, "minigeo", minigeo.__version__)'
echo "== newest-jax 1/3 unit tests (not slow)"
python -m pytest tests -m "not slow" -q -n 2 --dist loadfile -p no:cacheprovider
echo "== newest-jax 2/3 docstring examples (not the assignment checkers')"
python -m pytest --doctest-modules minigeo -o doctest_optionflags="ELLIPSIS NORMALIZE_WHITESPACE" -p no:cacheprovider -q \
    -n 2 --dist loadfile --ignore=minigeo/assignments
echo "== newest-jax 3/3 chapter 1 executed (nbval)"
python -m pytest --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
    book/01_vectors_and_covectors.ipynb -p no:cacheprovider -q
echo "test_newest_jax: all checks passed"
