"""Head types: every head's label as a layer x head grid (vit_explorer.analysis.head_types), and one head's
maps on each image of the set."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import (
    CELL_PIXELS, MARGIN, _float_array, _image_axis_layout, _image_trace, _on_axes, _panel_height,
    _patch_heatmap, _rgb_uint8, _subplots, _title, attention_top, figure, shared_attention_scale,
)
from .attention import _query_outline

# One colour per label, told apart by colour-blind readers too (Okabe and Ito's palette), with
# the letter written in each cell.
LABEL_STYLES = {
    "prefix sink": ("#999999", "S"), "outlier sink": ("#d55e00", "O"), "local": ("#0072b2", "L"),
    "global": ("#009e73", "G"), "positional": ("#cc79a7", "P"), "content": ("#e69f00", "C"),
}
CHOSEN = "#000000"  # the outline of the head whose maps are shown


def head_types_grid(
    labels: Sequence[Sequence[str]], measures: Mapping[str, object], order: Sequence[str], title: str = "",
    chosen: tuple[int, int] | None = None,
) -> go.Figure:
    """Every head's label (``labels[layer][head]``, each one of ``order``) as a coloured cell, the
    numbers behind it in its hover (``measures``: name -> (L, H) values, NaN shown as "n/a");
    the ``chosen`` (layer, head) outlined.

    Heatmap cells cannot be selected in Streamlit (streamlit#8760), so an invisible marker sits on
    every cell, row-major: a selected point's x is the head, its y the layer.
    """
    depth, heads = len(labels), len(labels[0]) if labels else 0
    unknown = {label for row in labels for label in row} - set(order)
    if not depth or not heads or unknown or any(len(row) != heads for row in labels):
        raise ValueError(f"labels must be a non-empty (layers, heads) grid of {', '.join(order)}")
    values = {name: _float_array(array) for name, array in measures.items()}
    if any(array.shape != (depth, heads) for array in values.values()):
        raise ValueError(f"every measure must be ({depth}, {heads}), one value per head")
    index = np.array([[order.index(label) for label in row] for row in labels])
    # A stepped scale: label i fills [i / n, (i + 1) / n] of it, with zmin -0.5 and zmax n - 0.5.
    count = len(order)
    scale = [
        [edge / count, LABEL_STYLES.get(label, ("#444444", "?"))[0]]
        for position, label in enumerate(order) for edge in (position, position + 1)
    ]
    heatmap = dict(
        type="heatmap", z=index, x=list(range(heads)), y=list(range(depth)), colorscale=scale, zmin=-0.5,
        zmax=count - 0.5, hoverinfo="skip", xgap=1, ygap=1,
        colorbar=dict(title=dict(text="label"), tickvals=list(range(count)), ticktext=list(order)),
    )
    if heads <= 16:  # the label's letter in each cell while the cells can hold it
        heatmap.update(
            text=[[LABEL_STYLES.get(label, ("", "?"))[1] for label in row] for row in labels],
            texttemplate="%{text}", textfont=dict(size=11, color="white"),
        )
    layer_grid, head_grid = np.meshgrid(np.arange(depth), np.arange(heads), indexing="ij")
    def written(array: np.ndarray) -> list[str]:
        return ["n/a" if np.isnan(value) else f"{value:.3g}" for value in array.ravel()]

    # Per cell, row-major: the label, then each measure as written.
    customdata = [list(cell) for cell in zip([label for row in labels for label in row], *map(written, values.values()))]
    lines = "".join(f"<br>{name}: %{{customdata[{position + 1}]}}" for position, name in enumerate(values))
    markers = dict(
        type="scatter", x=head_grid.ravel(), y=layer_grid.ravel(), mode="markers", customdata=customdata,
        showlegend=False,
        marker=dict(size=max(6, min(28, 360 // max(depth, heads))), symbol="square", color="rgba(0,0,0,0)"),
        selected=dict(marker=dict(color="rgba(0,0,0,0)")), unselected=dict(marker=dict(opacity=0)),
        hovertemplate=f"layer %{{y}}, head %{{x}}: <b>%{{customdata[0]}}</b>{lines}"
        "<br>click to see its maps on every image<extra></extra>",
    )
    shapes = [] if chosen is None else [dict(
        type="rect", x0=chosen[1] - 0.5, x1=chosen[1] + 0.5, y0=chosen[0] - 0.5, y1=chosen[0] + 0.5,
        line=dict(color=CHOSEN, width=3),
    )]
    return figure([heatmap, markers], dict(
        xaxis=dict(title=dict(text="head"), dtick=1, range=[-0.5, heads - 0.5]),
        yaxis=dict(title=dict(text="layer"), dtick=1, range=[depth - 0.5, -0.5]),  # layer 0 on top
        shapes=shapes, title=_title(title or "Head types"), margin=MARGIN,
        hovermode="closest", hoverdistance=-1, clickmode="event+select", dragmode=False,
        height=160 + 32 * depth,
    ))


def head_maps_grid(
    images: Sequence, maps, labels: Sequence[str], title: str, query_patch: int | None = None,
) -> go.Figure:
    """One head's attention map (B, gh, gw) over each of B images (H, W, 3), side by side on one
    colour scale from 0 (clear), as the Attention page draws a head's map; ``query_patch``
    (row-major) outlined in every panel."""
    maps = _float_array(maps)
    images = [_rgb_uint8(image) for image in images]
    if maps.ndim != 3 or maps.shape[0] != len(images) or len(labels) != len(images):
        raise ValueError(f"one (gh, gw) map and one label per image ({len(images)}) are needed, not {maps.shape}")
    if len({image.shape for image in images}) != 1:
        raise ValueError("the images must all have one size (the model's input)")
    count = len(images)
    top = attention_top(maps, 1 / maps[0].size)  # one scale: the heads' weights compare across images
    titles = [f"{label} (max {head_map.max():.2g})" for label, head_map in zip(labels, maps)]
    layout, cells = _subplots(1, count, titles, horizontal_spacing=0.01)
    colorscale = shared_attention_scale(images, maps)
    traces, shapes = [], []
    for position, (image, head_map) in enumerate(zip(images, maps)):
        suffix = cells[1, position + 1]
        traces += [
            _on_axes(_image_trace(image, hover=False), suffix),
            _on_axes(_patch_heatmap(
                head_map, image.shape[:2], label=labels[position], colorscale=colorscale, zmin=0, zmax=top,
                showscale=position == 0, colorbar=dict(title=dict(text="attention<br>(0 = clear)"), thickness=12),
            ), suffix),
        ]
        shapes += _query_outline(query_patch, head_map.shape, image.shape[:2], suffix)
        for axis, settings in _image_axis_layout(suffix).items():
            layout.setdefault(axis, {}).update(settings)
    layout.update(
        shapes=shapes, title=_title(title), margin=MARGIN,
        height=_panel_height(images[0].shape, 1, min(CELL_PIXELS, 1100 // count)),
    )
    return figure(traces, layout)
