"""Attention: overlays and per-head grids over the image, the N x N matrix, and statistics per
layer and head."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import (
    _scale,
    VALUE_SCALE, CELL_PIXELS, MARGIN, _array, _float_array, _rgb_uint8, _check_map,
    attention_scale, attention_top, image_data_uri, _image_trace, _patch_heatmap, _panel_height, _subplots,
    _image_axis_layout, _on_axes, _title, figure,
    token_labels,
)

HEAD_SCALES = ("shared", "per head")  # one colour scale for all heads, or one per head
MATRIX_PIXELS = 760  # the N x N matrix's height: square cells big enough to read in a wide column
QUERY_COLOUR = "#00e5ff"  # the patch picker's highlight


def _query_outline(patch: int | None, grid_size: tuple[int, int], image_size: tuple[int, int],
                   axes: str = "") -> list[dict]:
    """Shapes that outline the query patch (row-major index; None: no patch) on the image axes
    x{axes}/y{axes}: cyan over a black edge, visible on light and dark pictures alike."""
    if patch is None:
        return []
    grid_h, grid_w = grid_size
    if not 0 <= patch < grid_h * grid_w:
        raise ValueError(f"query patch {patch} is outside the {grid_h}x{grid_w} grid")
    row, col = divmod(patch, grid_w)
    dy, dx = image_size[0] / grid_h, image_size[1] / grid_w
    box = dict(type="rect", xref=f"x{axes}", yref=f"y{axes}", x0=col * dx - 0.5, x1=(col + 1) * dx - 0.5,
               y0=row * dy - 0.5, y1=(row + 1) * dy - 0.5)
    return [{**box, "line": dict(color="black", width=4)}, {**box, "line": dict(color=QUERY_COLOUR, width=2)}]


def _window_outline(window: tuple[int, int, int, int] | None, grid_size: tuple[int, int],
                    image_size: tuple[int, int], axes: str = "") -> list[dict]:
    """Shapes that outline a window of patches (top, left, bottom, right rows and columns,
    inclusive; None: none) on the image axes x{axes}/y{axes}: dashed white over a black edge."""
    if window is None:
        return []
    top, left, bottom, right = window
    dy, dx = image_size[0] / grid_size[0], image_size[1] / grid_size[1]
    box = dict(type="rect", xref=f"x{axes}", yref=f"y{axes}", x0=left * dx - 0.5, x1=(right + 1) * dx - 0.5,
               y0=top * dy - 0.5, y1=(bottom + 1) * dy - 0.5)
    return [{**box, "line": dict(color="black", width=4)}, {**box, "line": dict(color="white", width=2, dash="dash")}]


def attention_overlay(
    image, attention_map, opacity: float = 0.85, title: str = "Attention", value_name: str = "attention",
    query_patch: int | None = None, weights: bool = False, top: float | None = None, colorscale: list | None = None,
) -> go.Figure:
    """A (gh, gw) map (attention, rollout, relevance) laid over the image, one cell per patch, on
    a scale from 0 (transparent) to its largest value (or ``top``, to share another map's scale);
    ``query_patch`` (row-major) is outlined. ``weights``: the map is one query's weights over the
    patches (attention, rollout), so the scale reaches at least a few times the uniform weight and
    even attention stays pale. The colour: crimson, or gold where crimson would hide
    (``colorscale``: another figure's, to compare the two; by default :func:`attention_scale`)."""
    image = _rgb_uint8(image)
    attention_map = _check_map(_float_array(attention_map))
    if top is None:
        top = overlay_top(attention_map, weights)
    heatmap = _patch_heatmap(
        attention_map, image.shape[:2], value_name, colorscale=colorscale or attention_scale(image, attention_map), zmin=0, zmax=top,
        opacity=opacity, colorbar=dict(title=dict(text=f"{value_name}<br>(0 = clear)")),
    )
    return figure([_image_trace(image, hover=False), heatmap], dict(
        **_image_axis_layout(), title=_title(title), margin=MARGIN,
        shapes=_query_outline(query_patch, attention_map.shape, image.shape[:2]),
    ))


def overlay_top(attention_map, weights: bool = False) -> float:
    """The top of :func:`attention_overlay`'s scale for a (gh, gw) map."""
    attention_map = _float_array(attention_map)
    return attention_top(attention_map, 1 / attention_map.size if weights else 0.0)


def _where(layer: int | str | None) -> str:
    """Where maps come from, for a title: a layer index, a phrase of the caller's, or unknown."""
    if isinstance(layer, str):
        return layer
    return f"layer {layer}" if layer is not None else "one layer"


def _head_panels(
    image: np.ndarray, overlays: list, columns: int, titles: Sequence[str] | None = None,
    query_patch: int | None = None, grid_size: tuple[int, int] | None = None,
    window: tuple[int, int, int, int] | None = None, **layout,
) -> go.Figure:
    """One panel per head: the image with that head's overlay, titled "head h" (or ``titles``),
    the query patch and its attention ``window`` (if any) outlined in each; ``layout`` adds to
    the figure's layout (title, ...).

    Built in one go from make_subplots' grid layout (:func:`_subplots`), one PNG for all panels.
    """
    heads = len(overlays)
    columns = min(columns, heads)
    rows = math.ceil(heads / columns)
    layout.setdefault("height", heads_height(image.shape, heads, columns))
    grid, cells = _subplots(
        rows, columns, list(titles or (f"head {h}" for h in range(heads))),
        horizontal_spacing=0.02, vertical_spacing=0.06 if rows > 1 else 0.0,
    )
    source = image_data_uri(image)
    traces = []
    for head, overlay in enumerate(overlays):
        suffix = cells[divmod(head, columns)[0] + 1, head % columns + 1]
        traces += [_on_axes(dict(type="image", source=source, hoverinfo="skip"), suffix), _on_axes(overlay, suffix)]
        for axis, settings in _image_axis_layout(suffix).items():
            grid[axis].update(settings)
    if query_patch is not None:
        grid["shapes"] = [
            shape for head in range(heads) for axes in ["" if head == 0 else str(head + 1)]
            for shape in _window_outline(window, grid_size, image.shape[:2], axes)
            + _query_outline(query_patch, grid_size, image.shape[:2], axes)
        ]
    grid.update({"margin": MARGIN, **layout})
    return figure(traces, grid)


def heads_height(image_shape: tuple[int, ...], heads: int, columns: int) -> int:
    """The height of a grid of ``heads`` panels ``columns`` wide (:func:`attention_heads_grid`)."""
    return _panel_height(image_shape, math.ceil(heads / min(columns, heads)), CELL_PIXELS)


def attention_heads_grid(
    image, maps, opacity: float = 0.85, layer: int | str | None = None, columns: int = 4,
    query: str = "class token", query_patch: int | None = None, scale: str = "shared",
    top: float | None = None, panel: str = "head", colorscale: list | None = None,
    window: tuple[int, int, int, int] | None = None, **layout,
) -> go.Figure:
    """Every head's attention map (H, gh, gw) over the image, one panel per head, each from 0
    (transparent) up: on one shared scale so that heads can be compared (``scale="shared"``), or
    each to its own largest value (``"per head"``), which shows the pattern of a faint head; a scale
    never tops out below 3x the uniform weight, so that attention spread evenly stays pale.
    ``query_patch`` (row-major index, None for a token without a patch) is outlined in every panel,
    and the ``window`` it attends within (window attention: top, left, bottom, right patch rows and
    columns, inclusive), dashed.
    ``top`` sets the shared scale's top (another grid's, to compare two on one scale); ``layout``
    adds to the figure's layout last (a caller's own title, margin, height). ``panel`` names what
    the maps are one of ("layer": one query's map per layer, say; the caller then titles it).
    ``colorscale``: as :func:`attention_overlay`'s, one for every panel."""
    image = _rgb_uint8(image)
    maps = _float_array(maps)
    if maps.ndim != 3:
        raise ValueError(f"maps must be (H, gh, gw), not {maps.shape}")
    colorscale = colorscale or attention_scale(image, maps)
    if scale not in HEAD_SCALES:
        raise ValueError(f"scale must be one of {HEAD_SCALES}, not {scale!r}")
    shared = scale == "shared"
    uniform = 1 / maps[0].size  # each patch's weight under uniform attention (a bound: prefix tokens share it)
    colours = (
        [dict(coloraxis="coloraxis")] * len(maps) if shared
        else [dict(colorscale=colorscale, zmin=0, zmax=attention_top(head_map, uniform), showscale=False)
              for head_map in maps]
    )
    how = "one colour scale shared by all heads" if shared else "each head on its own scale, 0 to its max"
    layout = {"title": _title(f"Attention of the {query} in {_where(layer)}, per head ({how})"), **layout}
    if shared:
        layout["coloraxis"] = dict(
            colorscale=colorscale, cmin=0, cmax=top if top is not None else attention_top(maps, uniform),
            colorbar=dict(title=dict(text=f"attention<br>(all {panel}s,<br>0 = clear)")),
        )
    return _head_panels(image, [
        _patch_heatmap(head_map, image.shape[:2], label=f"{panel} {head}", opacity=opacity, **colour)
        for head, (head_map, colour) in enumerate(zip(maps, colours))
    ], columns, titles=[f"{panel} {head} (max {head_map.max():.2g})" for head, head_map in enumerate(maps)],
        query_patch=query_patch, grid_size=maps.shape[1:], window=window, **layout)


def attention_by_layer(image, maps, query: str = "class token", query_patch: int | None = None, columns: int = 4) -> go.Figure:
    """One query's attention map in every layer (L, gh, gw), the mean of each layer's heads, over
    the image on one shared colour scale: how where it looks changes with depth."""
    return attention_heads_grid(
        image, maps, query=query, query_patch=query_patch, columns=columns, panel="layer",
        title=_title(f"Attention of the {query} in every layer, the mean of its heads (one colour scale)"),
    )


def attention_masks_grid(
    image, masks, mass: float, layer: int | str | None = None, columns: int = 4, query: str = "class token",
    query_patch: int | None = None,
) -> go.Figure:
    """Every head's mask (H, gh, gw) of the patches that hold ``mass`` of its attention (DINO's
    figure): the kept patches show the image, the others are darkened; ``query_patch`` outlined."""
    image = _rgb_uint8(image)
    masks = _array(masks).astype(bool)
    if masks.ndim != 3:
        raise ValueError(f"masks must be (H, gh, gw), not {masks.shape}")
    # Dropped patches under a dark veil, kept ones clear: the mask reads as a cut-out.
    return _head_panels(image, [
        _patch_heatmap(
            (~mask).astype(float), image.shape[:2], value_name="dropped", label=f"head {head}",
            colorscale=[[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0.75)"]], zmin=0, zmax=1, showscale=False,
        )
        for head, mask in enumerate(masks)
    ], columns, query_patch=query_patch, grid_size=masks.shape[1:],
        title=_title(f"Patches holding {mass:.0%} of the {query}'s attention in {_where(layer)}, per head"))


MATRIX_CELLS = 400  # past this many tokens the matrix is drawn in blocks


def matrix_block(num_tokens: int, num_prefix_tokens: int, max_cells: int = MATRIX_CELLS) -> int:
    """The side k of the k x k blocks of patches that :func:`attention_matrix` draws as one cell
    (1: every token its own row and column)."""
    return max(1, math.ceil((num_tokens - num_prefix_tokens) / max(max_cells - num_prefix_tokens, 1)))


def attention_matrix(
    attention, num_prefix_tokens: int, title: str = "Attention matrix", class_token: bool = True,
    dist_token: bool = False, max_cells: int = MATRIX_CELLS, query_token: int | None = None,
) -> go.Figure:
    """The full (N, N) attention matrix: row = query token, column = key token, coloured from 0;
    the row of ``query_token`` (0..N-1, prefix tokens first) is outlined.

    Past ``max_cells`` tokens the patches are drawn in blocks of k x k (k as small as fits),
    each cell the largest weight in its block, so a single strong key still shows: a 785-token
    matrix on a screen some 700 px wide is otherwise 3.4 MB sent to draw sub-pixel cells. The
    prefix tokens keep a row and a column each.
    """
    attention = _float_array(attention)
    if attention.ndim != 2 or attention.shape[0] != attention.shape[1]:
        raise ValueError(f"an attention matrix must be (N, N), not {attention.shape}")
    tokens = attention.shape[0]
    if query_token is not None and not 0 <= query_token < tokens:
        raise ValueError(f"query token {query_token} is not one of the {tokens} tokens")
    labels = token_labels(tokens, num_prefix_tokens, class_token, dist_token)
    block = matrix_block(tokens, num_prefix_tokens, max_cells)
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
    heatmap = dict(
        type="heatmap", z=attention.astype(np.float32), x=labels, y=labels, colorscale=_scale(VALUE_SCALE),  # half the JSON
        zmin=0, zmax=attention_top(attention, 1 / tokens),  # uniform rows look flat and pale
        hovertemplate=f"query %{{y}}<br>key %{{x}}<br>{value} %{{z:.4g}}<extra></extra>",
        colorbar=dict(title=dict(text=value.replace(" ", "<br>"))),
    )
    shapes = []
    if num_prefix_tokens:
        # Lines between the prefix tokens and the patches.
        edge = num_prefix_tokens - 0.5
        line = dict(color="white", width=1, dash="dot")
        shapes += [dict(type="line", x0=edge, x1=edge, y0=-0.5, y1=cells - 0.5, line=line),
                   dict(type="line", x0=-0.5, x1=cells - 0.5, y0=edge, y1=edge, line=line)]
    if query_token is not None:
        row = query_token if query_token < num_prefix_tokens else (
            num_prefix_tokens + (query_token - num_prefix_tokens) // block
        )
        shapes.append(dict(type="rect", x0=-0.5, x1=cells - 0.5, y0=row - 0.5, y1=row + 0.5,
                           line=dict(color=QUERY_COLOUR, width=2)))
    return figure([heatmap], dict(
        **({"shapes": shapes} if shapes else {}),
        xaxis=dict(title=dict(text="key token"), constrain="domain", showgrid=False, type="category"),
        yaxis=dict(title=dict(text="query token"), autorange="reversed", scaleanchor="x", constrain="domain",
                   showgrid=False, type="category"),
        title=_title(title), margin=MARGIN, height=MATRIX_PIXELS,
    ))


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
    return figure([dict(
        type="heatmap", z=values, x=list(range(values.shape[1])), y=layer_labels, colorscale=_scale(VALUE_SCALE),
        hovertemplate=f"layer %{{y}}, head %{{x}}<br>{colorbar_title} %{{z:.4g}}<extra></extra>",
        colorbar=dict(title=dict(text=colorbar_title)),
    )], dict(
        xaxis=dict(title=dict(text="head"), dtick=1),
        yaxis=dict(title=dict(text="layer"), autorange="reversed", type="category"),
        title=_title(title), margin=MARGIN,
    ))


def layer_head_scatter(
    values, title: str, yaxis_title: str, layers: Sequence[int] | None = None
) -> go.Figure:
    """One dot per head at each layer plus the layer mean, as in the ViT paper's Fig. 7 (right)
    plot of mean attention distance against depth. values: (L, H)."""
    values = _float_array(values)
    if values.ndim != 2:
        raise ValueError(f"values must be (L, H), not {values.shape}")
    layer_labels = _layer_labels(values.shape[0], layers)
    traces = [
        dict(
            type="scatter", x=layer_labels, y=values[:, head], mode="markers", name=f"head {head}",
            marker=dict(size=8, opacity=0.8),
            hovertemplate=f"layer %{{x}}, head {head}<br>{yaxis_title} %{{y:.4g}}<extra></extra>",
        )
        for head in range(values.shape[1])
    ]
    traces.append(dict(
        type="scatter", x=layer_labels, y=values.mean(axis=1), mode="lines", name="mean over heads",
        line=dict(color="black", width=2),
        hovertemplate=f"layer %{{x}}, mean<br>{yaxis_title} %{{y:.4g}}<extra></extra>",
    ))
    return figure(traces, dict(
        xaxis=dict(title=dict(text="layer"), tickvals=layer_labels),
        yaxis=dict(title=dict(text=yaxis_title), rangemode="tozero"),
        title=_title(title), margin=MARGIN,
    ))
