"""Plotly figure builders shared by the app and ``python -m vit_explorer inspect``.

Builders are pure: arrays in (numpy or torch), a ``go.Figure`` out, nothing drawn or saved.
Images are (H, W, 3) uint8 (floats in [0, 1] are accepted); maps over the patch grid are
(gh, gw) and are drawn one cell per patch on top of the image, so non-square grids and images
of any size line up. :func:`write_figures` at the end turns figures into files.
"""
from __future__ import annotations

import base64
import functools
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import plotly.colors as plotly_colors
import plotly.graph_objects as go
from PIL import Image
from plotly.subplots import make_subplots

ATTENTION_SCALE = "Inferno"
VALUE_SCALE = "Viridis"
SIMILARITY_SCALE = "RdBu_r"  # red = similar, blue = opposite
CELL_PIXELS = 240  # on-screen size of one image panel in a grid of panels
MARGIN = dict(l=10, r=10, t=60, b=10)


class FigureExportError(ValueError):
    """Figures could not be written in the format asked for; the message says why."""


# --- array helpers ---------------------------------------------------------------------------


def _array(values) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    return np.asarray(values)


def _float_array(values) -> np.ndarray:
    return _array(values).astype(np.float64)


def _rgb_uint8(image) -> np.ndarray:
    """(H, W, 3) uint8 from uint8 or [0, 1] float images, grey (H, W) / (H, W, 1) repeated."""
    image = _array(image)
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3):
        raise ValueError(f"an image must be (H, W, 3) or (H, W), not {image.shape}")
    if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
    if image.dtype != np.uint8:
        image = np.round(np.clip(image.astype(np.float64), 0.0, 1.0) * 255).astype(np.uint8)
    return image


def _mosaic(tiles: np.ndarray, columns: int, gap: int, fill) -> np.ndarray:
    """Lay (n, h, w, ...) tiles out row-major in ``columns`` columns with ``gap`` between them."""
    count, height, width = tiles.shape[:3]
    rows = math.ceil(count / columns)
    mosaic = np.full(
        (rows * height + (rows - 1) * gap, columns * width + (columns - 1) * gap) + tiles.shape[3:],
        fill,
        dtype=tiles.dtype,
    )
    for index, tile in enumerate(tiles):
        top, left = divmod(index, columns)
        top, left = top * (height + gap), left * (width + gap)
        mosaic[top : top + height, left : left + width] = tile
    return mosaic


def _patch_positions(grid_size: tuple[int, int]) -> np.ndarray:
    """(gh, gw, 3) customdata: patch index, row, col."""
    grid_h, grid_w = grid_size
    rows, cols = np.indices((grid_h, grid_w))
    return np.stack([rows * grid_w + cols, rows, cols], axis=-1)


def _check_map(values: np.ndarray, name: str = "map") -> np.ndarray:
    if values.ndim != 2:
        raise ValueError(f"a {name} must be (gh, gw), not {values.shape}")
    return values


# --- traces and layout pieces ------------------------------------------------------------------


def colour_mapped(values: np.ndarray, scale: str, low: float, high: float) -> np.ndarray:
    """(..., 3) uint8: ``values`` coloured on the plotly colour scale ``scale`` from ``low`` to
    ``high`` (clipped), as a heatmap would colour them; NaN is white."""
    values = np.asarray(values, dtype=np.float32)
    table = _colour_table(scale)
    steps = len(table) - 1
    index = np.clip((values - low) * (steps / (high - low)), 0, steps)
    rgb = table[np.round(np.nan_to_num(index)).astype(np.intp)]  # a lookup: 660k values in ms
    rgb[np.isnan(values)] = 255
    return rgb


@functools.lru_cache(maxsize=16)
def _colour_table(scale: str, steps: int = 1024) -> np.ndarray:
    """(steps + 1, 3) uint8 colours of a plotly colour scale at evenly spaced positions."""
    stops = plotly_colors.get_colorscale(scale)
    positions = np.array([position for position, _ in stops])
    colours = np.array([
        plotly_colors.unlabel_rgb(plotly_colors.convert_colors_to_same_type(colour, "rgb")[0][0])
        for _, colour in stops
    ])  # (stops, 3)
    samples = np.linspace(0.0, 1.0, steps + 1)
    table = np.stack([np.interp(samples, positions, colours[:, channel]) for channel in range(3)], axis=-1)
    table = np.round(table).astype(np.uint8)
    table.flags.writeable = False  # shared by every call
    return table


def _encoded(image: np.ndarray, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=image_format, **options)
    return buffer.getvalue()


