"""Features: a sparse autoencoder's latents on an image (a patch's top latents, one latent's map, how
much of each patch the dictionary explains, the latents that matter for the prediction) and from
its index (a latent's top patches over the training images, its activation histogram), and what
steering one changed in the attention (steered minus intact)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import (
    MARGIN, SIMILARITY_SCALE, VALUE_SCALE, _check_map, _float_array, _image_axis_layout, _image_trace, _on_axes,
    _patch_heatmap, _rgb_uint8, _scale, _subplots, _title, figure,
)
from .attention import _head_panels, _query_outline

GALLERY_COLUMNS = 4


def latent_bars(values, latents: Sequence[int], title: str, chosen: int | None = None) -> go.Figure:
    """A patch's (or image's) strongest latents as horizontal bars, the strongest first; ``chosen``
    (a latent) in crimson. values: (n,) activations of ``latents``."""
    values = _float_array(values).reshape(-1)
    labels = [f"latent {latent}" for latent in latents]
    colours = ["crimson" if latent == chosen else "#4c78a8" for latent in latents]
    return figure([dict(
        type="bar", x=values, y=labels, orientation="h", marker=dict(color=colours), customdata=list(latents),
        text=[f"{value:.3g}" for value in values], textposition="auto",
        hovertemplate="latent %{customdata}: activation %{x:.4g}<br>click to look at it<extra></extra>",
    )], dict(
        title=_title(title), margin=MARGIN, yaxis=dict(autorange="reversed"),
        xaxis=dict(title=dict(text="activation")), height=120 + 28 * max(1, len(latents)),
        clickmode="event+select",
    ))


def latent_map(image, values, title: str, query_patch: int | None = None) -> go.Figure:
    """One latent's activation on every patch (gh, gw), laid over the image (0: transparent)."""
    image = _rgb_uint8(image)
    values = _check_map(_float_array(values))
    top = float(values.max()) if values.max() > 0 else 1.0
    heatmap = _patch_heatmap(
        values, image.shape[:2], "activation", colorscale=_scale(VALUE_SCALE), zmin=0, zmax=top, opacity=0.6,
        colorbar=dict(title=dict(text="activation")),
    )
    return figure([_image_trace(image, hover=False), heatmap], dict(
        **_image_axis_layout(), title=_title(title), margin=MARGIN,
        shapes=_query_outline(query_patch, values.shape, image.shape[:2]),
    ))


def explained_map(image, explained, title: str) -> go.Figure:
    """The share of each patch token (gh, gw) the dictionary explains, from below 0 (blue: it adds
    error) to 1 (red: all of it), over the image."""
    image = _rgb_uint8(image)
    explained = _check_map(_float_array(explained))
    heatmap = _patch_heatmap(
        np.clip(explained, -1, 1), image.shape[:2], "explained", colorscale=_scale(SIMILARITY_SCALE), zmin=-1, zmax=1,
        opacity=0.55, colorbar=dict(title=dict(text="explained")),
    )
    return figure([_image_trace(image, hover=False), heatmap], dict(
        **_image_axis_layout(), title=_title(title), margin=MARGIN,
    ))


