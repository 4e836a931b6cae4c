"""Patching figures: a site's effect per layer x token or layer x head (TransformerLens's heat
maps), exact patching against its attribution estimate, and the patched run's prediction."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import MARGIN, SIMILARITY_SCALE, _float_array, _scale, _title, figure
from .predictions import _class_names

CLEAN_COLOUR, CORRUPTED_COLOUR, PATCHED_COLOUR = "#4c78a8", "#9aa5b1", "#dc143c"


def patching_heatmap(values, cell: str, title: str, cell_labels: Sequence[str] | None = None) -> go.Figure:
    """values (L, cells): the normalised metric with each cell patched (0 = the corrupted run, 1
    = the clean one) on a diverging scale centred at 0, layer 0 on top; ``cell`` names the columns
    ("token", "head"), ``cell_labels`` their ticks. As in the sweep grid (figures.knockout), an
    invisible marker sits on every cell so that a click selects it: its x is the cell, y the layer."""
    values = _float_array(values)
    if values.ndim != 2:
        raise ValueError(f"values must be (L, cells), not {values.shape}")
    depth, cells = values.shape
    limit = max(float(np.abs(values).max()), 1e-9)
    labels = list(cell_labels) if cell_labels is not None else [str(c) for c in range(cells)]
    layer_grid, cell_grid = np.meshgrid(np.arange(depth), np.arange(cells), indexing="ij")
    heatmap = dict(
        type="heatmap", z=values, x=list(range(cells)), y=list(range(depth)), colorscale=_scale(SIMILARITY_SCALE),
        zmid=0, zmin=-limit, zmax=limit, colorbar=dict(title=dict(text="restored<br>(1 = clean)")), hoverinfo="skip",
    )
    markers = dict(
        type="scatter", x=cell_grid.ravel(), y=layer_grid.ravel(), mode="markers", showlegend=False,
        customdata=[[float(value), label] for value, label in zip(values.ravel(), labels * depth)],
        marker=dict(size=max(4, min(24, 480 // max(depth, cells))), symbol="square", color="rgba(0,0,0,0)"),
        selected=dict(marker=dict(color="rgba(0,0,0,0)")), unselected=dict(marker=dict(opacity=0)),
        hovertemplate=f"layer %{{y}}, {cell} %{{customdata[1]}}<br>restored: %{{customdata[0]:.4f}}"
        "<br>click for the patched run<extra></extra>",
    )
    return figure([heatmap, markers], dict(
        xaxis=dict(title=dict(text=cell), range=[-0.5, cells - 0.5],
                   **(dict(tickvals=list(range(cells)), ticktext=labels) if cells <= 32 else {})),
        yaxis=dict(title=dict(text="layer"), dtick=1, range=[depth - 0.5, -0.5]),
        title=_title(title), margin=MARGIN, hovermode="closest", hoverdistance=-1, clickmode="event+select",
        dragmode=False, height=160 + 28 * depth,
    ))


def patching_agreement(exact, estimate, site: str, correlation: float) -> go.Figure:
    """Every cell of one site, exact patching (x) against attribution patching's estimate (y):
    on the diagonal they agree; ``correlation`` goes in the title."""
    exact, estimate = _float_array(exact), _float_array(estimate)
    if exact.shape != estimate.shape:
        raise ValueError(f"the maps must have one shape, not {exact.shape} and {estimate.shape}")
    layers = np.broadcast_to(np.arange(exact.shape[0])[:, None], exact.shape).ravel()
    cells = np.broadcast_to(np.arange(exact.shape[1])[None, :], exact.shape).ravel()
    low = float(min(exact.min(), estimate.min(), 0.0))
    high = float(max(exact.max(), estimate.max(), 1.0))
    return figure([
        dict(type="scatter", x=[low, high], y=[low, high], mode="lines", line=dict(color="#9aa5b1", dash="dot"),
             name="agree", hoverinfo="skip"),
        dict(
            type="scatter", x=exact.ravel(), y=estimate.ravel(), mode="markers", name="cells",
            customdata=np.stack([layers, cells], axis=-1), marker=dict(size=6, color=PATCHED_COLOUR, opacity=0.6),
            hovertemplate="layer %{customdata[0]}, cell %{customdata[1]}<br>exact %{x:.4f}, estimate %{y:.4f}<extra></extra>",
        ),
    ], dict(
        xaxis=dict(title=dict(text="exact patching")), yaxis=dict(title=dict(text="attribution patching")),
        title=_title(f"{site}: the estimate against exact patching, cell by cell (correlation {correlation:.2f})"),
        margin=MARGIN, showlegend=False, height=420,
    ))


def patched_topk(clean, corrupted, patched, class_names: Sequence[str] | None = None, k: int = 5, what: str = "") -> go.Figure:
    """The k classes the patched run finds most probable, each with its probability in the clean,
    corrupted and patched runs. clean, corrupted, patched: (C,) probabilities."""
    runs = [_float_array(probabilities).reshape(-1) for probabilities in (clean, corrupted, patched)]
    names = _class_names(runs[0].shape[0], class_names)
    top = np.argsort(-runs[2], kind="stable")[:k]
    labels = [names[i] for i in top]
    return figure([
        dict(
            type="bar", x=probabilities[top], y=labels, orientation="h", name=name, marker=dict(color=colour),
            text=[f"{100 * p:.1f}%" for p in probabilities[top]], textposition="auto",
            hovertemplate=f"%{{y}}, {name}: %{{x:.4f}}<extra></extra>",
        )
        for probabilities, name, colour in zip(runs, ("clean", "corrupted", "patched"), (CLEAN_COLOUR, CORRUPTED_COLOUR, PATCHED_COLOUR))
    ], dict(
        xaxis=dict(title=dict(text="probability"), range=[0, 1]), yaxis=dict(autorange="reversed"),
        title=_title(f"Top-{len(top)} with {what or 'the patch'}, against the clean and corrupted runs"),
        barmode="group", margin=MARGIN, legend=dict(orientation="h", y=-0.2), height=140 + 75 * len(top),
    ))