def image_data_uri(image: np.ndarray, lossless: bool = False) -> str:
    """An (H, W, 3) uint8 image as a data URI: PNG, or JPEG where that is less than a third of
    the size and ``lossless`` is not asked (a photo: 17 kB instead of 93 kB at 224 px).

    Every rerun sends each figure to the browser, and grids repeat their image per panel, so the
    encoding decides how heavy a page is. Drawn shapes compress well as PNG and stay exact;
    colour-mapped values ask for ``lossless``.
    """
    png = _encoded(image, "PNG", compress_level=1)  # 4x faster than the default, 10% larger
    jpeg = None if lossless else _encoded(image, "JPEG", quality=90)
    if jpeg is not None and 3 * len(jpeg) < len(png):
        return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _image_trace(image: np.ndarray, hover: bool = True, lossless: bool = False, **kwargs) -> go.Image:
    # An encoded source is ~10x smaller in the figure JSON than z as nested lists of numbers.
    return go.Image(
        source=image_data_uri(image, lossless), hoverinfo="x+y+color" if hover else "skip", **kwargs
    )


def _patch_heatmap(
    values: np.ndarray,
    image_size: tuple[int, int],
    value_name: str = "attention",
    label: str = "",
    **kwargs,
) -> go.Heatmap:
    """A (gh, gw) map drawn one cell per patch over an image of ``image_size`` = (H, W) pixels.

    go.Image puts pixel centres at 0..W-1, so patch j spans pixels [j*dx - 0.5, (j+1)*dx - 0.5].
    """
    grid_h, grid_w = values.shape
    height, width = image_size
    dy, dx = height / grid_h, width / grid_w
    return go.Heatmap(
        z=values,
        x0=dx / 2 - 0.5,
        dx=dx,
        y0=dy / 2 - 0.5,
        dy=dy,
        customdata=_patch_positions((grid_h, grid_w)),
        hovertemplate=(
            "patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
            f"<br>{value_name} %{{z:.4g}}<extra>{label}</extra>"
        ),
        **kwargs,
    )


def _image_axes(fig: go.Figure, cells: Sequence[tuple[int, int]] | None = None, columns: int = 1) -> None:
    """Image convention: y grows downwards, square pixels, no ticks; for the figure's only axes,
    or for the subplots at ``cells`` (row, col) of a make_subplots grid ``columns`` wide, in one
    layout update (an update per axis re-validates the whole figure: for 12 panels that took
    longer than drawing them)."""
    if cells is None:
        fig.update_xaxes(visible=False, constrain="domain")
        fig.update_yaxes(visible=False, autorange="reversed", scaleanchor="x", constrain="domain")
        return
    layout = {}
    for row, col in cells:
        index = (row - 1) * columns + col  # make_subplots numbers its axes row by row
        suffix = "" if index == 1 else str(index)
        layout[f"xaxis{suffix}"] = dict(visible=False, constrain="domain")
        layout[f"yaxis{suffix}"] = dict(
            visible=False, autorange="reversed", scaleanchor=f"x{suffix}", constrain="domain"
        )
    fig.update_layout(layout)


def _panel_height(image_shape: tuple[int, ...], rows: int, width: int) -> int:
    height, image_width = image_shape[:2]
    return int(rows * width * height / image_width) + MARGIN["t"] + MARGIN["b"] + 30 * rows


def _title(text: str) -> dict:
    return dict(text=text, x=0.01, xanchor="left")


# --- the image and its patches -----------------------------------------------------------------


