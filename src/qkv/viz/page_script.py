"""The interactive page's script and style, inlined into every page (no CDN, works offline).

They are files in ``viz/static/`` (package data), read once on import:
- ``page.css``, ``core.js``, ``main.js``: the page, its data, controls, legend and drawing;
  ``core.js`` reads the JSON block ``#qkv-data`` and the gzip-compressed arrays
  ``#qkv-arrays`` written by ``qkv.viz.page``;
- ``headview.*``: the head view, as lines between query and key tokens, as a directed graph
  on a circle, or as a ViT's patches on its image. Hovering a token highlights what it attends
  to and what attends to it; past ``LINE_LIMIT`` tokens it shows a window around the pair
  chosen in the matrix view;
- ``matrix.*``: the matrix view and the model view, on canvas so they stay fast at thousands
  of tokens (one pixel per stored weight, zoom and pan, the row and column under the pointer
  named; the model view is every layer x head as a thumbnail). Colour is sqrt(weight);
- ``panels.*``: the neuron view (the per-dimension terms of the similarity's kernel for the
  chosen pair and head, ``qkv.viz.neuron``) and the head summary (a sortable table);
- ``rows.*``: the per-row summaries of every head on a long input's page
  (``qkv.viz.page_rows``), also of the heads whose maps the page leaves out.

The script is one async function made of the ``.js`` parts, which share its scope. Drawn
edges carry ``data-q``, ``data-k``, ``data-head`` and ``data-weight`` (the weight shown), so a
browser test can read back what is on screen; the other views expose the same through
``data-*`` attributes."""

from importlib.resources import files

_STATIC = files("qkv.viz").joinpath("static")


def _joined(*names: str) -> str:
    return "".join(_STATIC.joinpath(name).read_text(encoding="utf-8") for name in names)


STYLE = _joined("page.css", "headview.css", "matrix.css", "panels.css", "rows.css")
SCRIPT = ("\n(async function () {\n  \"use strict\";\n"
          + _joined("core.js", "headview.js", "matrix.js", "panels.js", "rows.js", "main.js")
          + "})();\n")
