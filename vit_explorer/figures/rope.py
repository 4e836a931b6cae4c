"""Rotary positions, drawn on the patch grid: each patch's rotation angle for a few channel pairs
(the Pipeline page), and one query's scores against the same key content placed at every patch,
with the query at two positions (Inside a layer)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import MARGIN, SIMILARITY_SCALE, _float_array, _patch_positions, _scale, _subplots, _title, figure
from .attention import _query_outline

# Cyclic: an angle and the same angle plus a full turn get the same colour, as the rotation does.
ANGLE_SCALE = "Twilight"
PANEL_PIXELS = 200  # height of one small grid panel


def _grid_axes(layout: dict, suffix: str) -> None:
    """Square cells, row 0 on top, no ticks (hover gives the patch)."""
    layout[f"xaxis{suffix}"] = {**layout.get(f"xaxis{suffix}", {}), "visible": False, "constrain": "domain"}
    layout[f"yaxis{suffix}"] = {
        **layout.get(f"yaxis{suffix}", {}), "visible": False, "autorange": "reversed",
        "scaleanchor": f"x{suffix}", "constrain": "domain",
    }


def _turns(period: float) -> str:
    return "never turns" if math.isinf(period) else f"a full turn every {period:.3g} patches"


def rotation_angles_figure(angles, grid_size: tuple[int, int], pairs: Sequence, title: str) -> go.Figure:
    """Each patch's rotation angle (``angles``: (gh * gw, hd/2) radians, vit_explorer.model.rope.angles)
    for the channel ``pairs`` chosen (vit_explorer.model.rope.AnglePair: index, channels, axis, period),
    one small grid per pair, on a cyclic colour scale (degrees modulo a full turn): pairs that turn
    with the row in the first row of panels, those that turn with the column in the second."""
    angles = _float_array(angles)
    grid_h, grid_w = grid_size
    if angles.ndim != 2 or angles.shape[0] != grid_h * grid_w:
        raise ValueError(f"angles must be (gh * gw, hd/2) for a {grid_h}x{grid_w} grid, not {angles.shape}")
    axes = list(dict.fromkeys(pair.axis for pair in pairs))  # in the pairs' order
    rows = [[pair for pair in pairs if pair.axis == axis] for axis in axes]
    columns = max(len(row) for row in rows)
    titles = [
        f"channels {pair.channels[0]} & {pair.channels[1]}: turn {'down' if pair.axis == 'row' else 'across'}"
        f"<br>{_turns(pair.period)}"
        for row in rows for pair in row
    ]
    layout, cells = _subplots(len(rows), columns, titles=titles, horizontal_spacing=0.04, vertical_spacing=0.16)
    customdata = _patch_positions(grid_size)
    traces = []
    for row_index, row in enumerate(rows, start=1):
        for column_index, pair in enumerate(row, start=1):
            suffix = cells[(row_index, column_index)]
            degrees = np.degrees(angles[:, pair.index]).reshape(grid_h, grid_w) % 360.0
            traces.append(dict(
                type="heatmap", z=degrees.astype(np.float32), coloraxis="coloraxis", customdata=customdata,
                xaxis=f"x{suffix}", yaxis=f"y{suffix}",
                hovertemplate="patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
                f"<br>angle %{{z:.0f}}°<extra>channels {pair.channels[0]} & {pair.channels[1]}</extra>",
            ))
            _grid_axes(layout, suffix)
    layout.update(
        title=_title(title), margin={**MARGIN, "t": 110}, height=110 + len(rows) * (PANEL_PIXELS + 50),
        coloraxis=dict(
            colorscale=_scale(ANGLE_SCALE), cmin=0, cmax=360,
            colorbar=dict(title=dict(text="angle"), tickvals=[0, 90, 180, 270, 360],
                          ticktext=["0°", "90°", "180°", "270°", "360°"], thickness=12),
        ),
    )
    return figure(traces, layout)


def offset_scores_figure(
    maps, query_positions: Sequence[int], grid_size: tuple[int, int], title: str, own_position: int | None = None,
) -> go.Figure:
    """One query's scores against the same key content at every patch (``maps``: (panels, gh * gw),
    vit_explorer.model.rope.offset_scores), the query at ``query_positions`` (outlined; ``own_position``
    is named the query's own patch), side by side on one colour scale centred on 0; hovering a
    patch gives its offset from the query."""
    maps = _float_array(maps)
    grid_h, grid_w = grid_size
    if maps.ndim != 2 or maps.shape != (len(query_positions), grid_h * grid_w):
        raise ValueError(f"maps {maps.shape} must be one (gh * gw,) map per query position")
    titles = [
        f"query at row {position // grid_w}, col {position % grid_w}"
        + (" (its own patch)" if position == own_position else "")
        for position in query_positions
    ]
    layout, cells = _subplots(1, len(maps), titles=titles, horizontal_spacing=0.08)
    rows, cols = np.indices((grid_h, grid_w))
    traces, shapes = [], []
    for panel, (values, position) in enumerate(zip(maps, query_positions), start=1):
        suffix = cells[(1, panel)]
        query_row, query_col = divmod(position, grid_w)
        offsets = np.stack([rows * grid_w + cols, rows, cols, rows - query_row, cols - query_col], axis=-1)
        traces.append(dict(
            type="heatmap", z=values.reshape(grid_h, grid_w).astype(np.float32), coloraxis="coloraxis",
            customdata=offsets, xaxis=f"x{suffix}", yaxis=f"y{suffix}",
            hovertemplate="key at patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
            "<br>offset from the query: %{customdata[3]} rows, %{customdata[4]} columns"
            "<br>score %{z:.4g}<extra></extra>",
        ))
        shapes += _query_outline(position, grid_size, grid_size, suffix)
        _grid_axes(layout, suffix)
    limit = float(np.abs(maps).max()) or 1.0
    layout.update(
        title=_title(title), margin={**MARGIN, "t": 90}, height=380, shapes=shapes,
        coloraxis=dict(colorscale=_scale(SIMILARITY_SCALE), cmin=-limit, cmax=limit,
                       colorbar=dict(title=dict(text="score"), thickness=12)),
    )
    return figure(traces, layout)
