"""Attention: overlays and per-head grids over the image, the N x N matrix, and statistics per
layer and head."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ._base import (
    ATTENTION_SCALE, VALUE_SCALE, CELL_PIXELS, MARGIN, _array, _float_array, _rgb_uint8, _check_map,
    image_data_uri, _image_trace, _patch_heatmap, _image_axes, _panel_height, _title, token_labels,
)


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
