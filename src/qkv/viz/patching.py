"""``qkv.viz.patching_view``: a patching result as a grid of effects, inline in a notebook.

``qkv.interp.patch`` gives one number per patched place: (layers, heads) for ``what="z"`` or
``"pattern"``, (layers, positions) for ``"resid"``. The view draws that grid as an SVG, each
cell coloured by its effect against a reference (blue below it, red above, white at it, on
one scale for the whole grid), with the value in the cell's tooltip and in a table beside it
(what a reader copies). The page is self-contained and static: no script, no network, so
a notebook shows it in the same sandboxed frame as the attention page.
"""

from __future__ import annotations

import html
import math

import torch
from torch import Tensor

from .notebook import AttentionView

_CELL = 34  # px


def _check(effects, rows: list[str] | None, columns: list[str] | None,
           reference) -> tuple[Tensor, list[str], list[str], float]:
    if not isinstance(effects, Tensor) or effects.dim() != 2 or 0 in effects.shape:
        shape = tuple(effects.shape) if isinstance(effects, Tensor) else type(effects).__name__
        raise ValueError(f"effects must be a 2-D tensor (layers, heads or positions), as "
                         f"qkv.interp.patch returns; got {shape}")
    effects = effects.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(effects).all()):
        raise ValueError("effects must be finite; the metric returned inf or NaN somewhere")
    n_rows, n_cols = effects.shape
    rows = [str(i) for i in range(n_rows)] if rows is None else [str(r) for r in rows]
    columns = [str(j) for j in range(n_cols)] if columns is None else [str(c) for c in columns]
    if len(rows) != n_rows or len(columns) != n_cols:
        raise ValueError(f"rows and columns must name the grid's {n_rows} rows and {n_cols} "
                         f"columns; got {len(rows)} and {len(columns)}")
    if reference is None:
        reference = float(effects.median())
    elif isinstance(reference, bool) or not isinstance(reference, (int, float)) \
            or not math.isfinite(reference):
        raise ValueError(f"reference must be a finite number (e.g. the corrupted run's "
                         f"metric); got {reference!r}")
    return effects, rows, columns, float(reference)


def _colour(delta: float, scale: float) -> str:
    """White at 0, towards red (delta > 0) or blue (delta < 0), full at |delta| = scale."""
    t = 0.0 if scale == 0 else min(abs(delta) / scale, 1.0)
    fade = round(255 * (1 - t))
    return f"rgb(255,{fade},{fade})" if delta > 0 else f"rgb({fade},{fade},255)"


def patching_svg(effects: Tensor, *, rows: list[str] | None = None,
                 columns: list[str] | None = None, reference: float | None = None,
                 row_title: str = "layer", column_title: str = "head") -> str:
    """The grid of ``effects`` (R, C) as a standalone SVG picture (see ``patching_view``)."""
    effects, rows, columns, reference = _check(effects, rows, columns, reference)
    delta = effects - reference
    scale = float(delta.abs().max())
    left, top = 12 + 8 * max(len(r) for r in rows), 40
    width, height = left + _CELL * len(columns) + 8, top + _CELL * len(rows) + 8
    esc = html.escape
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{left}" y="12">{esc(column_title)} →, {esc(row_title)} ↓; '
             f'colour: effect − {reference:.4g}</text>']
    for j, name in enumerate(columns):
        parts.append(f'<text x="{left + _CELL * j + _CELL / 2}" y="{top - 6}" '
                     f'text-anchor="middle">{esc(name)}</text>')
    for i, name in enumerate(rows):
        y = top + _CELL * i
        parts.append(f'<text x="{left - 4}" y="{y + _CELL / 2 + 4}" '
                     f'text-anchor="end">{esc(name)}</text>')
        for j in range(len(columns)):
            value = float(effects[i, j])
            parts.append(
                f'<rect class="cell" x="{left + _CELL * j}" y="{y}" width="{_CELL - 1}" '
                f'height="{_CELL - 1}" fill="{_colour(float(delta[i, j]), scale)}" '
                f'data-value="{value!r}"><title>{esc(row_title)} {esc(name)}, '
                f'{esc(column_title)} {esc(columns[j])}: {value:.6g}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def patching_view(effects: Tensor, *, rows: list[str] | None = None,
                  columns: list[str] | None = None, reference: float | None = None,
                  row_title: str = "layer", column_title: str = "head",
                  title: str = "qkv activation patching") -> AttentionView:
    """A patching result as a page a notebook shows inline (``save(path)`` writes it).

    Args:
        effects: (R, C), ``qkv.interp.patch``'s result: the metric with each place patched.
        rows, columns: their labels (default 0, 1, ...): the layers patched, the heads or
            the tokens of the positions.
        reference: the value drawn white, e.g. the corrupted run's metric (default: the
            grid's median).
        row_title, column_title: what the rows and columns are ("layer", "head";
            "position" for ``what="resid"``).
        title: the page's title.
    """
    svg = patching_svg(effects, rows=rows, columns=columns, reference=reference,
                       row_title=row_title, column_title=column_title)
    values, row_names, column_names, _ = _check(effects, rows, columns, reference)
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in column_names)
    body = "".join(
        f"<tr><th>{esc(r)}</th>" + "".join(f"<td>{float(v):.4g}</td>" for v in values[i])
        + "</tr>" for i, r in enumerate(row_names))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
            "<style>body{font-family:sans-serif;margin:12px}table{border-collapse:collapse;"
            "font-size:11px;margin-top:12px}td,th{border:1px solid #ccc;padding:2px 5px;"
            "text-align:right}</style></head><body>"
            f"<h3>{esc(title)}</h3>{svg}<table><thead><tr><th>{esc(row_title)} \\ "
            f"{esc(column_title)}</th>{head}</tr></thead><tbody>{body}</tbody></table>"
            "</body></html>")
    height = min(900, 120 + (_CELL + 22) * values.shape[0])
    return AttentionView(page, height)
