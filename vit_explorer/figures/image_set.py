"""Several images side by side: DINOv2's foreground PCA, patch correspondence across images,
high-norm tokens. Every image is the model's input (H, W, 3); maps are (B, gh, gw), one per image.
DINOv3's dense-feature PCA (of one image or several) takes each image at its own size and grid."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from PIL import Image

from ._base import (
    _scale,
    CELL_PIXELS, MARGIN, SIMILARITY_SCALE, VALUE_SCALE, _float_array, _image_axis_layout,
    _image_trace, _on_axes, _panel_height, _patch_heatmap, _rgb_uint8, _subplots, _title, colour_mapped, figure,
    shared_attention_scale,
)

MARK = "#00e5ff"  # the chosen patch and the best matches


def _check_set(images: Sequence, maps: np.ndarray, name: str) -> list[np.ndarray]:
    images = [_rgb_uint8(image) for image in images]
    if maps.ndim < 3 or maps.shape[0] != len(images):
        raise ValueError(f"{name} must hold one (gh, gw) map per image ({len(images)}), not {maps.shape}")
    if len({image.shape for image in images}) != 1:
        raise ValueError("the images must all have one size (the model's input)")
    return images


def _grid_image(values: np.ndarray, image_shape: tuple[int, ...]) -> dict:
    """A (gh, gw, 3) uint8 map drawn one cell per patch over an image of ``image_shape``."""
    grid_h, grid_w = values.shape[:2]
    height, width = image_shape[:2]
    dy, dx = height / grid_h, width / grid_w
    return _image_trace(values, hover=False, lossless=True, x0=dx / 2 - 0.5, dx=dx, y0=dy / 2 - 0.5, dy=dy)


def _patch_box(row: int, col: int, grid_size: tuple[int, int], image_shape: tuple[int, ...], axis: str, **line) -> dict:
    grid_h, grid_w = grid_size
    dy, dx = image_shape[0] / grid_h, image_shape[1] / grid_w
    return dict(
        type="rect", xref=f"x{axis}", yref=f"y{axis}", x0=col * dx - 0.5, x1=(col + 1) * dx - 0.5,
        y0=row * dy - 0.5, y1=(row + 1) * dy - 0.5, line=line,
    )


def foreground_pca_grid(
    images: Sequence, first_component, colours, threshold: float, labels: Sequence[str], explained: float,
    flipped: bool = False,
) -> go.Figure:
    """DINOv2's figure: per image (columns), the input, the first joint component (diverging,
    in standard deviations, the threshold drawn as the scale's midpoint: red above, blue below)
    and the foreground's three components as RGB (background black); ``explained``: the first
    component's share of the variance; ``flipped``: the component's sign was switched. first_component (B, gh, gw); colours (B, gh, gw, 3) in [0, 1]."""
    component = _float_array(first_component)
    images = _check_set(images, component, "first_component")
    colours = _float_array(colours)
    count = len(images)
    layout, cells = _subplots(
        3, count, column_titles=list(labels),
        row_titles=["input", f"1st component ({explained:.0%} of variance)", "foreground parts"],
        horizontal_spacing=0.01, vertical_spacing=0.04,
    )
    reach = max(float(np.abs(component - threshold).max()), 1e-6)
    traces = []
    for index, image in enumerate(images):
        col = index + 1
        mapped = colour_mapped(component[index], SIMILARITY_SCALE, threshold - reach, threshold + reach)
        traces += [
            _on_axes(_image_trace(image, hover=False), cells[1, col]),
            _on_axes(_grid_image(mapped, image.shape), cells[2, col]),
            _on_axes(_grid_image(_rgb_uint8(colours[index]), image.shape), cells[3, col]),
        ]
    for row in (1, 2, 3):
        for col in range(1, count + 1):
            _merge(layout, _image_axis_layout(cells[row, col]))
    layout.update(
        title=_title(
            f"Joint PCA of {count} images' last-layer patch tokens: foreground where the"
            f" {'sign-switched ' if flipped else ''}1st component > {threshold:+.1f} sd (red), its parts as RGB"
        ),
        margin=MARGIN, height=_panel_height(images[0].shape, 3, min(CELL_PIXELS, 1100 // count)),
    )
    return figure(traces, layout)


# A photo's longest side in DINOv3's figure: what a panel shows of a 768 px input (whose JPEG,
# sent with every rerun, would be several times larger).
PHOTO_SIDE = 512


def _shrunk(image: np.ndarray, side: int = PHOTO_SIDE) -> np.ndarray:
    """An (H, W, 3) uint8 image whose longest side is at most ``side``, its aspect ratio kept."""
    height, width = image.shape[:2]
    scale = side / max(height, width)
    if scale >= 1:
        return image
    size = (max(round(width * scale), 1), max(round(height * scale), 1))
    return np.asarray(Image.fromarray(image).resize(size, Image.Resampling.BOX))


def dense_pca_grid(images: Sequence, colours: Sequence, labels: Sequence[str], detail: str) -> go.Figure:
    """DINOv3's picture (vit_explorer.analysis.dense_pca): each image (H, W, 3) beside its patches'
    colours (gh, gw, 3) in [0, 1], background black, drawn one cell per patch over the picture;
    several images in columns, pictures above their colours. Each image keeps its own size and
    grid. ``detail``: what the title adds (the input size, the foreground rule)."""
    images = [_shrunk(_rgb_uint8(image)) for image in images]
    colours = [_float_array(values) for values in colours]
    count = len(images)
    if not count or len(colours) != count or len(labels) != count or any(
        values.ndim != 3 or values.shape[-1] != 3 for values in colours
    ):
        raise ValueError(f"one (gh, gw, 3) colour map and one label per image ({count}) are needed")
    if count == 1:
        layout, cells = _subplots(1, 2, (labels[0], "foreground PCA, whitened, sigmoid(2x)"), horizontal_spacing=0.03)
        places = [(cells[1, 1], cells[1, 2])]
        rows, width = 1, 1.5 * CELL_PIXELS
    else:
        layout, cells = _subplots(
            2, count, column_titles=list(labels), row_titles=["input", "foreground PCA"],
            horizontal_spacing=0.01, vertical_spacing=0.04,
        )
        places = [(cells[1, col], cells[2, col]) for col in range(1, count + 1)]
        rows, width = 2, min(CELL_PIXELS, 1100 // count)
    traces = []
    for image, values, (photo, pca) in zip(images, colours, places):
        traces += [
            _on_axes(_image_trace(image, hover=False), photo),
            _on_axes(_grid_image(_rgb_uint8(values), image.shape), pca),
        ]
        _merge(layout, {**_image_axis_layout(photo), **_image_axis_layout(pca)})
    tallest = max(images, key=lambda image: image.shape[0] / image.shape[1])
    layout.update(
        title=_title(f"DINOv3-style PCA of the last layer's patch tokens {detail}"),
        margin=MARGIN, height=_panel_height(tallest.shape, rows, width),
    )
    return figure(traces, layout)


def _merge(layout: dict, axes: dict) -> None:
    """Add settings to a :func:`_subplots` layout's axes (given as layout entries)."""
    for axis, settings in axes.items():
        layout.setdefault(axis, {}).update(settings)