def latent_gallery(images: Sequence[np.ndarray], patches: Sequence[int], values: Sequence[float],
                   grid_size: tuple[int, int], title: str) -> go.Figure:
    """A latent's top-activating patches: each training image (H, W, 3) with its patch (row-major
    index on ``grid_size``) outlined, its activation above it, strongest first."""
    count = len(images)
    if count == 0:
        return figure([], dict(title=_title(title + " (none: it never fired)"), margin=MARGIN, height=120))
    columns = min(GALLERY_COLUMNS, count)
    rows = -(-count // columns)
    layout, cells = _subplots(rows, columns, [f"{value:.3g}" for value in values],
                              horizontal_spacing=0.02, vertical_spacing=0.08)
    traces, shapes = [], []
    for index, (image, patch) in enumerate(zip(images, patches)):
        image = _rgb_uint8(image)
        suffix = cells[index // columns + 1, index % columns + 1]
        traces.append(_on_axes(_image_trace(image, hover=False), suffix))
        shapes += _query_outline(int(patch), grid_size, image.shape[:2], axes=suffix)
        for axis, settings in _image_axis_layout(suffix).items():
            layout.setdefault(axis, {}).update(settings)
    layout.update(title=_title(title), margin=MARGIN, shapes=shapes, height=60 + 170 * rows)
    return figure(traces, layout)


def latent_histogram(counts, top: float, frequency: float, title: str) -> go.Figure:
    """How a latent's nonzero activations over the training tokens spread, in equal bins from 0 to
    its largest (``counts``: (bins,)); ``frequency``: the share of tokens where it fires."""
    counts = _float_array(counts).reshape(-1)
    width = top / max(1, counts.shape[0])
    centres = (np.arange(counts.shape[0]) + 0.5) * width
    return figure([dict(
        type="bar", x=centres, y=counts, width=width, marker=dict(color="#4c78a8"),
        hovertemplate="activation about %{x:.3g}: %{y:,} tokens<extra></extra>",
    )], dict(
        title=_title(f"{title}: fires on {100 * frequency:.2f}% of the training tokens"), margin=MARGIN,
        xaxis=dict(title=dict(text="activation")), yaxis=dict(title=dict(text="tokens"), type="log"),
        height=300,
    ))


# RdBu's ends, clear at 0: red where a head looks more with the latent steered, blue less, the
# picture itself where nothing changed (an opaque white centre would hide it).
DIFFERENCE_SCALE = [[0.0, "rgba(5,48,97,1)"], [0.25, "rgba(67,147,195,0.8)"], [0.5, "rgba(247,247,247,0)"],
                    [0.75, "rgba(214,96,77,0.8)"], [1.0, "rgba(103,0,31,1)"]]


def latent_effect_bars(estimated, real, latents: Sequence[int], unit: str, title: str,
                       chosen: int | None = None) -> go.Figure:
    """The latents that matter most as grouped horizontal bars, most first: each one's estimated
    change of the prediction if removed (``estimated`` (n,)) and, where measured, the real one
    (``real`` (n,), NaN where not), in ``unit``; ``chosen`` (a latent) labelled in crimson. Click
    a bar to steer its latent."""
    estimated, real = _float_array(estimated).reshape(-1), _float_array(real).reshape(-1)
    labels = [f"<span style='color:crimson'>latent {latent}</span>" if latent == chosen else f"latent {latent}"
              for latent in latents]
    hover = f"latent %{{customdata}}: %{{x:+.4g}} {unit}<br>click to steer it<extra>%{{fullData.name}}</extra>"
    bars = [
        dict(type="bar", name=name, x=values, y=labels, orientation="h", marker=dict(color=colour),
             customdata=list(latents), hovertemplate=hover)
        for name, values, colour in (("estimated (activation x gradient)", estimated, "#9ecae9"),
                                      ("real (removed)", real, "#4c78a8"))
    ]
    return figure(bars, dict(
        title=_title(title), margin=MARGIN, barmode="group", yaxis=dict(autorange="reversed"),
        xaxis=dict(title=dict(text=f"change of the prediction if removed ({unit})"), zeroline=True),
        height=140 + 44 * max(1, len(latents)), clickmode="event+select",
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0),
    ))


def attention_difference_grid(image, intact_maps, steered_maps, layer: int, query: str, what: str,
                              columns: int = 4) -> go.Figure:
    """Each head's attention with ``what`` steered minus intact (maps (H, gh, gw) each) over the
    image, on one diverging scale centred at 0 (red: the head looks there more, blue: less, clear:
    unchanged), its largest change in each panel's title."""
    image = _rgb_uint8(image)
    difference = _float_array(steered_maps) - _float_array(intact_maps)
    if difference.ndim != 3:
        raise ValueError(f"maps must be (H, gh, gw), not {difference.shape}")
    top = float(np.abs(difference).max()) or 1e-12  # unchanged: a scale that stays white
    overlays = [
        _patch_heatmap(head_map, image.shape[:2], "change of attention", f"head {head}", coloraxis="coloraxis")
        for head, head_map in enumerate(difference)
    ]
    largest = [float(head_map.flat[np.abs(head_map).argmax()]) for head_map in difference]
    titles = [f"head {head}: {value:+.2g} at most" for head, value in enumerate(largest)]
    return _head_panels(
        image, overlays, columns, titles=titles, grid_size=difference.shape[1:],
        title=_title(f"Attention of the {query} in layer {layer} with {what}, minus intact, per head"),
        coloraxis=dict(colorscale=DIFFERENCE_SCALE, cmin=-top, cmax=top, cmid=0,
                       colorbar=dict(title=dict(text="steered<br>minus intact"))),
    )
