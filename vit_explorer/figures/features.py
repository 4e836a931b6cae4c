"""Features: a sparse autoencoder's latents on an image (a patch's top latents, one latent's map, how
much of each patch the dictionary explains) and from its index (a latent's top patches over the
training images, its activation histogram)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import (
    MARGIN, SIMILARITY_SCALE, VALUE_SCALE, _check_map, _float_array, _image_axis_layout, _image_trace, _on_axes,
    _patch_heatmap, _rgb_uint8, _scale, _subplots, _title, figure,
)
from .attention import _query_outline

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


def sae_frontier(names: Sequence[str], l0, nmse, title: str, chosen: str | None = None) -> go.Figure:
    """The sparsity-fidelity frontier of a layer's dictionaries: each one's NMSE (lower: closer
    reconstruction) against its L0 (active latents per token, fewer: sparser), ``chosen`` in
    crimson. names: (n,); l0, nmse: (n,) measured on held-out images."""
    l0, nmse = _float_array(l0).reshape(-1), _float_array(nmse).reshape(-1)
    colours = ["crimson" if name == chosen else "#4c78a8" for name in names]
    return figure([dict(
        type="scatter", mode="markers+text", x=l0, y=nmse, text=list(names), textposition="top center",
        marker=dict(color=colours, size=11), customdata=list(names),
        hovertemplate="%{customdata}<br>L0 %{x:.1f}, NMSE %{y:.3f}<extra></extra>",
    )], dict(
        title=_title(title), margin=MARGIN, height=340,
        xaxis=dict(title=dict(text="L0: active latents per token"), rangemode="tozero"),
        yaxis=dict(title=dict(text="NMSE: |x - x̂|² / |x - mean|²"), rangemode="tozero"),
    ))
