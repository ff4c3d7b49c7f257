"""Put the notebooks nbval has just executed into the book build's jupyter-cache.

    python scripts/cache_executed_notebooks.py DIR [--cache _build/.jupyter_cache]

DIR holds the notebooks written by ``pytest --nbval-record DIR`` (see the repository's
``conftest.py``). Each one is cached under the hash of its source notebook in ``book/`` (code cells
and their metadata, the kernelspec), so ``jupyter-book build`` with ``execute_notebooks: cache``
renders those outputs. A recorded notebook whose code no longer matches its source (edited after
the test run) is skipped with a message, and the build executes that source itself: the cache can
only ever hold the outputs of the code the book shows. ``scripts/test.sh`` calls this between the
nbval step and the book build, after ``rm -rf _build``, so every entry comes from this test run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn

ROOT = Path(__file__).resolve().parents[1]
RECORD_KEY = "nbval_record"


def cache_executed(recorded: Path, cache_path: Path, book: Path = ROOT / "book") -> list[str]:
    """Cache every recorded notebook that matches its source; return the names cached."""
    cache = get_cache(str(cache_path))
    cached = []
    for path in sorted(recorded.glob("*.ipynb")):
        source = book / path.name
        if not source.exists():
            print(f"cache_executed_notebooks: {path.name} has no source in {book}; skipped")
            continue
        nb = nbformat.read(str(path), as_version=4)
        record = nb.metadata.pop(RECORD_KEY, None)
        if record is None:
            print(f"cache_executed_notebooks: {path.name} was not written by --nbval-record; skipped")
            continue
        _, recorded_hash = cache.create_hashed_notebook(nb)
        _, source_hash = cache.create_hashed_notebook(nbformat.read(str(source), as_version=4))
        if recorded_hash != source_hash:
            print(f"cache_executed_notebooks: {path.name} differs from {source}; skipped (the build executes it)")
            continue
        cache.cache_notebook_bundle(
            CacheBundleIn(nb, str(source), data={"execution_seconds": record["execution_seconds"]}),
            check_validity=True,
            overwrite=True,
        )
        cached.append(path.name)
    return cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recorded", type=Path, help="folder written by pytest --nbval-record")
    parser.add_argument("--cache", type=Path, default=ROOT / "_build" / ".jupyter_cache")
    args = parser.parse_args()
    cached = cache_executed(args.recorded, args.cache)
    print(f"cache_executed_notebooks: {len(cached)} executed notebooks cached in {args.cache}: {', '.join(cached)}")


if __name__ == "__main__":
    main()
