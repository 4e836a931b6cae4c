"""Knock-out figures: the prediction with and without the knocked-out heads, and the sweep grid."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import MARGIN, _float_array, _rgb_uint8, _title, attention_scale, attention_top, distinct_names, figure, _scale
from .attention import attention_heads_grid, attention_overlay, overlay_top
from .predictions import _class_names

INTACT_COLOUR, KNOCKED_COLOUR = "#9aa5b1", "#dc143c"


def _points(delta: float) -> str:
    """A change in points of probability that does not read 0 when it is not (a saturated
    prediction moves by thousandths of a point)."""
    return f"{delta:+.2f} pts" if delta == 0 or abs(delta) >= 0.005 else f"{delta:+.1e} pts"


def knockout_topk(
    intact, knocked, class_names: Sequence[str] | None = None, k: int = 5, what: str = "", changed: str = "knocked out",
) -> go.Figure:
    """The k classes the knocked-out model finds most probable, each with its probability intact
    (grey) and knocked out (crimson), labelled with the change in percentage points. intact,
    knocked: (C,) probabilities; ``changed`` names the second model in the legend (another change
    than a knock-out: a test-time register)."""
    intact, knocked = _float_array(intact).reshape(-1), _float_array(knocked).reshape(-1)
    names = _class_names(intact.shape[0], class_names)
    top = np.argsort(-knocked, kind="stable")[:k]
    labels = distinct_names(names, top.tolist())
    change = 100 * (knocked[top] - intact[top])
    return figure([
        dict(
            type="bar", x=intact[top], y=labels, orientation="h", name="intact", marker=dict(color=INTACT_COLOUR),
            text=[f"{100 * p:.1f}%" for p in intact[top]], textposition="auto",
            hovertemplate="%{y}, intact: %{x:.4f}<extra></extra>",
        ),
        dict(
            type="bar", x=knocked[top], y=labels, orientation="h", name=changed,
            marker=dict(color=KNOCKED_COLOUR),
            text=[f"{100 * p:.1f}% ({_points(delta)})" for p, delta in zip(knocked[top], change)],
            textposition="auto", customdata=change,
            hovertemplate=f"%{{y}}, {changed}: %{{x:.6f}} (%{{customdata:+.3g}} points)<extra></extra>",
        ),
    ], dict(
        xaxis=dict(title=dict(text="probability"), range=[0, 1]), yaxis=dict(autorange="reversed"),
        title=_title(f"Top-{len(top)} with {what or 'the knock-out'}, against the intact model"),
        barmode="group", margin=MARGIN, legend=dict(orientation="h", y=-0.2),
        height=120 + 60 * len(top),
    ))


def head_sweep_grid(values, measure: str, knocked=None, title: str = "") -> go.Figure:
    """The importance sweep, one cell per (layer, head): values (L, H), 0 = no effect, on a
    diverging scale centred at 0 (red: the knock-out lowers the measure). ``knocked`` (L, H)
    bool outlines the heads knocked out now (the title should say so).

    Heatmap cells cannot be selected in Streamlit (streamlit#8760), so an invisible marker sits on
    every cell, row-major: a selected point's x is the head, its y the layer.
    """
    values = _float_array(values)
    if values.ndim != 2:
        raise ValueError(f"values must be (L, H), not {values.shape}")
    depth, heads = values.shape
    limit = float(np.abs(values).max()) or 1.0
    layer_grid, head_grid = np.meshgrid(np.arange(depth), np.arange(heads), indexing="ij")
    heatmap = dict(
        type="heatmap", z=values, x=list(range(heads)), y=list(range(depth)), colorscale=_scale("RdBu"), zmid=0,
        zmin=-limit, zmax=limit, colorbar=dict(title=dict(text=measure)), hoverinfo="skip", textfont=dict(size=10),
    )
    if heads <= 16:  # each cell's value written in it while the cells are large enough to hold it
        heatmap["texttemplate"] = "%{z:.2f}"
    markers = dict(
        type="scatter", x=head_grid.ravel(), y=layer_grid.ravel(), mode="markers", customdata=values.ravel(), showlegend=False,
        marker=dict(size=max(6, min(28, 360 // max(depth, heads))), symbol="square", color="rgba(0,0,0,0)"),
        selected=dict(marker=dict(color="rgba(0,0,0,0)")), unselected=dict(marker=dict(opacity=0)),
        hovertemplate=f"layer %{{y}}, head %{{x}}<br>{measure}: %{{customdata:.4g}}"
        "<br>click to knock this head out above<extra></extra>",
    )
    outlines = [] if knocked is None else [
        dict(type="rect", x0=head - 0.5, x1=head + 0.5, y0=layer - 0.5, y1=layer + 0.5,
             line=dict(color="black", width=3))
        for layer, head in zip(*np.nonzero(np.asarray(knocked, dtype=bool)))
    ]
    return figure([heatmap, markers], dict(
        xaxis=dict(title=dict(text="head"), dtick=1, range=[-0.5, heads - 0.5]),
        yaxis=dict(title=dict(text="layer"), dtick=1, range=[depth - 0.5, -0.5]),  # layer 0 on top
        **({"shapes": outlines} if outlines else {}),
        title=_title(title or f"Knocking out each head alone: {measure}"), margin=MARGIN,
        hovermode="closest", hoverdistance=-1, clickmode="event+select", dragmode=False,
        height=160 + 32 * depth,
    ))


def intact_and_knocked_heads(
    image, intact_maps, knocked_maps, layer: int, query: str, what: str, columns: int = 4,
) -> tuple[go.Figure, go.Figure]:
    """:func:`attention_heads_grid` of one layer intact and knocked out (maps (H, gh, gw) each), on
    one colour scale, so that a head that looks elsewhere after the knock-out shows it."""
    maps = [_float_array(intact_maps), _float_array(knocked_maps)]
    top = max(attention_top(head_maps, 1 / head_maps[0].size) for head_maps in maps)
    colorscale = attention_scale(_rgb_uint8(image), np.concatenate(maps))
    figs = [
        attention_heads_grid(
            image, head_maps, layer=layer, query=query, columns=columns, top=top, colorscale=colorscale,
            title=_title(f"{label}: attention of the {query} in layer {layer}, per head (one scale for both grids)"),
        )
        for head_maps, label in zip(maps, ("Intact", f"With {what}"))
    ]
    return figs[0], figs[1]


def intact_and_knocked_rollouts(image, intact_map, knocked_map, query: str, what: str) -> tuple[go.Figure, go.Figure]:
    """Rollout maps (gh, gw) intact and knocked out over the image, on one scale."""
    top = max(overlay_top(rollout, weights=True) for rollout in (intact_map, knocked_map))
    colorscale = attention_scale(_rgb_uint8(image), np.stack([_float_array(intact_map), _float_array(knocked_map)]))
    figs = [
        attention_overlay(
            image, rollout, title=f"{label}: rollout to the {query}", value_name="rollout", weights=True, top=top,
            colorscale=colorscale,
        )
        for rollout, label in ((intact_map, "Intact"), (knocked_map, f"With {what}"))
    ]
    return figs[0], figs[1]
