"""Drop repeated ``<script>`` entries from every HTML page.

Jupyter Book 1.x connects sphinx-thebe's ``init_thebe_core`` so that its inline configuration
(``const THEBE_JS_URL = ...``) is added to each page twice; the second copy raises
``SyntaxError: Identifier 'THEBE_JS_URL' has already been declared`` in every browser. The
rendered-book check fails on any JavaScript error, so the duplicates are removed here.
"""

from __future__ import annotations


def _dedupe(app, pagename, templatename, context, doctree):  # noqa: ARG001 (Sphinx signature)
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        attributes = getattr(js, "attributes", {}) or {}
        # the same inline script is registered once with filename None and once with ""
        key = (
            getattr(js, "filename", str(js)) or "",
            tuple(sorted((k, str(v)) for k, v in attributes.items())),
        )
        if key not in seen:
            seen.add(key)
            unique.append(js)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
