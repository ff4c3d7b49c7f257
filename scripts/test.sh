#!/usr/bin/env bash
# Set up the environment and run every test:
#   1. minigeo unit tests (float64, tests/) and nbval over every chapter notebook, in one pytest
#      process (nbval re-executes the notebooks, compares tagged outputs, and records each notebook
#      that passed with its fresh outputs: conftest.py's --nbval-record)
#   2. the executed examples in minigeo's docstrings (doctest, float32)
#   3. the book build with -W -n (any Sphinx warning or failing cell fails), and its PDF; the
#      notebooks nbval has just executed come from jupyter-cache (scripts/cache_executed_notebooks.py),
#      so each notebook executes once per run; one that was not recorded is executed by the build
#   4. a headless-browser smoke check of the rendered pages (offline)
#
# bash scripts/test.sh --quick   the day-to-day lane: step 1's unit tests without those marked `slow`
#                                (tests/conftest.py marks the notebook, packaging, parity and ViT
#                                modules slow, and the tests listed in tests/slow_tests.txt, which
#                                scripts/slow_tests.py writes from a full run's durations) and
#                                step 2; CI always runs everything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# the stage table (issue 50): each stage's wall time, printed at the end, also when a stage fails
STAGE_LOG=$(mktemp)
RUN_T0=$(date +%s)
STAGE_NAME="setup (venv, test extras, chromium)"
STAGE_T0=$RUN_T0
stage() {  # stage "name": close the running stage, open the next
    echo "$STAGE_NAME|$(( $(date +%s) - STAGE_T0 ))" >> "$STAGE_LOG"
    STAGE_NAME="$1"
    STAGE_T0=$(date +%s)
    echo "== $1"
}
stage_table() {
    local status=$?
    echo "$STAGE_NAME|$(( $(date +%s) - STAGE_T0 ))$([ $status -ne 0 ] && echo ' (failed)')" >> "$STAGE_LOG"
    echo
    echo "| stage | wall time |"
    echo "| --- | ---: |"
    while IFS='|' read -r name secs; do
        printf '| %s | %d:%02d%s |\n' "$name" "$(( ${secs%% *} / 60 ))" "$(( ${secs%% *} % 60 ))" "${secs#${secs%% *}}"
    done < "$STAGE_LOG"
    local total=$(( $(date +%s) - RUN_T0 ))
    printf '| **total** | **%d:%02d** |\n' "$(( total / 60 ))" "$(( total % 60 ))"
    if [ -n "${PARITY_NOTE:-}" ]; then echo "parity tests against timm and OpenCLIP: $PARITY_NOTE"; fi
    rm -f "$STAGE_LOG"
}
bash scripts/setup.sh
if [ "${1:-}" = "--quick" ]; then
    export PATH="$PWD/.venv/bin:$PATH" JAX_PLATFORMS=cpu MINIGEO_BOOK_BATCH=1
    echo "== quick 1/2 unit tests (not slow)"
    python -m pytest tests -m "not slow" -q -n 2 --dist loadfile
    # the assignment checkers' examples grade whole reference solutions (10-40 s each): they run
    # in the full run only; tests/test_assignments.py covers the checkers
    echo "== quick 2/2 docstring examples (not the assignment checkers')"
    python -m pytest --doctest-modules minigeo -o doctest_optionflags="ELLIPSIS NORMALIZE_WHITESPACE" -p no:cacheprovider -q \
        -n 2 --dist loadfile --ignore=minigeo/assignments
    rm -f "$STAGE_LOG"
    echo "test --quick: all checks passed"
    exit 0
fi
# test-only extras: torch/torchvision/timm/open_clip_torch for the timm and OpenCLIP parity tests of
# minigeo.models.vit.  On x86_64 the only torch/torchvision pair that imports together is a CUDA
# build of about 5.6 GB in the venv; a CI machine once ran out of disk installing it (ENOSPC, the
# whole run failed after 86 s).  So the extras install only where the disk has room for them; where
# it has not (or the install itself fails), the run goes on, the two parity modules skip, and the
# stage table says so.  Where they are installed, MINIGEO_REQUIRE_* turns a skip into a failure.
PARITY_NEED_GB=${MINIGEO_PARITY_NEED_GB:-8}
PARITY_NOTE="installed"
parity_free_gb=$(( $(df -Pk .venv | awk 'NR==2 {print $4}') / 1024 / 1024 ))
if .venv/bin/python -c "import timm, open_clip" 2>/dev/null; then
    PARITY_NOTE="already installed"
elif [ "$parity_free_gb" -lt "$PARITY_NEED_GB" ]; then
    PARITY_NOTE="SKIPPED: ${parity_free_gb} GB free, the extras need ${PARITY_NEED_GB}"
elif ! .venv/bin/python -m pip install --quiet --no-cache-dir -r requirements-parity.txt; then
    PARITY_NOTE="SKIPPED: pip could not install requirements-parity.txt"
    .venv/bin/python -m pip uninstall --quiet --yes open_clip_torch timm torchvision torch || true
fi
echo "setup: parity extras (torch, timm, OpenCLIP): $PARITY_NOTE"
case "$PARITY_NOTE" in
    SKIPPED*) export MINIGEO_REQUIRE_TIMM=0 MINIGEO_REQUIRE_OPEN_CLIP=0 ;;
    *) export MINIGEO_REQUIRE_TIMM=1 MINIGEO_REQUIRE_OPEN_CLIP=1 ;;
esac
# MINIGEO_BOOK_BATCH=1: the chapters' slider cells print a note instead of starting ipywidgets'
# interact, which can deadlock a non-interactive notebook client (jupyter/nbclient#312)
export PATH="$PWD/.venv/bin:$PATH" JAX_PLATFORMS=cpu MINIGEO_BOOK_BATCH=1

trap stage_table EXIT

bash scripts/install_chromium.sh

stage "1/4 unit tests and notebooks (nbval), one pytest process"
# one pytest process with two xdist workers, whole files per worker (--dist loadfile): a test
# module's fixtures stay in one worker, and a notebook's cells run in order in one kernel (nbval's
# documented way to run in parallel); the 40-odd unit test files and the chapters then share both
# cores to the end.  tests/conftest.py drops the compiled programs after each test module, so a
# worker does not accumulate every module's executables.
# --durations: every test phase over 1 s is listed at the end, the data for the quick lane's `slow`
# list (python scripts/slow_tests.py LOG writes tests/slow_tests.txt from it)
# nbval: re-executes every chapter, compares the tagged outputs, and records each notebook that
# passed with its fresh outputs (conftest.py's --nbval-record) for the book build
RECORDED=$(mktemp -d)
python -m pytest book/ tests -n 2 --dist loadfile --durations=0 --durations-min=1 \
    --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-record "$RECORDED"
stage "2/4 docstring examples"
# a process of their own: the unit tests run in float64 (tests/conftest.py), the examples print
# float32 as a reader sees it; two workers, whole modules per worker (a module's examples then
# reuse the compilations of the examples before them in the same process)
python -m pytest --doctest-modules minigeo -o doctest_optionflags="ELLIPSIS NORMALIZE_WHITESPACE" -p no:cacheprovider \
    -n 2 --dist loadfile
stage "3/4 book build (-W -n) and PDF"
rm -rf _build
python scripts/cache_executed_notebooks.py "$RECORDED"
jupyter-book build . -W -n --keep-going
test -f _build/html/index.html
python scripts/build_pdf.py
stage "4/4 rendered book in a headless browser"
python scripts/check_rendered_book.py
echo "test: all checks passed"
