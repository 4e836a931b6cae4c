"""The image and its patches: the patch grid, the patch sequence, the patch picker, the
patch-size trade-off."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import (
    MARGIN, _array, _rgb_uint8, _mosaic, _patch_positions, _image_trace, _patch_heatmap, _image_axis_layout,
    _on_axes, _panel_height, _subplots, _title, figure,
)


def image_with_grid(
    image, grid_size: tuple[int, int], highlight: int | tuple[int, int] | None = None
) -> go.Figure:
    """The model's input image cut into its gh x gw patches; hover names each patch."""
    traces, layout = _grid_parts(image, grid_size, highlight)
    return figure(traces, layout)


def _grid_parts(image, grid_size: tuple[int, int], highlight: int | tuple[int, int] | None) -> tuple[list, dict]:
    """:func:`image_with_grid`'s traces and layout, for a figure built in one go."""
    image = _rgb_uint8(image)
    grid_h, grid_w = grid_size
    height, width = image.shape[:2]
    # An invisible heatmap carries the hover text of each patch.
    clear = [[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0)"]]
    hover = _patch_heatmap(
        _patch_positions(grid_size)[..., 0].astype(float), (height, width),
        colorscale=clear, showscale=False,
    )
    hover["hovertemplate"] = "patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})<extra></extra>"
    line = dict(color="rgba(255,255,255,0.8)", width=1)
    rows = [row * height / grid_h - 0.5 for row in range(1, grid_h)]
    cols = [col * width / grid_w - 0.5 for col in range(1, grid_w)]
    shapes = [
        *(dict(type="line", x0=-0.5, x1=width - 0.5, y0=y, y1=y, line=line) for y in rows),
        *(dict(type="line", x0=x, x1=x, y0=-0.5, y1=height - 0.5, line=line) for x in cols),
    ]
    title = f"Input image as a {grid_h} x {grid_w} grid of {grid_h * grid_w} patches"
    if highlight is not None:
        if isinstance(highlight, Sequence):
            row, col = highlight
        else:
            row, col = divmod(int(highlight), grid_w)
        if not (0 <= row < grid_h and 0 <= col < grid_w):
            raise ValueError(f"patch ({row}, {col}) is outside the {grid_h}x{grid_w} grid")
        dy, dx = height / grid_h, width / grid_w
        shapes.append(dict(
            type="rect", x0=col * dx - 0.5, x1=(col + 1) * dx - 0.5, y0=row * dy - 0.5,
            y1=(row + 1) * dy - 0.5, line=dict(color="#00e5ff", width=3),
        ))
        title += f" (patch {row * grid_w + col} at row {row}, col {col} highlighted)"
    layout = dict(**_image_axis_layout(), shapes=shapes, title=_title(title), margin=MARGIN)
    return [_image_trace(image, hover=False), hover], layout


def patch_sequence(patches, max_patches: int = 64, per_row: int = 16) -> go.Figure:
    """The patches in token order (row-major), as the transformer reads them.

    patches: (gh, gw, C, p, p) denormalised pixels, uint8 or floats in [0, 1].
    """
    patches = _array(patches)
    if patches.ndim != 5:
        raise ValueError(f"patches must be (gh, gw, C, p, p), not {patches.shape}")
    grid_h, grid_w, channels, patch, _ = patches.shape
    total = grid_h * grid_w
    shown = min(max_patches, total)
    tiles = patches.reshape(total, channels, patch, patch)[:shown].transpose(0, 2, 3, 1)
    tiles = np.stack([_rgb_uint8(tile) for tile in tiles])  # (n, p, p, 3)
    columns = min(per_row, shown)
    gap = max(1, patch // 4)
    mosaic = _mosaic(tiles, columns, gap, fill=255)
    # One invisible cell per slot for the hover; empty slots are gaps.
    slots = np.full((math.ceil(shown / columns), columns), np.nan)
    slots.flat[:shown] = np.arange(shown)
    step = patch + gap
    hover = dict(
        type="heatmap", z=slots, x0=(patch - 1) / 2, dx=step, y0=(patch - 1) / 2, dy=step,
        colorscale=[[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0)"]], showscale=False,
        hoverongaps=False,
        customdata=np.stack(np.divmod(np.nan_to_num(slots, nan=-1), grid_w), axis=-1),
        hovertemplate="patch %{z}: row %{customdata[0]}, col %{customdata[1]}<extra></extra>",
    )
    what = "all" if shown == total else f"the first {shown} of"
    return figure([_image_trace(mosaic, hover=False), hover], dict(
        **_image_axis_layout(), title=_title(f"Patch sequence: {what} {total} patches in token order (row by row)"),
        margin=MARGIN, height=_panel_height(mosaic.shape, 1, 900),
    ))


def input_image(image, title: str) -> go.Figure:
    """An image at its true pixel size with each pixel's RGB value on hover."""
    return figure([_image_trace(_rgb_uint8(image))], dict(**_image_axis_layout(), title=_title(title), margin=MARGIN))


def patch_picker(image, grid_size: tuple[int, int], selected: int | None = None, **layout) -> go.Figure:
    """:func:`image_with_grid` that reports a click on any patch as a selected point; ``layout``
    adds to the figure's layout (a caller's title, height), in one go.

    Heatmap cells cannot be selected in Streamlit (streamlit#8760), so an invisible marker sits
    on every patch centre and ``hoverdistance=-1`` lets a click anywhere pick the nearest one;
    the markers run in row-major patch order, so a selected point's index is the patch index.
    """
    traces, grid = _grid_parts(image, grid_size, selected)
    height, width = _rgb_uint8(image).shape[:2]
    grid_h, grid_w = grid_size
    positions = _patch_positions(grid_size).reshape(-1, 3)
    traces.append(dict(
        type="scatter", x=(positions[:, 2] + 0.5) * width / grid_w - 0.5,
        y=(positions[:, 1] + 0.5) * height / grid_h - 0.5,
        mode="markers", customdata=positions, showlegend=False,
        marker=dict(size=max(4, min(30, 360 // max(grid_h, grid_w))), color="rgba(0,0,0,0)"),
        selected=dict(marker=dict(color="rgba(0,229,255,0.5)")),
        unselected=dict(marker=dict(opacity=0)),
        hovertemplate="patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
        "<br>click to make it the query<extra></extra>",
    ))
    grid.update(
        title=_title("Click a patch to make it the query"), hovermode="closest", hoverdistance=-1,
        clickmode="event+select", dragmode=False,
    )
    return figure(traces, {**grid, **layout})


def patch_size_tradeoff(rows: Sequence[Mapping], current: int) -> go.Figure:
    """Smaller patches: more tokens, more cost, more detail. Panels over the patch sizes, rows as
    ``vit_explorer.app.costs.compare_patch_sizes`` gives them: the token count, the measured
    forward time of one image and, where the rows have predictions (a model with classes), how well the
    model does (the top-1 probability on this image labelled with the class, and the accuracy on
    a held-out batch where the rows have one). ``current`` is highlighted."""
    labels = [f"p={row['patch size']} ({row['grid']})" for row in rows]
    colours = ["#e45756" if row["patch size"] == current else "#4c78a8" for row in rows]
    predictions = all("probability" in row for row in rows)
    titles = ("tokens", "forward time of one image (ms)") + (("how well it does",) if predictions else ())
    grid, cells = _subplots(1, len(titles), titles, horizontal_spacing=0.08)
    traces = [
        _on_axes(dict(
            type="bar", x=labels, y=[row["tokens"] for row in rows], marker=dict(color=colours), showlegend=False,
            text=[str(row["tokens"]) for row in rows], textposition="auto",
            hovertemplate="%{x}: %{y} tokens<extra></extra>",
        ), cells[1, 1]),
        _on_axes(dict(
            type="bar", x=labels, y=[row["forward ms"] for row in rows], marker=dict(color=colours), showlegend=False,
            text=[f"{row['forward ms']:.1f}" for row in rows], textposition="auto",
            hovertemplate="%{x}: %{y:.2f} ms<extra></extra>",
        ), cells[1, 2]),
    ]
    if predictions:
        traces.append(_on_axes(dict(
            type="bar", x=labels, y=[row["probability"] for row in rows], marker=dict(color=colours),
            name="top-1 probability on this image", text=[row["prediction"] for row in rows],
            textposition="auto", hovertemplate="%{x}<br>%{text}: %{y:.3f}<extra></extra>",
        ), cells[1, 3]))
        held_out = [row.get("held-out accuracy") for row in rows]
        if any(value is not None for value in held_out):
            traces.append(_on_axes(dict(
                type="scatter", x=labels, y=held_out, mode="lines+markers", name="accuracy on held-out images",
                line=dict(color="#f58518"), marker=dict(size=9),
                hovertemplate="%{x}: %{y:.1%} of held-out images right<extra></extra>",
            ), cells[1, 3]))
        grid[f"yaxis{cells[1, 3]}"]["range"] = [0, 1.05]
    for suffix in cells.values():
        grid[f"xaxis{suffix}"].update(type="category", tickangle=-45)
    grid.update(
        title=_title("The same weights at every patch size (current in red)"),
        margin={**MARGIN, "l": 50},  # room for the first panel's tick labels and slanted x labels
        legend=dict(orientation="h", yanchor="top", y=-0.35, x=1, xanchor="right"), height=380,
    )
    return figure(traces, grid)
