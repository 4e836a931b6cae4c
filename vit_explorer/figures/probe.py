"""A probe a person labels (vit_explorer.analysis.probe): the picture to click patches of, each
labelled patch in its label's colour; every image of the set segmented by the probe; and the
probe's held-out accuracy across the layers."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import (
    CELL_PIXELS, MARGIN, _array, _float_array, _image_axis_layout, _image_trace, _on_axes, _panel_height,
    _patch_heatmap, _patch_positions, _rgb_uint8, _subplots, _title, figure,
)
from .patches import _grid_parts

# Each label's colour, in the order of the labels: "object" red, "background" blue, then two more.
LABEL_COLOURS = ("#e45756", "#4c78a8", "#54a24b", "#f2cf5b")
SEGMENT_OPACITY = 0.5


def _check_names(names: Sequence[str]) -> None:
    if not 1 <= len(names) <= len(LABEL_COLOURS):
        raise ValueError(f"between 1 and {len(LABEL_COLOURS)} labels can be told apart by colour, not {len(names)}")


def _centres(patches: np.ndarray, grid_size: tuple[int, int], shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) pixel centres of the row-major ``patches`` on an image of ``shape``."""
    grid_h, grid_w = grid_size
    rows, columns = np.divmod(patches, grid_w)
    return (columns + 0.5) * shape[1] / grid_w - 0.5, (rows + 0.5) * shape[0] / grid_h - 0.5


def _fixed_axes(shape: tuple[int, ...], suffix: str = "") -> dict:
    """An image's axes (:func:`_image_axis_layout`) fixed to its pixels: markers on its edge patches
    would otherwise widen the autoranged axes and shrink the picture."""
    axes = _image_axis_layout(suffix)
    axes[f"xaxis{suffix}"].update(range=[-0.5, shape[1] - 0.5], autorange=False)
    axes[f"yaxis{suffix}"].update(range=[shape[0] - 0.5, -0.5], autorange=False)
    return axes