def image_with_grid(
    image, grid_size: tuple[int, int], highlight: int | tuple[int, int] | None = None
) -> go.Figure:
    """The model's input image cut into its gh x gw patches; hover names each patch."""
    image = _rgb_uint8(image)
    grid_h, grid_w = grid_size
    height, width = image.shape[:2]
    fig = go.Figure(_image_trace(image, hover=False))
    # An invisible heatmap carries the hover text of each patch.
    clear = [[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0)"]]
    hover = _patch_heatmap(
        _patch_positions(grid_size)[..., 0].astype(float), (height, width),
        colorscale=clear, showscale=False,
    )
    fig.add_trace(hover.update(hovertemplate=(
        "patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})<extra></extra>"
    )))
    line = dict(color="rgba(255,255,255,0.8)", width=1)
    rows = [row * height / grid_h - 0.5 for row in range(1, grid_h)]
    cols = [col * width / grid_w - 0.5 for col in range(1, grid_w)]
    # All lines in one layout update: add_shape per line re-validates every earlier shape, which
    # took seconds for the 27 + 27 lines of a 28 x 28 grid.
    fig.update_layout(shapes=[
        *(dict(type="line", x0=-0.5, x1=width - 0.5, y0=y, y1=y, line=line) for y in rows),
        *(dict(type="line", x0=x, x1=x, y0=-0.5, y1=height - 0.5, line=line) for x in cols),
    ])
    title = f"Input image as a {grid_h} x {grid_w} grid of {grid_h * grid_w} patches"
    if highlight is not None:
        if isinstance(highlight, Sequence):
            row, col = highlight
        else:
            row, col = divmod(int(highlight), grid_w)
        if not (0 <= row < grid_h and 0 <= col < grid_w):
            raise ValueError(f"patch ({row}, {col}) is outside the {grid_h}x{grid_w} grid")
        dy, dx = height / grid_h, width / grid_w
        fig.add_shape(
            type="rect", x0=col * dx - 0.5, x1=(col + 1) * dx - 0.5, y0=row * dy - 0.5,
            y1=(row + 1) * dy - 0.5, line=dict(color="#00e5ff", width=3),
        )
        title += f" (patch {row * grid_w + col} at row {row}, col {col} highlighted)"
    _image_axes(fig)
    fig.update_layout(title=_title(title), margin=MARGIN)
    return fig


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
    fig = go.Figure(_image_trace(mosaic, hover=False))
    # One invisible cell per slot for the hover; empty slots are gaps.
    slots = np.full((math.ceil(shown / columns), columns), np.nan)
    slots.flat[:shown] = np.arange(shown)
    step = patch + gap
    fig.add_trace(
        go.Heatmap(
            z=slots, x0=(patch - 1) / 2, dx=step, y0=(patch - 1) / 2, dy=step,
            colorscale=[[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0)"]], showscale=False,
            hoverongaps=False,
            customdata=np.stack(np.divmod(np.nan_to_num(slots, nan=-1), grid_w), axis=-1),
            hovertemplate="patch %{z}: row %{customdata[0]}, col %{customdata[1]}<extra></extra>",
        )
    )
    _image_axes(fig)
    what = "all" if shown == total else f"the first {shown} of"
    fig.update_layout(
        title=_title(f"Patch sequence: {what} {total} patches in token order (row by row)"),
        margin=MARGIN, height=_panel_height(mosaic.shape, 1, 900),
    )
    return fig


def token_pca_image(colors, image) -> go.Figure:
    """The image beside its patch tokens coloured by their first three principal components."""
    image = _rgb_uint8(image)
    colors = _array(colors)
    if colors.ndim != 3 or colors.shape[-1] not in (1, 3):
        raise ValueError(f"colors must be (gh, gw, 3) or (gh, gw, 1), not {colors.shape}")
    grid_h, grid_w = colors.shape[:2]
    height, width = image.shape[:2]
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("input", "patch tokens, PCA as RGB"),
        horizontal_spacing=0.03,
    )
    fig.add_trace(_image_trace(image), row=1, col=1)
    dy, dx = height / grid_h, width / grid_w
    fig.add_trace(
        _image_trace(
            _rgb_uint8(colors.astype(np.float64)), lossless=True, x0=dx / 2 - 0.5, dx=dx, y0=dy / 2 - 0.5, dy=dy
        ),
        row=1, col=2,
    )
    _image_axes(fig, [(1, 1), (1, 2)], columns=2)
    fig.update_layout(
        title=_title("Token PCA: patches with similar tokens get similar colours"),
        margin=MARGIN, height=_panel_height(image.shape, 1, 1.5 * CELL_PIXELS),
    )
    return fig


# --- what the model learned in its embeddings --------------------------------------------


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
    fig = go.Figure([
        go.Image(source=image_data_uri(colours, lossless=True), hoverinfo="skip"),
        go.Heatmap(
            z=np.zeros((grid_h, grid_w)), opacity=0.0,
            x0=(grid_w - 1) / 2, dx=tile_w, y0=(grid_h - 1) / 2, dy=tile_h,
            customdata=np.stack([rows, cols], axis=-1),
            hovertemplate="patch (%{customdata[0]}, %{customdata[1]}) against every patch<extra></extra>",
            colorscale=SIMILARITY_SCALE, zmin=-1, zmax=1, showscale=True, colorbar=dict(title="cosine"),
        ),
    ])
    fig.update_xaxes(
        title="input patch column", tickvals=[col * tile_w + (grid_w - 1) / 2 for col in range(grid_w)],
        ticktext=list(range(grid_w)), showgrid=False, zeroline=False, constrain="domain",
    )
    fig.update_yaxes(
        title="input patch row", tickvals=[row * tile_h + (grid_h - 1) / 2 for row in range(grid_h)],
        ticktext=list(range(grid_h)), autorange="reversed", scaleanchor="x", showgrid=False,
        zeroline=False, constrain="domain",
    )
    fig.update_layout(
        title=_title("Position embedding similarity (each tile: one patch vs all patches)"),
        margin=MARGIN, plot_bgcolor="white",
    )
    return fig


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
    fig = go.Figure(_image_trace(mosaic))
    _image_axes(fig)
    fig.update_layout(
        title=_title(f"Patch embedding filters: the first {count} principal components"),
        margin=MARGIN,
    )
    return fig


# --- attention -----------------------------------------------------------------------------


def attention_overlay(
    image, attention_map, opacity: float = 0.6, title: str = "Attention", value_name: str = "attention"
) -> go.Figure:
    """A (gh, gw) map (attention, rollout, relevance) laid over the image, one cell per patch."""
    image = _rgb_uint8(image)
    attention_map = _check_map(_float_array(attention_map))
    fig = go.Figure(_image_trace(image, hover=False))
    fig.add_trace(
        _patch_heatmap(
            attention_map, image.shape[:2], value_name, colorscale=ATTENTION_SCALE,
            opacity=opacity, colorbar=dict(title=value_name),
        )
    )
    _image_axes(fig)
    fig.update_layout(title=_title(title), margin=MARGIN)
    return fig


def _where(layer: int | str | None) -> str:
    """Where maps come from, for a title: a layer index, a phrase of the caller's, or unknown."""
    if isinstance(layer, str):
        return layer
    return f"layer {layer}" if layer is not None else "one layer"


def _head_panels(image: np.ndarray, overlays: list, columns: int) -> tuple[go.Figure, int]:
    """One panel per head: the image with that head's overlay, titled "head h"; (figure, rows).

    One PNG for all panels and one call for all traces: per-panel add_trace re-validates the
    whole figure, which made these figures the slowest part of a rerun.
    """
    heads = len(overlays)
    columns = min(columns, heads)
    rows = math.ceil(heads / columns)
    fig = make_subplots(
        rows=rows, cols=columns, subplot_titles=[f"head {h}" for h in range(heads)],
        horizontal_spacing=0.02, vertical_spacing=0.06 if rows > 1 else 0.0,
    )
    source = image_data_uri(image)
    positions = [divmod(head, columns) for head in range(heads)]
    traces = [trace for overlay in overlays for trace in (go.Image(source=source, hoverinfo="skip"), overlay)]
    fig.add_traces(
        traces,
        rows=[row + 1 for row, _ in positions for _ in range(2)],
        cols=[col + 1 for _, col in positions for _ in range(2)],
    )
    _image_axes(fig, [(row + 1, col + 1) for row, col in positions], columns)
    return fig, rows


def attention_heads_grid(
    image, maps, opacity: float = 0.6, layer: int | str | None = None, columns: int = 4,
    query: str = "class token",
) -> go.Figure:
    """Every head's attention map (H, gh, gw) over the image, one panel per head, on one shared
    colour scale so that heads can be compared."""
    image = _rgb_uint8(image)
    maps = _float_array(maps)
    if maps.ndim != 3:
        raise ValueError(f"maps must be (H, gh, gw), not {maps.shape}")
    fig, rows = _head_panels(image, [
        _patch_heatmap(head_map, image.shape[:2], label=f"head {head}", coloraxis="coloraxis", opacity=opacity)
        for head, head_map in enumerate(maps)
    ], columns)
    where = _where(layer)
    fig.update_layout(
        title=_title(f"Attention of the {query} in {where}, per head"),
        coloraxis=dict(colorscale=ATTENTION_SCALE, cmin=0, cmax=float(maps.max()),
                       colorbar=dict(title="attention")),
        margin=MARGIN, height=_panel_height(image.shape, rows, CELL_PIXELS),
    )
    return fig


def attention_masks_grid(
    image, masks, mass: float, layer: int | str | None = None, columns: int = 4, query: str = "class token"
) -> go.Figure:
    """Every head's mask (H, gh, gw) of the patches that hold ``mass`` of its attention (DINO's
    figure): the kept patches show the image, the others are darkened."""
    image = _rgb_uint8(image)
    masks = _array(masks).astype(bool)
    if masks.ndim != 3:
        raise ValueError(f"masks must be (H, gh, gw), not {masks.shape}")
    # Dropped patches under a dark veil, kept ones clear: the mask reads as a cut-out.
    fig, rows = _head_panels(image, [
        _patch_heatmap(
            (~mask).astype(float), image.shape[:2], value_name="dropped", label=f"head {head}",
            colorscale=[[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0.75)"]], zmin=0, zmax=1, showscale=False,
        )
        for head, mask in enumerate(masks)
    ], columns)
    where = _where(layer)
    fig.update_layout(
        title=_title(f"Patches holding {mass:.0%} of the {query}'s attention in {where}, per head"),
        margin=MARGIN, height=_panel_height(image.shape, rows, CELL_PIXELS),
    )
    return fig


def token_labels(
    num_tokens: int, num_prefix_tokens: int, class_token: bool = True, dist_token: bool = False
) -> list[str]:
    """Readable names of the tokens: CLS, DIST (DeiT's distillation token), reg 1.., patch 0.."""
    named = (["CLS"] if class_token else []) + (["DIST"] if dist_token else [])
    registers = [f"reg {index + 1}" for index in range(num_prefix_tokens - len(named))]
    return named + registers + [f"patch {i}" for i in range(num_tokens - num_prefix_tokens)]


def attention_matrix(
    attention, num_prefix_tokens: int, title: str = "Attention matrix", class_token: bool = True,
    dist_token: bool = False, max_cells: int = 400,
) -> go.Figure:
    """The full (N, N) attention matrix: row = query token, column = key token.

    Past ``max_cells`` tokens the patches are drawn in blocks of k x k (k as small as fits),
    each cell the largest weight in its block, so a single strong key still shows: a 785-token
    matrix on a screen some 700 px wide is otherwise 3.4 MB sent to draw sub-pixel cells. The
    prefix tokens keep a row and a column each.
    """
    attention = _float_array(attention)
    if attention.ndim != 2 or attention.shape[0] != attention.shape[1]:
        raise ValueError(f"an attention matrix must be (N, N), not {attention.shape}")
    tokens = attention.shape[0]
    labels = token_labels(tokens, num_prefix_tokens, class_token, dist_token)
    block = max(1, math.ceil((tokens - num_prefix_tokens) / max(max_cells - num_prefix_tokens, 1)))
    if block > 1:
        starts = list(range(num_prefix_tokens)) + list(range(num_prefix_tokens, tokens, block))
        attention = np.maximum.reduceat(np.maximum.reduceat(attention, starts, axis=0), starts, axis=1)
        labels = labels[:num_prefix_tokens] + [
            f"patches {start - num_prefix_tokens}-{min(start + block, tokens) - 1 - num_prefix_tokens}"
            for start in starts[num_prefix_tokens:]
        ]
        title = f"{title} (patches in blocks of {block} x {block}: each cell the largest weight in its block)"
    cells = attention.shape[0]
    # Token names as category coordinates: the hover names both tokens without an N x N
    # customdata array (a 577-token matrix would carry 666k strings).
    value = "attention" if block == 1 else "largest attention"
    fig = go.Figure(
        go.Heatmap(
            z=attention.astype(np.float32), x=labels, y=labels, colorscale=VALUE_SCALE,  # half the JSON
            hovertemplate=f"query %{{y}}<br>key %{{x}}<br>{value} %{{z:.4g}}<extra></extra>",
            colorbar=dict(title="attention"),
        )
    )
    if num_prefix_tokens:
        # Lines between the prefix tokens and the patches.
        edge = num_prefix_tokens - 0.5
        line = dict(color="white", width=1, dash="dot")
        fig.add_shape(type="line", x0=edge, x1=edge, y0=-0.5, y1=cells - 0.5, line=line)
        fig.add_shape(type="line", x0=-0.5, x1=cells - 0.5, y0=edge, y1=edge, line=line)
    fig.update_xaxes(title="key token", constrain="domain", showgrid=False, type="category")
    fig.update_yaxes(
        title="query token", autorange="reversed", scaleanchor="x", constrain="domain",
        showgrid=False, type="category",
    )
    fig.update_layout(title=_title(title), margin=MARGIN)
    return fig


# --- statistics per layer and head ---------------------------------------------------------


def _layer_labels(count: int, layers: Sequence[int] | None) -> list[int]:
    layers = list(range(count)) if layers is None else [int(layer) for layer in layers]
    if len(layers) != count:
        raise ValueError(f"{len(layers)} layer labels for {count} layers")
    return layers


def layer_head_heatmap(
    values, title: str, colorbar_title: str, layers: Sequence[int] | None = None
) -> go.Figure:
    """A value per (layer, head), e.g. mean attention distance or entropy: values (L, H)."""
    values = _float_array(values)
    if values.ndim != 2:
        raise ValueError(f"values must be (L, H), not {values.shape}")
    layer_labels = _layer_labels(values.shape[0], layers)
    fig = go.Figure(
        go.Heatmap(
            z=values, x=list(range(values.shape[1])), y=layer_labels, colorscale=VALUE_SCALE,
            hovertemplate=f"layer %{{y}}, head %{{x}}<br>{colorbar_title} %{{z:.4g}}<extra></extra>",
            colorbar=dict(title=colorbar_title),
        )
    )
    fig.update_xaxes(title="head", dtick=1)
    fig.update_yaxes(title="layer", autorange="reversed", type="category")
    fig.update_layout(title=_title(title), margin=MARGIN)
    return fig


def layer_head_scatter(
    values, title: str, yaxis_title: str, layers: Sequence[int] | None = None
) -> go.Figure:
    """One dot per head at each layer plus the layer mean, as in the ViT paper's Fig. 7 (right)
    plot of mean attention distance against depth. values: (L, H)."""
    values = _float_array(values)
    if values.ndim != 2:
        raise ValueError(f"values must be (L, H), not {values.shape}")
    layer_labels = _layer_labels(values.shape[0], layers)
    fig = go.Figure()
    for head in range(values.shape[1]):
        fig.add_trace(
            go.Scatter(
                x=layer_labels, y=values[:, head], mode="markers", name=f"head {head}",
                marker=dict(size=8, opacity=0.8),
                hovertemplate=f"layer %{{x}}, head {head}<br>{yaxis_title} %{{y:.4g}}<extra></extra>",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=layer_labels, y=values.mean(axis=1), mode="lines", name="mean over heads",
            line=dict(color="black", width=2),
            hovertemplate=f"layer %{{x}}, mean<br>{yaxis_title} %{{y:.4g}}<extra></extra>",
        )
    )
    fig.update_xaxes(title="layer", tickvals=layer_labels)
    fig.update_yaxes(title=yaxis_title, rangemode="tozero")
    fig.update_layout(title=_title(title), margin=MARGIN)
    return fig


# --- predictions -------------------------------------------------------------------------------


def _class_names(count: int, class_names: Sequence[str] | None) -> list[str]:
    if class_names is None:
        return [f"class {i}" for i in range(count)]
    if len(class_names) != count:
        raise ValueError(f"{len(class_names)} class names for {count} classes")
    return [str(name) for name in class_names]


def logit_lens_figure(probs, class_names: Sequence[str] | None = None, max_classes: int = 10) -> go.Figure:
    """How the prediction forms through the depth: class probabilities read out after each block.

    probs: (L+1, K) softmax of ``analysis.logit_lens`` (row 0: the embeddings). With more than
    ``max_classes`` classes, the ones most probable at the output are shown.
    """
    probs = _float_array(probs)
    if probs.ndim != 2:
        raise ValueError(f"probs must be (L+1, K), not {probs.shape}")
    names = _class_names(probs.shape[1], class_names)
    shown = np.argsort(-probs[-1], kind="stable")[:max_classes]
    depth = probs.shape[0] - 1
    rows = ["embeddings"] + [f"after block {block}" for block in range(depth)]
    fig = go.Figure(
        go.Heatmap(
            z=probs[:, shown], x=[names[i] for i in shown], y=rows, colorscale=VALUE_SCALE,
            zmin=0, zmax=1, colorbar=dict(title="probability"),
            hovertemplate="%{y}<br>%{x}: %{z:.3f}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title="class (most probable at the output first)")
    fig.update_layout(
        title=_title("Logit lens: the classifier head applied after every block"), margin=MARGIN
    )
    return fig


def topk_bar(probs, class_names: Sequence[str] | None = None, k: int = 5) -> go.Figure:
    """The k most probable classes as horizontal bars, the most probable on top. probs: (C,)."""
    probs = _float_array(probs).reshape(-1)
    names = _class_names(probs.shape[0], class_names)
    top = np.argsort(-probs, kind="stable")[:k]
    fig = go.Figure(
        go.Bar(
            x=probs[top], y=[names[i] for i in top], orientation="h",
            text=[f"{100 * probs[i]:.1f}%" for i in top], textposition="auto",
            marker_color="#4c78a8", hovertemplate="%{y}: %{x:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(title="probability", range=[0, 1])
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=_title(f"Top-{len(top)} predictions"), margin=MARGIN)
    return fig


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
    fig = make_subplots(
        rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.16,
        subplot_titles=("patch tokens on the grid", "every token"),
    )
    patch_norms = norms[num_prefix_tokens:].reshape(grid_h, grid_w)
    fig.add_trace(
        go.Heatmap(
            z=patch_norms, colorscale=VALUE_SCALE, customdata=_patch_positions(grid_size),
            hovertemplate="patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
            "<br>norm %{z:.4g}<extra></extra>",
            colorbar=dict(title="norm", x=0.39, thickness=12),
        ),
        row=1, col=1,
    )
    colours = ["#e45756"] * num_prefix_tokens + ["#4c78a8"] * (norms.shape[0] - num_prefix_tokens)
    fig.add_trace(
        go.Bar(
            x=list(range(norms.shape[0])), y=norms, marker_color=colours, customdata=labels,
            hovertemplate="token %{x} (%{customdata})<br>norm %{y:.4g}<extra></extra>",
            showlegend=False,
        ),
        row=1, col=2,
    )
    _image_axes(fig, [(1, 1)], columns=2)
    fig.update_xaxes(title="token (prefix tokens in red)", row=1, col=2)
    fig.update_yaxes(title="L2 norm", row=1, col=2)
    where = f" after block {layer}" if layer is not None else ""
    fig.update_layout(title=_title(f"Token norms{where}"), margin=MARGIN)
    return fig


# --- training --------------------------------------------------------------------------------


def _epoch_steps(history: Mapping) -> list[float]:
    """x position (a step) of each epoch summary: where that epoch ended.

    Epochs (1-based, as ``vit_explorer.train`` counts them) have equal step counts, so epoch e of
    E ends at step e * total_steps / E; without step records, the epoch number itself.
    """
    steps = history.get("steps", [])
    if not steps:
        return [record["epoch"] for record in history.get("epochs", [])]
    total_steps = steps[-1]["total_steps"]
    return [
        record["epoch"] * total_steps / record["epochs"] for record in history.get("epochs", [])
    ]


def training_curves(history: Mapping | None) -> go.Figure:
    """Loss, accuracy and learning rate of a training run (``TrainingRun.history``): per-step
    training values as lines, per-epoch test values as markers. Empty history: empty axes."""
    history = history or {}
    steps = history.get("steps", [])
    epochs = history.get("epochs", [])
    fig = make_subplots(
        rows=1, cols=3, subplot_titles=("loss", "accuracy", "learning rate"),
        horizontal_spacing=0.08,
    )
    step_x = [record["step"] for record in steps]
    epoch_x = _epoch_steps(history)
    train = dict(mode="lines", line=dict(color="#4c78a8"), legendgroup="train")
    test = dict(mode="lines+markers", line=dict(color="#e45756"), legendgroup="test")
    fig.add_trace(go.Scatter(x=step_x, y=[r["loss"] for r in steps], name="train (per step)",
                             **train), row=1, col=1)
    fig.add_trace(go.Scatter(x=step_x, y=[r["accuracy"] for r in steps], showlegend=False,
                             name="train (per step)", **train), row=1, col=2)
    fig.add_trace(go.Scatter(x=step_x, y=[r["lr"] for r in steps], showlegend=False,
                             name="learning rate", **train), row=1, col=3)
    fig.add_trace(go.Scatter(x=epoch_x, y=[r["test_loss"] for r in epochs], name="test (per epoch)",
                             **test), row=1, col=1)
    fig.add_trace(go.Scatter(x=epoch_x, y=[r["test_accuracy"] for r in epochs], showlegend=False,
                             name="test (per epoch)", **test), row=1, col=2)
    fig.update_xaxes(title="step")
    fig.update_yaxes(range=[0, 1], row=1, col=2)
    fig.update_yaxes(exponentformat="e", row=1, col=3)
    if steps:
        latest = steps[-1]
        title = (
            f"Training: step {latest['step']} of {latest['total_steps']},"
            f" loss {latest['loss']:.3f}, accuracy {latest['accuracy']:.1%}"
        )
        if epochs:
            title += f"; test accuracy {epochs[-1]['test_accuracy']:.1%}"
    else:
        title = "Training curves (nothing logged yet)"
    fig.update_layout(title=_title(title), margin=MARGIN,
                      legend=dict(orientation="h", y=-0.2))
    return fig


# --- files ---------------------------------------------------------------------------------------


def find_browser() -> str | None:
    """A Chrome/Chromium executable for kaleido's PNG export, or None.

    ``BROWSER_PATH`` wins (kaleido's and choreographer's own override); otherwise the system
    browser that choreographer finds on PATH or at the usual places (/usr/bin/chromium on Debian).
    """
    override = os.environ.get("BROWSER_PATH")
    if override:
        return override if os.access(override, os.X_OK) else None
    try:
        from choreographer.browsers.chromium import Chromium
    except ImportError:  # kaleido (and with it choreographer) is not installed
        return None
    return Chromium.find_browser(skip_local=False)


def write_figures(
    figures: Mapping[str, go.Figure], directory: str | os.PathLike, image_format: str = "png",
    width: int = 900, height: int = 700,
) -> list[Path]:
    """Write each figure as ``directory/<name>.<image_format>``, or as HTML with
    ``image_format="html"``; returns the paths. Static images need kaleido and a Chrome/Chromium
    (see :func:`find_browser`); without one, use HTML. HTML files share one plotly.min.js in
    ``directory`` (written once, about 4 MB) so that they open offline."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.{image_format}" for name in figures]
    if image_format == "html":
        for fig, path in zip(figures.values(), paths):
            fig.write_html(path, include_plotlyjs="directory", full_html=True)
        return paths
    browser = find_browser()
    if browser is None:
        raise FigureExportError(f"writing {image_format} files needs Chrome or Chromium; none was found")
    try:
        import kaleido
    except ImportError as error:
        raise FigureExportError(f"writing {image_format} files needs kaleido (pip install kaleido)") from error

    specs = [
        dict(
            fig=fig.to_dict(), path=path,
            opts=dict(format=image_format, width=fig.layout.width or width,
                      height=fig.layout.height or height, scale=1),
        )
        for fig, path in zip(figures.values(), paths)
    ]
    # One browser for all figures; MathJax off, since its default source is a CDN.
    try:
        kaleido.write_fig_from_object_sync(specs, kopts=dict(path=browser, mathjax=False))
    except Exception as error:  # the browser can fail in many ways; say which, in one line
        raise FigureExportError(
            f"{browser} could not render the figures: {type(error).__name__}: {error}"
        ) from error
    return paths


# --- app-specific figures ---


def input_image(image, title: str) -> go.Figure:
    """An image at its true pixel size with each pixel's RGB value on hover."""
    image = _rgb_uint8(image)
    fig = go.Figure(_image_trace(image))
    _image_axes(fig)
    fig.update_layout(title=_title(title), margin=MARGIN)
    return fig


def patch_picker(image, grid_size: tuple[int, int], selected: int | None = None) -> go.Figure:
    """:func:`image_with_grid` that reports a click on any patch as a selected point.

    Heatmap cells cannot be selected in Streamlit (streamlit#8760), so an invisible marker sits
    on every patch centre and ``hoverdistance=-1`` lets a click anywhere pick the nearest one;
    the markers run in row-major patch order, so a selected point's index is the patch index.
    """
    fig = image_with_grid(image, grid_size, highlight=selected)
    height, width = _rgb_uint8(image).shape[:2]
    grid_h, grid_w = grid_size
    positions = _patch_positions(grid_size).reshape(-1, 3)
    fig.add_trace(
        go.Scatter(
            x=(positions[:, 2] + 0.5) * width / grid_w - 0.5,
            y=(positions[:, 1] + 0.5) * height / grid_h - 0.5,
            mode="markers", customdata=positions, showlegend=False,
            marker=dict(size=max(4, min(30, 360 // max(grid_h, grid_w))), color="rgba(0,0,0,0)"),
            selected=dict(marker=dict(color="rgba(0,229,255,0.5)")),
            unselected=dict(marker=dict(opacity=0)),
            hovertemplate="patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
            "<br>click to make it the query<extra></extra>",
        )
    )
    fig.update_layout(
        title=_title("Click a patch to make it the query"), hovermode="closest", hoverdistance=-1,
        clickmode="event+select", dragmode=False,
    )
    return fig


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
    fig = go.Figure(
        go.Heatmap(
            z=shown, y=labels, colorscale=SIMILARITY_SCALE, zmin=-limit, zmax=limit,
            hovertemplate="%{y}, dimension %{x}<br>value %{z:.4g}<extra></extra>",
            colorbar=dict(title="value"),
        )
    )
    fig.update_xaxes(title="embedding dimension")
    fig.update_yaxes(title="token", autorange="reversed", type="category", showticklabels=count <= 40)
    cut = "" if shown.shape == tokens.shape else f" (first {shown.shape[0]} x {shown.shape[1]} shown)"
    fig.update_layout(title=_title(f"{title}: {count} x {dims}{cut}"), margin=MARGIN)
    return fig


def patch_size_tradeoff(rows: Sequence[Mapping], current: int) -> go.Figure:
    """Smaller patches: more tokens, more cost, more detail. Three panels over the patch sizes,
    rows as ``ui.Selection.predictions_by_patch_size`` gives them: the token count, the measured
    forward time of this image, and how well the model does (the top-1 probability on this image
    labelled with the class, and the accuracy on a held-out batch where the row has one).
    ``current`` is highlighted."""
    labels = [f"p={row['patch size']} ({row['grid']})" for row in rows]
    colours = ["#e45756" if row["patch size"] == current else "#4c78a8" for row in rows]
    fig = make_subplots(
        rows=1, cols=3, horizontal_spacing=0.08,
        subplot_titles=("tokens", "forward time of this image (ms)", "how well it does"),
    )
    fig.add_trace(go.Bar(
        x=labels, y=[row["tokens"] for row in rows], marker_color=colours, showlegend=False,
        text=[row["tokens"] for row in rows], textposition="auto",
        hovertemplate="%{x}: %{y} tokens<extra></extra>",
    ), row=1, col=1)
    fig.add_trace(go.Bar(
        x=labels, y=[row["forward ms"] for row in rows], marker_color=colours, showlegend=False,
        text=[f"{row['forward ms']:.1f}" for row in rows], textposition="auto",
        hovertemplate="%{x}: %{y:.2f} ms<extra></extra>",
    ), row=1, col=2)
    fig.add_trace(go.Bar(
        x=labels, y=[row["probability"] for row in rows], marker_color=colours,
        name="top-1 probability on this image", text=[row["prediction"] for row in rows],
        textposition="auto", hovertemplate="%{x}<br>%{text}: %{y:.3f}<extra></extra>",
    ), row=1, col=3)
    held_out = [row.get("held-out accuracy") for row in rows]
    if any(value is not None for value in held_out):
        fig.add_trace(go.Scatter(
            x=labels, y=held_out, mode="lines+markers", name="accuracy on held-out images",
            line=dict(color="#f58518"), marker=dict(size=9),
            hovertemplate="%{x}: %{y:.1%} of held-out images right<extra></extra>",
        ), row=1, col=3)
    fig.update_xaxes(type="category", tickangle=-45)
    fig.update_yaxes(range=[0, 1.05], row=1, col=3)
    fig.update_layout(
        title=_title("The same weights at every patch size (current in red)"),
        margin={**MARGIN, "l": 50},  # room for the first panel's tick labels and slanted x labels
        legend=dict(orientation="h", yanchor="top", y=-0.35, x=1, xanchor="right"), height=380,
    )
    return fig
