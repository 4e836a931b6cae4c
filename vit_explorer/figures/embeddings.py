"""Tokens and embeddings: token PCA, position-embedding similarity, the patch-embedding
filters, token matrices and token norms."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ._base import (
    _scale,
    VALUE_SCALE, SIMILARITY_SCALE, CELL_PIXELS, MARGIN, _array, _float_array, _rgb_uint8, _mosaic,
    _patch_positions, colour_mapped, image_data_uri, _image_trace, _image_axis_layout, _on_axes,
    _panel_height, _subplots, _title, figure,
    token_labels,
)


def token_pca_image(colors, image, **layout) -> go.Figure:
    """The image beside its patch tokens coloured by their first three principal components;
    ``layout`` adds to the figure's layout (a caller's title), in one go."""
    image = _rgb_uint8(image)
    colors = _array(colors)
    if colors.ndim != 3 or colors.shape[-1] not in (1, 3):
        raise ValueError(f"colors must be (gh, gw, 3) or (gh, gw, 1), not {colors.shape}")
    grid_h, grid_w = colors.shape[:2]
    height, width = image.shape[:2]
    grid, cells = _subplots(1, 2, ("input", "patch tokens, PCA as RGB"), horizontal_spacing=0.03)
    dy, dx = height / grid_h, width / grid_w
    traces = [
        _on_axes(_image_trace(image), cells[1, 1]),
        _on_axes(_image_trace(
            _rgb_uint8(colors.astype(np.float64)), lossless=True, x0=dx / 2 - 0.5, dx=dx, y0=dy / 2 - 0.5, dy=dy
        ), cells[1, 2]),
    ]
    for suffix in (cells[1, 1], cells[1, 2]):
        for axis, settings in _image_axis_layout(suffix).items():
            grid[axis].update(settings)
    grid.update({
        "title": _title("Token PCA: patches with similar tokens get similar colours"),
        "margin": MARGIN, "height": _panel_height(image.shape, 1, 1.5 * CELL_PIXELS), **layout,
    })
    return figure(traces, grid)


def position_similarity_grid(similarity) -> go.Figure:
    """ViT paper Fig. 7 (centre): tile (i, j) shows the cosine similarity of patch (i, j)'s
    position embedding to every other patch's. similarity: (gh, gw, gh, gw).

    The (gh*gw)^2 values are drawn as one colour-mapped PNG (at patch 8 on 224 px that is 660k
    values, 12 MB as a heatmap); an invisible cell over each tile names its patch on hover and
    carries the colour bar.
    """
    similarity = _float_array(similarity)
    if similarity.ndim != 4:
        raise ValueError(f"similarity must be (gh, gw, gh, gw), not {similarity.shape}")
    grid_h, grid_w = similarity.shape[:2]
    # (gh*gw, gh, gw) tiles, one per query position, laid out on the grid with 1-cell gaps.
    tiles = similarity.reshape(grid_h * grid_w, grid_h, grid_w)
    mosaic = _mosaic(tiles, grid_w, 1, np.nan)
    tile_h, tile_w = grid_h + 1, grid_w + 1  # a tile and its gap, in mosaic cells
    rows, cols = np.indices((grid_h, grid_w))
    colours = colour_mapped(mosaic, SIMILARITY_SCALE, -1, 1)
    return figure([
        dict(type="image", source=image_data_uri(colours, lossless=True), hoverinfo="skip"),
        dict(
            type="heatmap", z=np.zeros((grid_h, grid_w)), opacity=0.0,
            x0=(grid_w - 1) / 2, dx=tile_w, y0=(grid_h - 1) / 2, dy=tile_h,
            customdata=np.stack([rows, cols], axis=-1),
            hovertemplate="patch (%{customdata[0]}, %{customdata[1]}) against every patch<extra></extra>",
            colorscale=_scale(SIMILARITY_SCALE), zmin=-1, zmax=1, showscale=True, colorbar=dict(title=dict(text="cosine")),
        ),
    ], dict(
        xaxis=dict(
            title=dict(text="input patch column"), tickvals=[col * tile_w + (grid_w - 1) / 2 for col in range(grid_w)],
            ticktext=list(range(grid_w)), showgrid=False, zeroline=False, constrain="domain",
        ),
        yaxis=dict(
            title=dict(text="input patch row"), tickvals=[row * tile_h + (grid_h - 1) / 2 for row in range(grid_h)],
            ticktext=list(range(grid_h)), autorange="reversed", scaleanchor="x", showgrid=False,
            zeroline=False, constrain="domain",
        ),
        # Two short lines: the app draws this in half a page, where one long line was cut off.
        title=_title("Position embedding similarity<br><sup>each tile: one patch against all patches</sup>"),
        margin={**MARGIN, "t": 80}, plot_bgcolor="white",
    ))


def embedding_filters_figure(filters, columns: int = 7) -> go.Figure:
    """ViT paper Fig. 7 (left): principal components of the patch-embedding filters.

    filters: (k, p, p, C) in [0, 1], as ``analysis.embedding_filters`` returns them.
    """
    filters = _float_array(filters)
    if filters.ndim != 4:
        raise ValueError(f"filters must be (k, p, p, C), not {filters.shape}")
    count, patch = filters.shape[:2]
    tiles = np.stack([_rgb_uint8(tile) for tile in filters])
    mosaic = _mosaic(tiles, min(columns, count), max(1, patch // 4), fill=255)
    return figure([_image_trace(mosaic)], dict(
        **_image_axis_layout(), title=_title(f"Patch embedding filters: the first {count} principal components"),
        margin=MARGIN,
    ))


def token_matrix(tokens, num_prefix_tokens: int, title: str, class_token: bool = True,
                 max_tokens: int = 256, max_dims: int = 128, dist_token: bool = False) -> go.Figure:
    """A sequence of token vectors (N, D) as a heatmap: one row per token, one column per
    dimension; large sequences show their first ``max_tokens`` rows and ``max_dims`` columns."""
    tokens = _float_array(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (N, D), not {tokens.shape}")
    count, dims = tokens.shape
    shown = tokens[:max_tokens, :max_dims]
    labels = token_labels(count, num_prefix_tokens, class_token, dist_token)[: shown.shape[0]]
    limit = float(np.abs(shown).max()) or 1.0
    cut = "" if shown.shape == tokens.shape else f" (first {shown.shape[0]} x {shown.shape[1]} shown)"
    return figure([dict(
        type="heatmap", z=shown, y=labels, colorscale=_scale(SIMILARITY_SCALE), zmin=-limit, zmax=limit,
        hovertemplate="%{y}, dimension %{x}<br>value %{z:.4g}<extra></extra>",
        colorbar=dict(title=dict(text="value")),
    )], dict(
        xaxis=dict(title=dict(text="embedding dimension")),
        yaxis=dict(title=dict(text="token"), autorange="reversed", type="category", showticklabels=count <= 40),
        title=_title(f"{title}: {count} x {dims}{cut}"), margin=MARGIN,
    ))


MANY_BARS = 200  # more tokens than this are drawn as touching bars


def token_norms_figure(
    norms, grid_size: tuple[int, int], num_prefix_tokens: int, layer: int | None = None,
    class_token: bool = True, dist_token: bool = False,
) -> go.Figure:
    """Token L2 norms (N,) of one layer: a map of the patch norms (artifact tokens stand out as
    isolated bright patches, Darcet et al. 2023) beside the norm of every token."""
    norms = _float_array(norms).reshape(-1)
    grid_h, grid_w = grid_size
    if norms.shape[0] != num_prefix_tokens + grid_h * grid_w:
        raise ValueError(
            f"{norms.shape[0]} norms do not fit {num_prefix_tokens} prefix tokens and a"
            f" {grid_h}x{grid_w} grid"
        )
    labels = token_labels(norms.shape[0], num_prefix_tokens, class_token, dist_token)
    grid, cells = _subplots(
        1, 2, ("patch tokens on the grid", "every token"), column_widths=[0.45, 0.55], horizontal_spacing=0.16,
    )
    patch_norms = norms[num_prefix_tokens:].reshape(grid_h, grid_w)
    heatmap = dict(
        type="heatmap", z=patch_norms, colorscale=_scale(VALUE_SCALE), customdata=_patch_positions(grid_size),
        hovertemplate="patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
        "<br>norm %{z:.4g}<extra></extra>",
        colorbar=dict(title=dict(text="norm"), x=0.39, thickness=12),
    )
    colours = ["#e45756"] * num_prefix_tokens + ["#4c78a8"] * (norms.shape[0] - num_prefix_tokens)
    bars = dict(
        type="bar", x=list(range(norms.shape[0])), y=norms, marker=dict(color=colours), customdata=labels,
        hovertemplate="token %{x} (%{customdata})<br>norm %{y:.4g}<extra></extra>", showlegend=False,
    )
    for axis, settings in _image_axis_layout(cells[1, 1]).items():
        grid[axis].update(settings)
    grid[f"xaxis{cells[1, 2]}"]["title"] = dict(text="token (prefix tokens in red)")
    grid[f"yaxis{cells[1, 2]}"]["title"] = dict(text="L2 norm")
    if norms.shape[0] > MANY_BARS:  # bars under a pixel wide: plotly's gaps between them left a pale haze
        bars["marker"]["line"] = dict(width=0)
        grid.update(bargap=0)
    where = f" after block {layer}" if layer is not None else ""
    grid.update(title=_title(f"Token norms{where}"), margin=MARGIN)
    return figure([_on_axes(heatmap, cells[1, 1]), _on_axes(bars, cells[1, 2])], grid)