def probe_picker(
    image, grid_size: tuple[int, int], labelled: Sequence[tuple[int, int]], names: Sequence[str], label: int,
    title: str | None = None,
) -> go.Figure:
    """The picture cut into its patches, each labelled patch (``labelled``: (patch, label index)
    pairs) a square of its label's colour, and a click anywhere selecting the nearest patch (as
    :func:`patch_picker`: the selected point's index is the patch index) to label it ``names[label]``."""
    _check_names(names)
    image = _rgb_uint8(image)
    traces, layout = _grid_parts(image, grid_size, None)
    grid_h, grid_w = grid_size
    size = max(4, min(30, 360 // max(grid_h, grid_w)))
    pairs = np.asarray(list(labelled), dtype=np.int64).reshape(-1, 2)
    for index, name in enumerate(names):
        patches = pairs[pairs[:, 1] == index, 0]
        x, y = _centres(patches, grid_size, image.shape)
        traces.append(dict(
            type="scatter", x=x, y=y, mode="markers", name=f"{name} ({len(patches)})", legendgroup=name,
            marker=dict(size=size, symbol="square", color=LABEL_COLOURS[index], opacity=0.75,
                        line=dict(color="white", width=1)),
            hoverinfo="skip", showlegend=True,
        ))
    positions = _patch_positions(grid_size).reshape(-1, 3)
    x, y = _centres(positions[:, 0], grid_size, image.shape)
    traces.append(dict(  # last: its point indices are the patch indices
        type="scatter", x=x, y=y, mode="markers", customdata=positions, showlegend=False,
        marker=dict(size=size, color="rgba(0,0,0,0)"),
        selected=dict(marker=dict(color="rgba(0,229,255,0.5)")), unselected=dict(marker=dict(opacity=0)),
        hovertemplate="patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
        f"<br>click to label it '{names[label]}' (again: unlabel it)<extra></extra>",
    ))
    for axis, settings in _fixed_axes(image.shape).items():
        layout[axis].update(settings)
    layout.update(
        title=_title(title or f"Click patches to label them '{names[label]}'"), hovermode="closest", hoverdistance=-1,
        clickmode="event+select", dragmode=False, legend=dict(title=dict(text="labelled"), itemclick=False,
                                                              itemdoubleclick=False),
    )
    return figure(traces, layout)


def probe_segmentation_grid(
    images: Sequence, segmentation, names: Sequence[str], labels: Sequence[str], title: str,
    labelled: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> go.Figure:
    """Every image (columns) with each patch coloured by the label the probe gives it
    (``segmentation`` (B, gh, gw) label indices into ``names``), a legend of the labels' colours;
    ``labelled``: per image the (patch, label) pairs the person clicked, outlined."""
    _check_names(names)
    images = [_rgb_uint8(image) for image in images]
    segments = _array(segmentation).astype(np.int64)
    count = len(images)
    if segments.ndim != 3 or segments.shape[0] != count or len(labels) != count or not count:
        raise ValueError(f"one (gh, gw) segmentation and one label per image ({count}) are needed, not {segments.shape}")
    grid_size = segments.shape[1:]
    layout, cells = _subplots(1, count, list(labels), horizontal_spacing=0.01)
    # One flat band of colour per label index: z = index lands in its band.
    scale = [[position, colour] for index, colour in enumerate(LABEL_COLOURS[:len(names)])
             for position in (index / len(names), (index + 1) / len(names))]
    named = np.asarray(list(names), dtype=object)
    traces = []
    for index, image in enumerate(images):
        suffix = cells[1, index + 1]
        cells_trace = _patch_heatmap(segments[index].astype(float), image.shape[:2], label=labels[index])
        cells_trace.update(
            colorscale=scale, zmin=-0.5, zmax=len(names) - 0.5, showscale=False, opacity=SEGMENT_OPACITY,
            customdata=np.dstack([cells_trace["customdata"], named[segments[index]]]),
            hovertemplate="patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]}): '%{customdata[3]}'"
            f"<extra>{labels[index]}</extra>",
        )
        traces += [_on_axes(_image_trace(image, hover=False), suffix), _on_axes(cells_trace, suffix)]
        pairs = np.asarray(list((labelled or [()] * count)[index]), dtype=np.int64).reshape(-1, 2)
        if len(pairs):
            x, y = _centres(pairs[:, 0], grid_size, image.shape)
            traces.append(_on_axes(dict(
                type="scatter", x=x, y=y, mode="markers", showlegend=False, hoverinfo="skip",
                marker=dict(symbol="square-open", size=max(4, min(24, 300 // max(grid_size))),
                            color=[LABEL_COLOURS[label] for label in pairs[:, 1]], line=dict(width=2)),
            ), suffix))
        for axis, settings in _fixed_axes(image.shape, suffix).items():
            layout[axis].update(settings)
    traces += [  # legend entries only: a square of each label's colour
        dict(type="scatter", x=[None], y=[None], mode="markers", name=name, showlegend=True, hoverinfo="skip",
             marker=dict(size=12, symbol="square", color=LABEL_COLOURS[index]))
        for index, name in enumerate(names)
    ]
    layout.update(
        title=_title(title), margin=MARGIN, height=_panel_height(images[0].shape, 1, min(CELL_PIXELS, 1100 // count)),
        legend=dict(title=dict(text="the probe says"), itemclick=False, itemdoubleclick=False),
    )
    return figure(traces, layout)


def probe_layers_figure(layers: Sequence[int], accuracies: Sequence[float], chosen: int | None = None) -> go.Figure:
    """The probe's held-out accuracy (0 to 1) on the tokens after each of ``layers`` blocks (0:
    the embeddings), the best layer and the ``chosen`` one marked."""
    layers = [int(layer) for layer in layers]
    accuracies = _float_array(accuracies).reshape(-1)
    if len(layers) != len(accuracies) or not layers:
        raise ValueError(f"one accuracy per layer is needed: {len(layers)} layers, {len(accuracies)} accuracies")
    best = layers[int(np.argmax(accuracies))]
    traces = [dict(
        type="scatter", x=layers, y=accuracies, mode="lines+markers", name="held-out accuracy", showlegend=False,
        line=dict(color="#4c78a8", width=2.5), hovertemplate="after %{x} layers: %{y:.0%}<extra></extra>",
    )]
    marks = [(best, "best", "#54a24b", "star")]
    if chosen is not None and chosen in layers:
        marks.insert(0, (chosen, "shown", "#e45756", "circle-open"))
    for layer, name, colour, symbol in marks:
        traces.append(dict(
            type="scatter", x=[layer], y=[accuracies[layers.index(layer)]], mode="markers", name=f"{name}: {layer}",
            marker=dict(size=16, color=colour, symbol=symbol, line=dict(width=2, color=colour)),
            hovertemplate=f"{name}: after %{{x}} layers, %{{y:.0%}}<extra></extra>",
        ))
    return figure(traces, dict(
        xaxis=dict(title=dict(text="tokens after this many layers (0: the embeddings)"), dtick=1),
        yaxis=dict(title=dict(text="held-out accuracy"), range=[0, 1.05], tickformat=".0%"),
        title=_title("Which layer knows your labels best: the probe's held-out accuracy on each layer's tokens"),
        margin=MARGIN, height=320,
    ))