def correspondence_grid(
    images: Sequence, cosines, best: Sequence[int], source_image: int, source_patch: int,
    labels: Sequence[str], what: str,
) -> go.Figure:
    """The cosine of one patch with every patch of every image, (B, gh, gw), as a heat map over
    each image (clear at the lowest cosine shown or 0, crimson at 1); the source patch and each
    other image's best match (``best``: patch indices) are outlined. ``what``: the features
    compared, for the title."""
    cosines = _float_array(cosines)
    images = _check_set(images, cosines, "cosines")
    count = len(images)
    grid_size = cosines.shape[1:3]
    grid_w = grid_size[1]
    low = min(max(float(cosines.min()), 0.0), 0.99)
    titles = [
        f"{label}: the chosen patch" if index == source_image
        else f"{label}: best {cosines[index].flat[best[index]]:.2f}"
        for index, label in enumerate(labels)
    ]
    layout, cells = _subplots(1, count, titles, horizontal_spacing=0.01)
    colorscale = shared_attention_scale(images, np.clip(cosines - low, 0, None))  # weighed where they match
    traces, shapes = [], []
    for index, image in enumerate(images):
        suffix = cells[1, index + 1]
        traces.append(_on_axes(_image_trace(image, hover=False), suffix))
        traces.append(_on_axes(_patch_heatmap(
            cosines[index], image.shape[:2], value_name="cosine", label=labels[index], colorscale=colorscale,
            zmin=low, zmax=1.0, showscale=index == 0, colorbar=dict(title=dict(text="cosine"), thickness=12),
        ), suffix))
        row, patch_col = divmod(int(source_patch if index == source_image else best[index]), grid_w)
        style = dict(color=MARK, width=3, dash="solid" if index == source_image else "dot")
        shapes.append(_patch_box(row, patch_col, grid_size, image.shape, suffix, **style))
        _merge(layout, _image_axis_layout(suffix))
    source_row, source_col = divmod(int(source_patch), grid_w)
    layout.update(
        shapes=shapes,
        title=_title(
            f"Cosine of {what} with patch {source_patch} (row {source_row}, col {source_col}) of"
            f" {labels[source_image]}: the chosen patch outlined solid, each image's best match dotted"
        ),
        margin=MARGIN, height=_panel_height(images[0].shape, 1, min(CELL_PIXELS, 1100 // count)),
    )
    return figure(traces, layout)


def norm_outliers_grid(
    norms, outliers, threshold: float, rule: str, labels: Sequence[str], image_shape: tuple[int, ...], layer: int,
) -> go.Figure:
    """Patch-token norms (B, gh, gw) of each image on one colour scale (columns), the outliers
    (B, gh, gw) bool marked with a cross, and below the histogram of all the norms with the
    threshold drawn; ``rule`` says how the threshold was set."""
    norms = _float_array(norms)
    outliers = np.asarray(outliers, dtype=bool)
    count = len(labels)
    if norms.shape[0] != count or outliers.shape != norms.shape:
        raise ValueError(f"norms {norms.shape} and outliers {outliers.shape} must hold one map per image ({count})")
    grid_h, grid_w = norms.shape[1:]
    height, width = image_shape[:2]
    layout, cells = _subplots(
        2, count, [
            f"{label}: {int(found)} outlier{'' if found == 1 else 's'}"
            for label, found in zip(labels, outliers.sum(axis=(1, 2)))
        ] + ["every patch's norm"],
        horizontal_spacing=0.01, vertical_spacing=0.12, row_heights=[0.65, 0.35],
        specs=[[{}] * count, [{"colspan": count}] + [None] * (count - 1)],
    )
    low, high = float(norms.min()), float(norms.max())
    traces = []
    for index in range(count):
        suffix = cells[1, index + 1]
        traces.append(_on_axes(_patch_heatmap(
            norms[index], (height, width), value_name="norm", label=labels[index], colorscale=_scale(VALUE_SCALE),
            zmin=low, zmax=high if high > low else low + 1, showscale=index == 0,
            colorbar=dict(title=dict(text="norm"), thickness=12, len=0.6, y=1, yanchor="top"),
        ), suffix))
        rows, cols = np.nonzero(outliers[index])
        traces.append(_on_axes(dict(
            type="scatter", x=(cols + 0.5) * width / grid_w - 0.5, y=(rows + 0.5) * height / grid_h - 0.5, mode="markers",
            marker=dict(symbol="x-thin-open", size=10, line=dict(width=2, color="#e45756")), showlegend=False,
            customdata=rows * grid_w + cols, hovertemplate="outlier: patch %{customdata}<extra></extra>",
        ), suffix))
        _merge(layout, _image_axis_layout(suffix))
    histogram = cells[2, 1]
    traces.append(_on_axes(dict(type="histogram", x=norms.reshape(-1), nbinsx=60, marker=dict(color="#4c78a8"),
                                showlegend=False, hovertemplate="norm %{x}: %{y} patches<extra></extra>"), histogram))
    _merge(layout, {f"xaxis{histogram}": dict(title=dict(text="L2 norm of a patch token")),
                    f"yaxis{histogram}": dict(title=dict(text="patches"))})
    layout.update(
        # The threshold across the histogram, as add_vline draws it.
        shapes=[dict(type="line", x0=threshold, x1=threshold, xref=f"x{histogram}", y0=0, y1=1,
                     yref=f"y{histogram} domain", line=dict(color="#e45756", dash="dash"))],
        title=_title(f"Patch-token norms after layer {layer}; outliers (x) above {threshold:.3g} = {rule}"),
        margin={**MARGIN, "l": 50}, height=_panel_height(image_shape, 1, min(CELL_PIXELS, 1100 // count)) + 260,
    )
    return figure(traces, layout)
