"""Registers at test time: the register neurons found, and the token norms and the attention drawn
before and after the register, on one scale each."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import (
    MARGIN, VALUE_SCALE, _float_array, _image_axis_layout, _on_axes, _panel_height, _patch_heatmap, _scale, _subplots,
    _title, figure,
)
from .knockout import INTACT_COLOUR, KNOCKED_COLOUR

CHOSEN_COLOUR, OTHER_COLOUR, REGISTER_COLOUR = "#e45756", "#9aa5b1", "#54a24b"
OUTLIER_MARKER = dict(symbol="x-thin-open", size=10, line=dict(width=2, color="#e45756"))


def register_neurons_figure(
    best: Sequence[float], ranked: Sequence[tuple[int, int, float]], chosen: int, first: int, last: int,
    appears_at: int,
) -> go.Figure:
    """Left: the best score of each layer searched (``best``, layers 0 on), the layers chosen
    (``first`` to ``last``) in colour, the layer where the outliers appear marked; right: the
    ``ranked`` (layer, unit, score) of those layers, best first, the ``chosen`` first ones in colour."""
    best = _float_array(best)
    layout, cells = _subplots(
        1, 2, ("best unit of each layer searched", f"the best units of layers {first} to {last}"),
        column_widths=[0.4, 0.6], horizontal_spacing=0.12,
    )
    layers = np.arange(len(best))
    searched = (layers >= first) & (layers <= last)
    traces = [_on_axes(dict(
        type="bar", x=layers, y=best, marker=dict(color=[CHOSEN_COLOUR if s else OTHER_COLOUR for s in searched]),
        hovertemplate="layer %{x}: best score %{y:.4g}<extra></extra>", showlegend=False,
    ), cells[1, 1])]
    labels = [f"layer {layer}, unit {unit}" for layer, unit, _ in ranked]
    traces.append(_on_axes(dict(
        type="bar", x=[score for _, _, score in ranked], y=labels, orientation="h", showlegend=False,
        marker=dict(color=[CHOSEN_COLOUR if index < chosen else OTHER_COLOUR for index in range(len(ranked))]),
        hovertemplate="%{y}: score %{x:.4g}<extra></extra>",
    ), cells[1, 2]))
    left, right = cells[1, 1], cells[1, 2]
    layout[f"xaxis{left}"].update(title=dict(text="layer"), dtick=1)
    layout[f"yaxis{left}"].update(title=dict(text="mean |activation| on the outliers"))
    layout[f"xaxis{right}"].update(title=dict(text="score"))
    layout[f"yaxis{right}"].update(autorange="reversed", type="category")
    layout.update(
        shapes=[dict(
            type="line", x0=appears_at, x1=appears_at, xref=f"x{left}", y0=0, y1=1, yref=f"y{left} domain",
            line=dict(color="black", dash="dot"),
        )],
        title=_title(
            f"Register neurons: the {chosen} in colour feed the register; dotted: the outliers appear after layer {appears_at}"
        ),
        margin={**MARGIN, "l": 60}, height=max(320, 140 + 18 * len(ranked)),
    )
    return figure(traces, layout)


def register_norms_figure(
    before, after, outliers, register_norm: float, image_shape: tuple[int, ...], layer: int,
) -> go.Figure:
    """The patch tokens' norms (gh, gw) after ``layer`` without and with the register, on one colour
    scale, the outliers (gh, gw) bool found without it crossed in both; the register's own norm
    in the title."""
    before, after = _float_array(before), _float_array(after)
    outliers = np.asarray(outliers, dtype=bool)
    if before.shape != after.shape or outliers.shape != before.shape or before.ndim != 2:
        raise ValueError(f"before {before.shape}, after {after.shape} and outliers {outliers.shape} must be one (gh, gw) grid")
    grid_h, grid_w = before.shape
    height, width = image_shape[:2]
    layout, cells = _subplots(
        1, 2, (f"without: largest {before.max():.3g}", f"with the register: largest {after.max():.3g}"),
        horizontal_spacing=0.04,
    )
    low, high = float(min(before.min(), after.min())), float(max(before.max(), after.max()))
    rows, cols = np.nonzero(outliers)
    traces = []
    for index, (norms, label) in enumerate(((before, "without"), (after, "with the register"))):
        suffix = cells[1, index + 1]
        traces.append(_on_axes(_patch_heatmap(
            norms, (height, width), value_name="norm", label=label, colorscale=_scale(VALUE_SCALE),
            zmin=low, zmax=high if high > low else low + 1, showscale=index == 1,
            colorbar=dict(title=dict(text="norm"), thickness=12),
        ), suffix))
        traces.append(_on_axes(dict(
            type="scatter", x=(cols + 0.5) * width / grid_w - 0.5, y=(rows + 0.5) * height / grid_h - 0.5,
            mode="markers", marker=OUTLIER_MARKER, showlegend=False, customdata=rows * grid_w + cols,
            hovertemplate="an outlier without the register: patch %{customdata}<extra></extra>",
        ), suffix))
        for axis, settings in _image_axis_layout(suffix).items():
            layout[axis].update(settings)
    layout.update(
        title=_title(
            f"Patch-token norms after layer {layer} (x: the outliers without the register); the register's norm: {register_norm:.3g}"
        ),
        margin=MARGIN, height=_panel_height(image_shape, 1, 420),
    )
    return figure(traces, layout)


def _lines(
    series: Sequence[tuple[str, np.ndarray, str, str]], title: str, y_title: str, y_range: list[float] | None = None,
) -> go.Figure:
    """One line per (name, values (L,), colour, dash) over the layers."""
    traces = [
        dict(
            type="scatter", x=np.arange(len(values)), y=_float_array(values), mode="lines+markers", name=name,
            line=dict(color=colour, dash=dash), hovertemplate=f"layer %{{x}}, {name}: %{{y:.4g}}<extra></extra>",
        )
        for name, values, colour, dash in series
    ]
    y_axis = dict(title=dict(text=y_title), **({} if y_range is None else dict(range=y_range)))
    return figure(traces, dict(
        xaxis=dict(title=dict(text="layer"), dtick=1), yaxis=y_axis, title=_title(title),
        margin=MARGIN, legend=dict(orientation="h", y=-0.25),
    ))


def norms_by_layer_figure(largest_before, largest_after, median_before, register) -> go.Figure:
    """Every layer's largest patch-token norm without and with the register (L,), the median
    patch norm without it, and the register token's norm (L,): where the outliers grow, and where
    their norm goes."""
    return _lines([
        ("largest patch norm, without", largest_before, INTACT_COLOUR, "solid"),
        ("largest patch norm, with the register", largest_after, KNOCKED_COLOUR, "solid"),
        ("median patch norm, without", median_before, INTACT_COLOUR, "dot"),
        ("the register's norm", register, REGISTER_COLOUR, "solid"),
    ], "Token norms after each layer: the outliers' norm moves into the register", "L2 norm")


def attention_drawn_figure(on_outliers_before, on_outliers_after, on_register, query: str) -> go.Figure:
    """The share of the ``query``'s attention (mean over heads) on this image's outlier patches in
    every layer without the register (L,), on the same patches with it, and on the register."""
    return _lines([
        ("on the outlier patches, without", on_outliers_before, INTACT_COLOUR, "solid"),
        ("on the same patches, with the register", on_outliers_after, KNOCKED_COLOUR, "solid"),
        ("on the register", on_register, REGISTER_COLOUR, "solid"),
    ], f"The attention the outliers draw: the {query}'s share, mean over heads, in each layer", "share of the attention",
        y_range=[0, 1])
