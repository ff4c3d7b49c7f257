#!/usr/bin/env bash
# Set up the environment and run every test:
#   1. minigeo unit tests (float64, tests/)
#   2. the executed examples in minigeo's docstrings (doctest)
#   3. nbval over every chapter notebook (re-executes them, compares tagged outputs, and records
#      each notebook that passed with its fresh outputs: conftest.py's --nbval-record)
#   4. the book build with -W -n (any Sphinx warning or failing cell fails), and its PDF; the
#      notebooks nbval has just executed come from jupyter-cache (scripts/cache_executed_notebooks.py),
#      so each notebook executes once per run; one that was not recorded is executed by the build
#   5. a headless-browser smoke check of the rendered pages (offline)
#
# bash scripts/test.sh --quick   the day-to-day lane: step 1 without the tests marked `slow`
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
# minigeo.models.vit
.venv/bin/python -m pip install --quiet -r requirements-parity.txt
# MINIGEO_BOOK_BATCH=1: the chapters' slider cells print a note instead of starting ipywidgets'
# interact, which can deadlock a non-interactive notebook client (jupyter/nbclient#312)
export PATH="$PWD/.venv/bin:$PATH" JAX_PLATFORMS=cpu MINIGEO_BOOK_BATCH=1 MINIGEO_REQUIRE_TIMM=1 \
    MINIGEO_REQUIRE_OPEN_CLIP=1

trap stage_table EXIT

bash scripts/install_chromium.sh

stage "1/5 unit tests"
# two worker processes (pytest-xdist, whole files per worker: a module's fixtures stay in one process)
# keep both cores busy while the other compiles; two runs: the sharpness and ViT modules compile the
# largest XLA programs, and fresh workers for them keep a long-lived process from accumulating every
# compiled executable of the suite
# --durations: every test phase over 1 s is listed at the end, the data for the quick lane's `slow` list
# (python scripts/slow_tests.py LOG writes tests/slow_tests.txt from it)
PARALLEL="-n 2 --dist loadfile --durations=0 --durations-min=1"
HEAVY="tests/test_sharpness.py tests/test_batches_and_inputs.py tests/test_vit.py tests/test_vit_timm_parity.py tests/test_vit_open_clip_parity.py"
python -m pytest tests $PARALLEL $(for f in $HEAVY; do printf -- '--ignore=%s ' "$f"; done)
stage "1/5 unit tests, heavy modules"
python -m pytest $HEAVY $PARALLEL
stage "2/5 docstring examples"
# two workers, whole modules per worker (a module's examples then reuse the compilations of the
# examples before them in the same process)
python -m pytest --doctest-modules minigeo -o doctest_optionflags="ELLIPSIS NORMALIZE_WHITESPACE" -p no:cacheprovider \
    -n 2 --dist loadfile
stage "3/5 notebooks (nbval)"
# two notebooks at a time; --dist loadscope keeps each notebook's cells, in order, in one kernel (nbval's
# documented way to run in parallel)
RECORDED=$(mktemp -d)
python -m pytest --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg book/ -p no:cacheprovider \
    -n 2 --dist loadscope --nbval-record "$RECORDED"
stage "4/5 book build (-W -n) and PDF"
rm -rf _build
python scripts/cache_executed_notebooks.py "$RECORDED"
jupyter-book build . -W -n --keep-going
test -f _build/html/index.html
python scripts/build_pdf.py
stage "5/5 rendered book in a headless browser"
python scripts/check_rendered_book.py
echo "test: all checks passed"
